# One GPU, one probe (saved beside its output under <card>/probes/): both final rungs
# (torch's with fused AdamW, as in the alternated runs), every class kernel by kernel, and
# JAX's compiled program.
#   bash results/calls/2026-12-07_gpu_kernels_by_class.sh
source results/calls/gpu_lib.sh
machine kernels_by_class
P=$R/$CARD/probes
mkdir -p $P && cp .probes/kernels_by_class.py $P/
run $CARD/probes/kernels_by_class_jax 200 python3 .probes/kernels_by_class.py jax results/h100/07_capstone_jax_final_rung.json
mv jax_final_rung_hlo.txt $P/kernels_by_class_jax_hlo.txt
repack kernels
run $CARD/probes/kernels_by_class_torch 200 python3 .probes/kernels_by_class.py torch results/h100/probes/torch_final_rung_fused_adamw.json
repack kernels
