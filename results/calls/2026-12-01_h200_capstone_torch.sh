# 07_capstone_torch.py on one H200.  bash THIS probe: chaos or precision in the headline's
# curves (results/h200/probes/headline_spread.*).  bash THIS: the waterfall, then --headline x3.
source results/calls/gpu_lib.sh
machine h200
if [ "${1:-}" = probe ]; then
  mkdir -p $R/probes
  run probes/headline_spread 200 python3 results/h200/probes/headline_spread.py $R/probes/headline_spread.json 16
  pack capstone_torch_probe
  exit
fi
run h200/07_capstone_torch 300 python3 07_capstone_torch.py --json $R/h200/07_capstone_torch.json --out $R/h200
repack capstone_torch
if ! grep -q "^rc=0 " $R/h200/07_capstone_torch.txt; then exit; fi  # broken: spend no more
out=$R/h200
for n in "" _2 _3; do
  run h200/07_capstone_torch_headline$n 240 python3 07_capstone_torch.py --headline --json $R/h200/07_capstone_torch_headline$n.json --out $out
  repack capstone_torch
  out=$R/figs$n  # one headline figure is enough
done
pack capstone_torch
