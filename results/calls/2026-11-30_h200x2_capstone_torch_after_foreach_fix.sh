#!/usr/bin/env bash
# 2 x H200: the torch waterfall (GPU 0) and headline (GPU 1), after
# configure_optimizer stopped turning off foreach AdamW for the non-fused rungs.
source .parts/gpu_lib.sh
machine h200
H=$R/h200
(CUDA_VISIBLE_DEVICES=0 run h200/07_capstone_torch 170 python3 07_capstone_torch.py \
    --json $H/07_capstone_torch.json --out $H/fig07t; repack final4) &
(CUDA_VISIBLE_DEVICES=1 run h200/07_capstone_torch_headline 170 python3 07_capstone_torch.py \
    --headline --json $H/07_capstone_torch_headline.json --out $H/fig07th; repack final4) &
wait
repack final4
grep -h "   [+f]\|check\|rc=\|derived: the final\|measured: largest" $H/*.txt | head -30
