# One GPU, back to back, started with setsid so that it runs on past the 600 s a single
# command may last on that machine (the commands after it only wait for it and bring back its
# archive):
#   one probe (saved beside its output under <card>/probes/): each capstone's final rung (its
#   settings from the last committed H100 run) timed as its capstone times it, then 8 steps
#   profiled at once and split by class, with NVML's SM clock and power sampled meanwhile;
#   then the torch capstone's default waterfall, nanoGPT's own bench.py at the capstones'
#   batch and the JAX capstone's default waterfall, side by side on one card.
# Started from a copy of the repository, so edits made meanwhile do not reach it:
#   rm -rf /tmp/repo && cp -r . /tmp/repo && cd /tmp/repo &&
#   OUT=/tmp/chain_out setsid bash results/calls/2026-12-07_gpu_steady_state_and_capstones.sh
# nanoGPT (github.com/karpathy/nanoGPT: bench.py, model.py, configurator.py at the commit in
# .nanogpt/COMMIT) is brought beside the repository, not into it.
source results/calls/gpu_lib.sh
machine steady_state_and_capstones
C=$R/$CARD
P=$R/$CARD/probes
mkdir -p $P && cp .probes/steady_state_classes.py $P/
for framework in torch jax; do
  run $CARD/probes/steady_state_classes_$framework 240 python3 .probes/steady_state_classes.py $framework results/h100/07_capstone_${framework}_final_rung.json
  repack steady
done
run $CARD/07_capstone_torch 330 python3 07_capstone_torch.py --out $C --json $C/07_capstone_torch.json
repack steady
(cd .nanogpt && run $CARD/probes/nanogpt_bench_batch64 90 python3 bench.py --batch_size=64 --real_data=False --compile=True)
repack steady
run $CARD/07_capstone_jax 540 python3 07_capstone_jax.py --out $C --json $C/07_capstone_jax.json
repack steady
grep -h "rc=\|Traceback\|Error" $R/*/*.txt $R/*/*/*.txt | head -20
touch $OUT/DONE
