"""
Section 13.7: the waterfall, in JAX. GPT-2 124M down the chapter's method, one measured
rung per technique, all from 07_capstone_torch.py's init on the same batches: the speed
changes, the losses must not. Each rung is timed against the incumbent (every rung kept so
far), their steps interleaved, and kept only when it is faster beyond the spread. Then the
final rung on its own roofline: its step, kernel class by kernel class, against the floor
of each class; the chapter's techniques for the class furthest above its floor (fewer
bytes), as more rungs; and the table again. With several devices, last, the final rung
sharded over them.

    python 07_capstone_jax.py                 # one GPU: gpt2 (124M, T=1024), ~8 min on an H100
    python 07_capstone_jax.py --memory-gb 24  # the same, as on the book's 24 GB card
    python 07_capstone_jax.py --headline      # the first jitted rung vs the final rung
    python 07_capstone_jax.py --scaling       # the final rung on one device, then sharded
    python 07_capstone_jax.py --device cpu    # the tiny model, a few minutes on 2 cores
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python 07_capstone_jax.py --quick
                                              # a toy on 4 simulated devices (the tests)

Where the frameworks differ: "compile" is jax.jit of the whole step (forward, backward
and AdamW, one XLA program); JAX runs fp32 matmuls as TF32 on a GPU unless asked for
'highest'; mixed precision is a dtype; data parallelism is a sharding of the batch over a
mesh of devices, in one process. JAX's allocator takes its share of the GPU as its backend
starts (XLA_CLIENT_MEM_FRACTION, which --memory-gb sets from the card's size); each rung's
micro-batches are sized for that share by model_jax's accounting, and a jitted step's plan
is checked with XLA's own (compiled.memory_analysis()) before it runs.

Each rung prints its prediction for this kind of device, the memory it is sized for, then
what it measured: ms/step, tokens/s, tokens/J (NVML), speed-up over the baseline, MFU
(6N + 12LTd FLOPs per token over the datasheet's bf16 peak and over this device's
measured matmul peak), its loss against the baseline's, kept or dropped, whether the
prediction held, and where its step goes. The waterfall writes its final rung to
out/07_capstone_jax_final_rung.json, which --headline and --scaling read.
Text: --data FILE (UTF-8), else the Python standard library's sources; GPT-2 BPE tokens
when tiktoken can load them, else UTF-8 bytes. Needs model_jax.py and model_torch.py.
"""

import argparse
import gc
import gzip
import hashlib
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch  # 07_capstone_torch's init, and the card's size before JAX's backend starts
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import model_jax
import model_torch
from model_jax import GPT, adamw, from_torch
from model_torch import GPTConfig, flops_per_token

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")  # a CPU

# --- The waterfall: every setting a rung can change, then the rungs, in order.

BASELINE = dict(jit=False, precision="highest", bf16=False, attn="manual", donate=False,
                pad_vocab=False, host_sync=True, triton_gemm=True, fused_classifier=False,
                checkpoint=False, bf16_residual=False, recompute_gelu=False, split_qkv=False,
                shard=False)
WINDOW = 4  # steps between host syncs once "no host sync per step" is on
RUNGS = [  # (name, what it changes, the mechanism and the regime it targets)
    ("un-jitted (op-by-op)", {},
     "the baseline: each jnp op its own program, dispatched from Python, every "
     "intermediate through memory; fp32 matmuls in full fp32 ('highest'); the T x T "
     "attention scores in memory"),
    ("+ jax.jit (whole step)", dict(jit=True),
     "overhead- and bandwidth-bound: one XLA program for forward, backward and AdamW; "
     "chains of elementwise ops fused into one pass over memory"),
    ("+ TF32 (default precision)", dict(precision="default"),
     "compute-bound on the wrong units: fp32 matmuls as TF32 on the tensor cores, JAX's "
     "default on a GPU (a CPU has no TF32: the same program)"),
    ("+ bf16 compute dtype", dict(bf16=True),
     "compute-bound: dtype=bfloat16, param_dtype=float32: bf16 tensor cores, half the "
     "activation bytes; LayerNorms, residual stream and loss stay fp32"),
    ("+ fused attention (cuDNN)", dict(attn="sdpa"),
     "bandwidth-bound: jax.nn.dot_product_attention, cuDNN's flash attention on a GPU, "
     "never writes the B x H x T x T scores (XLA's own implementation on a CPU does)"),
    ("+ buffer donation", dict(donate=True),
     "memory: the old state (params, AdamW moments) is donated, so the new one is "
     "written into its buffers: 12 bytes a parameter fewer held, the same work"),
    ("+ vocab 50304", dict(pad_vocab=True),
     "compute-bound: 50304 = 128 x 393 tiles the largest matmul evenly (50257 is odd)"),
    ("+ no host sync per step", dict(host_sync=False),
     f"overhead-bound: Python reads the loss every {WINDOW} steps, not every step, so "
     "the host queues the next step while the device works"),
    ("+ cuBLAS for every matmul", dict(triton_gemm=False),
     "the compiler's kernel choice: matmuls XLA fuses with a neighbour leave its own "
     "Triton GEMMs for cuBLAS's (a CPU compiles the same program)"),
    ("+ fused classifier (logits never written)", dict(fused_classifier=True),
     "memory and bandwidth: the head and the loss chunk by chunk, so the B x T x V "
     "logits never exist; the same matmuls"),
    ("+ activation checkpointing", dict(checkpoint=True),
     "memory: nnx.remat keeps each block's input and recomputes its insides in backward: "
     "~18% more FLOPs for GPT-2 for far fewer bytes held"),
    ("+ bf16 residual stream", dict(bf16_residual=True),
     "bandwidth-bound: the residual stream and the LayerNorms' inputs in bf16: half the "
     "bytes of every residual add and LayerNorm"),
    ("+ GELU recomputed, q, k, v from three matmuls",
     dict(recompute_gelu=True, split_qkv=True),
     "bandwidth-bound: two copies torch.compile's kernels do not make. jax.checkpoint "
     "around the GELU keeps only its input for backward and recomputes its tanh there: "
     "one (B, T, 4d) tensor a layer neither written nor read again. c_attn's thirds as "
     "three matmuls write q, k and v whole: one matmul's (B, T, 3d) output is no longer "
     "copied apart for cuDNN's attention, nor its gradients concatenated back"),
    ("+ data-parallel sharding", dict(shard=True),
     "the batch's rows sharded over every device, the state replicated; XLA adds the "
     "gradient all-reduce"),
]
# What each rung should do to the step time, over the incumbent's, on each kind of device:
# (low, high) of the median interleaved ratio. A CPU has no TF32 or bf16 tensor cores, no
# tiles to fill, no fused attention kernel: ~1.0x, or slower. The sharding rung: the
# fraction of world x one device alone. The bf16 residual stream: from the floor table.
PREDICTED = {
    "+ jax.jit (whole step)": dict(gpu=(3, 15), cpu=(2, 10)),
    "+ TF32 (default precision)": dict(gpu=(2, 4), cpu=(0.9, 1.1)),
    "+ bf16 compute dtype": dict(gpu=(1.5, 3), cpu=(0.5, 1.05)),  # XLA:CPU: casts
    "+ fused attention (cuDNN)": dict(gpu=(1.1, 1.8), cpu=(0.8, 1.2)),
    "+ buffer donation": dict(gpu=(0.98, 1.03), cpu=(0.95, 1.05)),
    "+ vocab 50304": dict(gpu=(1.0, 1.15), cpu=(0.9, 1.1)),
    "+ no host sync per step": dict(gpu=(1.0, 1.03), cpu=(0.98, 1.1)),
    "+ cuBLAS for every matmul": dict(gpu=(1.0, 1.08), cpu=(0.95, 1.05)),
    "+ fused classifier (logits never written)": dict(gpu=(0.95, 1.03), cpu=(0.8, 1.1)),
    "+ activation checkpointing": dict(gpu=(0.7, 0.9), cpu=(0.85, 1.02)),  # a CPU's tiny
    # model: the blocks are a fifth of its FLOPs (the head's 50257 x 128 the rest)
    # GPT-2 on an H100: 12 x (2 x 402 MB + 4 x 302 MB) fewer, ~8 ms of ~130 at 3 TB/s,
    # less what three narrower matmuls lose; a CPU computes tanh twice. One rung: each
    # alone saves about as much as a rung's timed pairs spread
    "+ GELU recomputed, q, k, v from three matmuls": dict(gpu=(1.0, 1.08),
                                                        cpu=(0.85, 1.15)),
    "+ data-parallel sharding": dict(gpu=(0.85, 1.0), cpu=(0.2, 1.0)),  # CPU devices:
}  # simulated, on the same cores
# A first incumbent: its MFU of the measured peak. The headline: the final rung's speed-up
# over the first jitted rung
PREDICTED["un-jitted (op-by-op)"] = dict(gpu=(0.0, 0.05), cpu=(0.0, 0.3))
PREDICTED["final rung, one device alone"] = dict(gpu=(0.3, 0.7), cpu=(0.0, 0.9))
PREDICTED["the first jitted rung (fp32 matmuls)"] = dict(gpu=(0.0, 0.1), cpu=(0.0, 0.9))
PREDICTED["final rung (every rung kept)"] = dict(gpu=(5.0, 20.0), cpu=(0.8, 3.0))
FLOOR_PREDICTED = dict(gpu=(1.2, 1.6), cpu=(2.0, None))  # the step over its floor
BASE = "un-jitted (op-by-op)"  # the waterfall's first incumbent
FLOOR_FIX = "+ bf16 residual stream"  # measured after the floor table, predicted from it
# (the rung after it, before SHARDED, acts on the same table's bytes: the GELU's, q, k, v)
SHARDED = "+ data-parallel sharding"  # needs several devices
ALONE = "final rung, one device alone"  # --scaling: what the sharding is measured against
FIRST_JITTED = "the first jitted rung (fp32 matmuls)"  # --headline's first incumbent
HEADLINE = "final rung (every rung kept)"  # --headline: against the first jitted rung
CLASSES = {  # class: words in a kernel's name, or in the XLA instruction it computes
    "attention": ("fmha", "flash", "sdpa"),  # cuDNN's fused attention
    # an XLA dot or a library's GEMM; op by op, the module of a jnp matmul. Not a JAX path:
    # an elementwise op's path names the dot_general it differentiates (a GELU's backward)
    "matmul": ("gemm", "nvjet", "cutlass", "xmma", "cublas", " dot(", "convolution(",
               "jit_dot_general", "jit__einsum", "jit_matmul"),
    "communication": ("nccl", "all-reduce", "all_reduce"),
    "optimizer": ("/optimizer/",),  # the step's named scope, in the ops' JAX paths
    "elementwise/norm/loss": (),  # everything else a device runs
    "idle": (),  # the step's wall time no kernel ran
}
TECHNIQUE = {  # the chapter's technique that targets each class
    "matmul": "fewer FLOPs or faster units: lower precision (bf16, fp8), larger tiles",
    "attention": "a fused attention kernel (flash) that never writes the scores",
    "elementwise/norm/loss": "fewer bytes: fusion, and narrower dtypes for what stays "
                             "(the residual stream in bf16, logits never written)",
    "optimizer": "a fused optimizer: one pass over the parameters and moments",
    "communication": "overlap the all-reduce with the backward, compress its bytes",
    "idle": "less host work per step: compile the step, sync the host less often",
}
COLOURS = {"matmul": "tab:blue", "attention": "tab:orange",
           "elementwise/norm/loss": "tab:purple", "optimizer": "tab:green",
           "communication": "tab:brown", "idle": "lightgray"}
# Losses: the largest per-step relative gap to the baseline over the first EARLY_STEPS
# steps. Broken math shows early: a loss on bf16 logits is ~0.27% off within 10 steps, a
# wrongly scaled loss far more; honest variants (bf16, TF32, padded vocab, other kernels)
# stay within 0.08% there on a GPU
EARLY_STEPS = 10
LOSS_TOLERANCE = 0.0015
# The headline's claim, "the same curve": the curves smoothed by a moving mean of SMOOTH
# steps, their largest relative gap. Two honest runs on the same batches drift apart along
# a run (chaos, not precision): a TF32 run and the same run from an init perturbed by 1e-6
# drift as far as bf16 does, within 1.4% over 100 steps
SMOOTH = 20
CURVE_TOLERANCE = 0.04
ACCUM_TOLERANCE = 1e-4  # accumulated vs full-batch gradient in fp32 (rounding: ~1e-7)
ENERGY_MIN_SECONDS = 1.0  # NVML's energy counter moves in steps of tens of ms: over a
# shorter timed region it reads zero or a fraction of the energy, so tokens/J is left out
BUSY_SHARE = 0.9  # below this share of a core, other programs were taking the CPU
SETTLE_S = 2.0  # seconds of untimed work on a GPU before each timing (see settle): from
# idle its power climbs for ~1 s of work, its clock dips where it first meets the cap
SET_ASIDE_FROM = 6  # timed pairs: from this many on, the keep rule sets the slowest aside
MEMORY_FRACTION = 0.9  # of the GPU for JAX's allocator (its default: 0.75); the rest for
# the CUDA context, cuBLAS's and cuDNN's handles and the compiled kernels
AUTOTUNE_LEVEL = 1  # XLA times each candidate kernel of a jitted step (level 1); its
# default, 4, also fills and checks every candidate's buffers: half a minute more on the
# fp32 step, kernels as fast. Op by op, each of ~250 one-op programs: none (memory_budget)


@dataclass
class Sizes:
    model: str = "tiny"  # a label: GPT-2's shape at a CPU's scale
    block_size: int = 128  # tokens per sequence (T)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab: int = 50257  # GPT-2's tokens as shipped (UTF-8 bytes use the first 256)
    padded_vocab: int = 50304  # the next multiple of 128
    batch: int = 4  # sequences per optimizer step, on every card: the same loss curve
    eager_pairs: int = 2  # interleaved timings of a rung against the op-by-op baseline
    compiled_pairs: int = 6  # of a rung against a jitted incumbent (SET_ASIDE_FROM)
    headline_batch: int = 4
    headline_steps: int = 32  # steps of each headline curve, a multiple of WINDOW
    peak_size: int = 1024  # n of the n x n matmuls that measure the peak
    peak_samples: int = 10
    copy_mib: int = 64  # MiB copied to measure the bandwidth


# GPU: an op-by-op step of GPT-2 takes seconds: two pairs against it are enough
GPU = Sizes(model="gpt2", block_size=1024, n_layer=12, n_head=12, n_embd=768, batch=64,
            headline_batch=16, headline_steps=100, peak_size=8192, copy_mib=1024)
QUICK = Sizes(model="toy", block_size=16, n_layer=1, n_head=2, n_embd=32, vocab=4095,
              padded_vocab=4096, eager_pairs=2, compiled_pairs=2, headline_steps=20,
              peak_size=512, peak_samples=3, copy_mib=8)  # UTF-8 bytes; 4096: +1 row

# --- Data: real text, the same batches in both capstones (both files hold this block).

GPT2_FILES = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


def read_corpus(data, max_bytes=20_000_000):
    """--data FILE, else the stdlib's *.py files (sorted, capped); a bad file: one line."""
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages"}  # installed packages are not the stdlib
        files = sorted(p for p in root.rglob("*.py") if not skip & set(p.parts))
        return b"\n".join(p.read_bytes() for p in files)[:max_bytes]
    if not Path(data).is_file():
        sys.exit(f"error: --data {data}: not a file")
    raw = Path(data).read_bytes()[:max_bytes]
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(raw) - 3:  # not a multi-byte character cut by the cap
            sys.exit(f"error: --data {data}: not UTF-8 text (byte {e.start} is "
                     f"{raw[e.start]:#x})")
    return raw


def gpt2_encoding(choice):
    """tiktoken's GPT-2 BPE when it can be loaded (its files cached, or fetched from a
    network that answers within 3 s), else None: UTF-8 bytes. 'bytes' never looks."""
    if choice == "bytes":
        return None
    try:
        import tiktoken
    except ImportError:
        print("tokenizer: tiktoken is not installed (pip install tiktoken): UTF-8 bytes")
        return None
    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    if cache is None:
        cache = os.path.join(tempfile.gettempdir(), "data-gym-cache")  # tiktoken's default
    cached = True
    for name in ("vocab.bpe", "encoder.json"):
        key = hashlib.sha1(f"{GPT2_FILES}{name}".encode()).hexdigest()
        if not os.path.exists(os.path.join(cache, key)):
            cached = False
    if not cached:
        try:
            socket.create_connection(("openaipublic.blob.core.windows.net", 443), 3).close()
        except OSError:
            print("tokenizer: GPT-2 BPE files not cached and no network: UTF-8 bytes (run "
                  "once with a network to cache them; TIKTOKEN_CACHE_DIR says where)")
            return None
    return tiktoken.get_encoding("gpt2")


def load_tokens(data, choice, min_tokens, cache_dir=".cache"):
    """Token ids (uint16) and the tokenizer's name; tokenized once, cached atomically."""
    raw = read_corpus(data)
    encoding = gpt2_encoding(choice)
    tokenizer = "utf8-bytes"
    if encoding is not None:
        tokenizer = "gpt2-bpe"
    if choice == "gpt2" and encoding is None:
        sys.exit("error: --tokenizer gpt2: tiktoken's GPT-2 BPE cannot be loaded here")
    path = Path(cache_dir) / f"tokens-{tokenizer}-{hashlib.sha1(raw).hexdigest()[:16]}.npy"
    try:
        return np.load(path), tokenizer
    except (OSError, ValueError, EOFError):  # absent, or left unreadable: tokenize again
        pass
    if encoding is None:
        ids = np.frombuffer(raw, dtype=np.uint8)
    else:
        ids = encoding.encode_ordinary(raw.decode("utf-8", errors="replace"))
    ids = np.asarray(ids, dtype=np.uint16)
    if len(ids) < min_tokens:
        sys.exit(f"error: --data {data}: {len(ids)} tokens, fewer than one batch's "
                 f"{min_tokens}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, ids)
    os.replace(tmp, path)  # a reader never sees a half-written cache, even after Ctrl-C
    return ids, tokenizer


def get_batch(tokens, step, batch_size, seq_len, seed=0):
    """Batch number `step`, drawn by a generator seeded by (seed, step): the same in every
    rung and in both capstones."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, batch_size)
    windows = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)
    return windows[:, :-1], windows[:, 1:]

# --- Measuring.


def cpu_share(seconds=0.05):
    """The share of one core this thread got while it spun for `seconds`: ~1.0 on an idle
    machine, less when other programs compete for the cores (a laptop at work, a shared
    server). It sleeps 0.1 s first, so this program's own worker threads (a thread pool
    spins a while after its work) are parked, not counted as other programs. A GPU
    shared with another program is not seen here."""
    time.sleep(0.1)
    start_wall = time.perf_counter()
    start_cpu = time.thread_time()
    while time.perf_counter() - start_wall < seconds:
        pass
    return (time.thread_time() - start_cpu) / (time.perf_counter() - start_wall)


def sync(outputs):
    """Wait until the device has computed these arrays: JAX returns before it has."""
    return jax.block_until_ready(outputs)


def interleaved(fns, reps):
    """Seconds of each call of each function, the functions called in turn (A, B, A, B,
    ...), so a machine slowed for a while slows every side alike. Each function
    synchronises its own device before it returns. Python's garbage collector is off
    meanwhile, as timeit has it and as torchtitan's trainer schedules it (gc_freq): a full
    collection walks every object the compiled steps hold, stalls the host for
    milliseconds, and lands in whichever side's call comes at that point. The caller
    collects first, before its untimed steps (compare)."""
    seconds = [[] for _ in fns]
    gc.disable()
    try:
        for _ in range(reps):
            for samples, fn in zip(seconds, fns):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return seconds


def ratio_summary(slow, fast):
    """Two interleaved timings compared: the median of the per-pair ratios slow_i /
    fast_i with their [min, max], and the lowest ratio the keep rule reads (decide):
    every pair's or, from SET_ASIDE_FROM pairs on, every pair's but the one whose
    two calls took longest together. A moment the machine runs slow slows both calls
    of its pair, rarely by the same amount. Which pair took longest says nothing of
    which side is faster, so with no real difference the other n - 1 ratios are all
    above 1 once in 2^(n - 1) comparisons: once in 32 of 6 pairs."""
    ratios = [a / b for a, b in zip(slow, fast)]
    totals = [a + b for a, b in zip(slow, fast)]
    set_aside = None
    if len(ratios) >= SET_ASIDE_FROM:
        set_aside = totals.index(max(totals))
    decisive = [r for i, r in enumerate(ratios) if i != set_aside]
    return dict(ratio=statistics.median(ratios), low=min(ratios), high=max(ratios),
                ratios=ratios, set_aside=set_aside, decisive_low=min(decisive))


def burst_seconds(fn, in_order=False):
    """Seconds of one call of fn, from a burst of calls lasting >= 5 ms after 100 ms
    idle (01_roofline.py's way: a short kernel timed alone measures its launch, not its
    work). in_order: the device runs the calls one after another (a GPU's stream), so
    only the last output is kept: a burst of copies would hold ~5 ms of the copy's
    output, 10+ GiB on an H200."""
    sync(fn())
    start = time.perf_counter()
    sync(fn())
    calls = math.ceil(0.005 / (time.perf_counter() - start))
    time.sleep(0.1)
    sync(fn())
    start = time.perf_counter()
    outputs = []
    for _ in range(calls):
        outputs.append(fn())
        if in_order:
            outputs = outputs[-1:]
    sync(outputs)
    return (time.perf_counter() - start) / calls


def measure_roofs(shared):
    """PREDICTION: on an H100 or H200 the bf16 matmul peak near 750-800 TFLOP/s
    (datasheet: 989 dense), the copy near 3-4 TB/s read + written (datasheet: 3.35 and
    4.8 TB/s); a CPU core or two: tens to a few hundred GFLOP/s in fp32, 5-20 GB/s. The
    floors and the MFU against the measured peak divide by these."""
    device = shared.devices[0]
    n = shared.sizes.peak_size
    shares = [cpu_share()]
    dtype = jnp.float32
    if shared.gpu:
        dtype = jnp.bfloat16  # the tensor cores' format
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), dtype), device)
    b = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), dtype), device)
    matmul = jax.jit(jnp.matmul).lower(a, b).compile(xla_options(device))
    matmul_samples = []
    for _ in range(shared.sizes.peak_samples):
        matmul_samples.append(2 * n**3 / burst_seconds(lambda: matmul(a, b)))
    source = jax.device_put(jnp.zeros(shared.sizes.copy_mib * 2**20 // 4), device)
    copy = jax.jit(jnp.copy).lower(source).compile()
    copy_samples = []
    for _ in range(shared.sizes.peak_samples):
        copy_samples.append(2 * source.nbytes / burst_seconds(lambda: copy(source),
                                                                shared.gpu))
    shares.append(cpu_share())
    datasheet = None
    if shared.gpu:  # NVIDIA's datasheet, by this product's exact name
        datasheet = model_torch.datasheet_bf16_peak(shared.device_name)
    return dict(busy=min(shares) < BUSY_SHARE, cpu_shares=shares,
                matmul_dtype=jnp.dtype(dtype).name, matmul_size=n,
                matmul_samples=matmul_samples,
                matmul_flops=statistics.median(matmul_samples),
                matmul_flops_best=max(matmul_samples), copy_bytes=source.nbytes,
                copy_samples=copy_samples,
                copy_bytes_per_s=statistics.median(copy_samples),
                copy_bytes_per_s_best=max(copy_samples), datasheet_flops=datasheet)


def report_roofs(roofs, device_name):
    n = roofs["matmul_size"]
    tflops = [flops / 1e12 for flops in roofs["matmul_samples"]]
    print(f"measured: {n} x {n} {roofs['matmul_dtype']} matmul peak "
          f"{roofs['matmul_flops'] / 1e12:.3g} TFLOP/s "
          f"[{min(tflops):.3g}, {max(tflops):.3g}] (median of {len(tflops)} bursts)")
    gbs = [rate / 1e9 for rate in roofs["copy_samples"]]
    print(f"measured: {roofs['copy_bytes'] / 2**20:.0f} MiB copy "
          f"{roofs['copy_bytes_per_s'] / 1e9:,.0f} GB/s read + written "
          f"[{min(gbs):,.0f}, {max(gbs):,.0f}]")
    if roofs["busy"]:
        print("   (machine busy: other programs took the CPU while the roofs were "
              "measured)")
    datasheet_flops = roofs["datasheet_flops"]
    if datasheet_flops is None:
        print(f"reference: no datasheet row for {device_name}: roofs measured only")
    else:  # NVIDIA's datasheet for this product: dense bf16, no sparsity
        print(f"reference: datasheet dense bf16 peak {datasheet_flops / 1e12:.1f} "
              f"TFLOP/s ({device_name})", flush=True)


def has_bf16_tensor_cores(device):
    """(True, "") on a CPU (whether bf16 is faster there is measured) and on a GPU of
    compute capability 8.0 (Ampere) or later; (False, why) before it (a T4, a V100)."""
    if device.platform != "gpu":
        return True, ""
    major, minor = device.compute_capability.split(".")
    if (int(major), int(minor)) < (8, 0):
        capability = device.compute_capability
        return False, f"compute capability {capability} < 8.0: no bf16 tensor cores"
    return True, ""


def energy_meter(device):
    """A function reading this GPU's energy counter in joules (NVML), or None. The GPU is
    found by its UUID (JAX's GPU i is torch's: both number CUDA_VISIBLE_DEVICES' GPUs), so
    CUDA_VISIBLE_DEVICES cannot point NVML at another card."""
    if device.platform != "gpu":
        return None
    try:
        import pynvml
    except ImportError:  # no nvidia-ml-py: no tokens/J
        return None
    try:
        pynvml.nvmlInit()
        uuid = "GPU-" + str(torch.cuda.get_device_properties(device.id).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # mJ since the driver loaded
    except pynvml.NVMLError:  # no counter on this GPU (or a MIG slice)
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def program_instructions(text):
    """What each XLA instruction of a compiled program computes, by its name and by the
    name XLA gives its kernel on a GPU ('.' and '-' as '_'): its own line and the body of
    the computation it calls (a fusion's ops, each with its JAX path in op_name)."""
    bodies = {}
    for match in re.finditer(r"^%?([\w.-]+) [^\n]*\{\n(.*?)^\}", text, re.M | re.S):
        bodies[match.group(1)] = match.group(2)
    instructions = {}
    for line in text.splitlines():
        op = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = ", line)
        if op is None:
            continue
        calls = re.search(r"calls=%?([\w.-]+)", line)
        body = ""
        if calls is not None:
            body = bodies.get(calls.group(1), "")
        instructions[op.group(1)] = f"{line}\n{body}"
        instructions[re.sub(r"[.-]", "_", op.group(1))] = f"{line}\n{body}"
    return instructions


def kernel_class(name, computes=""):
    """The first class one of whose words is in the kernel's (op's) name (cuBLAS's and
    cuDNN's kernels are named by their library) or in what it computes: its XLA
    instruction and that instruction's fused ops."""
    text = f"{name} {computes}".lower()
    for cls, words in CLASSES.items():
        for word in words:
            if word in text:
                return cls
    return "elementwise/norm/loss"


def trace_events(step):
    """Run step() once under JAX's profiler: its wall seconds and the trace's events."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python events: they would swamp op-by-op's trace
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, profiler_options=options):
            start = time.perf_counter()
            step()
            wall = time.perf_counter() - start
        trace = next(Path(folder).rglob("*.trace.json.gz"))
        events = json.load(gzip.open(trace))["traceEvents"]
    return wall, events


def device_events(events):
    """The events of the device's work: a GPU's kernels (its "Stream" threads), else a
    CPU's XLA ops (the events that name the op they run)."""
    names = {}
    for e in events:
        if e.get("name") in ("process_name", "thread_name"):
            names[(e.get("pid"), e.get("tid"))] = e["args"]["name"]
    streams = set()
    for (pid, tid), name in names.items():
        if name.startswith("Stream") and "/device:GPU" in names.get((pid, None), ""):
            streams.add((pid, tid))
    work = []
    for e in events:
        op = e.get("args", {}).get("hlo_op", "")
        if e.get("ph") != "X" or op.startswith(("while", "call", "conditional")):
            continue  # not work, or a loop whose body's ops are counted
        if streams and (e.get("pid"), e.get("tid")) in streams:
            work.append(e)
        if not streams and op:
            work.append(e)
    return work


def profile_split(step, instructions, world):
    """Seconds of one step by class, from the profiler: a GPU's kernels, or a CPU's XLA
    ops, each classed by its name and by the instruction of the program's text it runs
    (found under the event's hlo_op, or under the kernel's own name: a GPU runs a jitted
    step's kernels inside command buffers, whose events name the buffer, not the op). Op
    by op there is no one program: the event's module (jit_einsum, ...) says what it is.
    One stream runs the kernels in order (a CPU's threads overlap: scaled to the wall
    time), so their sum is the busy time and the rest idle. Returns the split, the step's
    wall time, and the seconds of kernels of a jitted step that named no instruction
    (counted as elementwise/norm/loss: XLA's own helpers, copies)."""
    wall, events = trace_events(step)
    split = dict.fromkeys(CLASSES, 0.0)
    unmatched = 0.0
    for e in device_events(events):
        args = e.get("args", {})
        op = args.get("hlo_op", "")
        computes = None
        if not op.startswith("command_buffer"):  # a buffer's call line: not this kernel's
            computes = instructions.get(op)
        if computes is None:
            computes = instructions.get(e["name"])
        if computes is None:
            computes = f"{op} {args.get('hlo_module', '')}"
            cls = kernel_class(e["name"], computes)
            if instructions and cls == "elementwise/norm/loss":
                unmatched += e["dur"] / 1e6 / world
        split[kernel_class(e["name"], computes)] += e["dur"] / 1e6 / world  # trace: us
    busy = sum(split.values())
    split["idle"] = wall - busy
    if busy > wall:  # overlapping threads (a CPU's), or streams beside each other
        for cls in split:
            split[cls] *= wall / busy
        unmatched *= wall / busy
        split["idle"] = 0.0
    return split, wall, unmatched

# --- One configuration: its model, its size, its compiled step, its steps.


@dataclass
class Shared:  # what every configuration uses
    devices: list
    gpu: bool
    device_name: str
    sizes: Sizes
    batch: int  # sequences per optimizer step
    tokens: np.ndarray  # the text; batch i is step i of every configuration
    init_state: dict  # one init for every rung (the padded vocab; GPT-2's rows a prefix)
    budget: int  # bytes JAX's allocator may hold on one device (None: a CPU, not sized)
    meter: object  # this GPU's energy in joules (NVML), or None
    flops_per_token: float
    bf16_ok: bool  # bf16 tensor cores (or a CPU, where bf16 is simply measured)
    bf16_why: str
    host_batches: list = field(default_factory=list)  # batch i as numpy int32, drawn once

    def host_batch(self, step):
        while len(self.host_batches) <= step:
            x, y = get_batch(self.tokens, len(self.host_batches), self.batch,
                             self.sizes.block_size)
            self.host_batches.append((x.astype(np.int32), y.astype(np.int32)))
        return self.host_batches[step]


@dataclass
class Trainer:
    """One configuration in training: its step (a compiled program, or op by op the Python
    function), its state, the steps it has taken."""
    name: str
    settings: dict
    micro_batches: int
    step: object  # (state, x, y) -> (the batch's mean loss, the new state)
    state: object  # its parameters and AdamW's moments
    rows: object  # where each batch goes: its rows over the configuration's devices
    devices: list
    compile_s: float = None  # jitted: lower + compile, measured
    plan_bytes: int = None  # jitted: XLA's memory plan of one device
    lowered: str = ""  # jitted: the step as JAX asked for it (StableHLO)
    compiled: str = ""  # jitted: the step as XLA made it (HLO)
    donated: bool = False  # whether its first step took the old state's buffers
    losses: list = field(default_factory=list)  # one per step taken, in order
    warmup_steps: int = 0
    profiled_steps: int = 0
    timed_steps: int = 0


def model_config(sizes, settings):
    vocab = sizes.vocab
    if settings["pad_vocab"]:
        vocab = sizes.padded_vocab
    return GPTConfig(block_size=sizes.block_size, n_layer=sizes.n_layer,
                     n_head=sizes.n_head, n_embd=sizes.n_embd, vocab_size=vocab,
                     attn=settings["attn"], checkpoint=settings["checkpoint"],
                     fused_classifier=settings["fused_classifier"],
                     bf16_residual=settings["bf16_residual"])


def accumulate(model, x, y, micro_batches, jitted=True):
    """Loss and gradient of a batch from `micro_batches` equal micro-batches: their
    gradients summed, then divided by their count, so they are the full batch's (torch
    divides each micro-batch's loss instead). Jitted: a lax.scan, one micro-step to
    compile; op by op: a Python loop."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def micro_step(grad_sum, xy):
        def loss_of(params):
            return nnx.merge(graphdef, params, rest)(xy[0], xy[1])[1]

        loss, grads = jax.value_and_grad(loss_of)(params)
        return jax.tree.map(jnp.add, grad_sum, grads), loss

    grad_sum = jax.tree.map(jnp.zeros_like, params)
    micro_x = x.reshape(micro_batches, -1, x.shape[1])  # (micro-steps, rows, T)
    micro_y = y.reshape(micro_batches, -1, y.shape[1])
    if jitted:
        grad_sum, losses = jax.lax.scan(micro_step, grad_sum, (micro_x, micro_y))
    else:
        losses = []
        for xy in zip(micro_x, micro_y):
            grad_sum, loss = micro_step(grad_sum, xy)
            losses.append(loss)
    grads = jax.tree.map(lambda g: g / micro_batches, grad_sum)
    return jnp.mean(jnp.asarray(losses)), grads


def accumulation_error(count=4):
    """The gradient accumulated over 4 micro-batches vs the full batch's, in fp32 on a toy
    model: their relative difference.
    PREDICTION: fp32 rounding, ~1e-7 (the same sums in another order). A step that forgot
    to divide by the micro-batch count would be off by 3x - and AdamW would hide it."""
    config = GPTConfig.preset("tiny", n_layer=1, n_head=2, n_embd=32, block_size=16,
                              vocab_size=256)
    abstract = nnx.eval_shape(lambda: GPT(config))  # shapes only: no init to compile
    graphdef, shapes = nnx.split(abstract)
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: rng.normal(0, 0.1, s.shape).astype(s.dtype), shapes)
    x = jnp.asarray(rng.integers(0, 256, (8, 16)), jnp.int32)
    y = jnp.asarray(rng.integers(0, 256, (8, 16)), jnp.int32)

    def both(state):  # one program computes both gradients
        model = nnx.merge(graphdef, state)
        _, accumulated = accumulate(model, x, y, count)
        _, full = accumulate(model, x, y, 1)
        return accumulated, full

    with jax.default_matmul_precision("highest"):
        accumulated, full = jax.jit(both)(state)
    difference = jax.tree.map(jnp.subtract, accumulated, full)
    return float(optax.tree.norm(difference) / optax.tree.norm(full))


def report_accumulation(error):
    print(f"measured: gradient accumulated over 4 micro-batches vs the full batch: "
          f"relative difference {error:.1e} (tolerance {ACCUM_TOLERANCE:.0e})")


def build(settings, shared, micro_batches, name=""):
    """The configuration at the shared init with AdamW: its model on its devices (one, or
    a replica on each when sharded) and its step, as a Python function: compile_step
    makes it one XLA program."""
    devices = shared.devices[:1]
    if settings["shard"]:
        devices = shared.devices
    mesh = jax.make_mesh((len(devices),), ("data",), (jax.sharding.AxisType.Auto,),
                         devices=devices)
    config = model_config(shared.sizes, settings)
    dtype = jnp.float32
    if settings["bf16"]:
        dtype = jnp.bfloat16  # the matmuls' dtype; the parameters stay fp32
    attention = "xla"  # XLA's own, on a CPU: the T x T scores in memory
    if shared.gpu:
        attention = "cudnn"  # cuDNN's flash attention (bf16 inputs)
    abstract = nnx.eval_shape(lambda: GPT(config, dtype, attn_impl=attention,
                                          split_qkv=settings["split_qkv"],
                                          recompute_gelu=settings["recompute_gelu"]))
    graphdef, shapes = nnx.split(abstract)  # shapes only: the shared weights fill them
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    model = nnx.merge(graphdef, zeros)
    weights = dict(shared.init_state)
    for key in ("transformer.wte.weight", "lm_head.weight"):  # the tied embedding
        weights[key] = weights[key][:config.vocab_size]
    from_torch(model, weights)
    graphdef, state = nnx.split((model, nnx.Optimizer(model, adamw(6e-4), wrt=nnx.Param)))
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))  # replicated
    rows = NamedSharding(mesh, PartitionSpec("data"))  # each device gets its rows

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = accumulate(model, x, y, micro_batches, settings["jit"])
        with jax.named_scope("optimizer"):  # a name the profile's classes look for
            optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    return Trainer(name, settings, micro_batches, step, state, rows, devices)


def xla_options(device, triton_gemm=True):
    """XLA's options for a jitted program on this device (a CPU: none)."""
    if device.platform != "gpu":
        return {}
    return dict(xla_gpu_autotune_level=AUTOTUNE_LEVEL,
                xla_gpu_enable_triton_gemm=triton_gemm)


def compile_step(trainer, shared):
    """jax.jit of the whole step, compiled now rather than at its first call: the program,
    its text before and after XLA, its compile seconds, and XLA's memory plan for one
    device (its inputs and outputs, less what they share, and its scratch)."""
    donate = ()
    if trainer.settings["donate"]:
        donate = (0,)  # the old state's buffers become the new state's
    x, y = jax.device_put(shared.host_batch(0), trainer.rows)
    options = xla_options(trainer.devices[0], trainer.settings["triton_gemm"])
    start = time.perf_counter()
    with jax.default_matmul_precision(trainer.settings["precision"]):
        lowered = jax.jit(trainer.step, donate_argnums=donate).lower(trainer.state, x, y)
        compiled = lowered.compile(options)
    trainer.compile_s = time.perf_counter() - start
    trainer.step = compiled
    trainer.lowered = lowered.as_text()
    trainer.compiled = compiled.as_text()
    plan = compiled.memory_analysis()
    trainer.plan_bytes = (plan.argument_size_in_bytes + plan.output_size_in_bytes
                          - plan.alias_size_in_bytes + plan.temp_size_in_bytes)


def run_steps(trainer, count, shared):
    """`count` optimizer steps on the trainer's next batches. The host reads each loss
    after its step (it waits for the device there), or, without host sync, all of them
    after the last: each loss's copy to the host is queued with its step, so it is made as
    soon as the loss is computed (read one by one after the last step, the copies came
    0.7-1.1 ms apart on an H100). Ends with the device synchronised, the AdamW update
    included."""
    pending = []
    with jax.default_matmul_precision(trainer.settings["precision"]):  # op by op: per op
        for _ in range(count):
            index = len(trainer.losses) + len(pending)
            x, y = jax.device_put(shared.host_batch(index), trainer.rows)
            loss, trainer.state = trainer.step(trainer.state, x, y)
            if trainer.settings["host_sync"]:
                trainer.losses.append(float(loss))
            else:
                loss.copy_to_host_async()
                pending.append(loss)
    sync(trainer.state)
    for loss in pending:
        trainer.losses.append(float(loss))


def predicted_bytes(settings, shared, rows):
    """A step's predicted peak on one device, micro-batches of `rows` sequences, by
    model_jax's accounting: op by op, the residuals JAX's autodiff keeps (traced); jitted,
    what XLA keeps (model_torch's terms, as XLA's plans show it keeps them)."""
    config = model_config(shared.sizes, settings)
    if not settings["jit"]:
        return model_jax.eager_peak_bytes(config, rows)
    return model_jax.predicted_peak_bytes(config, rows, settings["bf16"])


def size_rung(settings, shared, held, rows):
    """The fewest micro-batches (a divisor of `rows`) whose step fits the memory left
    beside what is `held` (the incumbent, the batches) and beside the weights and AdamW
    moments of the next rung, which it will be timed against (the incumbent steps while
    the candidate's state is alive), by model_jax's predicted peak with model_torch's
    allocator headroom; the prediction for one micro-batch; the memory available. A CPU
    is not sized: one micro-batch."""
    if shared.budget is None:
        return 1, None, None
    state = model_torch.state_bytes(model_config(shared.sizes, settings))
    available = shared.budget - held - state["params"] - state["optimizer"]
    predicted = None
    for count in range(1, rows + 1):
        if rows % count:
            continue
        predicted = predicted_bytes(settings, shared, rows // count)
        if model_torch.ALLOCATOR_HEADROOM * predicted <= available:
            return count, predicted, available
    return None, predicted, available


def more_micro_batches(rows, count):
    """The next divisor of rows at least twice count, or None."""
    for larger in range(2 * count, rows + 1):
        if rows % larger == 0:
            return larger
    return None


def memory_held(shared):
    if shared.gpu:
        return shared.devices[0].memory_stats()["bytes_in_use"]
    return 0


def free_memory(trainer=None, op_by_op=False):
    """A configuration's memory back to JAX's pool before the next is sized: its arrays
    deleted now (not when its last reference goes), what else is no longer referenced
    (gc.collect: compiled programs in reference cycles); after the op-by-op rung, JAX's
    caches of its ~250 one-op programs too. JAX's pool is one region taken at start: what
    is freed joins its free space again, whole, for the next rung's largest buffer."""
    if trainer is not None:
        for leaf in jax.tree.leaves(trainer.state):
            leaf.delete()
    gc.collect()
    if op_by_op:
        jax.clear_caches()


def report_memory(count, rows, predicted, available):
    noun = "micro-batches"
    if count == 1:
        noun = "micro-batch"
    line = f"   memory: {count} {noun} of {rows // count}"
    if available is None:
        line += " (a CPU: not sized; --memory-gb N sizes for N GiB)"
    else:
        line += (f": {predicted / 2**30:.1f} GiB predicted of {available / 2**30:.1f} "
                 "available")
    print(line, flush=True)


class DoesNotFit(Exception):
    """XLA's plan of a compiled step is over the memory available."""


def same_program(settings, count, incumbent, shared):
    """Whether a jitted rung's program is its incumbent's: the same settings but those
    that do not reach XLA (when the host reads the loss; on a CPU, the GPU's kernel
    choice), the same micro-batches."""
    if incumbent is None or not incumbent.settings["jit"]:
        return False
    if count != incumbent.micro_batches or settings["shard"] != incumbent.settings["shard"]:
        return False
    ignored = ["host_sync"]
    if not shared.gpu:
        ignored.append("triton_gemm")
    for key, value in settings.items():
        if key not in ignored and incumbent.settings[key] != value:
            return False
    return True


def start_rung(name, settings, shared, count, available, incumbent):
    """Build a configuration and take its first step, untimed: jitted, its compile first
    (said before it starts), then XLA's plan checked against the memory available (over
    it: DoesNotFit, before anything runs), or the incumbent's program where it is the
    same; op by op, JAX compiles each op in that step. Then a profiled call of the steps
    its timed calls hold (profile_as_timed)."""
    trainer = build(settings, shared, count, name)
    if same_program(settings, count, incumbent, shared):
        print("   the incumbent's program: what changed does not reach XLA", flush=True)
        trainer.step = incumbent.step
        trainer.lowered = incumbent.lowered
        trainer.compiled = incumbent.compiled
        trainer.plan_bytes = incumbent.plan_bytes
    elif settings["jit"]:
        print("   compiling the whole step with XLA ...", flush=True)
        compile_step(trainer, shared)
        print(f"   XLA's plan: {trainer.plan_bytes / 2**30:.2f} GiB on one device (its "
              "inputs, outputs and scratch)", flush=True)
        if available is not None and trainer.plan_bytes > available:
            raise DoesNotFit(f"XLA's plan, {trainer.plan_bytes / 2**30:.1f} GiB, is over "
                             f"the {available / 2**30:.1f} available")
    first_state = trainer.state
    run_steps(trainer, 1, shared)
    trainer.donated = all(leaf.is_deleted() for leaf in jax.tree.leaves(first_state))
    del first_state  # not donated: freed now
    trainer.warmup_steps = 1
    peak = None
    if shared.gpu and not settings["jit"]:  # op by op, first: the allocator's peak so far
        peak = shared.devices[0].memory_stats()["peak_bytes_in_use"]
    split, wall, unmatched, window = profile_as_timed(trainer, shared)
    started = dict(profile=split, profile_step_s=wall, unmatched_s=unmatched,
                   profile_window=window, peak_memory_bytes=peak)
    return trainer, started


def profile_as_timed(trainer, shared):
    """One profiled call of the steps the rung's timed calls hold (one step, or WINDOW
    without the per-step host sync), split by class, per step. A step queued behind the
    one before it starts as that one ends; a step run alone first waits on the device for
    the host's launch (XLA's command buffers updated to the step's buffers, then launched),
    idle that a window of timed steps pays once, not once a step. Returns the split, the
    wall seconds and the unclassified seconds a step, and the steps profiled."""
    window = 1
    if not trainer.settings["host_sync"]:
        window = WINDOW
    shared.host_batch(len(trainer.losses) + window)  # drawn before the profile starts
    instructions = program_instructions(trainer.compiled)
    split, wall, unmatched = profile_split(lambda: run_steps(trainer, window, shared),
                                           instructions, len(trainer.devices))
    trainer.profiled_steps += window
    per_step = {cls: seconds / window for cls, seconds in split.items()}
    return per_step, wall / window, unmatched / window, window


def count_lines(pattern, text):
    return len(re.findall(pattern, text, re.M))


def evidence(trainer, shared):
    """What each technique did, not its flag, from the programs: the matmuls JAX asks for
    in bf16 and at 'highest' precision; whether the loss exponentiates fp32 logits (a bf16
    one rounds the loss by ~0.3%, within an honest run's spread: its value cannot tell);
    B x T x V logits; T x T scores; cuDNN attention, cuBLAS and Triton GEMM calls; bf16
    adds of (B, T, d) values (the residual stream's, with bf16_residual); the GELU's tanh
    over (B, T, 4d) values (twice a layer when backward recomputes it); slices of the
    (B, T, 3d) q, k, v matmul's output; all-reduces; whether the first step took the
    donated state's buffers."""
    config = model_config(shared.sizes, trainer.settings)
    lowered = trainer.lowered  # what JAX asked for (XLA:CPU computes bf16 dots in f32)
    compiled = trainer.compiled  # what XLA made of it
    T = config.block_size
    V = config.vocab_size
    rows = shared.batch // trainer.micro_batches  # a micro-batch on all devices: JAX's
    # view; XLA's (the compiled text) is one device's
    device_rows = rows // len(trainer.devices)
    return dict(
        bf16_dots=count_lines(r"dot_general.*-> tensor<[\dx]*xbf16>", lowered),
        highest_dots=count_lines(r"dot_general.*precision = \[HIGHEST", lowered),
        f32_vocab_exps=count_lines(rf"exponential.*<[\dx]*x{V}xf32>", lowered),
        full_logits=count_lines(rf"tensor<{rows}x{T}x{V}x", lowered),
        scores=count_lines(rf"\[{device_rows},{config.n_head},{T},{T}\]", compiled),
        cudnn_attention=count_lines(r'custom_call_target="__cudnn\$fmha', compiled),
        cublas_calls=count_lines(r'custom_call_target="__cublas', compiled),
        triton_gemms=count_lines(r"__triton_gemm", compiled),
        bf16_residual_adds=count_lines(
            rf"stablehlo\.add .*: tensor<{rows}x{T}x{config.n_embd}xbf16>$", lowered),
        gelu_tanhs=count_lines(rf"stablehlo\.tanh .*tensor<{rows}x{T}x{4 * config.n_embd}x",
                               lowered),
        qkv_slices=count_lines(
            rf"stablehlo\.slice .*tensor<{rows}x{T}x{3 * config.n_embd}x", lowered),
        all_reduces=count_lines(r" all-reduce(?:-start)?\(", compiled),
        donated_inputs_deleted=trainer.donated)

# --- The experiments: each rung against the incumbent, the final rung's floor, the
# headline.


def settle(incumbent, candidate, shared, window):
    """Untimed steps before a timing: one of the incumbent, then on a GPU calls of `window`
    steps of each in turn (incumbent, candidate) until the device has worked ~SETTLE_S.
    A GPU left idle (a compile) draws little power; under work its draw climbs for about
    a second, and a card that reaches its power cap (an H100 SXM's 700 W, by its
    datasheet) lowers its clock for a moment when it first meets it: a call timed there is
    slow on whichever side it falls. (A later pair can still be slow, most often both of
    its calls at once, which leaves their ratio as it was.) A CPU compiles on its own cores
    and is already at its working clock: the one step."""
    shared.host_batch(len(incumbent.losses))  # drawn before the clock starts
    start = time.perf_counter()
    run_steps(incumbent, 1, shared)  # ends with the device synchronised
    first_s = time.perf_counter() - start
    incumbent.warmup_steps += 1
    if not shared.gpu:
        return
    pairs = math.ceil(max(SETTLE_S - first_s, 0) / (2 * window * first_s))
    shared.host_batch(len(incumbent.losses) + pairs * window)
    shared.host_batch(len(candidate.losses) + pairs * window)
    for _ in range(pairs):
        run_steps(incumbent, window, shared)
        run_steps(candidate, window, shared)
    incumbent.warmup_steps += pairs * window
    candidate.warmup_steps += pairs * window


def compare(incumbent, candidate, shared, pairs):
    """The incumbent and the candidate timed interleaved, `pairs` times: one step each, or
    WINDOW steps each where either skips the per-step host sync. First untimed steps (see
    settle) where the incumbent is jitted: the candidate's compile left the device idle
    (an op-by-op step takes seconds, the device busy at once)."""
    window = 1
    if not incumbent.settings["host_sync"] or not candidate.settings["host_sync"]:
        window = WINDOW

    def incumbent_call():
        run_steps(incumbent, window, shared)

    def candidate_call():
        run_steps(candidate, window, shared)

    shares = [cpu_share()]
    gc.collect()  # before the untimed steps, not between them and the pairs: a full
    # collection stalls the host while the GPU idles, and the call after an idle may run fast
    if incumbent.settings["jit"]:
        settle(incumbent, candidate, shared, window)
    shared.host_batch(len(incumbent.losses) + pairs * window)  # drawn before the
    shared.host_batch(len(candidate.losses) + pairs * window)  # clock starts
    seconds = interleaved([incumbent_call, candidate_call], pairs)
    shares.append(cpu_share())
    incumbent.timed_steps += pairs * window
    candidate.timed_steps = pairs * window
    incumbent_ms = [s / window * 1e3 for s in seconds[0]]
    candidate_ms = [s / window * 1e3 for s in seconds[1]]
    return dict(incumbent_ms=incumbent_ms, candidate_ms=candidate_ms, window=window,
                busy=min(shares) < BUSY_SHARE, cpu_shares=shares)


def tokens_per_joule(trainer, shared, step_ms):
    """This GPU's tokens per joule (NVML's energy counter) over whole steps lasting at
    least ENERGY_MIN_SECONDS, taken after the timed pairs: the counter is never read inside
    a timed step (on an H100 two reads cost milliseconds, as much as two rungs differ).
    None without NVML, and for a rung sharded over several devices (the meter reads the
    first GPU only)."""
    if shared.meter is None or len(trainer.devices) > 1:
        return None
    steps = math.ceil(ENERGY_MIN_SECONDS / (step_ms / 1e3))
    shared.host_batch(len(trainer.losses) + steps)  # drawn before the counter is read
    before = shared.meter()
    run_steps(trainer, steps, shared)  # ends with the device synchronised
    joules = shared.meter() - before
    if joules <= 0:  # the counter did not move: too short a stretch to say
        return None
    tokens = shared.batch * shared.sizes.block_size  # this GPU's tokens, its energy
    return tokens * steps / joules


def decide(ratio, busy):
    """The rule, the same in both capstones. A rung is kept when it is faster than the
    incumbent (every rung kept so far) beyond the run-to-run spread: measured
    interleaved, incumbent and candidate steps alternating, every per-pair ratio
    (incumbent ms / rung ms) above 1, the pair where the machine ran slowest set
    aside when there are SET_ASIDE_FROM pairs or more (ratio_summary). Each rung
    runs with the micro-batches its own memory allows, so a rung whose saved memory
    lets a larger micro-batch fit is kept by the same rule when that makes it
    faster. Otherwise it is dropped: slower when every ratio is below 1, within
    noise when they straddle 1. Returns (kept, the verdict's words)."""
    measured = f"{ratio['ratio']:.2f}x [{ratio['low']:.2f}, {ratio['high']:.2f}]"
    if ratio["decisive_low"] > ratio["low"]:  # the lowest ratio was the pair set aside
        measured += f" (pair {ratio['set_aside'] + 1}, the slowest, set aside)"
    kept = ratio["decisive_low"] > 1
    if kept:
        verdict = f"kept: {measured} over the incumbent"
    elif ratio["high"] < 1:
        verdict = f"dropped: {measured}, slower"
    else:
        verdict = f"dropped: {measured}, within noise"
    if busy:
        verdict += " (machine busy)"
    return kept, verdict


def loss_gap(losses, base_losses):
    """Largest relative gap of two loss curves over their first EARLY_STEPS steps."""
    gaps = []
    for loss, base in zip(losses[:EARLY_STEPS], base_losses[:EARLY_STEPS]):
        gaps.append(abs(loss - base) / base)
    return max(gaps)


def curve_gap(losses, base_losses):
    """Largest relative gap of two loss curves, each a moving mean over SMOOTH steps."""
    steps = min(len(losses), len(base_losses))
    window = np.ones(SMOOTH) / SMOOTH
    smooth = np.convolve(losses[:steps], window, mode="valid")
    smooth_base = np.convolve(base_losses[:steps], window, mode="valid")
    return float(np.max(np.abs(smooth - smooth_base) / smooth_base))


def derive(trainer, started, step_ms, incumbent_ms, incumbent_row, base_losses, shared,
           roofs):
    """A rung's row: its raw measurements and the numbers derived from them. step_ms: its
    interleaved timings; incumbent_ms: the incumbent's beside them (the first incumbent's
    own row: []); incumbent_row: None for a first incumbent (the baseline)."""
    settings = trainer.settings
    world = len(trainer.devices)
    ms = statistics.median(step_ms)
    tokens_per_step = shared.batch * shared.sizes.block_size
    tokens_per_s = tokens_per_step / (ms / 1e3)  # all devices together
    flops = tokens_per_s * shared.flops_per_token / world  # FLOP/s of one device
    mfu_datasheet = None
    if roofs["datasheet_flops"] is not None:
        mfu_datasheet = flops / roofs["datasheet_flops"]
    micro_batch = shared.batch // world // trainer.micro_batches
    row = dict(name=trainer.name, settings=settings, micro_batches=trainer.micro_batches,
               micro_batch_size=micro_batch, step_ms=step_ms,
               incumbent_step_ms=incumbent_ms, ms_per_step=ms,
               tokens_per_step=tokens_per_step, tokens_per_s=tokens_per_s,
               mfu_datasheet=mfu_datasheet,
               mfu_measured_peak=flops / roofs["matmul_flops"],
               losses=trainer.losses, warmup_steps=trainer.warmup_steps,
               profiled_steps=trainer.profiled_steps, timed_steps=trainer.timed_steps,
               peak_memory_bytes=started["peak_memory_bytes"],
               xla_plan_bytes=trainer.plan_bytes,
               predicted_peak_bytes=started["predicted_peak_bytes"],
               memory_available_bytes=started["memory_available_bytes"],
               profile=started["profile"], profile_step_s=started["profile_step_s"],
               profile_window=started["profile_window"],
               unmatched_s=started["unmatched_s"], world=world,
               compile_s=trainer.compile_s, acts=evidence(trainer, shared))
    row["loss_rel_gap"] = loss_gap(trainer.losses, base_losses)
    row["loss_gap_steps"] = min(len(trainer.losses), len(base_losses), EARLY_STEPS)
    if incumbent_row is None:
        row.update(ratios=[], ratio=None, ratio_low=None, ratio_high=None,
                   ratio_set_aside=None, ratio_decisive_low=None, speedup=1.0,
                   speedup_low=1.0, speedup_high=1.0)
        return row
    ratio = ratio_summary(incumbent_ms, step_ms)
    row.update(ratios=ratio["ratios"], ratio=ratio["ratio"], ratio_low=ratio["low"],
               ratio_high=ratio["high"], ratio_set_aside=ratio["set_aside"],
               ratio_decisive_low=ratio["decisive_low"])
    row["speedup"] = incumbent_row["speedup"] * ratio["ratio"]  # the kept rungs' product
    row["speedup_low"] = incumbent_row["speedup_low"] * ratio["low"]
    row["speedup_high"] = incumbent_row["speedup_high"] * ratio["high"]
    return row


def report_rung(row):
    """A rung's lines, printed as soon as it is measured."""
    busy = ""
    if row["busy"]:
        busy = " (machine busy)"
    ms = row["step_ms"]
    line = (f"   measured: {row['ms_per_step']:.1f} ms/step [{min(ms):.1f}, "
            f"{max(ms):.1f}], {row['tokens_per_s']:,.0f} tokens/s")
    if row["peak_memory_bytes"] is not None:
        line += f", peak {row['peak_memory_bytes'] / 2**30:.1f} GiB"
    if row["tokens_per_joule"] is not None:
        line += f", {row['tokens_per_joule']:,.0f} tokens/J"
    print(line + busy)
    if row["compile_s"] is not None:
        print(f"   measured: compile {row['compile_s']:.1f} s (jax.jit's lower and "
              "compile, before the first step)")
    line = "   derived: "
    if row["ratio"] is not None:
        line += (f"{row['speedup']:.2f}x [{row['speedup_low']:.2f}, "
                 f"{row['speedup_high']:.2f}] over the baseline, ")
    line += "MFU "
    if row["mfu_datasheet"] is not None:
        line += f"{row['mfu_datasheet']:.1%} of the datasheet peak, "
    line += (f"{row['mfu_measured_peak']:.1%} of the measured peak; losses within "
             f"{row['loss_rel_gap']:.3%} of the baseline's{busy}")
    print(line)
    step = row["profile_step_s"]
    shares = []
    for cls, seconds in sorted(row["profile"].items(), key=lambda item: -item[1]):
        if seconds >= 0.005 * step:
            shares.append(f"{cls} {seconds / step:.0%}")
    profiled = f"one profiled step, {step * 1e3:.1f} ms"
    if row["profile_window"] > 1:
        profiled = (f"a profiled call of {row['profile_window']} steps, "
                    f"{step * 1e3:.1f} ms a step")
    print(f"   measured: {profiled}: {', '.join(shares)}")
    print(f"   {row['verdict']}")
    low, high = row["predicted"]
    held = "held"
    if not row["prediction_held"]:
        held = "missed"
    if row["ratio"] is None:  # a first incumbent: its MFU was predicted
        print(f"   prediction {held}: MFU {low:.0%}-{high:.0%} of the measured peak, "
              f"measured {row['mfu_measured_peak']:.1%}{busy}")
    else:
        print(f"   prediction {held}: {low:.2f}-{high:.2f}x, measured "
              f"{row['ratio']:.2f}x{busy}")


def device_kind(shared):
    if shared.gpu:
        return "gpu"
    return "cpu"


def skip_reason(settings, shared):
    """Why this machine cannot run a configuration, or None."""
    if settings["shard"] and len(shared.devices) == 1:
        return ("it needs several devices (a CPU can simulate them: "
                "XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    if settings["shard"] and shared.batch % len(shared.devices):
        return f"{shared.batch} sequences do not split over {len(shared.devices)} devices"
    if settings["bf16"] and not shared.bf16_ok:
        return shared.bf16_why
    if shared.gpu and settings["attn"] == "sdpa" and not settings["bf16"]:
        return "cuDNN's fused attention takes bf16 inputs, and bf16 was dropped above"
    if settings["bf16_residual"] and not settings["bf16"]:
        return ("without the bf16 compute dtype (dropped above) the residual stream is "
                "fp32 anyway")
    return None


def floor_ms(settings, micro_batches, tokens, shared, roofs):
    """Each class's terms and floor in ms for a configuration (model_torch's accounting
    at the best measured roofs: the floors are lower bounds). Where no fused attention
    kernel runs (XLA's own attention, on a CPU), its matmuls run as matmuls and its
    softmax as elementwise kernels: their floors go there."""
    config = model_config(shared.sizes, settings)
    terms = model_torch.step_floor_terms(config, tokens, settings["bf16"], micro_batches)
    if not shared.gpu and settings["attn"] == "sdpa":
        attention = terms.pop("attention")
        terms["matmul"]["flops"] += attention["flops"]
        terms["elementwise/norm/loss"]["bytes"] += attention["bytes"]
        terms["attention"] = dict(flops=0, bytes=0)
    seconds = model_torch.floor_seconds(terms, roofs["matmul_flops_best"],
                                        roofs["copy_bytes_per_s_best"])
    return terms, {cls: s * 1e3 for cls, s in seconds.items()}


def predict(name, settings, shared, roofs, floor):
    """(low, high) of what a rung should measure on this kind of device, and the words
    that say so: a first incumbent's MFU, a rung's speed-up over the incumbent,
    FLOOR_FIX's from the floor table."""
    kind = device_kind(shared)
    where = "on a GPU"
    if kind == "cpu":
        where = "on a CPU"
    if name == FLOOR_FIX and floor is not None:
        return predict_from_floor(floor, settings, shared, roofs)
    low, high = PREDICTED[name][kind]
    if name in (BASE, ALONE, FIRST_JITTED):
        return (low, high), f"{where} MFU {low:.0%}-{high:.0%} of the measured peak"
    if name == SHARDED and shared.gpu:  # a share of world x one device alone (simulated
        low = low * len(shared.devices)  # CPU devices share the cores: no multiple)
        high = high * len(shared.devices)
    return (low, high), f"{where} {low:.2f}-{high:.2f}x over the incumbent"


def predict_from_floor(floor, settings, shared, roofs):
    """A change predicted from the floor table: each class's floor now and with the
    change; the time saved at the floor, and at the rate each class runs now (measured /
    floor). The speed-up expected over the step: from half the first to one and a half
    times the second."""
    micro = floor["micro_batches"]
    tokens = floor["tokens"]
    _, before = floor_ms(floor["settings"], micro, tokens, shared, roofs)
    _, after = floor_ms(settings, micro, tokens, shared, roofs)
    at_floor = 0.0
    at_rate = 0.0
    for cls, ms in before.items():
        saved = ms - after[cls]
        at_floor += saved
        if saved > 0:  # a class with a floor: the rate it runs at, measured over floor
            at_rate += saved * floor["classes"][cls]["measured_ms"] / ms
    step = floor["step_ms"]
    low = step / (step - at_floor / 2)
    high = step / (step - 1.5 * at_rate)
    words = (f"{low:.3f}-{high:.3f}x over the incumbent: the floor table's classes "
             f"lose {at_floor:.3g} ms at their floors, {at_rate:.3g} ms at the rate they "
             f"run now, of a {step:.4g} ms step")
    return (low, high), words


def next_rung(name, settings, incumbent, shared, pairs):
    """The candidate sized, started and timed against the incumbent (None: the first
    incumbent, started only). XLA's plan over the memory, or out of memory: the prediction
    missed; twice the micro-batches, and again. Returns (the candidate, what its start
    measured, the timing), or None when one sequence at a time does not fit."""
    rows = shared.batch
    if settings["shard"]:
        rows = rows // len(shared.devices)  # each device's share
    held = memory_held(shared)
    count, predicted, available = size_rung(settings, shared, held, rows)
    while count is not None:
        report_memory(count, rows, predicted, available)
        candidate = None
        try:
            candidate, started = start_rung(name, settings, shared, count, available,
                                            incumbent)
            started["predicted_peak_bytes"] = predicted
            started["memory_available_bytes"] = available
            timing = None
            if incumbent is not None:
                timing = compare(incumbent, candidate, shared, pairs)
            return candidate, started, timing
        except DoesNotFit as error:
            said = f"   prediction missed: {error} with {count} micro-batches"
        except jax.errors.JaxRuntimeError as error:  # the device's allocator refused
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            said = f"   prediction missed: out of memory with {count} micro-batches"
        free_memory(candidate)  # before it is sized again
        larger = more_micro_batches(rows, count)
        if larger is None:
            print(f"{said}: it does not fit this device")
        else:
            print(f"{said}; trying {larger}")
        count = larger
        if count is not None:
            predicted = predicted_bytes(settings, shared, rows // count)
    return None


def start_first(name, why, settings, shared, roofs):
    """The first incumbent (the baseline; --headline: the first jitted rung; --scaling:
    the final rung on one device alone): predicted, sized, started; it is timed beside
    the first rung."""
    predicted, words = predict(name, settings, shared, roofs, None)
    print(f"{name}: predicted: {words} ({why})", flush=True)
    started = next_rung(name, settings, None, shared, None)
    if started is None:
        sys.exit(f"error: {name} does not fit this device with one sequence per "
                 "micro-batch: give it more memory (--memory-gb)")
    trainer, started, _ = started
    started["predicted"] = predicted
    started["why"] = why
    return trainer, started


def first_row(trainer, started, timing, shared, roofs):
    """The first incumbent's row, from its timings beside the first rung."""
    print(f"{trainer.name} (timed beside the rung above):")
    row = derive(trainer, started, timing["incumbent_ms"], [], None, trainer.losses,
                 shared, roofs)
    low, high = started["predicted"]
    row.update(why=started["why"], kept=True, verdict="the first incumbent")
    row.update(busy=timing["busy"], cpu_shares=timing["cpu_shares"])
    row["tokens_per_joule"] = None
    row["predicted"] = [low, high]
    row["prediction_held"] = low <= row["mfu_measured_peak"] <= high
    report_rung(row)
    return row


def descend(incumbent, started, entries, shared, roofs, rows, skipped, floor=None,
            pairs=None, judge=True):
    """Each rung of `entries` (name, change, why) against the incumbent, in order:
    measured, reported, kept or dropped (judge=False: only timed against it). The first
    timing also times the first incumbent, whose row is made then (started: what its
    start measured). Appends to rows and skipped; returns the incumbent at the end."""
    for name, change, why in entries:
        settings = dict(incumbent.settings, **change)
        reason = skip_reason(settings, shared)
        if reason is not None:
            print(f"{name}: skipped: {reason}")
            skipped[name] = reason
            continue
        predicted, words = predict(name, settings, shared, roofs, floor)
        print(f"{name}: predicted: {words} ({why})", flush=True)
        count = pairs
        if count is None:
            count = shared.sizes.compiled_pairs
            if not incumbent.settings["jit"]:
                count = shared.sizes.eager_pairs  # op-by-op steps take seconds
        measured = next_rung(name, settings, incumbent, shared, count)
        if measured is None:
            skipped[name] = "does not fit this device"
            continue
        candidate, candidate_started, timing = measured
        if not rows:
            rows.append(first_row(incumbent, started, timing, shared, roofs))
            print(f"{name}:")
        incumbent_row = [row for row in rows if row["name"] == incumbent.name][-1]
        row = derive(candidate, candidate_started, timing["candidate_ms"],
                     timing["incumbent_ms"], incumbent_row, rows[0]["losses"], shared,
                     roofs)
        ratio = ratio_summary(timing["incumbent_ms"], timing["candidate_ms"])
        kept, verdict = decide(ratio, timing["busy"])
        if not judge:
            verdict = (f"timed against {incumbent.name}: {ratio['ratio']:.2f}x "
                       f"[{ratio['low']:.2f}, {ratio['high']:.2f}] faster per step")
        smaller = row["micro_batch_size"] != incumbent_row["micro_batch_size"]
        if smaller and not settings["shard"]:  # (sharded: each device's share is smaller)
            verdict += (f", in micro-batches of {row['micro_batch_size']} where the "
                        f"incumbent's are {incumbent_row['micro_batch_size']}")
        row.update(why=why, kept=kept, verdict=verdict, busy=timing["busy"])
        row["cpu_shares"] = timing["cpu_shares"]
        row["tokens_per_joule"] = tokens_per_joule(candidate, shared, row["ms_per_step"])
        row["predicted"] = list(predicted)
        row["prediction_held"] = predicted[0] <= ratio["ratio"] <= predicted[1]
        report_rung(row)
        rows.append(row)
        loser = candidate
        if kept:
            loser = incumbent
            incumbent = candidate
        free_memory(loser, not loser.settings["jit"])  # before the next rung is sized
        loser = None
        candidate = None
    return incumbent


def busy_mark(busy):
    if busy:
        return " (machine busy)"
    return ""


def report_waterfall(rows):
    """Every rung in one table, after the waterfall."""
    print("the waterfall (measured: ms/step, peak memory, tokens/J; derived: speed-up "
          "over the baseline, MFU of the datasheet peak and of the measured peak):")
    print(f"   {'rung':42s} {'verdict':8s} {'micro-batches':>13s} {'ms/step':>9s} "
          f"{'speed-up':>8s} {'MFU (datasheet)':>15s} {'MFU (measured)':>14s} "
          f"{'peak GiB':>8s} {'tokens/J':>8s}")
    for row in rows:
        verdict = "dropped"
        if row["kept"]:
            verdict = "kept"
        peak = "n/a"
        if row["peak_memory_bytes"] is not None:
            peak = f"{row['peak_memory_bytes'] / 2**30:.1f}"
        elif row["xla_plan_bytes"] is not None:
            peak = f"{row['xla_plan_bytes'] / 2**30:.1f}*"
        mfu = "n/a"
        if row["mfu_datasheet"] is not None:
            mfu = f"{row['mfu_datasheet']:.1%}"
        joules = "n/a"
        if row["tokens_per_joule"] is not None:
            joules = f"{row['tokens_per_joule']:,.0f}"
        micro = f"{row['micro_batches']} x {row['micro_batch_size']}"
        print(f"   {row['name']:42s} {verdict:8s} {micro:>13s} {row['ms_per_step']:9.1f} "
              f"{row['speedup']:7.2f}x {mfu:>15s} {row['mfu_measured_peak']:14.1%} "
              f"{peak:>8s} {joules:>8s}{busy_mark(row['busy'])}")
    print("   (* XLA's memory plan of the jitted step, one device: JAX has no per-rung "
          "peak to read; the op-by-op rung's peak is the allocator's)")


def step_floor(trainer, shared, roofs):
    """The final rung on its own roofline: a profiled call of the steps its timed calls
    hold (profile_as_timed), kernel class by kernel class, against each class's floor
    (model_torch.step_floor_terms: its FLOPs at the best measured matmul burst or its
    bytes at the best measured copy, whichever takes longer).
    PREDICTION: on a GPU the matmuls within ~1.2x of their floor, the
    elementwise/norm/loss kernels within ~2x of theirs (XLA fuses them, but moves the fp32
    residual stream and its casts), attention further (its kernels reach a fraction of the
    matmul roof at head size 64), idle near 0: the step 1.2-1.6x its floor. A CPU runs
    far above every floor, over 2x: kernels made for no particular shape, and its roofs
    are one op's speed at one size."""
    shares = [cpu_share()]
    # The later rungs ran since: untimed steps first, as before every timing.
    settle(trainer, trainer, shared, 1)
    split, wall, unmatched, window = profile_as_timed(trainer, shared)
    shares.append(cpu_share())
    tokens = shared.batch // len(trainer.devices) * shared.sizes.block_size  # a device's
    micro = trainer.micro_batches
    terms, floors = floor_ms(trainer.settings, micro, tokens, shared, roofs)
    classes = {}
    for cls in CLASSES:
        term = terms.get(cls, dict(flops=0, bytes=0))  # communication, idle: no floor
        compute_s = term["flops"] / roofs["matmul_flops_best"]
        memory_s = term["bytes"] / roofs["copy_bytes_per_s_best"]
        regime = None
        if cls == "idle":
            regime = "overhead-bound"
        elif compute_s > memory_s:
            regime = "compute-bound"
        elif term["bytes"] > 0:
            regime = "bandwidth-bound"
        classes[cls] = dict(measured_ms=split[cls] * 1e3, floor_ms=floors.get(cls, 0.0),
                            flops=term["flops"], bytes=term["bytes"], regime=regime)
    excess = {cls: c["measured_ms"] - c["floor_ms"] for cls, c in classes.items()}
    largest = max(excess, key=excess.get)
    busy = roofs["busy"] or min(shares) < BUSY_SHARE  # the roofs or the step slowed
    low, high = FLOOR_PREDICTED[device_kind(shared)]
    step_ms = wall * 1e3
    floor_total = sum(c["floor_ms"] for c in classes.values())
    held = low <= step_ms / floor_total
    if high is not None:
        held = held and step_ms / floor_total <= high
    return dict(rung=trainer.name, busy=busy, cpu_shares=shares, checked=shared.gpu,
                predicted=[low, high], prediction_held=held,
                settings=trainer.settings, tokens=tokens,
                micro_batches=trainer.micro_batches, step_ms=step_ms,
                steps_profiled=window, floor_ms=floor_total,
                matmul_flops=roofs["matmul_flops_best"],
                copy_bytes_per_s=roofs["copy_bytes_per_s_best"], classes=classes,
                largest_excess=largest, technique=TECHNIQUE[largest],
                unmatched_ms=unmatched * 1e3)


def report_floor(floor):
    low, high = floor["predicted"]
    expected = f"over {low:g}x"
    if high is not None:
        expected = f"{low:g}-{high:g}x"
    print(f"the floor table: predicted: the step {expected} its floor on this kind of "
          "device")
    profiled = f"one profiled step of {floor['step_ms']:.1f} ms"
    if floor["steps_profiled"] > 1:
        profiled = (f"a profiled call of {floor['steps_profiled']} steps, "
                    f"{floor['step_ms']:.1f} ms a step")
    print(f"{floor['rung']} on its own roofline: {profiled} (measured), class by class "
          "against its floor (derived)")
    print(f"   {'class':24s} {'measured ms':>11s} {'floor ms':>9s} "
          f"{'measured/floor':>14s} {'above floor ms':>14s}  floor's regime")
    for cls in COLOURS:  # matmul first, idle last
        c = floor["classes"][cls]
        ratio = "n/a"
        if c["floor_ms"] > 0:
            ratio = f"{c['measured_ms'] / c['floor_ms']:.2f}x"
        above = c["measured_ms"] - c["floor_ms"]
        print(f"   {cls:24s} {c['measured_ms']:11.2f} {c['floor_ms']:9.2f} {ratio:>14s} "
              f"{above:14.2f}  {c['regime'] or '-'}")
    total = floor["step_ms"] / floor["floor_ms"]
    print(f"   {'the step':24s} {floor['step_ms']:11.2f} {floor['floor_ms']:9.2f} "
          f"{total:13.2f}x {floor['step_ms'] - floor['floor_ms']:14.2f}")
    tflops = floor["matmul_flops"] / 1e12
    gbs = floor["copy_bytes_per_s"] / 1e9
    print(f"   (a floor: the class's FLOPs at {tflops:.3g} TFLOP/s or its bytes at "
          f"{gbs:,.0f} GB/s, the best matmul burst and copy measured above, whichever "
          "takes longer: model_torch.step_floor_terms)")
    if floor["unmatched_ms"] > 0:
        print(f"   (not classified: {floor['unmatched_ms']:.2f} ms of kernels that name "
              "no instruction of the step's program, counted as elementwise/norm/loss)")
    if floor["busy"]:
        print("   (machine busy: the roofs or this step were slowed by other programs: "
              "the ratios are not findings, and no floor is checked against its time)")
    if not floor["checked"]:
        print("   (a CPU: its roofs are one op's speed at one size, not the machine's; a "
              "class can run past such a floor, so none is checked)")
    largest = floor["largest_excess"]
    worst = floor["classes"][largest]
    above = worst["measured_ms"] - worst["floor_ms"]
    print(f"derived: the step is {total:.2f}x its floor; {largest} is furthest above its "
          f"floor ({above:.1f} ms): the chapter's technique for it: {floor['technique']}"
          f"{busy_mark(floor['busy'])}")
    below = floor_below_measured(floor)
    if floor["checked"] and below:
        print("derived: every class took at least its floor, as a lower bound must")
    if floor["checked"] and not below:
        print("derived: a class ran faster than its floor: it beat the measured roof, or "
              "the count of its FLOPs or bytes is too high (not a failed run: a timing)")
    held = "held"
    if not floor["prediction_held"]:
        held = "missed"
    print(f"prediction {held}: the step {expected} its floor, measured {total:.2f}x"
          f"{busy_mark(floor['busy'])}")


def floor_below_measured(floor):
    """Every floor at or below its measured time. A floor above it means its class beat
    the roofs measured for this run, or a count is wrong: reported, never a failed run,
    since both sides are timings."""
    for c in floor["classes"].values():
        if c["floor_ms"] > c["measured_ms"]:
            return False
    return True


def single_device(shared, roofs):
    """The waterfall: the baseline, every rung against the incumbent, the final rung on
    its own roofline, the rungs that act on its largest excess (the first predicted from
    the table), the table again; then, where there are several devices, the final rung
    sharded over all of them."""
    rows = []
    skipped = {}
    name, _, why = RUNGS[0]
    incumbent, started = start_first(name, why, BASELINE, shared, roofs)
    names = [entry[0] for entry in RUNGS]
    fix = names.index(FLOOR_FIX)
    sharded = names.index(SHARDED)
    incumbent = descend(incumbent, started, RUNGS[1:fix], shared, roofs, rows, skipped)
    floors = [step_floor(incumbent, shared, roofs)]
    report_floor(floors[0])
    final = incumbent.name
    incumbent = descend(incumbent, None, RUNGS[fix:sharded], shared, roofs, rows, skipped,
                        floor=floors[0])
    if incumbent.name != final:  # a fix was kept: the table again, re-measured
        floors.append(step_floor(incumbent, shared, roofs))
        report_floor(floors[-1])
    final = incumbent.name
    descend(incumbent, None, RUNGS[sharded:], shared, roofs, rows, skipped)
    report_scaling(rows, shared)
    for floor in floors:
        [row] = [row for row in rows if row["name"] == floor["rung"]]
        row["floor"] = floor
    report_waterfall(rows)
    checks = waterfall_checks(rows, floors, shared)
    return dict(rungs=rows, skipped=skipped, final_rung=final, checks=checks)


def report_scaling(rows, shared):
    """The sharded rung against the final rung on one device: its share of world x one."""
    world = len(shared.devices)
    for row in rows:
        if row["settings"]["shard"]:
            row["scaling"] = row["ratio"] / world
            row["scaling_low"] = row["ratio_low"] / world
            row["scaling_high"] = row["ratio_high"] / world
            print(f"derived: {row['name']}: scaling {row['scaling']:.1%} "
                  f"[{row['scaling_low']:.1%}, {row['scaling_high']:.1%}] of {world} x "
                  f"one device alone{busy_mark(row['busy'])}")


def waterfall_checks(rows, floors, shared):
    """What the waterfall must not change (the losses), and what must add up (the profile,
    the floors, checkpointing's memory)."""
    checks = dict(losses_track_baseline=True, time_split_adds_up=True)
    for row in rows:
        if row["loss_rel_gap"] > LOSS_TOLERANCE:
            checks["losses_track_baseline"] = False
        if min(row["profile"].values()) < 0:
            checks["time_split_adds_up"] = False
    for row, before in zip(rows[1:], rows):
        if row["settings"]["checkpoint"] and not before["settings"]["checkpoint"]:
            lower = checkpointing_lowers_memory(row, shared)
            checks["checkpointing_lowers_memory"] = lower
    checks["loss_softmax_in_fp32"] = loss_in_fp32(rows)
    return checks


def checkpointing_lowers_memory(row, shared):
    """Whether the checkpointed rung keeps less for its backward than without
    checkpointing: the residuals JAX's autodiff asks XLA to keep, traced."""
    config = model_config(shared.sizes, row["settings"])
    plain = replace(config, checkpoint=False)
    rows = row["micro_batch_size"]
    return model_jax.residual_bytes(config, rows) < model_jax.residual_bytes(plain, rows)


def loss_in_fp32(rows):
    """Whether every jitted rung's loss exponentiates fp32 logits."""
    for row in rows:
        if row["settings"]["jit"] and row["acts"]["f32_vocab_exps"] == 0:
            return False
    return True


def headline(shared, final_settings, roofs):
    """The chapter's opening claim: the first jitted rung (fp32 matmuls; the op-by-op
    baseline would take minutes for these steps) and the final rung trained for the same
    steps from one init on the same batches, interleaved: one loss curve against step,
    an order of magnitude apart against wall-clock.
    PREDICTION: the same curve - the first EARLY_STEPS losses within LOSS_TOLERANCE, the
    smoothed curves within CURVE_TOLERANCE - while the final rung is 5-20x faster per
    step on a GPU, 0.8-3x on a CPU; its compile is paid once, before the timed steps."""
    rows = []
    _, change, why = RUNGS[1]
    first_settings = dict(BASELINE, **change)
    base, started = start_first(FIRST_JITTED, why, first_settings, shared, roofs)
    window = 1
    if not final_settings["host_sync"]:
        window = WINDOW
    pairs = shared.sizes.headline_steps // window
    entry = (HEADLINE, final_settings, "every rung the waterfall kept")
    descend(base, started, [entry], shared, roofs, rows, {}, pairs=pairs, judge=False)
    base_row = rows[0]
    final_row = rows[-1]
    early = final_row["loss_rel_gap"]
    curve = curve_gap(final_row["losses"], base_row["losses"])
    count = min(len(final_row["losses"]), len(base_row["losses"]))
    print(f"derived: the first {EARLY_STEPS} steps' losses: largest relative gap "
          f"{early:.3%} (tolerance {LOSS_TOLERANCE:.2%})")
    print(f"derived: the curves smoothed over {SMOOTH} steps, all {count}: largest "
          f"relative gap {curve:.2%} (tolerance {CURVE_TOLERANCE:.0%})")
    result = dict(steps=count, early_steps=EARLY_STEPS, smooth=SMOOTH,
                  loss_tolerance=LOSS_TOLERANCE, curve_tolerance=CURVE_TOLERANCE,
                  early_gap=early, curve_gap=curve, compile_s=final_row["compile_s"])
    result.update(time_ratio=final_row["ratio"], time_ratio_low=final_row["ratio_low"],
                  time_ratio_high=final_row["ratio_high"])
    checks = dict(headline_starts_the_same=early <= LOSS_TOLERANCE,
                  headline_same_curve=curve <= CURVE_TOLERANCE,
                  loss_softmax_in_fp32=loss_in_fp32(rows))
    return dict(rungs=rows, headline=result, checks=checks)


def data_parallel(shared, final_settings, roofs):
    """--scaling: the final rung on one device alone, the whole batch, then sharded over
    every device (the same losses to rounding). Its tokens/s over world x one device alone
    leaves what sharding adds: the all-reduce not hidden under backward."""
    rows = []
    skipped = {}
    why = "the whole batch on one device"
    alone, started = start_first(ALONE, why, final_settings, shared, roofs)
    entries = [entry for entry in RUNGS if entry[0] == SHARDED]
    descend(alone, started, entries, shared, roofs, rows, skipped)
    report_scaling(rows, shared)
    checks = waterfall_checks(rows, [], shared)
    return dict(rungs=rows, skipped=skipped, checks=checks)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (the figure is skipped)."""
    try:
        import matplotlib
    except ImportError:
        print("figure skipped (no matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_waterfall(rows, path):
    """Left: each rung's tokens/s (red: dropped); right: where a profiled step goes."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    names = [row["name"] for row in rows]
    colours = []
    for row in rows:
        if row["kept"]:
            colours.append("tab:blue")
        else:
            colours.append("tab:red")
    bars = left.barh(names, [row["tokens_per_s"] for row in rows], color=colours)
    left.bar_label(bars, [f"{row['speedup']:.1f}x" for row in rows], fontsize=8)
    left.set(xlabel="tokens/s (measured)",
             title="speed-up over the baseline (red: dropped)")
    left.invert_yaxis()
    stacked = np.zeros(len(rows))
    for cls, colour in COLOURS.items():
        share = np.array([row["profile"][cls] / row["profile_step_s"] for row in rows])
        right.barh(names, share, left=stacked, label=cls, color=colour)
        stacked += share
    right.set(xlabel="share of a profiled step (measured)",
              title="where a step's time goes", xlim=(0, 1.5))  # room for the legend
    right.legend(fontsize=8, loc="center right")
    fig.subplots_adjust(left=0.22, right=0.98, wspace=0.05)  # room for the rungs' names
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"figure: {path}")


def plot_headline(result, path):
    """Left: the two loss curves against step; right: against wall-clock seconds."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for row in result["rungs"]:
        steps = np.arange(1, len(row["losses"]) + 1)
        left.plot(steps, row["losses"], label=row["name"])
        right.plot(steps * row["ms_per_step"] / 1e3, row["losses"])
    gap = result["headline"]["curve_gap"]
    left.set(xlabel="optimizer step", ylabel="training loss (measured)",
             title=f"the same curve: smoothed over {SMOOTH} steps, largest gap {gap:.2%}")
    right.set(xlabel="wall-clock s (steps x measured median step; compile left out)",
              xscale="log", title=f"{result['headline']['time_ratio']:.1f}x apart")
    left.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"figure: {path}")


def main():
    args = parse_args()
    json_file = None
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        json_file = open(args.json, "w")  # a path that cannot be written fails here
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    shared, result = setup(args)
    final_settings = None
    if args.headline or args.scaling:
        final_settings = read_final_rung(args.out)
    roofs = measure_roofs(shared)
    report_roofs(roofs, shared.device_name)
    error = accumulation_error()
    report_accumulation(error)
    if args.headline:
        result.update(headline(shared, final_settings, roofs))
    elif args.scaling:
        result.update(data_parallel(shared, final_settings, roofs))
    else:
        result.update(single_device(shared, roofs))
    result["checks"]["accumulated_gradient_equals_full_batch"] = error <= ACCUM_TOLERANCE
    shares = list(roofs["cpu_shares"])
    for row in result["rungs"]:
        shares += row["cpu_shares"]
    busy = [row["name"] for row in result["rungs"] if row["busy"]]
    if roofs["busy"]:
        busy.insert(0, "the roofs")
    for row in result["rungs"]:
        if "floor" in row:
            shares += row["floor"]["cpu_shares"]
            if row["floor"]["busy"]:
                busy.append(f"the floor table of {row['name']}")
    predictions = {}
    for row in result["rungs"]:
        predictions[row["name"]] = row["prediction_held"]
        if "floor" in row:
            held = row["floor"]["prediction_held"]
            predictions[f"the floor table of {row['name']}"] = held
    result.update(roofs=roofs, accumulation_rel_diff=error, cpu_shares=shares,
                  machine_busy=bool(busy), wall_s=time.perf_counter() - start,
                  predictions=predictions)
    for check, ok in result["checks"].items():
        verdict = "FAILED"
        if ok:
            verdict = "ok"
        print(f"check {check}: {verdict}")
    if busy:
        print(f"machine busy: other programs took the CPU during {', '.join(busy)}; the "
              "marked numbers are not findings")
    print(f"wall time: {result['wall_s']:.0f} s")
    if args.headline:
        plot_headline(result, args.out / "07_capstone_jax_headline.png")
    elif args.scaling:
        plot_waterfall(result["rungs"], args.out / "07_capstone_jax_scaling.png")
    else:
        plot_waterfall(result["rungs"], args.out / "07_capstone_jax.png")
        write_final_rung(args.out, result)
    if json_file is not None:
        json.dump(result, json_file, indent=1)
        json_file.close()
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed:
        sys.exit(f"check failed: {', '.join(failed)}")

# --- Flags, the machine and its memory, the final rung's file.


def memory_gb(text):
    """An argparse type: whole GiB of a card, 1 to 4096."""
    value = int(text)
    if not 1 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"{text} GiB is not in 1..4096")
    return value


def sequences(text):
    """An argparse type: sequences per optimizer step, 1 to 1024."""
    value = int(text)
    if not 1 <= value <= 1024:
        raise argparse.ArgumentTypeError(f"{text} is not in 1..1024")
    return value


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="figure folder; the waterfall's final rung is kept there")
    parser.add_argument("--data",
                        help="a UTF-8 text file (default: the stdlib's sources)")
    parser.add_argument("--tokenizer", choices=["auto", "gpt2", "bytes"], default="auto",
                        help="auto: GPT-2 BPE if tiktoken can load it, else UTF-8 bytes")
    parser.add_argument("--batch", type=sequences, help="sequences per optimizer step")
    parser.add_argument("--memory-gb", type=memory_gb,
                        help="as on a card of this many GiB: JAX's allocator capped")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--headline", action="store_true",
                      help="the first jitted rung against the last waterfall's final")
    mode.add_argument("--scaling", action="store_true",
                      help="the last waterfall's final rung on one device, then sharded")
    args = parser.parse_args()
    if args.quick and args.tokenizer == "gpt2":
        parser.error("--quick trains a toy vocabulary of UTF-8 bytes: --tokenizer gpt2 "
                     "needs a full run")
    return args


def allocator_fraction(gib, total, environ):
    """The share of the card JAX's allocator takes when its backend starts: --memory-gb N
    as N GiB of the card's `total` bytes; else the share the environment already gives (a
    shared machine's XLA_CLIENT_MEM_FRACTION, or the deprecated name of it); else
    MEMORY_FRACTION."""
    if gib is not None:
        if gib * 2**30 > total:
            sys.exit(f"error: --memory-gb {gib}: the card has {total / 2**30:.1f} GiB")
        return gib * 2**30 / total
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        if environ.get(name):
            return float(environ[name])
    return MEMORY_FRACTION


def jax_misses_gpu(torch_sees_gpu, platform_name):
    """The line to stop with when torch sees a CUDA GPU and JAX's backend is not on it
    (jax installed without CUDA, or its CUDA plugin failed to start), else None."""
    if torch_sees_gpu and platform_name != "gpu":
        return (f"error: torch sees a CUDA GPU but JAX runs on the {platform_name} "
                "(install jax[cuda13], or read the CUDA plugin's error above); "
                "--device cpu runs on the CPU on purpose")
    return None


def memory_budget(args):
    """JAX's backend, started with its share of the GPU set first (it reads the share
    once, as it starts, and takes it whole: one region, which a rung's freed buffers
    rejoin). The card's size comes from torch, which reads it without taking the card.
    Returns the devices, the card's bytes (None: no GPU) and the bytes JAX's allocator
    may hold."""
    total = None
    if args.device != "cpu" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = allocator_fraction(args.memory_gb, total, os.environ)
        # one name only: the deprecated one beside the current one stops JAX's CUDA plugin
        os.environ.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
        os.environ["XLA_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
    # op by op JAX compiles ~250 one-op programs: none autotuned (a jitted step: at
    # AUTOTUNE_LEVEL); the reader's own XLA_FLAGS come after these, so they win
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"--xla_gpu_autotune_level=0 {flags}"
    devices = jax.devices()  # the backend starts here
    missed = jax_misses_gpu(total is not None, devices[0].platform)
    if missed is not None:
        sys.exit(missed)
    if args.device == "cuda" and devices[0].platform != "gpu":
        sys.exit("error: --device cuda: no CUDA GPU here")
    budget = None
    if devices[0].platform == "gpu":
        budget = devices[0].memory_stats()["bytes_limit"]
    elif args.memory_gb is not None:
        budget = args.memory_gb * 2**30
    return devices, total, budget


def setup(args):
    """The devices (JAX's backend started with its share of the GPU), the sizes, the text,
    one init, the memory budget; the first lines printed. Returns (Shared, the run's
    facts)."""
    devices, memory, budget = memory_budget(args)
    gpu = devices[0].platform == "gpu"
    sizes = Sizes()
    name = platform.machine()
    capability = None
    if gpu:
        sizes = GPU
        name = devices[0].device_kind
        capability = devices[0].compute_capability
    if args.quick:
        sizes = QUICK
    if args.batch is not None:
        sizes = replace(sizes, batch=args.batch, headline_batch=args.batch)
    batch = sizes.batch
    if args.headline:
        batch = sizes.headline_batch
    bf16_ok, bf16_why = has_bf16_tensor_cores(devices[0])
    print(f"device: {len(devices)} x {name} | jax {jax.__version__}, flax "
          f"{version('flax')}, optax {optax.__version__} | python "
          f"{platform.python_version()}")
    describe_memory(gpu, memory, budget, args.memory_gb)
    if not bf16_ok:
        print(f"bf16: {bf16_why}: the bf16 rungs are skipped")
    choice = args.tokenizer
    if args.quick:  # the toy vocabulary: UTF-8 bytes
        choice = "bytes"
    tokens, tokenizer = load_tokens(args.data, choice, sizes.block_size + 2)
    torch.manual_seed(0)  # one init for every rung (padded vocab; GPT-2's rows a prefix)
    init_config = model_config(sizes, dict(BASELINE, pad_vocab=True))
    init_state = model_torch.GPT(init_config).state_dict()  # 07_capstone_torch's init
    flops = flops_per_token(model_config(sizes, BASELINE))  # GPT-2 as shipped: 50257
    shared = Shared(devices, gpu, name, sizes, batch, tokens, init_state, budget,
                    energy_meter(devices[0]), flops, bf16_ok, bf16_why)
    print(f"data: {len(tokens):,} tokens ({tokenizer}), {batch} x {sizes.block_size} "
          f"tokens per optimizer step on every card; model {sizes.model} "
          f"({sizes.n_layer} layers, d={sizes.n_embd})")
    print(f"derived: flops_per_token = 6N + 12LTd = {flops / 1e6:.1f} MFLOP", flush=True)
    facts = dict(lesson="07_capstone_jax", quick=args.quick,
                 device=dict(name=name, type=devices[0].platform, count=len(devices),
                             memory_bytes=memory, capability=capability),
                 framework=dict(jax=jax.__version__, flax=version("flax"),
                                optax=optax.__version__,
                                python=platform.python_version()),
                 sizes=asdict(sizes), tokenizer=tokenizer, flops_per_token=flops,
                 tokens_per_step=batch * sizes.block_size, memory_budget_bytes=budget,
                 world=len(devices))
    return shared, facts


def describe_memory(gpu, memory, budget, gib):
    if not gpu:
        if budget is None:
            print("memory: a CPU: one micro-batch a step (--memory-gb N sizes for N GiB)")
        else:
            print(f"memory: sized for {gib} GiB (--memory-gb; a CPU's allocator is not "
                  "capped)")
        return
    fraction = os.environ["XLA_CLIENT_MEM_FRACTION"]
    if gib is None:
        print(f"memory: {memory / 2**30:.1f} GiB card, {budget / 2**30:.1f} GiB for "
              f"JAX's allocator (XLA_CLIENT_MEM_FRACTION={fraction}): each rung's "
              "micro-batches sized for it")
    else:
        print(f"memory: as on a {gib} GiB card: JAX's allocator capped at "
              f"{budget / 2**30:.1f} GiB (XLA_CLIENT_MEM_FRACTION={fraction})")


def write_final_rung(out, result):
    """The final rung's settings, for --headline and --scaling to read."""
    [row] = [row for row in result["rungs"] if row["name"] == result["final_rung"]]
    path = out / "07_capstone_jax_final_rung.json"
    with open(path, "w") as f:
        json.dump(dict(rung=row["name"], settings=row["settings"],
                       device=result["device"]["name"]), f, indent=1)
    print(f"final rung: {row['name']} (its settings in {path})")


def read_final_rung(out):
    """The settings of the last waterfall's final rung, from --out."""
    path = out / "07_capstone_jax_final_rung.json"
    if not path.is_file():
        sys.exit(f"error: {path}: no final rung yet: run the waterfall first "
                 f"(python 07_capstone_jax.py --out {out})")
    saved = json.loads(path.read_text())
    print(f"final rung: {saved['rung']}, as the waterfall on {saved['device']} found it "
          f"({path})")
    settings = dict(BASELINE)
    settings.update(saved["settings"])
    settings["shard"] = False
    return settings


if __name__ == "__main__":
    main()
