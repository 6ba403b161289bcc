#!/usr/bin/env bash
# The 2-core development machine (no GPU) as a laptop at other work: every lesson at its
# default CPU sizes beside four busy processes (each spinning a core), one lesson at a
# time, into /tmp/cpu_busy_res/; copied from there into results/cpu_busy/. The same
# lessons idle: 2026-12-07_cpu_all_lessons.sh.
#   bash results/calls/2026-12-07_cpu_busy_lessons.sh
set -u
export PYTHONUNBUFFERED=1
R=/tmp/cpu_busy_res
rm -rf $R
mkdir -p $R
spinners=()
for i in 1 2 3 4; do
  python -c "while True: pass" &
  spinners+=($!)
done
trap 'kill ${spinners[*]}' EXIT
run() {  # run NAME command...: output to $R/NAME.txt, its exit code and wall time appended
  local name=$1
  shift
  local t0=$SECONDS
  echo "\$ $*  # beside four busy processes" > $R/$name.txt
  "$@" >> $R/$name.txt 2>&1
  local rc=$?
  echo "rc=$rc wall $((SECONDS - t0)) s" >> $R/$name.txt
  echo "$name: rc=$rc $((SECONDS - t0)) s"
}
run 01_roofline python 01_roofline.py --device cpu --json $R/01_roofline.json --out $R
run 02_hardware python 02_hardware.py --device cpu --json $R/02_hardware.json --out $R
run 03_compile python 03_compile.py --device cpu --json $R/03_compile.json --out $R
run 04_memory python 04_memory.py --device cpu --json $R/04_memory.json --out $R
run 05_ddp_scratch env OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 \
    05_ddp_scratch.py --device cpu --json $R/05_ddp_scratch.json --out $R
run 06_ddp_prod_torch env OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \
    06_ddp_prod.py --device cpu --json $R/06_ddp_prod_torch.json --out $R
run 06_ddp_prod_jax python 06_ddp_prod.py --device cpu --json $R/06_ddp_prod_jax.json --out $R
run 07_capstone_torch python 07_capstone_torch.py --device cpu \
    --json $R/07_capstone_torch.json --out $R
run 07_capstone_jax env XLA_FLAGS=--xla_force_host_platform_device_count=4 \
    python 07_capstone_jax.py --device cpu --json $R/07_capstone_jax.json --out $R
for f in $R/*.json; do
  python -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1], 'machine_busy:', d.get('machine_busy'))" $f
done
