#!/usr/bin/env bash
# 2 x H200: the torch capstone's DDP rungs (dynamo reset before DDP compiles), both fabrics.
source .parts/gpu_lib.sh
machine h200x2
D=$R/h200x2
for fab in default staged; do
  n=nvlink
  if [ $fab = staged ]; then n=staged; fi
  run h200x2/07_capstone_torch_ddp_$n 200 torchrun --standalone --nproc_per_node=2 \
      07_capstone_torch.py --interconnect $fab --json $D/07_capstone_torch_ddp_$n.json \
      --out $D/fig07t_$n; repack final3
done
grep -h "scaling\|rc=\|   [+f]" $D/*.txt | head -40
