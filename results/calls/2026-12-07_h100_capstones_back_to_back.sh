# One GPU: nanoGPT's own bench.py at the capstones' batch, then both capstones' default
# waterfalls, back to back on the same machine.
#   bash results/calls/2026-12-07_gpu_capstones_back_to_back.sh
# nanoGPT (github.com/karpathy/nanoGPT: bench.py, model.py, configurator.py at the commit in
# .nanogpt/COMMIT) is brought beside the repository, not into it.
source results/calls/gpu_lib.sh
machine capstones
C=$R/$CARD
(cd .nanogpt && run $CARD/probes/nanogpt_bench_batch64 $(left 90) python3 bench.py --batch_size=64 --real_data=False --compile=True)
repack capstones
run $CARD/07_capstone_torch $(left 330) python3 07_capstone_torch.py --out $C --json $C/07_capstone_torch.json
repack capstones
run $CARD/07_capstone_jax $(left 590) python3 07_capstone_jax.py --out $C --json $C/07_capstone_jax.json
repack capstones
grep -h "rc=\|Traceback\|Error\|FAILED" $R/$CARD/*.txt $R/$CARD/*/*.txt | head -20
