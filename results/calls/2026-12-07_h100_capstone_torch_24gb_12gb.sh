# One H100 as the book's 24 GB card, then as a 12 GB card: the torch capstone with
# --memory-gb 24 and --memory-gb 12, back to back (500 s for both: the 12 GB run was
# stopped at its time limit, 291 s in).
#   bash results/calls/2026-12-07_h100_capstone_torch_24gb_12gb.sh
source results/calls/gpu_lib.sh
machine capstones_memory
for gb in 24 12; do
  M=$R/${CARD}_${gb}gb
  run ${CARD}_${gb}gb/07_capstone_torch $(left $((gb == 24 ? 250 : 500))) python3 07_capstone_torch.py --memory-gb $gb --out $M --json $M/07_capstone_torch.json
  repack capstones_memory
done
grep -h "rc=\|Traceback" $R/*_*gb/*.txt | head
