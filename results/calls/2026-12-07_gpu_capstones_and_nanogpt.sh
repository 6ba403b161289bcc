# One GPU, started with setsid so it outlives one call: the torch waterfall, nanoGPT's own
# bench.py at the capstone's batch, then the JAX waterfall, back to back on one card.
#   bash results/calls/2026-12-07_gpu_capstones_and_nanogpt.sh
source results/calls/gpu_lib.sh
machine capstones_and_nanogpt
C=$R/$CARD
P=$R/$CARD/probes
mkdir -p $P
run $CARD/07_capstone_torch 330 python3 07_capstone_torch.py --out $C --json $C/07_capstone_torch.json
repack capstones
(cd .nanogpt && run $CARD/probes/nanogpt_bench_batch64 90 python3 bench.py --batch_size=64 --real_data=False --compile=True)
repack capstones
run $CARD/07_capstone_jax 540 python3 07_capstone_jax.py --out $C --json $C/07_capstone_jax.json
repack capstones
grep -h "rc=\|Traceback\|Error" $R/*/*.txt $R/*/*/*.txt | head -20
touch $OUT/DONE
