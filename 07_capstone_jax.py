"""
Section 13.7: the waterfall, in JAX. GPT-2 124M down the chapter's method, one measured rung
per technique, each kept for the rungs after it, all from 07_capstone_torch.py's init on the
same batches: the speed changes, the losses must not. The JAX profiler says where each
rung's step goes.

    python 07_capstone_jax.py               # one GPU: gpt2 (124M, T=1024), ~4 min
    python 07_capstone_jax.py --headline    # the first jitted vs the final rung, ~2 min
    python 07_capstone_jax.py --scaling     # the final rung on one device, then on all
    python 07_capstone_jax.py --device cpu  # the tiny model, a few minutes on 2 cores
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python 07_capstone_jax.py --quick
                                            # a step or two a rung, 4 simulated devices

Where the frameworks differ: "compile" is jax.jit of the whole step (forward, backward and
AdamW); JAX runs fp32 matmuls as TF32 on a GPU unless asked for 'highest'; mixed precision
is a dtype; data parallelism is a sharding of the batch over a device mesh, in one process.
Each rung prints its prediction, then its row: ms/step, tokens/s, MFU (6N + 12LTd FLOPs per
token over the datasheet bf16 peak, and over a measured matmul peak), memory against a
24 GB card, tokens/J (NVML), the loss gap to the baseline, and what binds the step. Then the
checks, a figure in out/, --json. Needs model_jax.py and model_torch.py beside it.
"""

import os
import signal
import sys
import threading


def exit_on_ctrl_c():
    """Ctrl-C at any moment, even inside an import or an XLA compile: one line, exit 130.
    A thread waits on the signal's wake-up pipe, so a long C++ call cannot delay it."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGINT, stop)

    def wait():
        while os.read(read_end, 1)[0] != signal.SIGINT:  # the pipe gets each signal's number
            pass
        stop()

    threading.Thread(target=wait, daemon=True).start()


STOPPING = threading.Lock()  # the signal handler and the thread: only one prints


def stop(*signal_args):
    if STOPPING.acquire(blocking=False):
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(130)  # no unwinding through XLA's threads


if __name__ == "__main__":
    exit_on_ctrl_c()  # before the imports below, which take seconds

import argparse
import gzip
import hashlib
import json
import math
import platform
import re
import socket
import statistics
import sysconfig
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # grow as needed, up to
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # 95% of the GPU (B=64)
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import model_jax
from model_jax import GPT, adamw, from_torch
from model_torch import GPT as TorchGPT
from model_torch import GPTConfig, datasheet_bf16_peak, flops_per_token

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")  # a CPU

# --- The waterfall: every setting a rung can change, then the rungs, in order.

BASELINE = dict(jit=False, precision="highest", bf16=False, attn="manual", donate=False,
                pad_vocab=False, accum=4, host_sync=True, triton_gemm=True,
                fused_classifier=False, checkpoint=False, shard=False)
WINDOW = 5  # steps between host syncs once "no host sync per step" is on
RUNGS = [  # (name, what it changes, the regime it targets and the prediction)
    ("un-jitted (op-by-op)", {},
     "baseline: each jnp op dispatched from Python on its own, full fp32 matmuls "
     "('highest'), the T x T scores in memory: < 5% MFU on a GPU"),
    ("+ jax.jit (whole step)", dict(jit=True),
     "overhead: one XLA program for forward, backward and AdamW, elementwise chains "
     "fused; fp32 units still cap the matmuls: 1.2-5x"),
    ("+ TF32 (default precision)", dict(precision="default"),
     "compute-bound on the wrong units: fp32 matmuls as TF32 (H100 datasheet: 495 vs "
     "67 TFLOP/s): 2-3x; a CPU has none"),
    ("+ bf16 compute dtype", dict(bf16=True),
     "dtype=bfloat16, param_dtype=float32: twice TF32's peak, half the activation "
     "bytes; LayerNorm, residuals, loss stay fp32: 1.3-2x"),
    ("+ donation + fused attention", dict(donate=True, attn="sdpa"),
     "bandwidth: a fused attention (cuDNN) never writes the B*H*T*T scores; the state "
     "updated in place: 1.2-1.5x"),
    ("+ vocab 50304, 1 micro-step", dict(pad_vocab=True, accum=1),
     "50304 = 128 x 393 fills the largest matmul's tiles; 4x larger micro-batches "
     "amortise fixed costs: 1.1-1.3x"),
    ("+ no host sync per step", dict(host_sync=False),
     f"overhead: Python reads the loss every {WINDOW} steps, not every step; a ~100 ms "
     "step hides a < 1 ms gap: < 1%"),
    ("+ cuBLAS for every matmul", dict(triton_gemm=False),
     "the compiler's kernel choice: matmuls fused with a neighbour leave XLA's own "
     "Triton GEMMs for cuBLAS: a few %"),
    ("+ fused classifier (logits never written)", dict(fused_classifier=True),
     "memory and bandwidth: the B x T x V logits (6.6 GB in bf16, 13 GB in fp32) are "
     "never written, so peak memory falls by the logits the plain head keeps for "
     "backward and the loss's share of the step falls; the same matmuls: a few % at most"),
    ("+ activation checkpointing", dict(checkpoint=True),
     "memory does NOT bind: nnx.remat recomputes each block's forward, 1/3 more "
     "FLOPs: 20-30% SLOWER, less memory"),
    ("+ data-parallel sharding", dict(shard=True),
     "the batch's rows sharded over every device, params replicated, XLA adds the "
     "gradient all-reduce: ~N x one device"),
]
# measured, not kept: on one H200 the fused classifier saved memory, not time
DETOURS = {"+ fused classifier (logits never written)", "+ activation checkpointing"}
SHARDED = "+ data-parallel sharding"
# the last single-device rung kept: the headline's (a rung moved to DETOURS leaves it)
FINAL = [name for name, _, _ in RUNGS if name not in DETOURS | {SHARDED}][-1]
PYTHON_ONLY = ["host_sync"]  # settings that leave the compiled program as it is
GPU_ONLY = ["precision", "triton_gemm"]  # a CPU compiles these the same
CLASSES = {  # class: (its regime, words in a kernel's name or its ops' JAX paths)
    "communication": ("communication-bound", ("all-reduce", "all_reduce", "nccl")),
    "attention": ("compute-bound", ("sdpa", "fmha", "flash", "attention")),
    "matmul": ("compute-bound", ("gemm", "nvjet", "xmma", "cutlass", "dot")),
    "loss": ("bandwidth-bound", ("loss",)),  # the step's named scopes
    "optimizer": ("bandwidth-bound", ("optimizer",)),
    "other": ("copies", ("memcpy", "memset")),
    "norm+elementwise": ("bandwidth-bound", ("",)),  # every other kernel: XLA's fusions
    "idle": ("overhead-bound", ()),  # the wall time no kernel ran
}
COLOURS = {"matmul": "tab:blue", "attention": "tab:orange", "loss": "tab:red",
           "optimizer": "tab:green", "norm+elementwise": "tab:purple",
           "communication": "tab:brown", "other": "tab:gray", "idle": "lightgray"}
# The losses: the largest per-step relative gap to the baseline over the first EARLY_STEPS
# steps (a waterfall rung: its few). Broken math shows early: a loss on bf16 logits is
# ~0.27% off within 10 steps, a wrongly scaled loss far more; honest variants (bf16, TF32,
# padded vocab, other kernels) stay <= 0.08% there on an H200
EARLY_STEPS = 10
LOSS_TOLERANCE = 0.0015
# The headline's claim, "the same curve": the curves smoothed by a moving mean of SMOOTH
# steps, their largest relative gap. Two honest runs on the same batches drift apart along
# a run (chaos, not precision): on an H200 a TF32 run and the same run from an init
# perturbed by 1e-6 drift as far as bf16 does, <= 1.4%
SMOOTH = 20
CURVE_TOLERANCE = 0.04
ACCUM_TOLERANCE = 1e-4  # accumulated vs full-batch gradient in fp32 (rounding: ~1e-7)
ENERGY_MIN_SECONDS = 1.0  # NVML's energy counter moves in steps of tens of ms: a shorter
# timed region reads zero or a fraction of its energy, so tokens/J is left unmeasured
FITS_BYTES = 23 * 2**30  # a 24 GB card (RTX 4090) less ~1 GiB for the CUDA context


@dataclass
class Sizes:
    model: str = "tiny"    # a label: GPT-2's shape at a CPU's scale
    block_size: int = 128  # tokens per sequence (T)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab: int = 50257         # GPT-2's tokens, as shipped
    padded_vocab: int = 50304  # 128 x 393
    batch: int = 4         # sequences a step (a multiple of the 4 micro-batches)
    steps: int = 2         # timed steps of a bf16 rung
    slow_steps: int = 2    # timed steps of a jitted fp32 rung
    eager_steps: int = 2   # timed steps of the un-jitted rung (seconds a step on a GPU)
    headline_batch: int = 4
    headline_steps: int = 30  # steps of each headline run (a multiple of WINDOW)
    peak_size: int = 1024  # n of the n x n matmuls that measure the peak
    peak_samples: int = 10


# GPU: one timed un-jitted step (~11 s on an H200; two steps there differ by 2.7%)
GPU = Sizes(model="gpt2", block_size=1024, n_layer=12, n_head=12, n_embd=768, batch=64,
            steps=10, eager_steps=1, headline_batch=16, headline_steps=100, peak_size=8192)
QUICK = Sizes(model="toy", block_size=16, n_layer=1, n_head=2, n_embd=32, vocab=16385,
              padded_vocab=16512, steps=1, slow_steps=1, eager_steps=1, headline_steps=20,
              peak_size=256, peak_samples=3)  # a third of GPT-2's vocab: 3x faster op by op

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


def sync(outputs):
    """Wait until the device has computed these arrays: JAX returns before it has."""
    return jax.block_until_ready(outputs)


def bench(fn, reps):
    """The seconds of each of reps calls of fn, each waiting for fn's outputs. The caller
    warms up first."""
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        sync(fn())
        seconds.append(time.perf_counter() - start)
    return seconds


def matmul_peak(dtype, n, samples):
    """The matmul ceiling as 01_roofline.py measures it: bursts >= 5 ms of n x n matmuls,
    each after 100 ms idle and one untimed burst; 2 n^3 FLOPs over the median time."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    # XLA's default autotuning (level 4), which the environment turns off (un-jitted rung)
    matmul = jax.jit(jnp.matmul).lower(a, a).compile(dict(xla_gpu_autotune_level=4))
    sync(matmul(a, a))
    [one] = bench(lambda: matmul(a, a), reps=1)
    calls = math.ceil(0.005 / one)

    def burst():
        outputs = []
        for _ in range(calls):
            outputs.append(matmul(a, a))
        return outputs

    per_matmul = []
    for _ in range(samples):
        time.sleep(0.1)
        sync(burst())  # untimed: the clocks ramp up
        [seconds] = bench(burst, reps=1)
        per_matmul.append(seconds / calls)
    return 2 * n**3 / statistics.median(per_matmul)


def energy_meter(devices):
    """A function reading the joules these GPUs have used so far (NVML), or None."""
    try:
        import pynvml
    except ImportError:  # no nvidia-ml-py: no tokens/J
        return None
    visible = list(range(64))  # NVML numbers every GPU of the machine, JAX the visible ones
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        visible = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    try:
        pynvml.nvmlInit()
        handles = []
        for device in devices:
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(visible[device.id])))
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handles[0])  # mJ since the driver loaded
    except (pynvml.NVMLError, ValueError):  # no driver or counter, or GPUs named by UUID
        return None

    def joules():
        millijoules = 0
        for handle in handles:
            millijoules += pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        return millijoules / 1e3

    return joules


def kernel_class(event, op_paths):
    """The first class one of whose words is in the kernel's (CPU: XLA op's) name or in the
    JAX paths of the ops it computes (XLA's fusions keep the step's named scopes there).
    On a GPU, XLA launches the step's kernels inside CUDA command buffers, whose kernels'
    events name the buffer, not the op: there the loss's and AdamW's fused elementwise
    kernels count as norm+elementwise (results/h200/probes/jax_compile_time.txt)."""
    op = event.get("args", {}).get("hlo_op", "")
    text = f"{event['name']} {op} {op_paths.get(op, '')}".lower()
    for cls, (_, words) in CLASSES.items():
        for word in words:
            if word in text:
                return cls


def profile_split(window, steps, op_paths, world):
    """Seconds of one step by class: one call of window() (`steps` steps) under the JAX
    profiler, its trace read back: a GPU's kernels (its "Stream" lines), or a CPU's XLA
    ops. Returns the split and the step's wall seconds."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python events: they would swamp op-by-op's trace
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, profiler_options=options):
            [seconds] = bench(window, reps=1)
        trace = next(Path(folder).rglob("*.trace.json.gz"))
        events = json.load(gzip.open(trace))["traceEvents"]
    step_s = seconds / steps
    names = {}
    for e in events:
        if e.get("name") in ("process_name", "thread_name"):
            names[(e.get("pid"), e.get("tid"))] = e["args"]["name"]
    streams = set()
    for (pid, tid), name in names.items():
        if name.startswith("Stream") and "/device:GPU" in names.get((pid, None), ""):
            streams.add((pid, tid))
    split = dict.fromkeys(CLASSES, 0.0)
    for e in events:
        op = e.get("args", {}).get("hlo_op", "")
        if e.get("ph") != "X":
            continue
        if streams and (e.get("pid"), e.get("tid")) not in streams:
            continue
        if not streams and not op:  # a CPU: the XLA ops, the events that name one
            continue
        if op.startswith(("while", "call", "conditional")):  # their bodies are counted
            continue
        split[kernel_class(e, op_paths)] += e["dur"] / 1e6 / steps / world  # trace: us
    # One GPU stream runs its kernels one after another: their sum is the busy time. CPU
    # threads, or a second stream (an all-reduce beside the backward), overlap: scaled
    busy = sum(split.values())
    if busy > step_s:
        for cls in split:
            split[cls] *= step_s / busy
        busy = step_s
    split["idle"] = step_s - busy
    return split, step_s

# --- One rung: its settings, its model and step, its measurements, its derived numbers.


def is_kept(name, on_gpu):
    """Measure -> fix -> re-measure: a fix for a regime this device is not in is measured,
    then not carried forward: the detours, and bf16 on a CPU (no bf16 matmul units:
    XLA:CPU computes bf16 dots in f32, casts added)."""
    if name in DETOURS:
        return False
    if name == "+ bf16 compute dtype" and not on_gpu:
        return False
    return True


def settings_for(name, on_gpu):
    """BASELINE with the changes of every kept rung before `name`, and of `name` itself."""
    settings = dict(BASELINE)
    for rung, change, _ in RUNGS:
        if rung == name:
            return {**settings, **change}
        if is_kept(rung, on_gpu):
            settings.update(change)
    raise KeyError(name)


def model_config(sizes, settings):
    vocab = sizes.vocab
    if settings["pad_vocab"]:
        vocab = sizes.padded_vocab
    return GPTConfig(block_size=sizes.block_size, n_layer=sizes.n_layer,
                     n_head=sizes.n_head, n_embd=sizes.n_embd,
                     vocab_size=vocab, attn=settings["attn"],
                     checkpoint=settings["checkpoint"],
                     fused_classifier=settings["fused_classifier"])


@dataclass
class Shared:  # what every rung uses
    sizes: Sizes
    devices: list
    gpu: bool
    tokens: np.ndarray
    init_state: dict  # 07_capstone_torch's init (padded vocab; GPT-2's rows a prefix)
    attention: str    # the fused attention's implementation: cudnn (a GPU) or xla
    options: dict     # XLA's options for every jitted program
    programs: dict = field(default_factory=dict)  # compiled steps, by what shapes them


def accumulate(model, x, y, accum, jitted=True):
    """Loss and gradient of a batch from `accum` equal micro-batches: their gradients
    summed, then divided by accum. Jitted: a lax.scan (one micro-step to compile); else a
    Python loop."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def micro_step(grad_sum, xy):
        def loss_fn(params):
            micro_model = nnx.merge(graphdef, params, rest)
            if model.config.fused_classifier:  # the head and the loss in one, no logits
                return micro_model(xy[0], xy[1])[1]
            logits, _ = micro_model(xy[0])
            with jax.named_scope("loss"):  # a name the profile's classes look for
                return model_jax.cross_entropy(logits, xy[1])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(jnp.add, grad_sum, grads), loss

    grad_sum = jax.tree.map(jnp.zeros_like, params)
    micro_x = x.reshape(accum, -1, x.shape[1])  # (micro-steps, rows, T)
    micro_y = y.reshape(accum, -1, y.shape[1])
    if jitted:
        grad_sum, losses = jax.lax.scan(micro_step, grad_sum, (micro_x, micro_y))
    else:
        losses = []
        for xy in zip(micro_x, micro_y):
            grad_sum, loss = micro_step(grad_sum, xy)
            losses.append(loss)
    grads = jax.tree.map(lambda g: g / accum, grad_sum)
    return jnp.mean(jnp.asarray(losses)), grads


def accumulation_error(shared):
    """The gradient accumulated over 4 micro-batches vs the full batch's (fp32, a toy):
    their relative difference."""
    # PREDICTION: fp32 rounding, ~1e-7. A lost "/ accum" gives 4x the gradient (error 3.0),
    # which the losses would hide: AdamW's update g / sqrt(v) does not depend on its scale
    cfg = GPTConfig.preset("tiny", n_layer=1, n_head=2, n_embd=32, block_size=16,
                           vocab_size=256)
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: GPT(cfg)))  # no init to compile
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: rng.normal(0, 0.1, s.shape).astype(s.dtype), shapes)
    x = jnp.asarray(rng.integers(0, 256, (8, 16)), jnp.int32)
    y = jnp.asarray(rng.integers(0, 256, (8, 16)), jnp.int32)

    def both(state):  # one program computes both gradients
        model = nnx.merge(graphdef, state)
        _, accumulated = accumulate(model, x, y, BASELINE["accum"])
        _, full = accumulate(model, x, y, 1)
        return accumulated, full

    with jax.default_matmul_precision("highest"):
        accumulated, full = jax.jit(both).lower(state).compile(shared.options)(state)
    difference = jax.tree.map(jnp.subtract, accumulated, full)
    return float(optax.tree.norm(difference) / optax.tree.norm(full))


def build(settings, shared, devices, batch, n_steps):
    """The rung's model at torch's init with AdamW, a replica on each of its devices, its
    step function, its batches (their rows split over the devices), and the bytes its
    backward keeps (traced, not computed)."""
    mesh = jax.make_mesh((len(devices),), ("data",), (jax.sharding.AxisType.Auto,),
                         devices=devices)
    cfg = model_config(shared.sizes, settings)
    dtype = jnp.float32
    if settings["bf16"]:
        dtype = jnp.bfloat16
    abstract = nnx.eval_shape(lambda: GPT(cfg, dtype, attn_impl=shared.attention))
    graphdef, shapes = nnx.split(abstract)  # shapes only: torch's weights fill them
    model = nnx.merge(graphdef, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
    weights = dict(shared.init_state)
    for name in ("transformer.wte.weight", "lm_head.weight"):  # the tied embedding
        weights[name] = weights[name][:cfg.vocab_size]
    from_torch(model, weights)
    x, y = get_batch(shared.tokens, 0, batch // settings["accum"], cfg.block_size)
    params_def, params, rest = nnx.split(model, nnx.Param, ...)

    def residuals(params):  # what jax.vjp keeps for one micro-batch's backward
        _, backward = jax.vjp(lambda p: nnx.merge(params_def, p, rest)(x, y)[1], params)
        return jax.tree.leaves(backward)

    saved = 0
    for leaf in jax.eval_shape(residuals, params):
        saved += leaf.size * leaf.dtype.itemsize
    graphdef, state = nnx.split((model, nnx.Optimizer(model, adamw(6e-4), wrt=nnx.Param)))
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))  # replicated
    rows = NamedSharding(mesh, PartitionSpec("data"))  # each device gets its rows
    batches = []
    for i in range(n_steps):
        x, y = get_batch(shared.tokens, i, batch, cfg.block_size)
        batches.append(jax.device_put((x.astype(np.int32), y.astype(np.int32)), rows))

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = accumulate(model, x, y, settings["accum"], settings["jit"])
        with jax.named_scope("optimizer"):
            optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    return step, state, batches, saved


def compile_step(step, settings, example, shared_options):
    """jax.jit of the whole step, compiled now (XLA's autotuning included): the program,
    its text before and after XLA, its compile seconds."""
    options = dict(shared_options, xla_gpu_autotune_level=4,
                   xla_gpu_enable_triton_gemm=settings["triton_gemm"])
    donate = ()
    if settings["donate"]:
        donate = (0,)  # the old state's buffers become the new state's
    start = time.perf_counter()
    with jax.default_matmul_precision(settings["precision"]):
        lowered = jax.jit(step, donate_argnums=donate).lower(*example)
        compiled = lowered.compile(options)
    seconds = time.perf_counter() - start
    return dict(compiled=compiled, lowered=lowered.as_text(), text=compiled.as_text(),
                compile_s=seconds)


def evidence(program, vocab):
    """What each technique did, not its flag, from the program's text: the matmuls JAX
    asks for by dtype, whether the loss exponentiates fp32 logits (a bf16 one rounds the
    loss by ~0.3%, within an honest run's spread: its value cannot tell), XLA's
    all-reduces; XLA's memory plan; and the JAX paths of the ops each XLA op computes."""
    lowered = program["lowered"]  # what JAX asked for (XLA:CPU computes bf16 dots in f32)
    text = program["text"]  # what XLA made of it
    acts = dict(
        bf16_dots=len(re.findall(r"dot_general.*-> tensor<[\dx]*xbf16>", lowered)),
        f32_vocab_exps=len(re.findall(rf"exponential.*<[\dx]*x{vocab}xf32>", lowered)),
        all_reduces=len(re.findall(r" all-reduce(?:-start)?\(", text)))
    memory = program["compiled"].memory_analysis()  # one device's
    plan = None
    if memory is not None:  # inputs and outputs (less what they share) and scratch
        plan = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    bodies = {}  # a computation's name: the JAX paths of its ops
    for match in re.finditer(r"^%?([\w.-]+) [^\n]*\{\n(.*?)^\}", text, re.M | re.S):
        bodies[match.group(1)] = " ".join(re.findall(r'op_name="([^"]*)"', match.group(2)))
    op_paths = {}  # an XLA op: its own JAX path and those of a fusion's ops
    for line in text.splitlines():
        op = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = ", line)
        if op is None:
            continue
        path = re.search(r'op_name="([^"]*)"', line)
        calls = re.search(r"calls=%?([\w.-]+)", line)
        op_paths[op.group(1)] = ""
        if path is not None:
            op_paths[op.group(1)] = path.group(1)
        if calls is not None:
            op_paths[op.group(1)] += " " + bodies.get(calls.group(1), "")
    return acts, plan, op_paths


def train(step, state, batches, settings, timed_steps, op_paths, world, meter):
    """A rung's raw measurements: a warm-up call, the timed calls (one step each while the
    host reads every loss, else WINDOW steps), NVML's energy around them, then one
    profiled call; every step's loss."""
    window = 1
    if not settings["host_sync"]:
        window = min(WINDOW, timed_steps)
    losses = []

    def call():
        nonlocal state  # the only reference: a donated buffer is updated in place
        with jax.default_matmul_precision(settings["precision"]):  # un-jitted: op by op
            for _ in range(window):
                x, y = batches[len(losses)]
                loss, state = step(state, x, y)
                if settings["host_sync"]:
                    loss = float(loss)  # Python reads the loss: it waits for the device
                losses.append(loss)
        return state  # bench waits for it: the AdamW update too, not only the loss

    first_input = state
    sync(call())  # warm-up
    donated = all(leaf.is_deleted() for leaf in jax.tree.leaves(first_input))
    del first_input  # the warm-up's input state: gone if the step took its buffers
    joules_before = None
    if meter is not None:
        joules_before = meter()
    windows = math.ceil(timed_steps / window)
    seconds = bench(call, reps=windows)
    tokens_per_joule = None
    if meter is not None and sum(seconds) >= ENERGY_MIN_SECONDS:
        tokens = windows * window * batches[0][0].size
        tokens_per_joule = tokens / (meter() - joules_before)  # NVML: these GPUs' energy
    split, step_s = profile_split(call, window, op_paths, world)
    return dict(warmup_steps=window, timed_steps=windows * window, profiled_steps=window,
                step_ms=[s * 1e3 / window for s in seconds], donated=donated,
                tokens_per_joule=tokens_per_joule, profile=split, profile_step_s=step_s,
                losses=[float(loss) for loss in losses])


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


def derive(measured, base, flops_per_token, peaks):
    """The derived numbers of a rung from its raw ones; base: the baseline rung (None: this
    is the baseline)."""
    ms = statistics.median(measured["step_ms"])
    tokens_per_s = measured["tokens_per_step"] / (ms / 1e3)  # all devices together
    flops = tokens_per_s * flops_per_token / measured["world"]  # FLOP/s of one device
    mfu_datasheet = None
    if peaks["datasheet"] is not None:
        mfu_datasheet = flops / peaks["datasheet"]
    spread = max(measured["step_ms"]) - min(measured["step_ms"])
    fits = None
    if measured["peak_memory_bytes"] is not None:
        fits = measured["peak_memory_bytes"] < FITS_BYTES
    unreliable = spread > ms or flops > 1.1 * peaks["measured"]
    base_ms = ms
    base_losses = measured["losses"]
    if base is not None:  # a speed-up is as reliable as both its timings
        base_ms = base["ms_per_step"]
        base_losses = base["losses"]
        if base["unreliable"]:
            unreliable = True
    split = measured["profile"]
    binds = max(split, key=split.get)  # the class with the largest share of the step
    return dict(measured, ms_per_step=ms, tokens_per_s=tokens_per_s,
                speedup=base_ms / ms, mfu_datasheet=mfu_datasheet,
                mfu_measured_peak=flops / peaks["measured"], fits_24gb=fits,
                loss_rel_gap=loss_gap(measured["losses"], base_losses),
                unreliable=unreliable,
                binds=binds, regime=CLASSES[binds][0])


def fmt(value, spec=""):
    """A number, or n/a where this machine cannot measure it; yes/no for a verdict."""
    if value is None:
        return "n/a"
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return format(value, spec)


HEADER = (f"   {'rung':42s} {'ms/step':>8s} {'tokens/s':>10s} {'speed-up':>8s} "
          f"{'MFU(ds)':>7s} {'MFU(meas)':>9s} {'peak GiB':>8s} {'24 GB':>5s} "
          f"{'tokens/J':>8s} {'d(loss)':>7s}  binds: share of a profiled step\n"
          "   (measured: ms, tokens/s, peak memory (XLA's plan per device; un-jitted: the "
          "allocator's peak), tokens/J (NVML), binds; derived: speed-up, MFU; d(loss): vs "
          f"the baseline over its first {EARLY_STEPS} steps)")


def print_row(rung):
    name = rung["name"]
    if not rung["kept"]:
        name += " (dropped)"
    peak_gib = None
    if rung["peak_memory_bytes"] is not None:
        peak_gib = rung["peak_memory_bytes"] / 2**30
    share = rung["profile"][rung["binds"]] / rung["profile_step_s"]
    line = (f"   {name:42s} {rung['ms_per_step']:8.1f} {rung['tokens_per_s']:10,.0f} "
            f"{rung['speedup']:7.2f}x {fmt(rung['mfu_datasheet'], '.1%'):>7} "
            f"{rung['mfu_measured_peak']:9.1%} {fmt(peak_gib, '.1f'):>8} "
            f"{fmt(rung['fits_24gb']):>5} {fmt(rung['tokens_per_joule'], ',.0f'):>8} "
            f"{rung['loss_rel_gap']:7.2%}  {rung['binds']} {share:.0%} ({rung['regime']})")
    if rung["unreliable"]:
        line += "  unreliable (machine busy)"
    print(line, flush=True)

# --- The experiments.


def program_of(settings, gpu):
    """The settings that shape the compiled program (a rung with the same reuses it)."""
    program = dict(settings)
    for name in PYTHON_ONLY:
        program.pop(name)
    if not gpu:
        for name in GPU_ONLY:
            program.pop(name)
    return json.dumps(program, sort_keys=True)


def measure(name, why, settings, shared, timed_steps, base, flops, peaks, batch):
    """Build, compile (or reuse the same program) and train one rung, derive its numbers,
    print its row: the rung, or None when it does not fit this device."""
    print(f"{name}: predicted {why}", flush=True)
    devices = shared.devices[:1]
    if settings["shard"]:
        devices = shared.devices
    n_steps = 2 * WINDOW + math.ceil(timed_steps / WINDOW) * WINDOW  # warm-up, timed, profiled
    try:
        step, state, batches, saved = build(settings, shared, devices, batch, n_steps)
        measured = dict(compile_s=0.0, acts={}, peak_memory_bytes=None)
        op_paths = {}
        if settings["jit"]:
            key = (program_of(settings, shared.gpu), batch)
            if key not in shared.programs:
                print("   compiling the whole step with XLA ...", flush=True)
                shared.programs[key] = compile_step(step, settings, (state, *batches[0]),
                                                       shared.options)
                measured["compile_s"] = shared.programs[key]["compile_s"]
                print(f"   compiled 1 graph in {measured['compile_s']:.1f} s (measured)",
                      flush=True)
            else:
                print("   the same program as an earlier rung: no compile", flush=True)
            program = shared.programs[key]
            vocab = model_config(shared.sizes, settings).vocab_size
            acts, plan, op_paths = evidence(program, vocab)
            measured.update(acts=acts, peak_memory_bytes=plan)
            step = program["compiled"]
        else:
            print("   JAX compiles each jnp op at its first use (~250 programs)", flush=True)
        meter = None
        if shared.gpu:
            meter = energy_meter(devices)
        measured.update(train(step, state, batches, settings, timed_steps, op_paths,
                              len(devices), meter))
    except jax.errors.JaxRuntimeError as e:  # out of memory: the next rung runs
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"   does not fit: {str(e).splitlines()[0][:160]}", flush=True)
        return None
    if not settings["jit"] and shared.gpu:  # the allocator's peak: this rung runs first
        measured["peak_memory_bytes"] = devices[0].memory_stats()["peak_bytes_in_use"]
    measured["acts"]["donated_inputs_deleted"] = measured.pop("donated")
    measured.update(settings=settings, world=len(devices), activation_bytes=saved,
                    tokens_per_step=batch * shared.sizes.block_size)
    rung = dict(name=name, why=why, kept=is_kept(name, shared.gpu),
                **derive(measured, base, flops, peaks))
    print_row(rung)
    return rung


def loss_in_fp32(rungs):
    """Whether every jitted rung's loss exponentiates fp32 logits."""
    for rung in rungs:
        if rung["acts"].get("f32_vocab_exps") == 0:
            return False
    return True


def waterfall(shared, flops, peaks, scaling):
    """The accumulation check, then each rung on top of what the rungs before it kept;
    --scaling: the final rung on one device alone, then sharded over all."""
    error = accumulation_error(shared)
    print(f"measured: gradient accumulated over {BASELINE['accum']} micro-batches vs the "
          f"full batch: relative difference {error:.1e} (tolerance {ACCUM_TOLERANCE:.0e})",
          flush=True)
    todo = []
    for name, _, why in RUNGS:
        todo.append((name, settings_for(name, shared.gpu), why))
    n = len(shared.devices)
    if scaling:
        # PREDICTION: alone, one device trains the batch in n micro-batches, each one
        # device's share: the work of each of the n sharded devices. What scaling loses is
        # the gradient all-reduce left exposed (simulated CPU devices share the same cores)
        why = f"the batch in {n} micro-batches, one device's share each: the reference"
        alone = ("final rung, one device alone", dict(settings_for(FINAL, shared.gpu),
                                                      accum=n), why)
        todo = [alone, todo[-1]]
    print(HEADER, flush=True)
    rungs = []
    skipped = {}
    base = None
    batch = shared.sizes.batch
    for name, settings, why in todo:
        reason = None
        if settings["shard"] and n < 2:
            reason = ("one device (a CPU can simulate 4: "
                      "XLA_FLAGS=--xla_force_host_platform_device_count=4)")
        elif settings["shard"] and batch % n:
            reason = f"{batch} rows do not split over {n} devices"
        if reason is not None:
            print(f"{name}: predicted {why}\n   skipped: {reason}", flush=True)
            skipped[name] = reason
            continue
        timed_steps = shared.sizes.steps
        if not settings["bf16"]:
            timed_steps = shared.sizes.slow_steps
        if not settings["jit"]:
            timed_steps = shared.sizes.eager_steps
        rung = measure(name, why, settings, shared, timed_steps, base, flops, peaks, batch)
        if rung is None:
            skipped[name] = "does not fit"
            continue
        rungs.append(rung)
        base = rungs[0]
    by_name = {rung["name"]: rung for rung in rungs}
    checks = dict(accumulated_gradient_equals_full_batch=error <= ACCUM_TOLERANCE,
                  losses_track_baseline=True, time_split_adds_up=True,
                  loss_softmax_in_fp32=loss_in_fp32(rungs))
    for rung in rungs:
        if rung["loss_rel_gap"] > LOSS_TOLERANCE:
            checks["losses_track_baseline"] = False
        if min(rung["profile"].values()) < 0:
            checks["time_split_adds_up"] = False
    detour = "+ activation checkpointing"
    if detour in by_name and FINAL in by_name:  # XLA's memory plan on a GPU, else traced
        memory = "activation_bytes"  # (XLA:CPU's plan ignores remat)
        if shared.gpu:
            memory = "peak_memory_bytes"
        lower = by_name[detour][memory] < by_name[FINAL][memory]
        checks["checkpointing_lowers_memory"] = lower
    result = dict(rungs=rungs, skipped=skipped, accumulation_rel_diff=error, checks=checks)
    if scaling and len(rungs) == 2:
        result["scaling"] = rungs[1]["tokens_per_s"] / (n * rungs[0]["tokens_per_s"])
        print(f"derived: {rungs[1]['name']}: scaling {result['scaling']:.1%} of {n} x one "
              "device alone")
    return result


def headline(shared, flops, peaks):
    """The chapter's opening claim: the first jitted rung (fp32 matmuls) and the final one
    trained for the same steps from one init on the same batches: loss against step, and
    against wall-clock. (The un-jitted rung would take minutes for 100 steps.)"""
    # PREDICTION: the same curve - the first EARLY_STEPS losses within LOSS_TOLERANCE, the
    # smoothed curves within CURVE_TOLERANCE - while the final rung is ~10x faster per step
    # on a GPU (bf16 tensor cores, cuDNN attention); its compile is paid once.
    first = "+ jax.jit (whole step)"
    steps = shared.sizes.headline_steps
    batch = shared.sizes.headline_batch
    whys = {name: why for name, _, why in RUNGS}
    print(HEADER)
    rungs = []
    for name in (first, FINAL):  # warm-up, timed, profiled: every step's loss kept
        settings = settings_for(name, shared.gpu)
        window = 1
        if not settings["host_sync"]:
            window = WINDOW
        base = None
        if rungs:
            base = rungs[0]
        rung = measure(name, whys[name], settings, shared, steps - 2 * window, base, flops,
                       peaks, batch)
        if rung is None:
            sys.exit("error: the headline does not fit this device: try a smaller --batch")
        rungs.append(rung)
    base, final = rungs
    early = final["loss_rel_gap"]
    curve = curve_gap(final["losses"], base["losses"])
    ratio = base["ms_per_step"] / final["ms_per_step"]
    count = len(base["losses"])
    print(f"derived: the first {EARLY_STEPS} steps' losses: largest relative gap "
          f"{early:.3%} (tolerance {LOSS_TOLERANCE:.2%})")
    print(f"derived: the curves smoothed over {SMOOTH} steps, all {count}: largest "
          f"relative gap {curve:.2%} (tolerance {CURVE_TOLERANCE:.0%})")
    busy = ""
    if final["unreliable"]:
        busy = "  unreliable (machine busy)"
    print(f"derived: the final rung is {ratio:.1f}x faster per step (its compile, "
          f"{final['compile_s']:.0f} s, is left off the wall-clock axis){busy}")
    result = dict(steps=count, early_steps=EARLY_STEPS, smooth=SMOOTH,
                  loss_tolerance=LOSS_TOLERANCE, curve_tolerance=CURVE_TOLERANCE,
                  early_gap=early, curve_gap=curve, time_ratio=ratio,
                  compile_s=final["compile_s"], rungs=[first, FINAL])
    checks = dict(headline_starts_the_same=early <= LOSS_TOLERANCE,
                  headline_same_curve=curve <= CURVE_TOLERANCE,
                  loss_softmax_in_fp32=loss_in_fp32(rungs))
    return dict(rungs=rungs, headline=result, checks=checks)


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


def plot_waterfall(rungs, path):
    """Left: each rung's tokens/s (red: dropped); right: where a profiled step goes."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    names = [rung["name"] for rung in rungs]
    colours = []
    for rung in rungs:
        if rung["kept"]:
            colours.append("tab:blue")
        else:
            colours.append("tab:red")
    bars = left.barh(names, [rung["tokens_per_s"] for rung in rungs], color=colours)
    left.bar_label(bars, [f"{rung['speedup']:.1f}x" for rung in rungs], fontsize=8)
    left.set(xlabel="tokens/s (measured)", title="speed-up over the baseline (red: dropped)")
    left.invert_yaxis()
    stacked = np.zeros(len(rungs))
    for cls, colour in COLOURS.items():
        share = np.array([rung["profile"][cls] / rung["profile_step_s"] for rung in rungs])
        right.barh(names, share, left=stacked, label=cls, color=colour)
        stacked += share
    right.set(xlabel="share of a profiled step (measured)", title="where a step's time goes",
              xlim=(0, 1.45))  # room for the legend
    right.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"figure: {path}")


def plot_headline(result, path):
    """Left: the two loss curves against step; right: against wall-clock seconds."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for rung in result["rungs"]:
        steps = np.arange(1, len(rung["losses"]) + 1)
        left.plot(steps, rung["losses"], label=rung["name"])
        right.plot(steps * rung["ms_per_step"] / 1e3, rung["losses"])
    gap = result["headline"]["curve_gap"]
    left.set(xlabel="optimizer step", ylabel="training loss (measured)",
             title=f"the same curve: smoothed over {SMOOTH} steps, largest gap {gap:.2%}")
    right.set(xlabel="wall-clock s (steps x measured median step; compile left out)",
              xscale="log", title=f"{result['headline']['time_ratio']:.1f}x apart")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"figure: {path}")

# --- Flags, the shared state, main.


def int_in(low, high):
    """An argparse type: an integer from low to high."""
    def parse(text):
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is not in {low}..{high}")
        return value
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a step or two per rung (the tests)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--out", default="out", help="figure folder")
    p.add_argument("--data", help="a UTF-8 text file (default: the stdlib's sources)")
    p.add_argument("--tokenizer", choices=["auto", "gpt2", "bytes"], default="auto",
                   help="auto: GPT-2 BPE when tiktoken can load it, else UTF-8 bytes")
    p.add_argument("--batch", type=int_in(4, 512), help="sequences per step, a multiple of 4")
    p.add_argument("--steps", type=int_in(1, 100),
                   help="timed steps of every rung (op-by-op on an H200: ~11 s a step)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--headline", action="store_true", help="first jitted vs final rung")
    mode.add_argument("--scaling", action="store_true", help="final rung, alone and sharded")
    args = p.parse_args(argv)
    if args.batch is not None and args.batch % 4:
        p.error("argument --batch: a multiple of 4 (the first rungs take 4 micro-batches)")
    return args


def check_paths(args):
    """Before the work: --json a file in a writable folder, --out a writable folder (both
    made when missing); else one line and exit 1."""
    folders = [("--out", args.out)]
    if args.json is not None:
        if args.json == "" or Path(args.json).is_dir():
            sys.exit(f"error: --json {args.json!r}: not a file name")
        folders.append(("--json", str(Path(args.json).parent)))
    for flag, folder in folders:
        if folder == "":
            sys.exit(f"error: {flag}: an empty path")
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            sys.exit(f"error: {flag} {folder}: {e.strerror}")
        if not os.access(folder, os.W_OK):
            sys.exit(f"error: {flag} {folder}: not writable")


def setup(args):
    """The backend (its flags first), the sizes, the data, torch's init, the peaks; the
    first lines printed. Returns (Shared, peaks, flops per token, facts)."""
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
    flags = "--xla_gpu_autotune_level=0"  # the un-jitted rung's one-op programs: no tuning
    options = {}  # XLA's options for every jitted program
    if args.quick and args.device == "cpu":  # a smoke test is all compile: XLA:CPU fastest
        options = dict(xla_backend_optimization_level=0, xla_cpu_use_fusion_emitters=False)
        flags += " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = f"{flags} {os.environ.get('XLA_FLAGS', '')}"  # yours win
    devices = jax.devices()  # the backend starts here
    gpu = devices[0].platform == "gpu"
    if args.device == "cuda" and not gpu:
        sys.exit("error: --device cuda: JAX sees no CUDA GPU (jax[cuda] installed?)")
    sizes = Sizes()
    if gpu:
        sizes = GPU
    if args.quick:
        sizes = QUICK
    if args.batch is not None:
        sizes = replace(sizes, batch=args.batch, headline_batch=args.batch)
    if args.steps is not None:
        sizes = replace(sizes, steps=args.steps, slow_steps=args.steps, eager_steps=args.steps)
    name = platform.machine()
    dtype = jnp.float32  # a CPU has no bf16 matmul units
    attention = "xla"
    if gpu:
        name = devices[0].device_kind
        dtype = jnp.bfloat16
        attention = "cudnn"  # cuDNN's fused attention
    print(f"device: {len(devices)} x {name} | jax {jax.__version__}, flax "
          f"{version('flax')} | python {platform.python_version()}", flush=True)
    tokens, tokenizer = load_tokens(args.data, args.tokenizer, sizes.block_size + 2)
    tokens = tokens % sizes.vocab  # the same, but --quick's BPE ids: folded into its vocab
    torch.manual_seed(0)  # 07_capstone_torch's init; GPT-2's rows are its prefix
    init_state = TorchGPT(model_config(sizes, dict(BASELINE, pad_vocab=True))).state_dict()
    shared = Shared(sizes, devices, gpu, tokens, init_state, attention, options)
    flops = flops_per_token(model_config(sizes, BASELINE))  # GPT-2 as shipped (50257)
    peaks = dict(datasheet=None, measured=None)
    if gpu:
        peaks["datasheet"] = datasheet_bf16_peak(name)  # reference: NVIDIA's datasheet
    peaks["measured"] = matmul_peak(dtype, sizes.peak_size, sizes.peak_samples)
    datasheet_tflops = None
    if peaks["datasheet"] is not None:
        datasheet_tflops = peaks["datasheet"] / 1e12
    batch = sizes.batch
    if args.headline:
        batch = sizes.headline_batch
    print(f"data: {len(tokens):,} tokens ({tokenizer}), {batch} x {sizes.block_size} "
          f"tokens per step; model {sizes.model} ({sizes.n_layer} layers, d={sizes.n_embd})")
    print(f"derived: flops_per_token = 6N + 12LTd = {flops / 1e6:.1f} MFLOP")
    print(f"reference: datasheet dense bf16 peak {fmt(datasheet_tflops)} TFLOP/s (NVIDIA)")
    print(f"measured: {sizes.peak_size} x {sizes.peak_size} {jnp.dtype(dtype).name} matmul "
          f"peak (burst) {peaks['measured'] / 1e12:.3g} TFLOP/s")
    print("baseline: full fp32 matmuls ('highest'; JAX's default is TF32 on a GPU)",
          flush=True)
    facts = dict(device=dict(name=name, count=len(devices), platform=devices[0].platform),
                 framework=dict(jax=jax.__version__, flax=version("flax"),
                                optax=optax.__version__, python=platform.python_version()),
                 sizes=asdict(sizes), tokenizer=tokenizer, flops_per_token=flops,
                 tokens_per_step=batch * sizes.block_size, peak_flops=peaks,
                 world=len(devices))
    return shared, peaks, flops, facts


def main(argv=None):
    args = parse_args(argv)
    check_paths(args)
    start = time.perf_counter()
    shared, peaks, flops, result = setup(args)
    if args.headline:
        result.update(headline(shared, flops, peaks))
    else:
        result.update(waterfall(shared, flops, peaks, args.scaling))
    result.update(lesson="07_capstone_jax", quick=args.quick,
                  wall_s=time.perf_counter() - start)
    for check, ok in result["checks"].items():
        verdict = "FAILED"
        if ok:
            verdict = "ok"
        print(f"check {check}: {verdict}")
    print(f"wall time: {result['wall_s']:.0f} s")
    if args.headline:
        plot_headline(result, Path(args.out) / "07_capstone_jax_headline.png")
    elif not args.scaling:
        plot_waterfall(result["rungs"], Path(args.out) / "07_capstone_jax.png")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    failed = [check for check, ok in result["checks"].items() if not ok]
    if failed:
        sys.exit(f"error: check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
