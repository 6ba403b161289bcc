# Both capstones' default waterfalls on one H200, back to back in one call: the same machine,
# the same batch (64 x 1024), torch first.
#   bash results/calls/2026-12-02_h200_capstones_back_to_back.sh
source results/calls/gpu_lib.sh
machine h200
run h200/07_capstone_torch 240 python3 07_capstone_torch.py --json $R/h200/07_capstone_torch.json --out $R/h200
repack capstones
run h200/07_capstone_jax 330 python3 07_capstone_jax.py --json $R/h200/07_capstone_jax.json --out $R/h200
pack capstones
