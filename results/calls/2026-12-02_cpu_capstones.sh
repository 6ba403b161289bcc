#!/usr/bin/env bash
# The 2-core development machine (no GPU): both capstones at their default CPU sizes, one
# after the other, into /tmp/cpu_res/; copied from there into results/cpu/.
set -u
export PYTHONUNBUFFERED=1
R=/tmp/cpu_res
rm -rf $R
mkdir -p $R
run() {  # run NAME command...: output to $R/NAME.txt, its exit code and wall time appended
  local name=$1
  shift
  local t0=$SECONDS
  echo "\$ $*" > $R/$name.txt
  "$@" >> $R/$name.txt 2>&1
  local rc=$?
  echo "rc=$rc wall $((SECONDS - t0)) s" >> $R/$name.txt
  echo "$name: rc=$rc $((SECONDS - t0)) s"
}
run 07_capstone_torch python 07_capstone_torch.py --device cpu \
    --json $R/07_capstone_torch.json --out $R
run 07_capstone_jax env XLA_FLAGS=--xla_force_host_platform_device_count=4 \
    python 07_capstone_jax.py --device cpu --json $R/07_capstone_jax.json --out $R
ls $R
