# Shared by the device calls: environment, a run() that logs and times each command, a summary.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=8
R=/tmp/res
mkdir -p $R/h200 $R/h200x2
run() {  # run NAME LIMIT_S command...: output to $R/NAME.txt, its exit code and wall time appended
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "\$ $*" > $R/$name.txt
  timeout $limit "$@" >> $R/$name.txt 2>&1
  local rc=$?
  echo "rc=$rc wall $((SECONDS - t0)) s" >> $R/$name.txt
  echo "$name: rc=$rc $((SECONDS - t0)) s"
}
machine() {
  { nvidia-smi; nvidia-smi topo -m; python3 --version
    python3 -m pip list 2>/dev/null | grep -iE "^(torch|jax|jaxlib|jax-cuda13-plugin|jax-cuda13-pjrt|flax|optax|numpy|matplotlib|tiktoken|nvidia-ml-py|pytest) "
  } > $R/$1/machine.txt 2>&1
}
pack() {  # everything under $R into one archive under $OUT (the device returns at most 8 files)
  tar czf $OUT/$1.tgz -C $R .
  ls -la $OUT
}
T0=$SECONDS
left() {  # seconds left before a deadline $1 (from the start), at least 10
  local s=$(( $1 - (SECONDS - T0) ))
  if [ $s -lt 10 ]; then s=10; fi
  echo $s
}
repack() {  # an archive of everything so far, replaced atomically (survives a killed call)
  tar czf $OUT/.$1.tmp -C $R . && mv $OUT/.$1.tmp $OUT/$1.tgz
}
