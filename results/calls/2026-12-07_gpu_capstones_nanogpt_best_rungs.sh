# One GPU, started with setsid so it outlives one call: the torch waterfall, nanoGPT's own
# bench.py at the capstone's batch, the JAX waterfall, the two waterfalls' final rungs each
# in its own process, in turn, then whether torch takes the allocator setting made after its
# import, then the final rungs in turn twice more, back to back on one card (a short lease may
# end it early, so the most wanted runs come first).
#   bash results/calls/2026-12-07_gpu_capstones_nanogpt_best_rungs.sh
source results/calls/gpu_lib.sh
machine capstones_nanogpt_best_rungs
C=$R/$CARD
P=$R/$CARD/probes
mkdir -p $P && cp .probes/steady_state_classes.py .probes/allocator_setting.py $P/
run $CARD/07_capstone_torch 330 python3 07_capstone_torch.py --out $C --json $C/07_capstone_torch.json
repack chain
(cd .nanogpt && run $CARD/probes/nanogpt_bench_batch64_beside_best_rungs 150 python3 bench.py --batch_size=64 --real_data=False --compile=True)
repack chain
run $CARD/07_capstone_jax 800 python3 07_capstone_jax.py --out $C --json $C/07_capstone_jax.json
repack chain
alternate() {  # alternate N: the JAX final rung, then torch's, each in a fresh process
  for framework in jax torch; do
    run $CARD/probes/best_rungs_alternated_$1_$framework 150 python3 .probes/steady_state_classes.py $framework $C/07_capstone_${framework}_final_rung.json
    repack chain
  done
}
alternate 1
run $CARD/probes/allocator_setting_snapshot 60 python3 .probes/allocator_setting.py
repack chain
alternate 2
alternate 3
grep -h "rc=\|Traceback\|Error" $R/*/*.txt $R/*/*/*.txt | head -20
touch $OUT/DONE
