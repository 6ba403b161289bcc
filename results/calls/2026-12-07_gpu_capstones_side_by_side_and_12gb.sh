# One GPU, back to back, started with setsid so that it runs on past the 600 s a single
# command may last on that machine (the commands after it only wait for it and bring back its
# archive):
#   the torch capstone's default waterfall, nanoGPT's own bench.py at the capstones' batch and
#   the JAX capstone's default waterfall, side by side on one card; then a probe of the
#   compiled torch steps' slow timed calls (SM clock, power and throttle reasons from NVML
#   after each call; collector on, then off); then the JAX capstone as a 12 GiB card, to its
#   end; then, if the time allows, the torch capstone as the book's 24 GiB card.
# Started from a copy of the repository, so edits made meanwhile do not reach it:
#   rm -rf /tmp/repo && cp -r . /tmp/repo && cd /tmp/repo &&
#   OUT=/tmp/chain_out setsid bash results/calls/2026-12-07_gpu_capstones_side_by_side_and_12gb.sh
# nanoGPT (github.com/karpathy/nanoGPT: bench.py, model.py, configurator.py at the commit in
# .nanogpt/COMMIT) is brought beside the repository, not into it.
source results/calls/gpu_lib.sh
machine capstones_side_by_side_and_12gb
C=$R/$CARD
run $CARD/07_capstone_torch 260 python3 07_capstone_torch.py --out $C --json $C/07_capstone_torch.json
repack side_by_side
(cd .nanogpt && run $CARD/probes/nanogpt_bench_batch64 90 python3 bench.py --batch_size=64 --real_data=False --compile=True)
repack side_by_side
run $CARD/07_capstone_jax 480 python3 07_capstone_jax.py --out $C --json $C/07_capstone_jax.json
repack side_by_side
mkdir -p $C/probes && cp .probes/clock_transient.py $C/probes/
run $CARD/probes/clock_transient 240 python3 .probes/clock_transient.py
repack side_by_side
M=$R/${CARD}_12gb
run ${CARD}_12gb/07_capstone_jax 900 python3 07_capstone_jax.py --memory-gb 12 --out $M --json $M/07_capstone_jax.json
repack side_by_side
if [ $((SECONDS - T0)) -lt 1330 ]; then
  H=$R/${CARD}_24gb
  run ${CARD}_24gb/07_capstone_torch 280 python3 07_capstone_torch.py --memory-gb 24 --out $H --json $H/07_capstone_torch.json
fi
repack side_by_side
grep -h "rc=\|Traceback\|Error" $R/*/*.txt $R/*/*/*.txt | head -20
touch $OUT/DONE
