# The headline (baseline vs final rung, the same batches) on one H200, several runs in a row.
#   bash results/calls/2026-12-02_h200_headlines.sh jax 3 torch 1     (framework, runs, ...)
source results/calls/gpu_lib.sh
machine h200
while [ $# -gt 0 ]; do
  framework=$1
  runs=$2
  shift 2
  for n in $(seq 1 $runs); do
    name=07_capstone_${framework}_headline_$(date -u +%H%M%S)
    run h200/$name $(left 575) python3 07_capstone_$framework.py --headline --json $R/h200/$name.json --out $R/figs/$name
    repack headlines
  done
done
pack headlines
