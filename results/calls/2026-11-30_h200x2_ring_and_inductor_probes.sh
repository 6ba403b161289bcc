#!/usr/bin/env bash
# 2 x H200: the ring all-reduce probe under NCCL variants, then Inductor's reduction knobs
# on the torch capstone's final rung.
source .parts/gpu_lib.sh
mkdir -p $R/probes
P=.parts/probes
machine h200x2
ring() {  # ring LABEL [ENV=VALUE ...]
  local label=$1; shift
  env PROBE_LABEL="$label" NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT NCCL_DEBUG_FILE=$R/probes/nccl_$label.%h.%p.log "$@" \
    timeout 120 torchrun --standalone --nproc_per_node=2 $P/probe_ring.py >> $R/probes/probe_ring.txt 2>&1
  echo "rc=$? ($label)" >> $R/probes/probe_ring.txt
}
t0=$SECONDS
ring default
ring min_p2p_channels_32 NCCL_MIN_P2P_NCHANNELS=32
ring nvl_chunk_2MiB NCCL_P2P_NVL_CHUNKSIZE=2097152
ring p2p_cuda_memcpy NCCL_P2P_USE_CUDA_MEMCPY=1
ring min32_chunk2MiB NCCL_MIN_P2P_NCHANNELS=32 NCCL_P2P_NVL_CHUNKSIZE=2097152
echo "ring probes: $((SECONDS - t0)) s"
grep -h "p2p channels\|Channel 00\|nChannels" $R/probes/nccl_*.log | sort | uniq -c | head -30 > $R/probes/probe_ring_nccl_channels.txt
rm -f $R/probes/nccl_*.log
repack s3probe
CUDA_VISIBLE_DEVICES=0 run probes/probe_inductor_knobs 330 python3 $P/probe_inductor_knobs.py
repack s3probe
grep -v "Warning\|warn" $R/probes/probe_ring.txt | grep "library\|none\|wire\|exchange\|add\|rc=" | head -120
cat $R/probes/probe_ring_nccl_channels.txt | head
grep -v "Warning\|warn_once" $R/probes/probe_inductor_knobs.txt | head -80
