#!/usr/bin/env bash
# 2 x H200: the capstones' waterfalls and headlines (torch on GPU 0, JAX on GPU 1, at the
# same time), then JAX's sharding rung on both fabrics.
source .parts/gpu_lib.sh
machine h200
H=$R/h200
D=$R/h200x2
track0() {
  export CUDA_VISIBLE_DEVICES=0
  run h200/07_capstone_torch 200 python3 07_capstone_torch.py \
      --json $H/07_capstone_torch.json --out $H/fig07t; repack final1
  run h200/07_capstone_torch_headline $(left 400) python3 07_capstone_torch.py --headline \
      --json $H/07_capstone_torch_headline.json --out $H/fig07th; repack final1
}
track1() {
  export CUDA_VISIBLE_DEVICES=1
  run h200/07_capstone_jax 290 python3 07_capstone_jax.py \
      --json $H/07_capstone_jax.json --out $H/fig07j; repack final1
  run h200/07_capstone_jax_headline $(left 400) python3 07_capstone_jax.py --headline \
      --json $H/07_capstone_jax_headline.json --out $H/fig07jh; repack final1
}
track0 > $R/track0.log 2>&1 &
track1 > $R/track1.log 2>&1 &
wait
for fab in default staged; do
  n=nvlink
  if [ $fab = staged ]; then n=staged; fi
  run h200x2/07_capstone_jax_shard_$n $(left 575) python3 07_capstone_jax.py --scaling \
      --interconnect $fab --json $D/07_capstone_jax_shard_$n.json --out $D/fig07j_$n
  repack final1
done
cat $R/track0.log $R/track1.log
grep -h "check.*FAILED\|rc=\|scaling\|peak" $H/*.txt $D/*.txt | head -40
