# One GPU, back to back, started with setsid so that it runs on past the 600 s a single
# command may last on that machine (the commands after it only wait for it and bring back its
# archive):
#   the torch capstone's default waterfall, nanoGPT's own bench.py at the capstones' batch and
#   the JAX capstone's default waterfall, side by side on one card, each capstone settling the
#   GPU (SETTLE_S of untimed steps) before every timing; then two probes (each saved beside its
#   output under <card>/probes/): the JAX final rung under several of XLA's own options
#   (cuBLASLt, autotune level, cuDNN LayerNorm, command buffers) timed in turn and profiled by
#   class, with JAX's matmul roof as a burst and sustained; torch's matmul and copy roofs as
#   bursts and sustained, and GPT-2's own GEMM shapes sustained, with NVML's clock and power.
# Started from a copy of the repository, so edits made meanwhile do not reach it:
#   rm -rf /tmp/repo && cp -r . /tmp/repo && cd /tmp/repo &&
#   OUT=/tmp/chain_out setsid bash results/calls/2026-12-07_gpu_capstones_side_by_side_settled.sh
# nanoGPT (github.com/karpathy/nanoGPT: bench.py, model.py, configurator.py at the commit in
# .nanogpt/COMMIT) is brought beside the repository, not into it.
source results/calls/gpu_lib.sh
machine capstones_side_by_side_settled
C=$R/$CARD
P=$R/$CARD/probes
run $CARD/07_capstone_torch 330 python3 07_capstone_torch.py --out $C --json $C/07_capstone_torch.json
repack side_by_side
(cd .nanogpt && run $CARD/probes/nanogpt_bench_batch64 90 python3 bench.py --batch_size=64 --real_data=False --compile=True)
repack side_by_side
run $CARD/07_capstone_jax 540 python3 07_capstone_jax.py --out $C --json $C/07_capstone_jax.json
repack side_by_side
mkdir -p $P && cp .probes/jax_step_options.py .probes/matmul_sustained_torch.py $P/
F=$C/07_capstone_jax_final_rung.json  # this run's final rung, else the last one committed
[ -e $F ] || F=results/h100/07_capstone_jax_final_rung.json
run $CARD/probes/jax_step_options 400 python3 .probes/jax_step_options.py $F
repack side_by_side
run $CARD/probes/matmul_sustained_torch 120 python3 .probes/matmul_sustained_torch.py
repack side_by_side
grep -h "rc=\|Traceback\|Error" $R/*/*.txt $R/*/*/*.txt | head -20
touch $OUT/DONE
