#!/usr/bin/env bash
# 2 x H200: 05 over NVLink twice more, one after the other: an earlier run had measured
# GPT-2's bucketed gradients at 8.4 ms against 3.2-3.8 ms elsewhere; which is typical?
source .parts/gpu_lib.sh
machine h200x2
D=$R/h200x2
for i in 1 2; do
  run h200x2/05_ddp_scratch_nvlink_$i 60 torchrun --standalone --nproc_per_node=2 05_ddp_scratch.py \
      --interconnect default --json $D/05_ddp_scratch_nvlink_$i.json --out $D/fig05_nvlink_$i
  repack s3again
done
grep -h "256.000\|1024.000\|measured:.*all-reduce\|one step\|rc=" $D/05*.txt
