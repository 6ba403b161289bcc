# One GPU, one probe (saved beside its output under <card>/probes/): where the JAX final step's
# idle time falls, traced over 8 steps at once, as run and with buffer donation.
#   bash results/calls/2026-12-07_gpu_jax_idle_gaps.sh
source results/calls/gpu_lib.sh
P=$R/$CARD/probes
mkdir -p $P && cp .probes/jax_idle_gaps.py $P/
run $CARD/probes/jax_idle_gaps 240 python3 .probes/jax_idle_gaps.py results/h100/07_capstone_jax_final_rung.json
tar czf $OUT/gaps.tgz -C $R .
