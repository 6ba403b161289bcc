#!/usr/bin/env bash
# Session 3, call 4, 2 x H200: 05 over NVLink twice more: call 2 measured GPT-2's bucketed
# gradients at 8.4 ms, against 3.8 ms in the second session's run; which is typical?
source .parts/gpu_lib.sh
machine h200x2
D=$R/h200x2
for i in 1 2; do
  run h200x2/05_ddp_scratch_nvlink_$i 60 torchrun --standalone --nproc_per_node=2 05_ddp_scratch.py \
      --interconnect default --json $D/05_ddp_scratch_nvlink_$i.json --out $D/fig05_nvlink_$i
  repack s3again
done
grep -h "256.000\|1024.000\|measured:.*all-reduce\|one step\|rc=" $D/05*.txt
