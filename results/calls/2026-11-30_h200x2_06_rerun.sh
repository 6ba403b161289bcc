#!/usr/bin/env bash
# 2 x H200: 06 again (the profiler now skips one warm-up step before it
# records), torch and JAX, both fabrics. JAX: a hang would be killed with SIGABRT, which
# PYTHONFAULTHANDLER turns into a Python traceback.
source .parts/gpu_lib.sh
machine h200x2
D=$R/h200x2
export PYTHONFAULTHANDLER=1
for fab in default staged; do
  n=nvlink
  if [ $fab = staged ]; then n=staged; fi
  run h200x2/06_ddp_prod_torch_$n 100 torchrun --standalone --nproc_per_node=2 06_ddp_prod.py \
      --interconnect $fab --json $D/06_ddp_prod_torch_$n.json --out $D/fig06_$n; repack s3rerun06
  t0=$SECONDS
  f=$D/06_ddp_prod_jax_$n.txt
  echo "\$ python3 06_ddp_prod.py --framework jax --interconnect $fab --json $D/06_ddp_prod_jax_$n.json --out $D/fig06j_$n" > $f
  timeout -s ABRT 200 python3 06_ddp_prod.py --framework jax --interconnect $fab \
      --json $D/06_ddp_prod_jax_$n.json --out $D/fig06j_$n >> $f 2>&1
  echo "rc=$? wall $((SECONDS - t0)) s" >> $f
  tail -1 $f
  repack s3rerun06
done
grep -h "\[3\]\|checks\|rc=\|step " $D/06*.txt | head -60
