# One GPU: JAX's final rung and torch's with fused AdamW (torch's final rung from the last
# committed H100 run, where fused AdamW came out within noise and was dropped; kept in the
# run before: the stronger torch step), each in its own process, in turn: torch, JAX, torch,
# JAX, ..., so that a card that is hotter or slower for a while slows both alike. Each process
# builds and compiles its rung as its capstone does, gives the GPU ~2 s of untimed steps, times
# 8 calls of 4 steps as its capstone times them, then profiles 8 steps at once by class, with
# NVML's SM clock and power (the probe saved beside its output under <card>/probes/).
#   bash results/calls/2026-12-07_gpu_final_rungs_alternated.sh
source results/calls/gpu_lib.sh
machine final_rungs_alternated
P=$R/$CARD/probes
mkdir -p $P && cp .probes/steady_state_classes.py $P/
python3 -c "
import json
final = json.load(open('results/h100/07_capstone_torch_final_rung.json'))
final['settings']['fused'] = True
json.dump(final, open('$P/torch_final_rung_fused_adamw.json', 'w'), indent=1)"
for round in 1 2 3; do
  run $CARD/probes/final_rungs_alternated_${round}_torch 150 python3 .probes/steady_state_classes.py torch $P/torch_final_rung_fused_adamw.json
  repack alternated
  run $CARD/probes/final_rungs_alternated_${round}_jax 150 python3 .probes/steady_state_classes.py jax results/h100/07_capstone_jax_final_rung.json
  repack alternated
done
