#!/usr/bin/env bash
# 2 x H200: the torch capstone's DDP rungs once more on both fabrics (code unchanged):
# a second sample of the scaling.
source .parts/gpu_lib.sh
D=$R/h200x2
for fab in default staged; do
  n=nvlink
  if [ $fab = staged ]; then n=staged; fi
  run h200x2/07_capstone_torch_ddp_${n}_2 $(left 440) torchrun --standalone --nproc_per_node=2 \
      07_capstone_torch.py --interconnect $fab --json $D/07_capstone_torch_ddp_${n}_2.json \
      --out $D/fig07t_${n}_2; repack s3ddp
done
grep -h "scaling\|rc=\|   [+f]" $D/*.txt | head -40
