#!/usr/bin/env bash
# 2 x H200: 05 (ring sent whole, no pieces) and 06 (foreach AdamW), torch and JAX, both
# fabrics.
source .parts/gpu_lib.sh
machine h200x2
D=$R/h200x2
for fab in default staged; do
  n=nvlink
  if [ $fab = staged ]; then n=staged; fi
  run h200x2/05_ddp_scratch_$n 60 torchrun --standalone --nproc_per_node=2 05_ddp_scratch.py \
      --interconnect $fab --json $D/05_ddp_scratch_$n.json --out $D/fig05_$n; repack s3rerun
  run h200x2/06_ddp_prod_torch_$n 100 torchrun --standalone --nproc_per_node=2 06_ddp_prod.py \
      --interconnect $fab --json $D/06_ddp_prod_torch_$n.json --out $D/fig06_$n; repack s3rerun
  run h200x2/06_ddp_prod_jax_$n 100 python3 06_ddp_prod.py --framework jax --interconnect $fab \
      --json $D/06_ddp_prod_jax_$n.json --out $D/fig06j_$n; repack s3rerun
done
grep -h "checks\|rc=\|  256.000\| 1024.000" $D/*.txt | head -40
