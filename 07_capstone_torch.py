"""
Section 13.7: the waterfall. GPT-2 124M down the chapter's method, one measured rung per
technique, each kept for the rungs after it, all from one init on the same batches: the
speed changes, the losses must not. torch.profiler says where each rung's step goes.

    python 07_capstone_torch.py               # one GPU: gpt2 (124M, T=1024), ~3 min
    python 07_capstone_torch.py --headline    # baseline vs final rung, 100 steps, ~1.5 min
    torchrun --standalone --nproc_per_node=2 07_capstone_torch.py [--interconnect staged]
                                              # each GPU the final rung alone, then DDP
    python 07_capstone_torch.py --device cpu  # the tiny model, a few minutes on 2 cores
    python 07_capstone_torch.py --quick       # a toy on UTF-8 bytes, a step a rung (tests)

Each rung prints its prediction, then its row as soon as it is measured: ms/step, tokens/s,
MFU (6N + 12LTd FLOPs per token over the datasheet bf16 peak, and over this chip's measured
matmul peak), peak memory against a 24 GB card, tokens/J (NVML), the loss gap to the
baseline, and what binds the step. Then the table's checks, a figure in out/, --json.
Text: --data FILE (UTF-8), else the Python standard library's sources; GPT-2 BPE tokens when
tiktoken can load them, else UTF-8 bytes. Needs model_torch.py beside it.
"""

import os
import signal
import sys


def interrupted(signum, frame):
    """Ctrl-C while the imports below run: one line, exit 130. (A KeyboardInterrupt raised
    there can land in a callback of Python's import machinery, which prints it and goes on.)"""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted)  # before the imports below, which take seconds

import argparse
import gc
import hashlib
import json
import logging
import math
import platform
import socket
import statistics
import sysconfig
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch._inductor.config
import torch.distributed as dist
from torch._dynamo.callback import callback_handler
from torch._dynamo.utils import counters
from torch.autograd import DeviceType
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from model_torch import GPT, GPTConfig, activation_bytes, datasheet_bf16_peak
from model_torch import flops_per_token

if __name__ == "__main__":  # from here Ctrl-C is a KeyboardInterrupt: main() ends cleanly
    signal.signal(signal.SIGINT, signal.default_int_handler)

# --- The waterfall: every setting a rung can change, then the rungs, in order.

BASELINE = dict(tf32=False, bf16=False, attn="manual", compile=False, fused=False,
                pad_vocab=False, accum=4, host_sync=True, fused_classifier=False,
                checkpoint=False, ddp=False, bf16_grads=False)
WARMUP = 2  # untimed steps of every rung: the first compiles, the second settles
WINDOW = 5  # steps between host syncs once "no host sync per step" is on
RUNGS = [  # (name, what it changes, the regime it targets and the prediction)
    ("fp32 eager", {}, "baseline: full fp32 matmuls leave the tensor cores idle: ~67 "
     "TFLOP/s fp32 on an H100/H200 against 989 bf16 (datasheet): < 7% MFU"),
    ("+ TF32", dict(tf32=True), "compute-bound on the wrong units: TF32 runs fp32 matmuls "
     "on tensor cores (495 TFLOP/s): 2-3x (build-nanogpt, A100: 1000 -> 333 ms)"),
    ("+ bf16 autocast", dict(bf16=True), "tensor-core peak x2, activations /2, but eager "
     "adds casts and manual attention stays fp32: 1.1-1.5x (build-nanogpt: 333 -> 300 ms)"),
    ("+ flash attention (SDPA)", dict(attn="sdpa"), "bandwidth-bound: manual attention "
     "writes and re-reads B*H*T*T scores per layer; SDPA's fused kernel does not: 1.2-2x"),
    ("+ torch.compile", dict(compile=True), "bandwidth- and overhead-bound chains "
     "(LayerNorm, GELU, residuals, casts, the loss) fuse into few kernels: 1.3-2x, plus "
     "compile time once"),
    ("+ fused AdamW", dict(fused=True), "overhead: foreach AdamW launches several kernels "
     "per parameter group, fused is one pass over params, grads, moments: a few %"),
    ("+ vocab 50304, 1 micro-step", dict(pad_vocab=True, accum=1), "50304 = 128 x 393 leaves "
     "the largest matmul no ragged tiles (nanoGPT: up to ~25%); one 4x micro-batch "
     "amortises fixed costs: 1.05-1.3x, more activation memory"),
    ("+ no host sync per step", dict(host_sync=False), f"overhead: reading the loss every "
     f"step makes the CPU wait for the GPU to drain; every {WINDOW} steps it runs ahead. "
     "A ~100 ms step hides a gap < 1 ms: < 1% here, 0 on a CPU; it pays for ms-long steps"),
    ("+ fused classifier (logits never written)", dict(fused_classifier=True), "memory "
     "and bandwidth: the B x T x V logits (6.6 GB in bf16, 13 GB in fp32) are never "
     "written, so peak memory falls by the logits the plain head keeps for backward and "
     "the loss's share of the step falls; the matmuls are the same: a few % at most"),
    ("+ activation checkpointing", dict(checkpoint=True), "a memory fix where memory does "
     "NOT bind: recomputing each block's forward adds ~1/3 of its FLOPs: 20-30% SLOWER"),
    ("+ DDP", dict(ddp=True), "the batch split among N GPUs, the gradient all-reduce "
     "overlapped with backward: over NVLink close to N x one GPU (scaling > 90%)"),
    ("+ bf16 gradient all-reduce", dict(bf16_grads=True), "communication-bound on a slow "
     "link: a hook all-reduces bf16 gradients, half the bytes: ~0 on NVLink, a few % staged"),
]
DETOURS = {"+ activation checkpointing"}  # measured, then not carried forward
BASE = "fp32 eager"  # what every speed-up and loss gap is measured against
FIRST_DDP = "+ DDP"  # the final rung is every single-device rung kept before this one
ALONE = "final rung, each GPU alone"  # under torchrun: DDP's reference
CLASSES = {  # class: (the regime it means, substrings of a kernel's (CPU: op's) name)
    "communication": ("communication-bound", ("nccl", "gloo", "allreduce", "all_reduce")),
    "loss": ("bandwidth-bound", ("nll_loss", "nllloss", "log_softmax", "logsoftmax",
                                 "logsumexp")),
    "attention": ("attention-bound", ("flash", "fmha", "sdpa", "attention", "softmax")),
    "matmul": ("compute-bound", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "addmm",
                                 "bmm")),
    "optimizer": ("bandwidth-bound", ("adam", "multi_tensor_apply", "foreach")),
    "norm+elementwise": ("bandwidth-bound", ("norm", "elementwise", "gelu", "triton",
                                             "cpp_fused", "reduce", "copy", "memcpy",
                                             "memset", "fill", "add", "mul")),
    "other": ("unclassified", ()),  # every other kernel
    "idle": ("overhead-bound", ()),  # no kernel running: the device waits for the host
}
COLOURS = {"matmul": "tab:blue", "attention": "tab:orange", "loss": "tab:red",
           "optimizer": "tab:green", "norm+elementwise": "tab:purple",
           "communication": "tab:brown", "other": "tab:gray", "idle": "lightgray"}
# Training is chaotic. GPT-2 124M on one H200 (16 x 1024 tokens a step, the same batches):
# two TF32 runs, one with its init multiplied by (1 + 1e-6 noise), far below any rounding
# here, agree to ~0.03% for 40 steps, then drift apart: ~1.4% at single steps by step 100,
# ~1% on curves smoothed over 10 steps; bf16 drifts as far, and not always upwards. So a
# loss is checked where chaos has not grown yet, and a whole curve only smoothed:
EARLY_STEPS = 10  # the steps where per-step losses must agree
LOSS_TOLERANCE = 0.0015  # largest relative gap there: honest rounding (fp32, TF32, bf16
# autocast) stays below ~0.08%; a loss computed on bf16 logits is ~0.27% off, a loss scaled
# wrongly (a micro-step count not divided out) by a factor
SMOOTH = 20  # steps of the moving mean the headline's curves are compared through
CURVE_TOLERANCE = 0.04  # largest relative gap of the smoothed curves: honest runs differing
# by rounding alone or by bf16 stay within ~1.6% over 100 steps; a real change of the math
# (learning rate, data, a wrong gradient) moves them further
ACCUM_TOLERANCE = 1e-4  # accumulated vs full-batch gradient in fp32 (rounding: ~1e-6)
ENERGY_MIN_SECONDS = 1.0  # NVML's energy counter moves in steps of tens of ms: a shorter
# timed region reads zero or a fraction of its energy, so tokens/J is left unmeasured
FITS_BYTES = 23 * 2**30  # a 24 GB card (RTX 4090) less ~1 GiB for the CUDA context
DDP_HINT = ("one process per GPU: torchrun --standalone --nproc_per_node=2 "
            "07_capstone_torch.py (CPU ranks: --device cpu)")


@dataclass
class Sizes:
    model: str = "tiny"  # a label: GPT-2's shape at a CPU's scale
    block_size: int = 128  # tokens per sequence (T)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab: int = 50257  # GPT-2's tokens as shipped (UTF-8 bytes use the first 256)
    padded_vocab: int = 50304  # the next multiple of 128
    batch: int = 4  # sequences per optimizer step in the waterfall
    steps: int = 2  # timed steps of a compiled rung
    eager_steps: int = 2  # timed steps of an eager rung (the slow ones)
    headline_batch: int = 4
    headline_steps: int = 30  # timed steps of each headline curve
    peak_size: int = 1024  # n of the n x n matmuls that measure the peak
    peak_samples: int = 10


GPU = Sizes(model="gpt2", block_size=1024, n_layer=12, n_head=12, n_embd=768, batch=64,
            steps=20, eager_steps=3, headline_batch=16, headline_steps=100,
            peak_size=8192)
QUICK = Sizes(model="toy", block_size=16, n_layer=1, n_head=2, n_embd=32, vocab=4095,
              padded_vocab=4096, steps=1, eager_steps=1, headline_steps=20,
              peak_size=256, peak_samples=3)  # UTF-8 bytes; padded by 1 row in 4096

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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(fn, device, reps):
    """Seconds of each of `reps` calls of fn, the device synchronised around each (GPU
    work is asynchronous). The caller warms up first."""
    seconds = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def matmul_peak(device, dtype, n, samples):
    """The matmul ceiling as 01_roofline.py measures it: bursts >= 5 ms of n x n matmuls,
    each after 100 ms idle and one untimed matmul; 2 n^3 FLOPs over the median time."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    [one] = bench(lambda: a @ b, device, reps=1)
    calls = math.ceil(0.005 / one)

    def burst():
        for _ in range(calls):
            a @ b

    per_matmul = []
    for _ in range(samples):
        time.sleep(0.1)
        a @ b
        [seconds] = bench(burst, device, reps=1)
        per_matmul.append(seconds / calls)
    return 2 * n**3 / statistics.median(per_matmul)


def energy_meter(device):
    """A function reading this GPU's energy counter in joules (NVML), or None."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:  # no nvidia-ml-py: no tokens/J
        return None
    try:  # torch's handle for this device (CUDA_VISIBLE_DEVICES-aware)
        handle = torch.cuda._get_pynvml_handler(device)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # mJ since the driver loaded
    except pynvml.NVMLError:  # no counter on this GPU
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def kernel_class(name):
    """The first class one of whose substrings is in the kernel's (op's) name."""
    name = name.lower()
    for cls, (_, keys) in CLASSES.items():
        for key in keys:
            if key in name:
                return cls
    return "other"


def profile_split(step, device):
    """Seconds of one step by class, from the profiler: a GPU's kernels, or a CPU's ops on
    the step's thread (self times); the step's wall time; the names of the ops it ran.
    One stream runs the kernels in order (one thread the ops), so their sum is the busy
    time and the rest idle. Only DDP's all-reduce runs beside them (its own stream): what
    sums past the wall time overlapped compute, and is taken off communication."""
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU]
    if gpu:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - start
    events = prof.events()
    thread = min(events, key=lambda e: e.time_range.start).thread  # the step's
    split = dict.fromkeys(CLASSES, 0.0)
    for e in events:
        if gpu and e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            split[kernel_class(e.name)] += e.time_range.elapsed_us() / 1e6
        if not gpu and e.thread == thread:
            split[kernel_class(e.name)] += e.self_cpu_time_total / 1e6
    split["communication"] += min(wall - sum(split.values()), 0.0)  # the overlapped part
    split["idle"] = wall - sum(split.values())
    ops = {e.name for e in events if e.device_type == DeviceType.CPU}
    return split, wall, ops

# --- One rung: its settings, its model and step, its measurements, its derived numbers.


def is_kept(name, on_gpu):
    """Measure -> fix -> re-measure: a fix for a regime this device is not in is measured,
    then not carried forward: the DETOURS, and bf16 autocast on a CPU (no bf16 matmul
    units: its bf16 matmuls run 10-20x slower than fp32)."""
    if name in DETOURS:
        return False
    if name == "+ bf16 autocast" and not on_gpu:
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
    device: torch.device
    sizes: Sizes
    batches: list  # (x, y) pairs on the device: batch i is step i of every rung
    init_state: dict  # one init for every rung (the padded vocab; GPT-2's rows a prefix)
    backend: str  # torch.compile's
    rank: int = 0
    world: int = 1


def accumulate(model, x, y, accum, bf16):
    """Gradients of the batch's mean loss from `accum` equal micro-batches: each
    micro-batch's mean loss is divided by accum, so their gradients add up to the full
    batch's. Returns the batch's mean loss."""
    total = torch.zeros((), device=x.device)
    for x_micro, y_micro in zip(x.chunk(accum), y.chunk(accum)):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x_micro, y_micro)
        (loss / accum).backward()
        total += loss.detach() / accum
    return total


def accumulation_error(shared, rows=4):
    """The gradient accumulated over 4 micro-batches vs the full batch's, before any
    optimizer step (fp32 baseline): their relative difference."""
    # PREDICTION: fp32 rounding, ~1e-6 (the same sums in another order). A step that forgot
    # to divide by the micro-batch count would be off by 3x - and AdamW would hide it.
    raw, _, _ = build(BASELINE, shared)
    x = shared.batches[0][0][:rows]
    y = shared.batches[0][1][:rows]
    grads = []
    for accum in (BASELINE["accum"], 1):
        accumulate(raw, x, y, accum, bf16=False)
        grads.append(torch.cat([p.grad.flatten() for p in raw.parameters()]))
        raw.zero_grad(set_to_none=True)
    return ((grads[0] - grads[1]).norm() / grads[1].norm()).item()


def compressed_all_reduce(state, bucket):
    """DDP's communication hook: a bucket of gradients sent in 16 bits (half the bytes of
    fp32), averaged over the ranks, put back in fp32. state counts the bytes sent."""
    grads = bucket.buffer()
    sent = grads.to(state["dtype"]) / dist.get_world_size()
    state["bytes"] += sent.numel() * sent.element_size()
    future = dist.all_reduce(sent, async_op=True).get_future()

    def unpack(fut):
        grads.copy_(fut.value()[0])
        return grads

    return future.then(unpack)


def build(settings, shared):
    """The rung's model at the shared init and its optimizer step: (the model, the step,
    the gradient hook's state with its byte count, or None)."""
    if shared.device.type == "cuda":  # the last rung's model first: compiled modules hold
        gc.collect()  # reference cycles, and its memory would count in this rung's peak
    precision = "highest"
    if settings["tf32"]:
        precision = "high"  # fp32 matmuls on TF32 tensor cores
    torch.set_float32_matmul_precision(precision)
    config = model_config(shared.sizes, settings)
    with torch.device(shared.device):
        raw = GPT(config)
    state = dict(shared.init_state)
    for key in ("transformer.wte.weight", "lm_head.weight"):  # the tied embedding
        state[key] = state[key][:config.vocab_size]
    raw.load_state_dict(state)
    model = raw
    sent = None
    if settings["ddp"]:  # gradient_as_bucket_view: the gradients live in DDP's buckets
        device_ids = None
        if shared.device.type == "cuda":
            device_ids = [shared.device.index]
        model = DDP(raw, device_ids=device_ids, gradient_as_bucket_view=True)
        torch._dynamo.reset()  # else dynamo reuses the graph compiled without DDP
    if settings["bf16_grads"]:
        sent = dict(dtype=torch.float16, bytes=0)  # on gloo (no bf16): the same bytes
        if shared.device.type == "cuda":
            sent["dtype"] = torch.bfloat16
        model.register_comm_hook(sent, compressed_all_reduce)
    if settings["compile"]:  # static shapes: a new shape compiles anew, never symbolic
        model = torch.compile(model, backend=shared.backend, dynamic=False)
    opt = raw.configure_optimizer(lr=6e-4, weight_decay=0.1, fused=settings["fused"])

    def step(x, y):
        loss = accumulate(model, x, y, settings["accum"], settings["bf16"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if settings["ddp"]:  # the global batch's mean loss: the mean of the ranks' means
            dist.all_reduce(loss)
            loss = loss / shared.world
        return loss

    return raw, step, sent


def train(raw, step, sent, settings, shared, timed_steps):
    """A rung's raw measurements: WARMUP steps (the first compiles), `timed_steps` timed
    in windows of one step (the host reads each loss) or of WINDOW steps, NVML's energy
    around them, then one profiled step. Under DDP each process trains its rows of every
    batch. Then the evidence that each technique acted."""
    device = shared.device
    rows = slice(None)
    world = 1
    if settings["ddp"]:
        share = len(shared.batches[0][0]) // shared.world
        rows = slice(shared.rank * share, (shared.rank + 1) * share)
        world = shared.world
    window = 1
    if not settings["host_sync"]:
        window = min(WINDOW, timed_steps)
    windows = math.ceil(timed_steps / window)
    losses = []

    def run_steps(count):
        for _ in range(count):
            x, y = shared.batches[len(losses) % len(shared.batches)]
            loss = step(x[rows], y[rows])
            if settings["host_sync"]:
                loss = loss.item()  # the host waits for the device here
            losses.append(loss)

    said = False

    def compiling(*args):  # dynamo starts compiling: said once, as it happens
        nonlocal said
        if not said:
            print("   compiling (torch.compile, in the first step) ...", flush=True)
        said = True

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    graphs_before = counters["stats"]["unique_graphs"]
    callback_handler.register_start_callback(compiling)
    try:
        warmup_s = bench(lambda: run_steps(1), device, WARMUP)
    finally:
        callback_handler.remove_start_callback(compiling)
    graphs = counters["stats"]["unique_graphs"] - graphs_before
    read_energy = energy_meter(device)
    joules_before = None
    if read_energy is not None:
        joules_before = read_energy()
    window_s = bench(lambda: run_steps(window), device, windows)
    x = shared.batches[0][0][rows]
    tokens_per_joule = None
    timed_s = sum(window_s)
    if joules_before is not None and timed_s >= ENERGY_MIN_SECONDS:
        joules = read_energy() - joules_before  # this GPU's energy for its share of the tokens
        tokens_per_joule = x.numel() * windows * window / joules
    split, wall, ops = profile_split(lambda: run_steps(1), device)
    peak = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    step_ms = [seconds / window * 1e3 for seconds in window_s]
    compile_s = max(0.0, warmup_s[0] - statistics.median(step_ms) / 1e3)  # past a step's
    # What each technique did, not its flag: the logits' dtype (autocast), whether logits
    # exist beside the loss (the fused classifier), whether the profiled step ran the fused
    # AdamW kernel, an fp32 matmul's error against float64 (TF32 on a GPU: ~1e-3; fp32:
    # ~1e-6), and the bytes the gradient hook sent a step.
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                         enabled=settings["bf16"]):
        logits, _ = raw(x[:1, :8])
        logits_beside_loss, _ = raw(x[:1, :8], x[:1, :8])
    a = torch.randn(256, 256, device=device)
    exact = a.double() @ a.double()
    matmul_error = ((a @ a).double() - exact).norm() / exact.norm()
    acts = dict(logits_dtype=str(logits.dtype),
                logits_written=logits_beside_loss is not None,
                fused_adamw_ran="aten::_fused_adamw_" in ops,
                fp32_matmul_rel_error=matmul_error.item())
    if sent is not None:
        acts["allreduced_bytes_per_step"] = sent["bytes"] / len(losses)
        acts["allreduced_dtype"] = str(sent["dtype"])
    predicted = activation_bytes(model_config(shared.sizes, settings),
                                 len(x) // settings["accum"], bf16=settings["bf16"])
    return dict(settings=settings, world=world, warmup_steps=WARMUP,
                timed_steps=windows * window, profiled_steps=1,
                losses=[float(loss) for loss in losses], step_ms=step_ms,
                compile_s=compile_s, graphs=graphs, peak_memory_bytes=peak,
                tokens_per_joule=tokens_per_joule, profile=split, profile_step_s=wall,
                tokens_per_step=x.numel() * world, acts=acts, activation_bytes=predicted)


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
    """A rung's derived numbers from its raw ones; base: the baseline rung (None: this is
    the baseline)."""
    ms = statistics.median(measured["step_ms"])
    tokens_per_s = measured["tokens_per_step"] / (ms / 1e3)  # all ranks together
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
                unreliable=unreliable, binds=binds, regime=CLASSES[binds][0])


def fmt(value, spec=""):
    """A number, or n/a where this machine cannot measure it; yes/no for a verdict."""
    if value is None:
        return "n/a"
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return format(value, spec)


HEADER = (f"   {'rung':51s} {'ms/step':>8s} {'tokens/s':>10s} {'speed-up':>8s} "
          f"{'MFU(ds)':>7s} {'MFU(meas)':>9s} {'peak GiB':>8s} {'24 GB':>5s} "
          f"{'tokens/J':>8s} {'d(loss)':>7s}  binds: share of a profiled step\n"
          "   (measured: ms, tokens/s, peak memory, tokens/J (NVML), binds; derived: "
          f"speed-up, MFU; d(loss): vs the baseline over its first {EARLY_STEPS} steps)")


def print_row(rung):
    name = rung["name"]
    if not rung["kept"]:
        name += " (dropped)"
    peak_gib = None
    if rung["peak_memory_bytes"] is not None:
        peak_gib = rung["peak_memory_bytes"] / 2**30
    share = rung["profile"][rung["binds"]] / rung["profile_step_s"]
    line = (f"   {name:51s} {rung['ms_per_step']:8.1f} {rung['tokens_per_s']:10,.0f} "
            f"{rung['speedup']:7.2f}x {fmt(rung['mfu_datasheet'], '.1%'):>7} "
            f"{rung['mfu_measured_peak']:9.1%} {fmt(peak_gib, '.1f'):>8} "
            f"{fmt(rung['fits_24gb']):>5} {fmt(rung['tokens_per_joule'], ',.0f'):>8} "
            f"{rung['loss_rel_gap']:7.2%}  {rung['binds']} {share:.0%} ({rung['regime']})")
    if rung["unreliable"]:
        line += "  unreliable (machine busy)"
    print(line, flush=True)

# --- The experiments.


def measure(name, why, settings, shared, timed_steps, base, flops, peaks):
    """Build and train one rung, derive its numbers, print its row: the rung, or None when
    it does not fit this device."""
    print(f"{name}: predicted {why}", flush=True)
    try:
        raw, step, sent = build(settings, shared)
        measured = train(raw, step, sent, settings, shared, timed_steps)
    except torch.OutOfMemoryError:
        print(f"   does not fit: {name} runs out of device memory at this batch")
        return None
    if measured["graphs"]:
        noun = "graph"
        if measured["graphs"] > 1:
            noun = "graphs"
        print(f"   compiled {measured['graphs']} {noun}: {measured['compile_s']:.1f} s "
              "(measured: the first step less a timed one)")
    rung = dict(name=name, why=why, kept=is_kept(name, shared.device.type == "cuda"),
                **derive(measured, base, flops, peaks))
    print_row(rung)
    return rung


def waterfall(shared, flops, peaks):
    """The accumulation check, then each rung on top of what the rungs before it kept;
    under torchrun: the final single-device rung on each GPU alone, then the DDP rungs."""
    gpu = shared.device.type == "cuda"
    error = accumulation_error(shared)
    print(f"measured: gradient accumulated over {BASELINE['accum']} micro-batches vs the "
          f"full batch: relative difference {error:.1e} (tolerance {ACCUM_TOLERANCE:.0e})")
    todo = []
    if shared.world > 1:
        # PREDICTION: alone, each GPU trains the whole batch in `world` micro-batches, each
        # one rank's share: the same math as DDP (the same losses, to rounding), the same
        # work per GPU. DDP's tokens/s over world x this rate leaves what DDP adds: the
        # all-reduce not hidden under backward, each rank's own optimizer step.
        why = f"the batch in {shared.world} micro-batches, one rank's share each"
        final = dict(settings_for(FIRST_DDP, gpu), ddp=False)
        todo.append((ALONE, dict(final, accum=shared.world), why))
    for name, _, why in RUNGS:
        settings = settings_for(name, gpu)
        if shared.world == 1 or settings["ddp"]:
            todo.append((name, settings, why))
    print(HEADER)
    rungs = []
    skipped = {}
    for name, settings, why in todo:
        if settings["ddp"] and shared.world == 1:
            print(f"{name}: predicted {why}\n   skipped: it needs {DDP_HINT}")
            skipped[name] = DDP_HINT
            continue
        timed_steps = shared.sizes.eager_steps
        if settings["compile"]:
            timed_steps = shared.sizes.steps
        base = None
        if rungs:
            base = rungs[0]
        rung = measure(name, why, settings, shared, timed_steps, base, flops, peaks)
        if rung is None:
            skipped[name] = "does not fit"
            continue
        rungs.append(rung)
    checks = dict(accumulated_gradient_equals_full_batch=error <= ACCUM_TOLERANCE,
                  losses_track_baseline=True, time_split_adds_up=True)
    for rung in rungs:
        if rung["loss_rel_gap"] > LOSS_TOLERANCE:
            checks["losses_track_baseline"] = False
        if min(rung["profile"].values()) < 0:
            checks["time_split_adds_up"] = False
    memory = "activation_bytes"  # measured memory on a GPU, else predicted
    if gpu:
        memory = "peak_memory_bytes"
    for rung in rungs:  # checkpointing against the same rung without it
        for before in rungs:
            if rung["settings"]["checkpoint"] and before["settings"] == dict(
                    rung["settings"], checkpoint=False):
                checks["checkpointing_lowers_memory"] = rung[memory] < before[memory]
    for rung in rungs:  # under torchrun: the DDP rungs against world x one GPU alone
        if rung["world"] > 1 and rungs[0]["name"] == ALONE:
            rung["scaling"] = rung["tokens_per_s"] / (shared.world * rungs[0]["tokens_per_s"])
            print(f"derived: {rung['name']}: scaling {rung['scaling']:.1%} of "
                  f"{shared.world} x one GPU alone")
    return dict(rungs=rungs, skipped=skipped, accumulation_rel_diff=error, checks=checks)


def headline(shared, flops, peaks):
    """The chapter's opening claim: the baseline and the final rung trained for the same
    steps from one init on the same batches: loss against step, and against wall-clock."""
    # PREDICTION: the same curve - the first EARLY_STEPS losses within LOSS_TOLERANCE, the
    # smoothed curves within CURVE_TOLERANCE - while the final rung is ~10x faster per step
    # on a GPU, ~1.5x on a CPU; its compile is paid once.
    gpu = shared.device.type == "cuda"
    steps = WINDOW * math.ceil(shared.sizes.headline_steps / WINDOW)  # whole windows:
    print(HEADER)  # both curves have the same steps
    base = measure(BASE, RUNGS[0][2], BASELINE, shared, steps, None, flops, peaks)
    final = None
    if base is not None:
        settings = dict(settings_for(FIRST_DDP, gpu), ddp=False)  # every rung kept
        final = measure("final rung (every rung kept)", "the same curve, ~10x sooner",
                        settings, shared, steps, base, flops, peaks)
    if final is None:
        sys.exit("error: the headline does not fit this device: try a smaller --batch")
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
                  compile_s=final["compile_s"])
    checks = dict(headline_starts_the_same=early <= LOSS_TOLERANCE,
                  headline_same_curve=curve <= CURVE_TOLERANCE)
    return dict(rungs=[base, final], headline=result, checks=checks)


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
    p.add_argument("--quick", action="store_true", help="a toy, a step a rung (the tests)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--out", default="out", help="figure folder")
    p.add_argument("--data", help="a UTF-8 text file (default: the stdlib's sources)")
    p.add_argument("--tokenizer", choices=["auto", "gpt2", "bytes"], default="auto",
                   help="auto: GPT-2 BPE when tiktoken can load it, else UTF-8 bytes")
    p.add_argument("--batch", type=int_in(4, 256), help="sequences per step, a multiple of 4")
    p.add_argument("--steps", type=int_in(1, 200),
                   help="timed steps of a compiled rung (--headline: of each curve)")
    p.add_argument("--headline", action="store_true", help="baseline vs final rung")
    p.add_argument("--interconnect", choices=["default", "staged"], default="default",
                   help="staged: NCCL without peer-to-peer, GPU to GPU via host memory")
    args = p.parse_args(argv)
    if args.batch is not None and args.batch % 4:
        p.error("argument --batch: a multiple of 4 (the first rungs take 4 micro-batches)")
    if args.quick and args.tokenizer == "gpt2":
        p.error("--quick trains a toy vocabulary of UTF-8 bytes: --tokenizer gpt2 needs a "
                "full run")
    if args.headline and "RANK" in os.environ:
        p.error("--headline runs on one device: start it with python, not torchrun")
    return args


def check_paths(args):
    """Before the work: --json a file name, --out a folder; their folders made now, else
    one line and exit 1."""
    folders = [args.out]
    if args.json is not None:
        if args.json == "" or Path(args.json).is_dir():
            sys.exit(f"error: --json {args.json!r}: not a file name")
        folders.append(str(Path(args.json).parent))
    for folder in folders:
        if folder == "":
            sys.exit("error: --out: an empty path")
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            sys.exit(f"error: {folder}: {e.strerror}")
        if not os.access(folder, os.W_OK):
            sys.exit(f"error: {folder}: not writable")


def setup(args):
    """The device (and under torchrun the process group), the sizes, the batches, one init,
    the peaks; the first lines printed. Returns (Shared, peaks, flops per token, facts)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    enough = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if args.device == "cuda" and not enough:
        sys.exit("error: --device cuda: fewer CUDA GPUs here than processes (one GPU each)")
    device = torch.device("cpu")
    if args.device != "cpu" and enough:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if rank:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports; errors still reach stderr
    if world > 1:  # torchrun started this process: a process group for the DDP rungs
        comm = "gloo"
        if device.type == "cuda":
            comm = "nccl"
        if args.interconnect == "staged":  # every GPU-to-GPU byte through host memory
            os.environ["NCCL_P2P_DISABLE"] = "1"
        dist.init_process_group(comm, timeout=timedelta(seconds=120))
    sizes = Sizes()
    if device.type == "cuda":
        sizes = GPU
    if args.quick:
        sizes = QUICK
    if args.batch is not None:
        sizes = replace(sizes, batch=args.batch, headline_batch=args.batch)
    if args.steps is not None:
        sizes = replace(sizes, steps=args.steps, headline_steps=args.steps)
    batch = sizes.batch
    if args.headline:
        batch = sizes.headline_batch
    if batch % world:
        sys.exit(f"error: {batch} sequences per step do not split into {world} shares")
    backend = "inductor"
    if args.quick and device.type == "cpu":  # the tests: dynamo captures the graphs and
        backend = "eager"  # runs them eagerly (inductor's C++ build takes minutes)
    torch._dynamo.reset()  # every run compiles afresh: no graph kept from an earlier run
    name = platform.machine()
    memory = f"{os.cpu_count()} cores"
    dtype = torch.float32
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"
        dtype = torch.bfloat16
    print(f"device: {name}, {memory} | torch {torch.__version__} | python "
          f"{platform.python_version()} | compile backend {backend}")
    choice = args.tokenizer
    if args.quick:  # the toy vocabulary: UTF-8 bytes
        choice = "bytes"
    tokens, tokenizer = load_tokens(args.data, choice, sizes.block_size + 2)
    steps = WARMUP + max(sizes.steps, sizes.eager_steps, sizes.headline_steps) + 1
    batches = []
    for i in range(steps):
        x, y = get_batch(tokens, i, batch, sizes.block_size)
        batches.append((torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)))
    torch.manual_seed(0)  # one init for every rung (the padded vocab; GPT-2's rows a prefix)
    init_state = GPT(model_config(sizes, dict(BASELINE, pad_vocab=True))).state_dict()
    shared = Shared(device, sizes, batches, init_state, backend, rank, world)
    flops = flops_per_token(model_config(sizes, BASELINE))  # GPT-2 as shipped: 50257
    peaks = dict(datasheet=None, measured=None)
    if device.type == "cuda":
        peaks["datasheet"] = datasheet_bf16_peak(name)
    peaks["measured"] = matmul_peak(device, dtype, sizes.peak_size, sizes.peak_samples)
    datasheet_tflops = None
    if peaks["datasheet"] is not None:
        datasheet_tflops = peaks["datasheet"] / 1e12
    print(f"data: {len(tokens):,} tokens ({tokenizer}), {batch} x {sizes.block_size} "
          f"tokens per step; model {sizes.model} ({sizes.n_layer} layers, d={sizes.n_embd})")
    print(f"derived: flops_per_token = 6N + 12LTd = {flops / 1e6:.1f} MFLOP")
    print(f"reference: datasheet dense bf16 peak {fmt(datasheet_tflops)} TFLOP/s (NVIDIA)")
    print(f"measured: {sizes.peak_size} x {sizes.peak_size} {dtype} matmul peak (burst) "
          f"{peaks['measured'] / 1e12:.3g} TFLOP/s")
    if world > 1:
        print(f"interconnect: {args.interconnect} ({world} processes, {dist.get_backend()})")
    facts = dict(device=dict(name=name, type=device.type, memory=memory),
                 framework=dict(torch=torch.__version__, python=platform.python_version()),
                 sizes=asdict(sizes), tokenizer=tokenizer, flops_per_token=flops,
                 tokens_per_step=batch * sizes.block_size, peak_flops=peaks, world=world,
                 interconnect=args.interconnect)
    return shared, peaks, flops, facts


def main(argv=None):
    args = parse_args(argv)
    check_paths(args)
    start = time.perf_counter()
    warnings.filterwarnings("ignore", message=".*dynamo_pgo force disabled")
    warnings.filterwarnings("ignore", message=".*Profiler clears events")  # one a rung
    for name in ("torch._dynamo.variables.torch", "torch._dynamo.variables.ctx_manager"):
        quiet = logging.getLogger(name)  # dynamo ignores the profiler's marks (DDP's): we know
        quiet.addFilter(lambda record: "will be ignored" not in str(record.msg))
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no "USDT" lines around each profile
    torch._inductor.config.force_disable_caches = True  # every compile cold: its time true
    torch._inductor.config.cpp.enable_kernel_profile = True  # CPU kernels named in profiles
    shared, peaks, flops, result = setup(args)
    try:
        if args.headline:
            result.update(headline(shared, flops, peaks))
        else:
            result.update(waterfall(shared, flops, peaks))
    finally:
        if shared.world > 1:
            dist.destroy_process_group()
    result.update(lesson="07_capstone_torch", quick=args.quick,
                  wall_s=time.perf_counter() - start)
    for check, ok in result["checks"].items():
        verdict = "FAILED"
        if ok:
            verdict = "ok"
        print(f"check {check}: {verdict}")
    print(f"wall time: {result['wall_s']:.0f} s")
    if shared.rank == 0:
        if args.headline:
            plot_headline(result, Path(args.out) / "07_capstone_torch_headline.png")
        else:
            plot_waterfall(result["rungs"], Path(args.out) / "07_capstone_torch.png")
    if args.json and shared.rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    failed = [check for check, ok in result["checks"].items() if not ok]
    if failed:
        sys.exit(f"error: check failed: {', '.join(failed)}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
