# 07_capstone_jax.py on one H200: the waterfall (default sizes), then --headline three times in
# a row (each must pass). No network there: --tokenizer bytes (what auto would fall back to).
#   bash THIS
source results/calls/gpu_lib.sh
machine h200
run h200/07_capstone_jax 330 python3 07_capstone_jax.py --tokenizer bytes --json $R/h200/07_capstone_jax.json --out $R/h200
repack capstone_jax
for n in "" _2 _3; do
  run h200/07_capstone_jax_headline$n $(left 590) python3 07_capstone_jax.py --headline --tokenizer bytes --json $R/h200/07_capstone_jax_headline$n.json --out $R/h200/fig$n
  repack capstone_jax
done
pack capstone_jax
