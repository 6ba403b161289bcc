#!/usr/bin/env bash
# 2 x H200: speed probes of the capstones' final rungs: torch levers on GPU 0, JAX levers
# (XLA flags, batch) on GPU 1, at the same time.
source .parts/gpu_lib.sh
mkdir -p $R/probes
P=.parts/probes
(
  export CUDA_VISIBLE_DEVICES=0
  run probes/probe_speed_torch 420 python3 $P/probe_speed_torch.py
) &
(
  export CUDA_VISIBLE_DEVICES=1
  G=--xla_gpu_enable_triton_gemm=false
  for spec in "final|$G|64" "final B=128|$G|128" \
              "final + cudnn layer norm|$G --xla_gpu_enable_cudnn_layer_norm=true|64" \
              "final, command buffers off|$G --xla_gpu_enable_command_buffer=|64" \
              "triton gemm on (XLA default)||64" "final (again)|$G|64"; do
    IFS='|' read -r label flags batch <<< "$spec"
    XLA_FLAGS="$flags" timeout 120 python3 $P/probe_speed_jax.py "$label" $batch \
        >> $R/probes/probe_speed_jax.txt 2>&1
    echo "rc=$? ($label)" >> $R/probes/probe_speed_jax.txt
  done
) &
wait
repack probe17
cat $R/probes/probe_speed_torch.txt | grep -v "^\s*warn\|UserWarning" | tail -20
grep -h "^JAX\|rc=" $R/probes/probe_speed_jax.txt
