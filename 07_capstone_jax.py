"""
Section 13.7: the waterfall, in JAX. GPT-2 124M (tiny on a CPU) down one measured rung
per technique (RUNGS), each kept for the rungs after it, all from 07_capstone_torch.py's
init on the same batches: the speed changes, the losses must not. The JAX profiler says
where each rung's step goes.

    python 07_capstone_jax.py               # one GPU: gpt2 (124M, T=1024), ~5 min
    python 07_capstone_jax.py --headline    # the first jitted vs the final rung, ~2 min
    python 07_capstone_jax.py --scaling     # the final rung on one device, then on all
    NCCL_P2P_DISABLE=1 python 07_capstone_jax.py --scaling  # GPU to GPU via host memory
    python 07_capstone_jax.py --device cpu  # GPT-2's shape at a CPU's scale, a few minutes
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python 07_capstone_jax.py --quick
                                            # a step or two a rung, 4 simulated devices

Where the frameworks differ: "compile" is jax.jit of the whole step (forward, backward
and AdamW); JAX runs fp32 matmuls as TF32 on a GPU unless asked for 'highest'; mixed
precision is a dtype; data parallelism is a sharding of the batch over a device mesh, in
one process. Per rung: ms/step, tokens/s, MFU (6N + 12LTd FLOPs per token over the
datasheet bf16 peak and a measured matmul peak), memory against a 24 GB card, tokens/J
(NVML), the loss gap, what binds. Figures in out/, --json FILE. Needs model_jax.py and
model_torch.py.
"""

import os
import signal
import sys
import threading


def exit_on_ctrl_c():
    """Ctrl-C at any moment, even inside an import or an XLA compile: one line, exit 130.
    A thread waits on the signal's wake-up pipe, so a long C++ call cannot delay it, and
    os._exit stops the process without unwinding through XLA's threads."""
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
        os._exit(130)


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
from dataclasses import asdict, dataclass, replace
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

from model_jax import GPT, adamw, cross_entropy, from_torch
from model_torch import GPT as TorchGPT
from model_torch import GPTConfig, datasheet_bf16_peak, flops_per_token

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")  # a CPU

BASELINE = dict(jit=False, precision="highest", bf16=False, attn="manual", donate=False,
                pad_vocab=False, accum=4, host_sync=True, triton_gemm=True,
                cublaslt=False, checkpoint=False, shard=False)
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
    ("+ cuBLASLt epilogues", dict(cublaslt=True),
     "bandwidth: bias and GELU in the matmul's epilogue, one pass over the MLP "
     "activations less: 0-5% (a CPU: none)"),
    ("+ activation checkpointing", dict(checkpoint=True),
     "memory does NOT bind: nnx.remat recomputes each block's forward, 1/3 more "
     "FLOPs: 20-30% SLOWER, less memory"),
    ("+ data-parallel sharding", dict(shard=True),
     "the batch's rows sharded over every device, params replicated, XLA adds the "
     "gradient all-reduce: ~N x one device"),
]
DETOURS = {"+ cuBLASLt epilogues", "+ activation checkpointing"}  # measured, not kept
FINAL = "+ cuBLAS for every matmul"  # the best single-device rung: every kept change
SHARDED = "+ data-parallel sharding"
PYTHON_ONLY = ["host_sync"]  # settings that leave the compiled program as it is
GPU_ONLY = ["precision", "triton_gemm", "cublaslt"]  # a CPU compiles these the same
CLASSES = {  # class: (its regime, words in a kernel's name or its op's JAX path)
    "communication": ("communication-bound", ("all-reduce", "all_reduce", "nccl")),
    "attention": ("compute-bound", ("sdpa", "fmha", "flash", "attention")),
    "loss": ("bandwidth-bound", ("loss",)),  # the step's named scopes
    "optimizer": ("bandwidth-bound", ("optimizer",)),
    "matmul": ("compute-bound", ("gemm", "nvjet", "xmma", "cutlass", "dot")),
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
FITS_BYTES = 23 * 2**30  # a 24 GB card (RTX 4090) less ~1 GiB for the CUDA context


@dataclass
class Sizes:
    model: str = "tiny"        # a label: GPT-2's shape at a CPU's scale
    block_size: int = 128      # tokens per sequence (T)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab: int = 50257         # GPT-2's tokens, as shipped
    padded_vocab: int = 50304  # 128 x 393
    batch: int = 4             # sequences a step (a multiple of the 4 micro-batches)
    steps: int = 2             # timed steps of a bf16 rung
    slow_steps: int = 2        # timed steps of an fp32 rung (op-by-op: seconds a step)
    headline_batch: int = 4
    headline_steps: int = 30   # steps of each headline run (a multiple of WINDOW)
    peak_size: int = 1024      # the matmul peak's n x n
    peak_samples: int = 10     # its timed bursts


GPU = Sizes(model="gpt2", block_size=1024, n_layer=12, n_head=12, n_embd=768, batch=64,
            steps=10, headline_batch=16, headline_steps=100, peak_size=8192)
QUICK = Sizes(model="toy", block_size=32, n_layer=1, n_head=2, n_embd=64, vocab=16385,
              padded_vocab=16512, batch=4, steps=1, slow_steps=1, headline_batch=4,
              headline_steps=20, peak_size=256, peak_samples=3)


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

# --- Measuring: the clock, this chip's matmul peak, energy, where the device time goes.


def sync(outputs):
    """Wait until the device has computed these arrays: JAX returns before it has."""
    return jax.block_until_ready(outputs)


def bench(fn, reps):
    """The seconds of reps calls of fn, each waiting for fn's outputs (warm up first)."""
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        sync(fn())
        seconds.append(time.perf_counter() - start)
    return seconds


def matmul_peak(dtype, n, samples):
    """This chip's matmul FLOP/s as 01_roofline.py measures it: bursts of n x n matmuls
    lasting >= 5 ms, each after 100 ms idle and one untimed burst; 2 n^3 / the median
    seconds a matmul."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    # XLA's default autotuning (level 4), which the environment turns off (un-jitted rung)
    matmul = jax.jit(jnp.matmul).lower(a, a).compile(dict(xla_gpu_autotune_level=4))
    sync(matmul(a, a))  # warm-up
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
    except ImportError:  # no nvidia-ml-py
        return None
    visible = list(range(64))  # NVML numbers every GPU of the machine, JAX the visible ones
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        visible = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    try:
        pynvml.nvmlInit()
        handles = []
        for device in devices:
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(visible[device.id])))
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handles[0])  # mJ since the driver began
    except (pynvml.NVMLError, ValueError):  # no driver or counter, or GPUs named by UUID
        return None

    def joules():
        millijoules = 0
        for handle in handles:
            millijoules += pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        return millijoules / 1e3

    return joules


def kernel_class(event, op_paths):
    """The class of one traced kernel (a GPU) or XLA op (a CPU), by its names."""
    args = event.get("args", {})
    op = args.get("hlo_op", "")
    text = f"{event['name']} {op} {args.get('hlo_module')} {op_paths.get(op)}".lower()
    for name, (_, words) in CLASSES.items():
        if any(word in text for word in words):
            return name


def profile_split(window, steps, op_paths, world):
    """Seconds of a step and device by class: one call of window() (`steps` steps) under
    the JAX profiler, its trace read back. Returns the split and the step's seconds."""
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
    streams = set()  # a GPU's kernels: its "Stream #n" lines
    for (pid, tid), name in names.items():
        if name.startswith("Stream") and "/device:GPU" in names.get((pid, None), ""):
            streams.add((pid, tid))
    split = dict.fromkeys(CLASSES, 0.0)
    for e in events:
        if e.get("ph") != "X":
            continue
        op = e.get("args", {}).get("hlo_op", "")
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
        split = {name: t * step_s / busy for name, t in split.items()}
        busy = step_s
    split["idle"] = step_s - busy
    return split, step_s

# --- One rung: its settings, model and step, its training, the numbers derived from it.


def is_kept(name, on_gpu):
    """Whether the rungs after `name` keep its change: not a detour, and no bf16 on a CPU
    (no bf16 matmul units: XLA:CPU computes bf16 dots in f32, casts added)."""
    if name in DETOURS:
        return False
    if name == "+ bf16 compute dtype":
        return on_gpu
    return True


def settings_for(name, on_gpu):
    """BASELINE with the changes of every kept rung before `name`, and `name`'s own."""
    settings = dict(BASELINE)
    for rung, change, _ in RUNGS:
        if rung == name:
            settings.update(change)
            return settings
        if is_kept(rung, on_gpu):
            settings.update(change)
    raise ValueError(f"no rung named {name!r}")


def model_config(sizes, **switches):
    """GPT-2's architecture at these sizes (model_torch's GPTConfig)."""
    return GPTConfig.preset("gpt2", block_size=sizes.block_size, n_layer=sizes.n_layer,
                            n_head=sizes.n_head, n_embd=sizes.n_embd, **switches)

@dataclass
class Shared:
    """What every rung uses."""
    sizes: Sizes
    devices: list
    gpu: bool
    tokens: np.ndarray
    init_state: dict    # torch's initial weights (07_capstone_torch's init)
    attention: str      # the fused attention's implementation: cudnn (a GPU) or xla
    flops_per_token: float
    datasheet: float | None  # reference: the dense bf16 datasheet peak (None: unknown)
    peak: float         # measured: this chip's matmul peak


def accumulate(model, x, y, accum, jitted=True):
    """Loss and gradient of a batch from `accum` equal micro-batches: their gradients
    summed, then divided by accum. Jitted: a lax.scan (one micro-step to compile); else a
    Python loop."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def micro_step(grad_sum, xy):
        def loss_fn(params):
            logits, _ = nnx.merge(graphdef, params, rest)(xy[0])
            with jax.named_scope("loss"):  # a name the profile's classes look for
                return cross_entropy(logits, xy[1])

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


def accumulation_error():
    """Relative norm of (4 micro-batches' gradient - the full batch's): fp32, a toy."""
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
        _, accumulated = accumulate(model, x, y, 4)
        _, full = accumulate(model, x, y, 1)
        return accumulated, full

    with jax.default_matmul_precision("highest"):
        accumulated, full = jax.jit(both)(state)
    difference = jax.tree.map(jnp.subtract, accumulated, full)
    return float(optax.tree.norm(difference) / optax.tree.norm(full))


def vocab_for(settings, sizes):
    if settings["pad_vocab"]:
        return sizes.padded_vocab
    return sizes.vocab


def build(settings, shared, devices, batch, n_steps):
    """The rung's model at torch's init with AdamW, a replica on each of its devices, its
    step function, and its batches (their rows split over the devices)."""
    mesh = jax.make_mesh((len(devices),), ("data",), (jax.sharding.AxisType.Auto,),
                         devices=devices)
    vocab = vocab_for(settings, shared.sizes)
    cfg = model_config(shared.sizes, vocab_size=vocab, attn=settings["attn"],
                       checkpoint=settings["checkpoint"])
    dtype = jnp.float32
    if settings["bf16"]:
        dtype = jnp.bfloat16
    abstract = nnx.eval_shape(lambda: GPT(cfg, dtype, attn_impl=shared.attention))
    graphdef, shapes = nnx.split(abstract)  # shapes only: torch's weights fill them
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    model = nnx.merge(graphdef, zeros)
    weights = dict(shared.init_state)
    for name in ("transformer.wte.weight", "lm_head.weight"):
        weights[name] = weights[name][:vocab]  # GPT-2's rows: the padded table's prefix
    from_torch(model, weights)
    x, y = get_batch(shared.tokens, 0, batch // settings["accum"], cfg.block_size)
    saved = saved_bytes(model, x, y)
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


def saved_bytes(model, x, y):
    """The bytes jax.vjp keeps for one micro-batch's backward: traced, not computed."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        return nnx.merge(graphdef, params, rest)(x, y)[1]

    def residuals(params):
        _, backward = jax.vjp(loss, params)
        return jax.tree.leaves(backward)

    total = 0
    for leaf in jax.eval_shape(residuals, params):
        total += leaf.size * leaf.dtype.itemsize
    return total


def program_of(settings, gpu):
    """The settings that shape the compiled program (a rung with the same reuses it)."""
    program = dict(settings)
    for name in PYTHON_ONLY:
        program.pop(name)
    if not gpu:
        for name in GPU_ONLY:
            program.pop(name)
    return program


def compile_step(step, settings, example):
    """jax.jit of the whole step, compiled now (XLA's autotuning included); its seconds."""
    options = dict(xla_gpu_autotune_level=4,
                   xla_gpu_enable_triton_gemm=settings["triton_gemm"])
    if settings["cublaslt"]:  # named only where used: an XLA without it fails one rung
        options["xla_gpu_enable_cublaslt"] = True
    donate = ()
    if settings["donate"]:
        donate = (0,)  # the old state's buffers become the new state's
    start = time.perf_counter()
    with jax.default_matmul_precision(settings["precision"]):
        lowered = jax.jit(step, donate_argnums=donate).lower(*example)
        compiled = lowered.compile(options)
    seconds = time.perf_counter() - start
    return dict(compiled=compiled, lowered=lowered.as_text(), seconds=seconds)


def program_facts(program, vocab):
    """What the programs' texts show: the matmuls JAX asks for by dtype, whether the loss
    exponentiates f32 logits, XLA's all-reduces, the JAX path of each XLA op; and XLA's
    memory plan."""
    lowered = program["lowered"]  # what JAX asked for (XLA:CPU computes bf16 dots in f32)
    text = program["compiled"].as_text()  # what XLA made of it
    facts = dict(
        bf16_dots=len(re.findall(r"dot_general.*-> tensor<[\dx]*xbf16>", lowered)),
        f32_dots=len(re.findall(r"dot_general.*-> tensor<[\dx]*xf32>", lowered)),
        f32_vocab_exps=len(re.findall(rf"exponential.*<[\dx]*x{vocab}xf32>", lowered)),
        all_reduces=len(re.findall(r" all-reduce(?:-start)?\(", text)))
    memory = program["compiled"].memory_analysis()  # a device's
    facts["memory_bytes"] = None
    if memory is not None:  # inputs and outputs (less what they share) and scratch
        facts["memory_bytes"] = int(memory.argument_size_in_bytes
                                    + memory.output_size_in_bytes
                                    - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    ops = re.findall(r'^\s*(?:ROOT )?%?([\w.-]+) = [^\n]*?op_name="([^"]*)"', text, re.M)
    return facts, dict(ops)


def steps_per_call(settings):
    """Python waits for the device after each call: a step, or WINDOW steps."""
    if settings["host_sync"]:
        return 1
    return WINDOW


def train(step, state, batches, settings, timed_steps, profile, op_paths, world, meter):
    """A warm-up call, the timed calls (NVML's energy around them), one profiled; every
    step's loss and the raw measurements."""
    per_call = steps_per_call(settings)
    losses = []

    def call():
        nonlocal state  # the only reference: a donated buffer is updated in place
        with jax.default_matmul_precision(settings["precision"]):  # un-jitted: op by op
            for _ in range(per_call):
                x, y = batches[len(losses)]
                loss, state = step(state, x, y)
                if settings["host_sync"]:
                    loss = float(loss)  # Python reads the loss: it waits for the device
                losses.append(loss)
        return state  # bench waits for it: the AdamW update too, not only the loss

    first_input = state
    calls = math.ceil(timed_steps / per_call)
    sync(call())  # warm-up
    donated = all(leaf.is_deleted() for leaf in jax.tree.leaves(first_input))
    del first_input  # the warm-up's input state: gone if the step took its buffers
    raw = dict(warmup_steps=per_call, donated_inputs_deleted=donated)
    joules_before = None
    if meter is not None:
        joules_before = meter()
    seconds = bench(call, reps=calls)
    raw["timed_steps"] = calls * per_call
    raw["step_ms"] = [s * 1e3 / per_call for s in seconds]
    raw["tokens_per_joule"] = None
    if meter is not None:  # NVML: these GPUs' energy for the timed tokens
        tokens = raw["timed_steps"] * batches[0][0].size
        raw["tokens_per_joule"] = tokens / (meter() - joules_before)
    raw["profiled_steps"] = 0
    raw["profile"] = None
    if profile:
        split, step_s = profile_split(call, per_call, op_paths, world)
        raw["profile"] = split
        raw["profile_step_s"] = step_s
        raw["profiled_steps"] = per_call
    raw["losses"] = [float(loss) for loss in losses]
    return raw


def loss_gap(losses, base_losses, steps):
    """The largest relative gap between two loss curves over their first `steps` steps."""
    gaps = []
    for loss, base in zip(losses[:steps], base_losses[:steps]):
        gaps.append(abs(loss - base) / base)
    return max(gaps)


def curve_gap(losses, base_losses, smooth):
    """The largest relative gap between two loss curves, smoothed by a moving mean."""
    kernel = np.ones(smooth) / smooth
    curve = np.convolve(losses, kernel, "valid")
    base = np.convolve(base_losses, kernel, "valid")
    return float(np.max(np.abs(curve - base) / base))


def derive(raw, baseline, shared, tokens_per_step):
    """The numbers derived from a rung's raw ones and the baseline's (None: itself)."""
    ms = statistics.median(raw["step_ms"])
    spread = max(raw["step_ms"]) - min(raw["step_ms"])
    tokens_per_s = tokens_per_step / (ms / 1e3)
    flops_per_device = tokens_per_s * shared.flops_per_token / raw["world"]
    mfu_datasheet = None
    if shared.datasheet is not None:
        mfu_datasheet = flops_per_device / shared.datasheet
    mfu_measured_peak = flops_per_device / shared.peak
    # a timing noisier than itself, or faster than the chip: a busy machine
    unreliable = spread > ms or mfu_measured_peak > 1.1
    if baseline is None:
        baseline = dict(raw, ms_per_step=ms, unreliable=unreliable)
    if baseline["unreliable"]:  # a speed-up is as reliable as both its timings
        unreliable = True
    gap = loss_gap(raw["losses"], baseline["losses"], EARLY_STEPS)
    numbers = dict(tokens_per_step=tokens_per_step, ms_per_step=ms,
                   tokens_per_s=tokens_per_s, speedup=baseline["ms_per_step"] / ms,
                   mfu_datasheet=mfu_datasheet, mfu_measured_peak=mfu_measured_peak,
                   loss_rel_gap=gap,
                   unreliable=unreliable, fits_24gb=None, binds=None, regime=None)
    if raw["peak_memory_bytes"] is not None:
        numbers["fits_24gb"] = raw["peak_memory_bytes"] <= FITS_BYTES
    if raw["profile"] is not None:  # the class with the largest share of the step
        numbers["binds"] = max(raw["profile"], key=raw["profile"].get)
        numbers["regime"] = CLASSES[numbers["binds"]][0]
    return numbers


def fmt(value, spec=""):
    """A number, or n/a where this machine cannot measure it; yes/no for a verdict."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        if value:
            return "yes"
        return "no"
    return format(value, spec)

HEADER = (f"   {'rung':38s} {'ms/step':>8s} {'tokens/s':>10s} {'speed-up':>8s} "
          f"{'MFU(ds)':>7s} {'MFU(meas)':>9s} {'GiB':>5s} {'24 GB':>5s} {'tokens/J':>8s} "
          f"{'d(loss)':>7s}  binds: share of a profiled step\n"
          "   (measured: ms, tokens/s, GiB (XLA's plan per device; un-jitted: the "
          "allocator's peak), tokens/J (NVML), binds (profiler); derived: speed-up, MFU, "
          "d(loss) vs the baseline)")


def print_row(r):
    name = r["name"]
    if not r["kept"]:
        name += " (dropped)"
    memory = None
    if r["peak_memory_bytes"] is not None:
        memory = r["peak_memory_bytes"] / 2**30
    binds = "n/a"
    if r["binds"] is not None:
        share = r["profile"][r["binds"]] / r["profile_step_s"]
        binds = f"{r['binds']} {share:.0%} ({r['regime']})"
    line = (f"   {name:38s} {r['ms_per_step']:8.1f} {r['tokens_per_s']:10,.0f} "
            f"{r['speedup']:7.2f}x {fmt(r['mfu_datasheet'], '.1%'):>7} "
            f"{r['mfu_measured_peak']:9.1%} {fmt(memory, '.1f'):>5} "
            f"{fmt(r['fits_24gb']):>5} {fmt(r['tokens_per_joule'], ',.0f'):>8} "
            f"{r['loss_rel_gap']:7.2%}  {binds}")
    if r["unreliable"]:
        line += "  unreliable (machine busy)"
    print(line, flush=True)

# --- The experiments: the waterfall, the headline, their figures.


def cannot_run(settings, devices, batch):
    """Why a rung cannot run on these devices, or None."""
    if settings["shard"] and len(devices) < 2:
        return ("one device (a CPU can simulate 4: "
                "XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    if settings["shard"] and batch % len(devices):
        return f"{batch} rows do not split over {len(devices)} devices"
    return None


def measure(name, why, settings, shared, batch, timed, profile, last_compile):
    """One rung built, compiled (or the rung before's program reused), and trained.
    Returns its raw numbers, and the compile the next rung may reuse."""
    devices = shared.devices[:1]
    if settings["shard"]:
        devices = shared.devices
    n_steps = 2 * WINDOW + math.ceil(timed / WINDOW) * WINDOW  # warm-up, timed, profiled
    step, state, batches, saved = build(settings, shared, devices, batch, n_steps)
    r = dict(name=name, why=why, settings=settings, kept=is_kept(name, shared.gpu),
             world=len(devices), compile_s=0.0, acts={}, peak_memory_bytes=None,
             activation_bytes=saved)
    op_paths = {}
    if settings["jit"]:
        program = program_of(settings, shared.gpu)
        if last_compile is not None and last_compile["program"] == program:
            print("   the same program as the rung before: no compile", flush=True)
        else:
            print("   compiling the whole step with XLA ...", flush=True)
            last_compile = compile_step(step, settings, (state, *batches[0]))
            last_compile["program"] = program
            r["compile_s"] = last_compile["seconds"]
            print(f"   compiled in {r['compile_s']:.1f} s (measured)", flush=True)
        vocab = vocab_for(settings, shared.sizes)
        r["acts"], op_paths = program_facts(last_compile, vocab)
        r["peak_memory_bytes"] = r["acts"].pop("memory_bytes")
        step = last_compile["compiled"]
    else:
        print("   JAX compiles each jnp op at its first use (~250 programs)", flush=True)
    meter = None
    if shared.gpu:
        meter = energy_meter(devices)
    raw = train(step, state, batches, settings, timed, profile, op_paths, len(devices),
                meter)
    r.update(raw)
    r["acts"]["donated_inputs_deleted"] = r.pop("donated_inputs_deleted")
    if not settings["jit"] and shared.gpu:  # the allocator's peak: this rung runs first
        r["peak_memory_bytes"] = devices[0].memory_stats()["peak_bytes_in_use"]
    return r, last_compile


def measure_rungs(shared, plan, batch, profile=True, total_steps=None):
    """Each rung of the plan (name, why, settings) measured, derived and printed at once.
    The first rung that runs is the baseline; total_steps: each trains exactly that many.
    Returns the measured rungs, and {name: why not} for the others."""
    rows = []
    skipped = {}
    last_compile = None
    tokens_per_step = batch * model_config(shared.sizes).block_size
    print(HEADER, flush=True)
    for name, why, settings in plan:
        print(f"{name}: predicted {why}", flush=True)
        reason = cannot_run(settings, shared.devices, batch)
        if reason is not None:
            print(f"   skipped: {reason}", flush=True)
            skipped[name] = reason
            continue
        timed = shared.sizes.slow_steps
        if settings["bf16"]:
            timed = shared.sizes.steps
        if total_steps is not None:
            timed = total_steps - steps_per_call(settings)  # the warm-up call's steps
        start = time.perf_counter()
        try:
            r, last_compile = measure(name, why, settings, shared, batch, timed, profile,
                                      last_compile)
        except jax.errors.JaxRuntimeError as e:  # out of memory: the next rung runs
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            print(f"   does not fit: {str(e).splitlines()[0][:160]}", flush=True)
            skipped[name] = "does not fit"
            continue
        baseline = None
        if rows:
            baseline = rows[0]
        r.update(derive(r, baseline, shared, tokens_per_step))
        r["wall_s"] = time.perf_counter() - start
        print_row(r)
        steps = len(r["losses"])
        print(f"   ({r['wall_s']:.0f} s for this rung: build, compile, {steps} steps)",
              flush=True)
        rows.append(r)
    return rows, skipped


def loss_in_fp32(rows):
    """Whether every jitted rung's loss exponentiates f32 logits. The loss's value cannot
    tell: bf16 logits round it by ~0.3%, within any honest run-to-run spread."""
    for r in rows:
        if r["acts"].get("f32_vocab_exps") == 0:
            return False
    return True


def headline(shared):
    """The chapter's opening claim: the first jitted rung (fp32 matmuls) and the final one
    trained for the same steps from one init on the same batches: one loss curve, an order
    of magnitude apart in time."""
    # PREDICTION: the first steps' losses within 0.1% (rounding), the smoothed curves
    # within a few % (then chaos); the final rung ~10x faster a step on a GPU (bf16 tensor
    # cores, cuDNN attention), its compiles paid once. The un-jitted rung would take
    # minutes for 100 steps: the jitted one stands in
    names = ["+ jax.jit (whole step)", FINAL]
    plan = []
    for name, _, why in RUNGS:
        if name in names:
            plan.append((name, why, settings_for(name, shared.gpu)))
    steps = shared.sizes.headline_steps
    rows, skipped = measure_rungs(shared, plan, shared.sizes.headline_batch, False, steps)
    if skipped:
        sys.exit(f"error: the headline's rungs did not run: {skipped}")
    base, final = rows
    early = loss_gap(final["losses"], base["losses"], EARLY_STEPS)
    curve = curve_gap(final["losses"], base["losses"], SMOOTH)
    ratio = base["ms_per_step"] / final["ms_per_step"]
    print(f"derived: largest relative loss gap over the first {EARLY_STEPS} steps "
          f"{early:.2%} (tolerance {LOSS_TOLERANCE:.2%})")
    print(f"derived: over {steps} steps, the curves smoothed by {SMOOTH} steps: "
          f"{curve:.2%} (tolerance {CURVE_TOLERANCE:.0%})")
    print(f"derived: the final rung is {ratio:.1f}x faster a step (its compile, "
          f"{final['compile_s']:.0f} s, is left off the wall-clock axis)")
    summary = dict(steps=steps, early_steps=EARLY_STEPS, smooth=SMOOTH,
                   loss_tolerance=LOSS_TOLERANCE, curve_tolerance=CURVE_TOLERANCE,
                   early_gap=early, curve_gap=curve, time_ratio=ratio,
                   compile_s=final["compile_s"], rungs=names)
    checks = dict(headline_starts_the_same=early <= LOSS_TOLERANCE,
                  headline_same_curve=curve <= CURVE_TOLERANCE,
                  loss_softmax_in_fp32=loss_in_fp32(rows))
    return rows, summary, checks


def pyplot():
    try:
        import matplotlib
    except ImportError:
        print("figure skipped (no matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, out, name):
    path = Path(out) / f"{name}.png"
    tmp = Path(out) / f"{name}.tmp{os.getpid()}.png"  # a reader never sees half a figure
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    print(f"figure: {path}")


def plot_waterfall(rows, out):
    """Each rung's tokens/s and its speed-up, and where its profiled step's time goes."""
    plt = pyplot()
    if plt is None or not rows:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    names = [r["name"] for r in rows]
    colours = []
    for r in rows:
        if r["kept"]:
            colours.append("tab:blue")
        else:
            colours.append("tab:red")
    bars = left.barh(names, [r["tokens_per_s"] for r in rows], color=colours)
    left.bar_label(bars, [f"{r['speedup']:.1f}x" for r in rows], fontsize=8)
    left.set(xlabel="tokens/s (measured)",
             title="speed-up over the first rung (red: dropped)")
    left.invert_yaxis()
    stacked = np.zeros(len(rows))
    for cls in CLASSES:
        share = np.array([r["profile"][cls] / r["profile_step_s"] for r in rows])
        right.barh(names, share, left=stacked, label=cls, color=COLOURS[cls])
        stacked += share
    right.set(xlabel="share of a profiled step (measured)",
              title="where a step's time goes", xlim=(0, 1.45))  # room for the legend
    right.legend(fontsize=8, loc="center right")
    save_figure(fig, out, "07_capstone_jax")


def plot_headline(rows, summary, out):
    """The two loss curves against step, and against wall-clock (steps x median step)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for r in rows:
        steps = np.arange(1, len(r["losses"]) + 1)
        left.plot(steps, r["losses"], label=r["name"])
        right.plot(steps * r["ms_per_step"] / 1e3, r["losses"])
    left.set(xlabel="optimizer step", ylabel="training loss (measured)",
             title=f"the same curve: smoothed by {summary['smooth']} steps, within "
                   f"{summary['curve_gap']:.2%}")
    right.set(xlabel="wall-clock s (steps x measured median step; compile left out)",
              xscale="log", title=f"{summary['time_ratio']:.1f}x apart")
    left.legend()
    save_figure(fig, out, "07_capstone_jax_headline")

# --- Command line, set-up, and the run.


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
    p.add_argument("--quick", action="store_true", help="a toy model, a step or two a rung")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--out", default="out", help="figure folder")
    p.add_argument("--data", help="a UTF-8 text file (default: the stdlib's sources)")
    p.add_argument("--tokenizer", choices=["auto", "gpt2", "bytes"], default="auto")
    p.add_argument("--batch", type=int_in(4, 512), help="sequences a step (a multiple of 4)")
    p.add_argument("--steps", type=int_in(1, 100),
                   help="timed steps of every rung (op-by-op on an H200: ~11 s a step)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--headline", action="store_true", help="first jitted vs final rung")
    mode.add_argument("--scaling", action="store_true", help="final rung, alone and sharded")
    args = p.parse_args(argv)
    if args.batch is not None and args.batch % 4:
        p.error(f"argument --batch: {args.batch} is not a multiple of 4 (micro-batches)")
    if args.json is not None and (args.json == "" or Path(args.json).is_dir()):
        sys.exit(f"error: --json {args.json!r}: not a file name")
    if args.out == "" or Path(args.out).exists() and not Path(args.out).is_dir():
        sys.exit(f"error: --out {args.out!r}: not a folder")
    folders = [Path(args.out)]
    if args.json is not None:
        folders.append(Path(args.json).parent)
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)  # a missing folder is made
        if not os.access(folder, os.W_OK):
            sys.exit(f"error: {folder}: not writable")
    return args


def setup(args):
    """Start the backend (its flags first), read the data, draw torch's initial weights,
    measure the matmul peak; print what was found."""
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
    flags = "--xla_gpu_autotune_level=0"  # the un-jitted rung's one-op programs: no tuning
    if args.quick and args.device == "cpu":  # a smoke test is all compile: XLA:CPU fastest
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
        sizes = replace(sizes, steps=args.steps, slow_steps=args.steps)
    name = platform.machine()
    if platform.processor():
        name = platform.processor()
    datasheet = None
    dtype = jnp.float32  # a CPU has no bf16 matmul units
    if gpu:
        name = devices[0].device_kind
        datasheet = datasheet_bf16_peak(name)  # reference: NVIDIA's datasheet
        dtype = jnp.bfloat16
    print(f"device: {len(devices)} x {name} | jax {jax.__version__}, flax "
          f"{version('flax')} | python {platform.python_version()}", flush=True)
    shipped = model_config(sizes, vocab_size=sizes.vocab)  # GPT-2 as shipped: the FLOPs
    tokens, tokenizer = load_tokens(args.data, args.tokenizer, shipped.block_size + 2)
    tokens = tokens % sizes.vocab  # the same, but --quick's BPE ids: folded into its vocab
    torch.manual_seed(0)  # 07_capstone_torch's init; GPT-2's rows are its prefix
    init_state = TorchGPT(model_config(sizes, vocab_size=sizes.padded_vocab)).state_dict()
    attention = "xla"
    if gpu:  # cuDNN's fused attention, where this jaxlib runs it
        attention = "cudnn"
    peak = matmul_peak(dtype, sizes.peak_size, sizes.peak_samples)
    shared = Shared(sizes, devices, gpu, tokens, init_state, attention,
                    flops_per_token(shipped), datasheet, peak)
    datasheet_tflops = None
    if datasheet is not None:
        datasheet_tflops = datasheet / 1e12
    print(f"data: {len(tokens):,} tokens ({tokenizer}); model {sizes.model} "
          f"({shipped.n_layer} layers, d={shipped.n_embd}, T={shipped.block_size})")
    print(f"derived: flops_per_token = 6N + 12LTd = {shared.flops_per_token / 1e6:.1f} MFLOP")
    print(f"reference: datasheet dense bf16 peak {fmt(datasheet_tflops)} TFLOP/s (NVIDIA)")
    print(f"measured: {sizes.peak_size} x {sizes.peak_size} {jnp.dtype(dtype).name} matmul "
          f"peak (burst) {shared.peak / 1e12:.3g} TFLOP/s")
    print("baseline: full fp32 matmuls ('highest'; JAX's default is TF32 on a GPU)",
          flush=True)
    result = dict(lesson="07_capstone_jax", quick=args.quick,
                  device=dict(name=name, count=len(devices),
                              platform=devices[0].platform),
                  framework=dict(jax=jax.__version__, flax=version("flax"),
                                 optax=optax.__version__),
                  sizes=asdict(sizes), tokenizer=tokenizer,
                  flops_per_token=shared.flops_per_token,
                  peak_flops=dict(datasheet=datasheet, measured=shared.peak),
                  world=len(devices), loss_tolerance=LOSS_TOLERANCE)
    return shared, result


def waterfall(shared, args, result):
    """The accumulation check, then the rungs (--scaling: the final rung alone, sharded);
    the checks on what they measured."""
    error = accumulation_error()
    print(f"measured: gradient accumulated over {BASELINE['accum']} micro-batches vs the "
          f"full batch: relative difference {error:.1e} (tolerance {ACCUM_TOLERANCE:.0e})",
          flush=True)
    plan = []
    for name, _, why in RUNGS:
        plan.append((name, why, settings_for(name, shared.gpu)))
    if args.scaling:
        # PREDICTION: alone, one device trains the batch in N micro-batches, each one
        # device's share: the work of each of the N sharded devices. What scaling loses is the
        # gradient all-reduce left exposed (simulated CPU devices share the same cores)
        n = len(shared.devices)
        alone = dict(settings_for(FINAL, shared.gpu), accum=n)
        why = f"the batch in {n} micro-batches, one device's share each: the reference"
        sharded = [rung for rung in plan if rung[0] == SHARDED]
        plan = [(f"final rung, one device, accum {n}", why, alone)] + sharded
    rows, result["skipped"] = measure_rungs(shared, plan, shared.sizes.batch)
    split_ok = True
    for r in rows:  # each class's ms >= 0, idle the step's rest
        if min(r["profile"].values()) < 0:
            split_ok = False
    checks = dict(accumulated_gradient_equals_full_batch=error <= ACCUM_TOLERANCE,
                  losses_track_baseline=all(r["loss_rel_gap"] <= LOSS_TOLERANCE
                                            for r in rows),
                  time_split_adds_up=split_ok, loss_softmax_in_fp32=loss_in_fp32(rows))
    done = {r["name"]: r for r in rows}
    checkpointed = done.get("+ activation checkpointing")
    if checkpointed and FINAL in done:  # against the rung it builds on
        memory = "activation_bytes"  # a CPU: XLA:CPU's plan ignores remat, so the bytes
        if shared.gpu:  # kept for the backward (traced); a GPU: XLA's memory plan
            memory = "peak_memory_bytes"
        checks["checkpointing_lowers_memory"] = checkpointed[memory] < done[FINAL][memory]
    result.update(accumulation_rel_error=error, accumulation_tolerance=ACCUM_TOLERANCE)
    if args.scaling and len(rows) == 2:
        one = rows[0]
        sharded = rows[1]
        ideal = sharded["world"] * one["tokens_per_s"]
        result["scaling"] = sharded["tokens_per_s"] / ideal
        print(f"derived: scaling {result['scaling']:.1%} of {sharded['world']} x one device")
    return rows, checks


def main():
    args = parse_args()
    start = time.perf_counter()
    shared, result = setup(args)
    if args.headline:
        rows, result["headline"], checks = headline(shared)
        batch = shared.sizes.headline_batch
    else:
        rows, checks = waterfall(shared, args, result)
        batch = shared.sizes.batch
    result.update(rungs=rows, checks=checks,
                  tokens_per_step=batch * model_config(shared.sizes).block_size)
    print(f"\nthe table again\n{HEADER}")
    for r in rows:
        print_row(r)
    for check, ok in checks.items():
        verdict = "FAILED"
        if ok:
            verdict = "ok"
        print(f"check {check}: {verdict}")
    result["wall_s"] = time.perf_counter() - start
    print(f"wall time: {result['wall_s']:.0f} s")
    if args.headline:
        plot_headline(rows, result["headline"], args.out)
    elif not args.scaling:
        plot_waterfall(rows, args.out)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    failed = [check for check, ok in checks.items() if not ok]
    if failed:
        sys.exit(f"error: check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
