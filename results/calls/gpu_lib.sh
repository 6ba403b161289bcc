# Shared by the GPU scripts: environment, a run() that logs and times each command, the
# card's folder name, an archive of everything under $OUT.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=8
R=/tmp/res
mkdir -p $R
# the card's folder: h100 for "NVIDIA H100 80GB HBM3", h200 for "NVIDIA H200"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
T0=$SECONDS
run() {  # run NAME LIMIT_S command...: output to $R/NAME.txt, its exit code and wall time appended
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  mkdir -p $(dirname $R/$name)
  echo "\$ $*" > $R/$name.txt
  timeout $limit "$@" >> $R/$name.txt 2>&1
  local rc=$?
  echo "rc=$rc wall $((SECONDS - t0)) s" >> $R/$name.txt
  echo "$name: rc=$rc $((SECONDS - t0)) s (at $((SECONDS - T0)) s)"
  return $rc
}
machine() {
  mkdir -p $R/$CARD
  { date -u; nvidia-smi; python3 --version
    python3 -m pip list 2>/dev/null | grep -iE "^(torch|jax|jaxlib|jax-cuda13-plugin|jax-cuda13-pjrt|flax|optax|numpy|matplotlib|tiktoken|nvidia-ml-py|pytest) "
  } > $R/$CARD/machine_$1.txt 2>&1
}
left() {  # seconds left before a deadline $1 (from the start), at least 10
  local s=$(( $1 - (SECONDS - T0) ))
  if [ $s -lt 10 ]; then s=10; fi
  echo $s
}
repack() {  # an archive of everything so far, replaced atomically (survives a killed call)
  tar czf $OUT/.$1.tmp -C $R . && mv $OUT/.$1.tmp $OUT/$1.tgz
}
