# One GPU as a 12 GB card: both capstones with --memory-gb 12, back to back.
#   bash results/calls/2026-12-07_gpu_capstones_12gb.sh
source results/calls/gpu_lib.sh
machine capstones_12gb
M=$R/${CARD}_12gb
run ${CARD}_12gb/07_capstone_torch $(left 280) python3 07_capstone_torch.py --memory-gb 12 --out $M --json $M/07_capstone_torch.json
repack capstones_12gb
run ${CARD}_12gb/07_capstone_jax $(left 590) python3 07_capstone_jax.py --memory-gb 12 --out $M --json $M/07_capstone_jax.json
repack capstones_12gb
grep -h "rc=\|Traceback\|FAILED" $R/*/*.txt | head -20
