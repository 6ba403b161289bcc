# One GPU, one probe (saved beside its output under <card>/probes/): the matmul class of
# both final rungs, kernel by kernel (torch's with fused AdamW, as in the alternated runs).
#   bash results/calls/2026-12-07_gpu_matmul_kernels.sh
source results/calls/gpu_lib.sh
machine matmul_kernels
P=$R/$CARD/probes
mkdir -p $P && cp .probes/matmul_kernels.py $P/
run $CARD/probes/matmul_kernels_torch 150 python3 .probes/matmul_kernels.py torch results/h100/probes/torch_final_rung_fused_adamw.json
repack kernels
run $CARD/probes/matmul_kernels_jax 150 python3 .probes/matmul_kernels.py jax results/h100/07_capstone_jax_final_rung.json
repack kernels
