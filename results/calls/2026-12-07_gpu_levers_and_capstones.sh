# One GPU, started with setsid so it outlives one call. First the two final rungs (torch's
# with fused AdamW) and the JAX final rung with the GELU recomputed in backward and q, k, v
# from three matmuls, each in its own process, in turn, twice, and that JAX rung kernel by
# kernel; then nanoGPT's own bench.py at the capstone's batch, the JAX waterfall and the
# torch waterfall, back to back on the same card (a short lease may end it early).
#   bash results/calls/2026-12-07_gpu_levers_and_capstones.sh
source results/calls/gpu_lib.sh
machine levers_and_capstones
C=$R/$CARD
P=$R/$CARD/probes
mkdir -p $P && cp .probes/steady_state_classes.py .probes/kernels_by_class.py $P/
python3 -c "
import json
final = json.load(open('results/h100/07_capstone_jax_final_rung.json'))
final['settings']['recompute_gelu'] = True
final['settings']['split_qkv'] = True
json.dump(final, open('$P/jax_final_rung_recompute_gelu_split_qkv.json', 'w'), indent=1)"
# the three in turn (the JAX final rung and it with both levers first), then again
T=results/h100/probes/torch_final_rung_fused_adamw.json
J=results/h100/07_capstone_jax_final_rung.json
Q=$P/jax_final_rung_recompute_gelu_split_qkv.json
for name in 1_jax:jax:$J 1_jax_recompute_gelu_split_qkv:jax:$Q 1_torch:torch:$T \
            2_jax:jax:$J 2_jax_recompute_gelu_split_qkv:jax:$Q 2_torch:torch:$T; do
  IFS=: read label framework settings <<< "$name"
  run $CARD/probes/levers_alternated_$label 150 python3 .probes/steady_state_classes.py $framework $settings
  repack chain
done
run $CARD/probes/kernels_by_class_jax_recompute_gelu_split_qkv 150 python3 .probes/kernels_by_class.py jax $Q
gzip -c jax_final_rung_hlo.txt > $P/kernels_by_class_jax_recompute_gelu_split_qkv_hlo.txt.gz
repack chain
(cd .nanogpt && run $CARD/probes/nanogpt_bench_batch64 90 python3 bench.py --batch_size=64 --real_data=False --compile=True)
repack chain
run $CARD/07_capstone_jax 800 python3 07_capstone_jax.py --out $C --json $C/07_capstone_jax.json
repack chain
run $CARD/07_capstone_torch 330 python3 07_capstone_torch.py --out $C --json $C/07_capstone_torch.json
repack chain
grep -h "rc=\|Traceback\|Error" $R/*/*.txt $R/*/*/*.txt | head -20
touch $OUT/DONE
