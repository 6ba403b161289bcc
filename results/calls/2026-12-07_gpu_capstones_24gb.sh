# One GPU as the book's 24 GB card: both capstones with --memory-gb 24, back to back.
#   bash results/calls/2026-12-07_gpu_capstones_24gb.sh
source results/calls/gpu_lib.sh
machine capstones_24gb
M=$R/${CARD}_24gb
run ${CARD}_24gb/07_capstone_torch $(left 280) python3 07_capstone_torch.py --memory-gb 24 --out $M --json $M/07_capstone_torch.json
repack capstones_24gb
run ${CARD}_24gb/07_capstone_jax $(left 590) python3 07_capstone_jax.py --memory-gb 24 --out $M --json $M/07_capstone_jax.json
repack capstones_24gb
grep -h "rc=\|Traceback\|FAILED" $R/*/*.txt | head -20
