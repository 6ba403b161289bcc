# Probes on one H200: the fused classifier (torch and JAX, plain head vs chunks of 4096, 8192,
# 16384 tokens), where the JAX fp32 step's compile time goes (XLA's GEMM autotuning), and the
# torch capstone's --quick run on a GPU.
#   bash results/calls/2026-12-02_h200_probes_fused_classifier_jax_compile.sh
source results/calls/gpu_lib.sh
mkdir -p $R/probes
machine h200
run probes/fused_classifier 300 python3 results/h200/probes/fused_classifier.py --out $R/probes/fused_classifier.json
repack probes
run probes/jax_compile_time 170 python3 results/h200/probes/jax_compile_time.py --json $R/probes/jax_compile_time.json
repack probes
run probes/capstone_torch_quick_gpu 100 python3 07_capstone_torch.py --quick --json $R/probes/capstone_torch_quick_gpu.json --out $R/probes
pack probes
