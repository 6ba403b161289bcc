# One GPU: the JAX capstone as a 12 GiB card.
#   bash results/calls/2026-12-07_gpu_capstone_jax_12gb.sh
source results/calls/gpu_lib.sh
machine capstone_jax_12gb
run ${CARD}_12gb/07_capstone_jax $(left 470) python3 07_capstone_jax.py --memory-gb 12 --out $R/${CARD}_12gb --json $R/${CARD}_12gb/07_capstone_jax.json
repack capstone_jax_12gb
grep -h "rc=\|Traceback\|Error" $R/*/*.txt | head -20
