"""
Section 13.7: the waterfall. GPT-2 124M down the chapter's method, one measured rung per
technique, all from one init on the same batches: the speed changes, the losses must
not. Each rung is timed against the incumbent (every rung kept so far), their steps
interleaved, and kept only when it is faster beyond the spread. Then the final rung on its
own roofline: its step, kernel class by kernel class, against the floor of each class;
the chapter's technique for what the table shows, as one more rung; the table again.

    python 07_capstone_torch.py                 # one GPU: gpt2 (124M, T=1024), ~4 min on an H100
    python 07_capstone_torch.py --memory-gb 24  # the same, as on the book's 24 GB card
    python 07_capstone_torch.py --headline      # baseline vs the final rung found above
    torchrun --standalone --nproc_per_node=2 07_capstone_torch.py [--interconnect staged]
                                  # the final rung on each GPU alone, then DDP
    python 07_capstone_torch.py --device cpu    # the tiny model, ~4 min on 2 idle cores
    python 07_capstone_torch.py --quick         # a toy, seconds (the tests)

Each rung prints its prediction for this kind of device, the memory it is sized for ("4
micro-batches of 16: 13.6 GiB predicted of 21.9 available": the same tokens per step on
every card), then what it measured: ms/step, tokens/s, tokens/J (NVML), speed-up over the
baseline, MFU (6N + 12LTd FLOPs per token over the datasheet's bf16 peak and over this
device's measured matmul peak), its losses against the baseline's, kept or dropped,
whether the prediction held, and where its step goes. The waterfall writes its final rung
to out/07_capstone_torch_final_rung.json, which --headline and torchrun read. Text: --data
FILE (UTF-8), else the Python standard library's sources; GPT-2 BPE tokens when tiktoken
can load them, else UTF-8 bytes. Needs model_torch.py beside it.
"""

import argparse
import contextlib
import gc
import hashlib
import io
import json
import math
import os
import platform
import socket
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from model_torch import GPT, GPTConfig, activation_bytes, datasheet_bf16_peak
from model_torch import floor_seconds, flops_per_token, micro_batches
from model_torch import predicted_peak_bytes, state_bytes, step_floor_terms

# --- The waterfall: every setting a rung can change, then the rungs, in order.

BASELINE = dict(tf32=False, bf16=False, attn="manual", compile=False, fused=False,
                pad_vocab=False, host_sync=True, fused_classifier=False, checkpoint=False,
                bf16_residual=False, ddp=False, bf16_grads=False)
WINDOW = 4  # steps between host syncs once "no host sync per step" is on
RUNGS = [  # (name, what it changes, the regime it targets and why)
    ("fp32 eager", {}, "the baseline: fp32 matmuls in full fp32 (TF32 off), the T x T "
     "attention scores in memory, one kernel per op"),
    ("+ TF32", dict(tf32=True), "compute-bound on the wrong units: fp32 matmuls on TF32 "
     "tensor cores (H100 datasheet: 495 against 67 TFLOP/s); a CPU has none"),
    ("+ bf16 autocast", dict(bf16=True), "compute- and bandwidth-bound: bf16 tensor "
     "cores twice TF32's peak, half the activation bytes, but eager adds casts; a CPU "
     "without bf16 units computes bf16 matmuls slower than fp32"),
    ("+ flash attention (SDPA)", dict(attn="sdpa"), "bandwidth-bound: manual attention "
     "writes and re-reads B x H x T x T scores per layer; the fused kernel never "
     "writes them"),
    ("+ torch.compile", dict(compile=True), "bandwidth- and overhead-bound chains "
     "(LayerNorm, GELU, residual adds, casts, the loss) fuse into few kernels; compile "
     "time paid once"),
    ("+ fused AdamW", dict(fused=True), "overhead and bandwidth: one pass over params, "
     "grads and moments instead of a few kernels per step of the update"),
    ("+ vocab 50304", dict(pad_vocab=True), "compute-bound on ragged tiles: 50304 = "
     "128 x 393 fills the largest matmul's tensor-core tiles; a CPU has no such tiles"),
    ("+ no host sync per step", dict(host_sync=False), "overhead: reading the loss "
     f"every step makes the host wait for the device to drain; every {WINDOW} steps it "
     "runs ahead. A step of ~100 ms hides a gap < 1 ms; on a CPU the host is the device"),
    ("+ fused classifier (logits never written)", dict(fused_classifier=True),
     "memory and bandwidth: the B x T x V logits are formed chunk by chunk, never "
     "whole, so peak memory falls (a larger micro-batch may fit); the same matmuls"),
    ("+ activation checkpointing", dict(checkpoint=True), "a memory fix: each block's "
     "forward runs again in backward, ~18% more FLOPs for GPT-2; it pays only where the "
     "memory it frees lets a larger micro-batch fit"),
    ("+ bf16 residual stream", dict(bf16_residual=True), "bandwidth-bound: under "
     "autocast the residual stream, every LayerNorm's input and every add, moves in "
     "bf16, not fp32"),
    ("+ DDP", dict(ddp=True), "the batch split among the GPUs, the gradient all-reduce "
     "overlapped with backward, bucket by bucket"),
    ("+ bf16 gradient all-reduce", dict(ddp=True, bf16_grads=True), "communication-"
     "bound on a slow link: DDP's hook all-reduces 16-bit gradients, half the bytes"),
]
BASE = "fp32 eager"  # the waterfall's first incumbent
FLOOR_FIX = "+ bf16 residual stream"  # measured after the floor table, predicted from it
ALONE = "final rung, each GPU alone"  # under torchrun: what DDP is measured against
HEADLINE = "final rung (every rung kept)"  # --headline: against the baseline
FLOOR_PREDICTED = dict(gpu=(1.2, 1.6), cpu=(2.0, None))  # the step over its floor
# What each rung should do to the step time, over the incumbent's, on each kind of
# device: (low, high) of the median interleaved ratio. A CPU has no TF32 or bf16 tensor
# cores, no tiles to fill, no device to run ahead of its host: ~1.0x, or slower. "+ DDP":
# the share of world x one GPU alone. A first incumbent (BASE, ALONE): its MFU of the
# measured peak. HEADLINE: over the baseline. FLOOR_FIX: from the floor table.
PREDICTED = {
    BASE: dict(gpu=(0.0, 0.1), cpu=(0.0, 0.6)),
    "+ TF32": dict(gpu=(2.0, 3.0), cpu=(0.9, 1.1)),
    "+ bf16 autocast": dict(gpu=(1.0, 1.5), cpu=(0.02, 0.7)),
    "+ flash attention (SDPA)": dict(gpu=(1.5, 2.5), cpu=(0.8, 1.3)),
    "+ torch.compile": dict(gpu=(1.3, 2.5), cpu=(1.0, 3.0)),
    "+ fused AdamW": dict(gpu=(1.0, 1.05), cpu=(0.95, 1.3)),
    "+ vocab 50304": dict(gpu=(1.0, 1.15), cpu=(0.95, 1.05)),
    "+ no host sync per step": dict(gpu=(1.0, 1.02), cpu=(0.98, 1.02)),
    "+ fused classifier (logits never written)": dict(gpu=(0.95, 1.05), cpu=(0.9, 1.5)),
    "+ activation checkpointing": dict(gpu=(0.7, 0.85), cpu=(0.7, 0.9)),
    ALONE: dict(gpu=(0.3, 0.7), cpu=(0.0, 0.9)),
    "+ DDP": dict(gpu=(0.85, 1.0), cpu=(0.3, 1.0)),
    "+ bf16 gradient all-reduce": dict(gpu=(1.0, 1.1), cpu=(0.9, 1.2)),
    HEADLINE: dict(gpu=(5.0, 20.0), cpu=(1.0, 3.0)),
}
CLASSES = {  # kernel class: words in a GPU kernel's (a CPU op's) name; first match wins
    "communication": ("nccl", "gloo", "allreduce", "all_reduce"),
    "attention": ("flash", "fmha", "sdpa", "scaled_dot_product", "attention"),
    "optimizer": ("adam", "multi_tensor_apply", "foreach"),
    "matmul": ("gemm", "nvjet", "cutlass", "xmma", "splitk", "triton_tem", "aten::mm",
               "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "elementwise/norm/loss": (),  # every other kernel: LayerNorm, GELU, adds, the loss
    "idle": (),  # the step's time with no kernel running: the device waits for the host
}
TECHNIQUE = {  # the chapter's technique for time a class spends above its floor
    "matmul": "bf16 tensor cores and tiles the shapes fill (vocab 50304); past those, "
              "the GEMM library's own efficiency",
    "attention": "flash attention (SDPA); past it, the kernel's own efficiency, which "
                 "is kernel authoring, outside this chapter",
    "elementwise/norm/loss": "fusion (torch.compile) and fewer bytes: logits never "
                             "written, a bf16 residual stream",
    "optimizer": "a fused optimizer (fused AdamW)",
    "communication": "buckets overlapped with backward (DDP), fewer bytes (bf16 "
                     "gradients)",
    "idle": "fewer host syncs and launches (no host sync per step, torch.compile)",
}
COLOURS = {"matmul": "tab:blue", "attention": "tab:orange", "elementwise/norm/loss":
           "tab:purple", "optimizer": "tab:green", "communication": "tab:brown",
           "idle": "lightgray"}
# Training is chaotic. GPT-2 124M on one H200 (16 x 1024 tokens a step, the same batches):
# two TF32 runs, one with its init multiplied by (1 + 1e-6 noise), far below any rounding
# here, agree to ~0.03% for 40 steps, then drift apart: ~1.4% at single steps by step 100,
# ~1% on curves smoothed over 10 steps; bf16 drifts as far, and not always upwards. So a
# loss is checked where chaos has not grown yet, and a whole curve only smoothed:
EARLY_STEPS = 10  # the steps where per-step losses must agree
LOSS_TOLERANCE = 0.0015  # largest relative gap there: honest rounding (fp32, TF32,
# bf16 autocast) stays below ~0.08%; a loss computed on bf16 logits is ~0.27% off, a
# loss scaled wrongly (a micro-step count not divided out) by a factor
SMOOTH = 20  # steps of the moving mean the headline's curves are compared through
CURVE_TOLERANCE = 0.04  # largest relative gap of the smoothed curves: honest runs
# differing by rounding alone or by bf16 stay within ~1.6% over 100 steps; a real change
# of the math (learning rate, data, a wrong gradient) moves them further
ACCUM_TOLERANCE = 1e-4  # accumulated vs full-batch gradient in fp32 (rounding: ~1e-6)
ENERGY_MIN_SECONDS = 1.0  # NVML's energy counter moves in steps of tens of ms: over a
# shorter timed region it reads zero or a fraction of the energy, so tokens/J is left out
BUSY_SHARE = 0.9  # below this share of a core, other programs were taking the CPU
SETTLE_S = 2.0  # seconds of untimed work on a GPU before each timing (see settle): from
# idle its power climbs for ~1 s of work, its clock dips where it first meets the cap
SET_ASIDE_FROM = 6  # timed pairs: from this many on, the keep rule sets the slowest aside
BATCHES = 64  # distinct batches; a longer run goes round them again


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
    eager_pairs: int = 2  # interleaved timings of an eager rung and its incumbent
    compiled_pairs: int = 6  # of a compiled rung (steps of tens of ms, noisier)
    headline_batch: int = 4
    headline_steps: int = 32  # steps of each headline curve, a multiple of WINDOW
    peak_size: int = 1024  # n of the n x n matmuls that measure the peak
    peak_samples: int = 10
    copy_mib: int = 64  # MiB copied to measure the bandwidth


GPU = Sizes(model="gpt2", block_size=1024, n_layer=12, n_head=12, n_embd=768, batch=64,
            eager_pairs=3, headline_batch=16, headline_steps=100, peak_size=8192,
            copy_mib=1024)
QUICK = Sizes(model="toy", block_size=16, n_layer=1, n_head=2, n_embd=32, vocab=4095,
              padded_vocab=4096, eager_pairs=2, compiled_pairs=2, headline_steps=20,
              peak_size=512, peak_samples=3, copy_mib=8)  # UTF-8 bytes; 4096: a row more

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


# --- Measuring, on a machine that may be busy.


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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def burst_seconds(fn, device):
    """Seconds of one call of fn, from a burst of calls lasting >= 5 ms after 100 ms
    idle (01_roofline.py's way: a short kernel timed alone measures its launch, not its
    work)."""
    fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    calls = math.ceil(0.005 / (time.perf_counter() - start))
    time.sleep(0.1)
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls


def measure_roofs(shared):
    """PREDICTION: on an H100 or H200 the bf16 matmul peak near 750-800 TFLOP/s
    (datasheet: 989 dense), the copy near 3-4 TB/s read + written (datasheet: 3.35 and
    4.8 TB/s); a CPU core or two: tens to a few hundred GFLOP/s in fp32, 5-20 GB/s. The
    floors and the MFU against the measured peak divide by these."""
    device = shared.device
    n = shared.sizes.peak_size
    shares = [cpu_share()]
    dtype = torch.float32
    if device.type == "cuda":
        dtype = torch.bfloat16  # the tensor cores' format
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul = []
    for _ in range(shared.sizes.peak_samples):
        matmul.append(2 * n**3 / burst_seconds(lambda: a @ b, device))
    source = torch.empty(shared.sizes.copy_mib * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    copy = []
    for _ in range(shared.sizes.peak_samples):
        seconds = burst_seconds(lambda: target.copy_(source), device)
        copy.append(2 * source.nbytes / seconds)  # read once, written once
    shares.append(cpu_share())
    return dict(busy=min(shares) < BUSY_SHARE, cpu_shares=shares,
                matmul_dtype=str(dtype), matmul_size=n, matmul_samples=matmul,
                matmul_flops=statistics.median(matmul), matmul_flops_best=max(matmul),
                copy_bytes=source.nbytes, copy_samples=copy,
                copy_bytes_per_s=statistics.median(copy), copy_bytes_per_s_best=max(copy))


def report_roofs(roofs, device_name, datasheet_flops):
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
    if datasheet_flops is None:
        print(f"reference: no datasheet row for {device_name}: roofs measured only")
    else:  # NVIDIA's datasheet for this product: dense bf16, no sparsity
        print(f"reference: datasheet dense bf16 peak {datasheet_flops / 1e12:.1f} "
              f"TFLOP/s ({device_name})")


def has_bf16_tensor_cores(device):
    """(True, "") on a CPU (whether bf16 is faster there is measured) and on a GPU of
    compute capability 8.0 (Ampere) or later; (False, why) before it (a T4, a V100)."""
    if device.type != "cuda":
        return True, ""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return False, f"compute capability {major}.{minor} < 8.0: no bf16 tensor cores"
    return True, ""


def energy_meter(device):
    """A function reading this GPU's energy counter in joules (NVML), or None. The GPU is
    found by its UUID, so CUDA_VISIBLE_DEVICES cannot point NVML at another card."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:  # no nvidia-ml-py: no tokens/J
        return None
    try:
        pynvml.nvmlInit()
        uuid = "GPU-" + str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())  # bytes: any binding
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # mJ since the driver loaded
    except pynvml.NVMLError:  # no counter on this GPU (or a MIG slice)
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def kernel_class(name):
    """The first class one of whose words is in the kernel's (op's) name."""
    name = name.lower()
    for cls, words in CLASSES.items():
        for word in words:
            if word in name:
                return cls
    return "elementwise/norm/loss"


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

# --- One configuration: its model, its size, its steps.


@dataclass
class Shared:  # what every configuration uses
    device: torch.device
    sizes: Sizes
    batches: list  # (x, y) pairs on the device: batch i is step i of every configuration
    init_state: dict  # one init for every rung (the padded vocab; GPT-2's rows a prefix)
    backend: str  # torch.compile's
    budget: int  # bytes torch's allocator may use (None: a CPU, nothing sized)
    meter: object  # this GPU's energy in joules (NVML), or None
    flops_per_token: float
    bf16_ok: bool  # bf16 tensor cores (or a CPU, where bf16 is simply measured)
    bf16_why: str
    rank: int = 0
    world: int = 1


@dataclass
class Trainer:
    """One configuration in training: its model and step, the steps it has taken."""
    name: str
    settings: dict
    micro_batches: int
    raw: object  # the GPT itself (evidence runs it directly, uncompiled)
    step: object  # one optimizer step on (x, y); returns the batch's mean loss
    rows: slice  # its rows of each batch (under DDP: this rank's share)
    sent: dict  # the gradient hook's count of bytes sent, or None
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


def accumulate(model, x, y, micro_batches, bf16, no_sync=contextlib.nullcontext):
    """Gradients of the batch's mean loss from `micro_batches` equal micro-batches: each
    micro-batch's mean loss is divided by their count, so their gradients add up to the
    full batch's. Under DDP all but the last skip the all-reduce (no_sync). Returns the
    batch's mean loss."""
    total = torch.zeros((), device=x.device)
    count = micro_batches
    for i, (x_micro, y_micro) in enumerate(zip(x.chunk(count), y.chunk(count))):
        quiet = no_sync
        if i == count - 1:
            quiet = contextlib.nullcontext
        with quiet():
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(x_micro, y_micro)
            (loss / count).backward()
        total += loss.detach() / count
    return total


def accumulation_error(shared, rows=4, count=4):
    """PREDICTION: fp32 rounding, ~1e-6 (the same sums in another order). A step that
    forgot to divide by the micro-batch count would be off by 3x, and AdamW would hide
    it.

    The gradient accumulated over 4 micro-batches vs the full batch's, before any
    optimizer step (fp32 baseline): their relative difference."""
    trainer = build(BASELINE, shared, micro_batches=1)
    x = shared.batches[0][0][:rows]
    y = shared.batches[0][1][:rows]
    grads = []
    for micro in (count, 1):
        accumulate(trainer.raw, x, y, micro, bf16=False)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.raw.parameters()]))
        trainer.raw.zero_grad(set_to_none=True)
    return ((grads[0] - grads[1]).norm() / grads[1].norm()).item()


def report_accumulation(error):
    print(f"measured: gradient accumulated over 4 micro-batches vs the full batch: "
          f"relative difference {error:.1e} (tolerance {ACCUM_TOLERANCE:.0e})")


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


def build(settings, shared, micro_batches, name=""):
    """The configuration at the shared init: its model (compiled, under DDP, with a hook
    as its settings say), its optimizer and its step."""
    config = model_config(shared.sizes, settings)
    with torch.device(shared.device):
        raw = GPT(config)
    state = dict(shared.init_state)
    for key in ("transformer.wte.weight", "lm_head.weight"):  # the tied embedding
        state[key] = state[key][:config.vocab_size]
    raw.load_state_dict(state)
    model = raw
    rows = slice(None)
    no_sync = contextlib.nullcontext
    sent = None
    if settings["ddp"]:  # gradient_as_bucket_view: the gradients live in DDP's buckets
        share = len(shared.batches[0][0]) // shared.world
        rows = slice(shared.rank * share, (shared.rank + 1) * share)
        device_ids = None
        if shared.device.type == "cuda":
            device_ids = [shared.device.index]
        model = DDP(raw, device_ids=device_ids, gradient_as_bucket_view=True)
        no_sync = model.no_sync
    if settings["bf16_grads"]:
        sent = dict(dtype=torch.float16, bytes=0)  # gloo has no bf16: the same bytes
        if shared.device.type == "cuda":
            sent["dtype"] = torch.bfloat16
        model.register_comm_hook(sent, compressed_all_reduce)
    if settings["compile"]:  # static shapes: a new shape compiles anew, never symbolic
        model = torch.compile(model, backend=shared.backend, dynamic=False)
    optimizer = raw.configure_optimizer(lr=6e-4, weight_decay=0.1,
                                        fused=settings["fused"])
    precision = "highest"  # fp32 matmuls in full fp32
    if settings["tf32"]:
        precision = "high"  # fp32 matmuls on TF32 tensor cores

    def step(x, y):
        torch.set_float32_matmul_precision(precision)  # this configuration's, every step
        try:
            loss = accumulate(model, x, y, micro_batches, settings["bf16"], no_sync)
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)  # else they add into the next step's
            raise
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if settings["ddp"]:  # the global batch's mean loss: the mean of the ranks' means
            dist.all_reduce(loss)
            loss = loss / shared.world
        return loss

    return Trainer(name, settings, micro_batches, raw, step, rows, sent)


def run_steps(trainer, count, shared):
    """`count` optimizer steps on the trainer's next batches. The host reads each loss
    after its step (it waits for the device there), or, without host sync, all of them
    after the last. Ends with the device synchronised."""
    pending = []
    for _ in range(count):
        index = (len(trainer.losses) + len(pending)) % len(shared.batches)
        x, y = shared.batches[index]
        loss = trainer.step(x[trainer.rows], y[trainer.rows])
        if trainer.settings["host_sync"]:
            trainer.losses.append(loss.item())
        else:
            pending.append(loss)
    for loss in pending:
        trainer.losses.append(loss.item())
    sync(shared.device)


def size_rung(settings, shared, held, rows):
    """The fewest micro-batches (a divisor of `rows`) whose step fits the memory left
    beside what is `held` (the incumbent, the batches) and beside the weights and AdamW
    moments of the next rung, which it will be timed against (the incumbent steps while
    the candidate's state is alive), by model_torch's predicted peak with its allocator
    headroom; the prediction for one micro-batch; the memory available. A CPU is not
    sized: one micro-batch."""
    config = model_config(shared.sizes, settings)
    if shared.budget is None:
        return 1, predicted_peak_bytes(config, rows, settings["bf16"]), None
    state = state_bytes(config)
    available = shared.budget - held - state["params"] - state["optimizer"]
    count = micro_batches(config, rows, available, settings["bf16"])
    predicted = None
    if count is not None:
        predicted = predicted_peak_bytes(config, rows // count, settings["bf16"])
    return count, predicted, available


def more_micro_batches(rows, count):
    """The next divisor of rows at least twice count, or None."""
    for larger in range(2 * count, rows + 1):
        if rows % larger == 0:
            return larger
    return None


def memory_held(device):
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return 0


def free_memory(device):
    gc.collect()  # compiled modules hold reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def report_memory(count, rows, predicted, available):
    noun = "micro-batches"
    if count == 1:
        noun = "micro-batch"
    gib = predicted / 2**30
    line = f"   memory: {count} {noun} of {rows // count}: {gib:.1f} GiB predicted"
    if available is None:
        line += " (not sized on a CPU)"
    else:
        line += f" of {available / 2**30:.1f} available"
    print(line, flush=True)


def start_rung(name, settings, shared, count, held):
    """Build a configuration and take its first steps, untimed: a compiled one compiles
    in its first (said before it starts) and settles in its second; then one profiled
    step, in which its peak memory (less what was held before it) is read."""
    trainer = build(settings, shared, count, name)
    warmup = 1
    if settings["compile"]:
        warmup = 2
        print("   compiling (the first step) ...", flush=True)
    start = time.perf_counter()
    run_steps(trainer, 1, shared)
    first_step_s = time.perf_counter() - start
    run_steps(trainer, warmup - 1, shared)
    trainer.warmup_steps = warmup
    if shared.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(shared.device)
    split, wall, ops = profile_split(lambda: run_steps(trainer, 1, shared), shared.device)
    trainer.profiled_steps = 1
    peak = None
    if shared.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(shared.device) - held
    started = dict(first_step_s=first_step_s, profile=split, profile_step_s=wall, ops=ops,
                   peak_memory_bytes=peak)
    return trainer, started


def evidence(trainer, ops, shared):
    """What each technique did, not its flag: the logits' dtype (autocast), whether
    logits exist beside the loss (the fused classifier), the residual stream's dtype
    after a block (bf16 residual), whether the profiled step ran the fused AdamW kernel,
    an fp32 matmul's error against float64 (TF32 on a GPU: ~1e-3; fp32: ~1e-6), and the
    bytes the gradient hook sent a step."""
    device = shared.device
    settings = trainer.settings
    x = shared.batches[0][0][:1, :8]
    streams = []
    hook = trainer.raw.transformer.h[0].register_forward_hook(
        lambda module, inputs, output: streams.append(str(output.dtype)))
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                         enabled=settings["bf16"]):
        logits, _ = trainer.raw(x)
        logits_beside_loss, _ = trainer.raw(x, x)
    hook.remove()
    torch.set_float32_matmul_precision("highest")
    if settings["tf32"]:
        torch.set_float32_matmul_precision("high")
    a = torch.randn(256, 256, device=device)
    exact = a.double() @ a.double()
    matmul_error = ((a @ a).double() - exact).norm() / exact.norm()
    acts = dict(logits_dtype=str(logits.dtype),
                logits_written=logits_beside_loss is not None,
                residual_dtype=streams[0], fused_adamw_ran="aten::_fused_adamw_" in ops,
                fp32_matmul_rel_error=matmul_error.item())
    if trainer.sent is not None:
        steps = len(trainer.losses)
        acts["allreduced_bytes_per_step"] = trainer.sent["bytes"] / steps
        acts["allreduced_dtype"] = str(trainer.sent["dtype"])
    return acts

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
    and is already at its working clock: the one step. Under torchrun every rank takes the
    most pairs any rank needs (a DDP step all-reduces)."""
    start = time.perf_counter()
    run_steps(incumbent, 1, shared)  # ends with the device synchronised
    first_s = time.perf_counter() - start
    incumbent.warmup_steps += 1
    if shared.device.type != "cuda":
        return
    pairs = math.ceil(max(SETTLE_S - first_s, 0) / (2 * window * first_s))
    if shared.world > 1:
        agreed = torch.tensor(pairs, device=shared.device)  # NCCL reduces device tensors
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        pairs = int(agreed.item())
    for _ in range(pairs):
        run_steps(incumbent, window, shared)
        run_steps(candidate, window, shared)
    incumbent.warmup_steps += pairs * window
    candidate.warmup_steps += pairs * window


def compare(incumbent, candidate, shared, pairs):
    """The incumbent and the candidate timed interleaved, `pairs` times: one step each, or
    WINDOW steps each where either skips the per-step host sync. First untimed steps (see
    settle): the candidate's compile left the device idle. Under torchrun every rank keeps
    the slowest rank's time of each call, so all ranks decide alike."""
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
    settle(incumbent, candidate, shared, window)
    seconds = interleaved([incumbent_call, candidate_call], pairs)
    shares.append(cpu_share())
    incumbent.timed_steps += pairs * window
    candidate.timed_steps = pairs * window
    busy = min(shares) < BUSY_SHARE
    if shared.world > 1:
        samples = seconds[0] + seconds[1] + [float(busy)]
        agreed = torch.tensor(samples, dtype=torch.float64,
                              device=shared.device)  # NCCL reduces device tensors only
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        seconds = [agreed[:pairs].tolist(), agreed[pairs:2 * pairs].tolist()]
        busy = bool(agreed[-1] > 0)
    incumbent_ms = [s / window * 1e3 for s in seconds[0]]
    candidate_ms = [s / window * 1e3 for s in seconds[1]]
    return dict(incumbent_ms=incumbent_ms, candidate_ms=candidate_ms, window=window,
                busy=busy, cpu_shares=shares)


def tokens_per_joule(trainer, shared, step_ms):
    """This GPU's tokens per joule (NVML's energy counter) over whole steps lasting at
    least ENERGY_MIN_SECONDS, taken after the timed pairs: the counter is never read inside
    a timed step (on an H100 two reads cost milliseconds, as much as two rungs differ).
    None without NVML, and under torchrun (each rank would need the same step count)."""
    if shared.meter is None or shared.world > 1:
        return None
    steps = math.ceil(ENERGY_MIN_SECONDS / (step_ms / 1e3))
    sync(shared.device)
    before = shared.meter()
    run_steps(trainer, steps, shared)  # ends with the device synchronised
    joules = shared.meter() - before
    if joules <= 0:  # the counter did not move: too short a stretch to say
        return None
    tokens = len(shared.batches[0][0][trainer.rows]) * shared.sizes.block_size
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
    ms = statistics.median(step_ms)
    rows = len(shared.batches[0][0][trainer.rows])
    ranks = 1
    if settings["ddp"]:
        ranks = shared.world
    tokens_per_step = rows * shared.sizes.block_size * ranks
    tokens_per_s = tokens_per_step / (ms / 1e3)  # all ranks together
    flops = tokens_per_s * shared.flops_per_token / ranks  # FLOP/s of one device
    mfu_datasheet = None
    if roofs["datasheet_flops"] is not None:
        mfu_datasheet = flops / roofs["datasheet_flops"]
    config = model_config(shared.sizes, settings)
    micro_batch = rows // trainer.micro_batches
    row = dict(name=trainer.name, settings=settings, world=ranks)
    row.update(micro_batches=trainer.micro_batches, micro_batch_size=micro_batch)
    row.update(step_ms=step_ms, incumbent_step_ms=incumbent_ms, ms_per_step=ms)
    row.update(tokens_per_step=tokens_per_step, tokens_per_s=tokens_per_s)
    row["mfu_datasheet"] = mfu_datasheet
    row["mfu_measured_peak"] = flops / roofs["matmul_flops"]
    row["roofs_busy"] = roofs["busy"]  # a busy machine's peak: the MFU is no finding
    row.update(losses=list(trainer.losses), warmup_steps=trainer.warmup_steps,
               profiled_steps=trainer.profiled_steps, timed_steps=trainer.timed_steps)
    row.update(peak_memory_bytes=started["peak_memory_bytes"], profile=started["profile"],
               profile_step_s=started["profile_step_s"])
    row["activation_bytes"] = activation_bytes(config, micro_batch, bf16=settings["bf16"])
    row["acts"] = evidence(trainer, started["ops"], shared)
    row["loss_rel_gap"] = loss_gap(row["losses"], base_losses)
    row["compile_s"] = None
    if settings["compile"]:  # the first step's time past a timed one's
        row["compile_s"] = max(0.0, started["first_step_s"] - ms / 1e3)
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
        print(f"   measured: compile {row['compile_s']:.1f} s (the first step less a "
              "timed one)")
    line = "   derived: "
    if row["ratio"] is not None:
        line += (f"{row['speedup']:.2f}x [{row['speedup_low']:.2f}, "
                 f"{row['speedup_high']:.2f}] over the baseline, ")
    line += "MFU "
    if row["mfu_datasheet"] is not None:
        line += f"{row['mfu_datasheet']:.1%} of the datasheet peak, "
    line += f"{row['mfu_measured_peak']:.1%} of the measured peak"
    if row["roofs_busy"] and not row["busy"]:
        line += " (the peak measured on a busy machine)"
    line += f"; losses within {row['loss_rel_gap']:.3%} of the baseline's{busy}"
    print(line)
    step = row["profile_step_s"]
    shares = []
    for cls, seconds in sorted(row["profile"].items(), key=lambda item: -item[1]):
        if seconds >= 0.005 * step:
            shares.append(f"{cls} {seconds / step:.0%}")
    print(f"   measured: one profiled step, {step * 1e3:.1f} ms: {', '.join(shares)}")
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
    if shared.device.type == "cuda":
        return "gpu"
    return "cpu"


def skip_reason(settings, shared):
    """Why this machine cannot run a configuration, or None."""
    if (settings["ddp"] or settings["bf16_grads"]) and shared.world == 1:
        return ("it needs one process per GPU: torchrun --standalone --nproc_per_node=2 "
                "07_capstone_torch.py (CPU ranks: --device cpu)")
    if settings["bf16"] and not shared.bf16_ok:
        return shared.bf16_why
    if settings["bf16_residual"] and not settings["bf16"]:
        return "without bf16 autocast (dropped above) the residual stream is fp32 anyway"
    return None


def floor_ms(settings, micro_batches, tokens, shared, roofs):
    """Each class's floor in ms for a configuration (model_torch's accounting at the best
    measured roofs: the floors are lower bounds)."""
    config = model_config(shared.sizes, settings)
    terms = step_floor_terms(config, tokens, settings["bf16"], micro_batches)
    peak = roofs["matmul_flops_best"]
    bandwidth = roofs["copy_bytes_per_s_best"]
    seconds = floor_seconds(terms, peak, bandwidth)
    return {cls: s * 1e3 for cls, s in seconds.items()}


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
    if name in (BASE, ALONE):
        return (low, high), f"{where} MFU {low:.0%}-{high:.0%} of the measured peak"
    if name == "+ DDP":  # a share of world x one GPU alone
        low = low * shared.world
        high = high * shared.world
    return (low, high), f"{where} {low:.2f}-{high:.2f}x over the incumbent"


def predict_from_floor(floor, settings, shared, roofs):
    """A change predicted from the floor table: each class's floor now and with the
    change; the time saved at the floor, and at the rate each class runs now (measured /
    floor). The speed-up expected over the step: from half the first to one and a half
    times the second."""
    micro = floor["micro_batches"]
    tokens = floor["tokens"]
    before = floor_ms(floor["settings"], micro, tokens, shared, roofs)
    after = floor_ms(settings, micro, tokens, shared, roofs)
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
    """The candidate sized, started and timed against the incumbent. Out of memory: the
    prediction missed; twice the micro-batches, and again. Returns (the candidate, what
    its start measured, the timing), or None when one sequence at a time does not fit."""
    rows = len(shared.batches[0][0][incumbent.rows])
    if settings["ddp"] and not incumbent.settings["ddp"]:
        rows = rows // shared.world
        # dynamo would run the graph it compiled for the model alone, without DDP's split
        # at bucket boundaries that lets each bucket's all-reduce start during backward
        torch.compiler.reset()
    held = memory_held(shared.device)
    count, predicted, available = size_rung(settings, shared, held, rows)
    while count is not None:
        report_memory(count, rows, predicted, available)
        try:
            candidate, started = start_rung(name, settings, shared, count, held)
            timing = compare(incumbent, candidate, shared, pairs)
            return candidate, started, timing
        except torch.OutOfMemoryError:  # the exception holds the candidate's memory:
            candidate = started = None  # freed once it is gone (and these, if compare ran)
        free_memory(shared.device)
        larger = more_micro_batches(rows, count)
        said = f"   prediction missed: out of memory with {count} micro-batches"
        if larger is None:
            print(f"{said}: it does not fit this device")
        else:
            print(f"{said}; trying {larger}")
        count = larger
        if count is not None:
            predicted = predicted_peak_bytes(model_config(shared.sizes, settings),
                                             rows // count, settings["bf16"])
    return None


def start_first(name, why, settings, shared, roofs, count=None):
    """The first incumbent (the baseline; under torchrun the final rung alone): predicted,
    sized beside the batches, started; it is timed beside the first rung."""
    predicted, words = predict(name, settings, shared, roofs, None)
    print(f"{name}: predicted: {words} ({why})", flush=True)
    rows = len(shared.batches[0][0])
    free_memory(shared.device)  # the accumulation check's model
    held = memory_held(shared.device)
    sized, estimate, available = size_rung(settings, shared, held, rows)
    if count is None:
        count = sized
    if count is None:
        sys.exit(f"error: {name} does not fit this device with one sequence per "
                 "micro-batch: try a smaller --batch")
    report_memory(count, rows, estimate, available)
    trainer, started = start_rung(name, settings, shared, count, held)
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


def row_of(rows, name):
    """The row of the rung called `name`."""
    for row in rows:
        if row["name"] == name:
            return row
    raise KeyError(name)


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
            count = shared.sizes.eager_pairs
            if settings["compile"]:
                count = shared.sizes.compiled_pairs
        measured = next_rung(name, settings, incumbent, shared, count)
        if measured is None:
            skipped[name] = "does not fit this device"
            continue
        candidate, candidate_started, timing = measured
        if not rows:
            rows.append(first_row(incumbent, started, timing, shared, roofs))
            print(f"{name}:")
        incumbent_row = row_of(rows, incumbent.name)
        row = derive(candidate, candidate_started, timing["candidate_ms"],
                     timing["incumbent_ms"], incumbent_row, rows[0]["losses"], shared,
                     roofs)
        ratio = ratio_summary(timing["incumbent_ms"], timing["candidate_ms"])
        kept, verdict = decide(ratio, timing["busy"])
        if not judge:
            verdict = (f"timed against {incumbent.name}: {ratio['ratio']:.2f}x "
                       f"[{ratio['low']:.2f}, {ratio['high']:.2f}] faster per step")
        if row["micro_batch_size"] != incumbent_row["micro_batch_size"]:
            verdict += (f", in micro-batches of {row['micro_batch_size']} where the "
                        f"incumbent's are {incumbent_row['micro_batch_size']}")
        row.update(why=why, kept=kept, verdict=verdict, busy=timing["busy"])
        row["cpu_shares"] = timing["cpu_shares"]
        row["tokens_per_joule"] = tokens_per_joule(candidate, shared, row["ms_per_step"])
        row["predicted"] = list(predicted)
        row["prediction_held"] = predicted[0] <= ratio["ratio"] <= predicted[1]
        report_rung(row)
        rows.append(row)
        if kept:
            retire(incumbent)
            incumbent = candidate
        candidate = None
        measured = None
        free_memory(shared.device)  # the loser's memory, before the next rung is sized
    return incumbent


def retire(trainer):
    """Drop a replaced incumbent's model and step (its optimizer lives in the step): a
    caller may still hold the Trainer for its name and losses, but not its memory."""
    trainer.raw = None
    trainer.step = None


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


def step_floor(trainer, timed_ms, shared, roofs):
    """PREDICTION: on a GPU the matmuls within ~1.2x of their floor, the
    elementwise/norm/loss kernels within ~2x of theirs, attention further (its kernels
    reach a fraction of the matmul roof at head size 64), idle near 0: the step 1.2-1.6x
    its floor. A CPU runs far above every floor, over 2x: op-by-op overhead and kernels
    made for no particular shape.

    The final rung on its own roofline: one profiled step, kernel class by kernel class,
    against each class's floor (model_torch.step_floor_terms: its FLOPs at the best
    measured matmul burst or its bytes at the best measured copy, whichever is longer)."""
    shares = [cpu_share()]
    # The later rungs' memory came and went: an untimed step gets the allocator this
    # rung's back, so the profiled step does not pay for it; on a GPU more, to settle.
    settle(trainer, trainer, shared, 1)
    split, wall, _ = profile_split(lambda: run_steps(trainer, 1, shared), shared.device)
    shares.append(cpu_share())
    trainer.profiled_steps += 1
    tokens = len(shared.batches[0][0][trainer.rows]) * shared.sizes.block_size
    config = model_config(shared.sizes, trainer.settings)
    bf16 = trainer.settings["bf16"]
    terms = step_floor_terms(config, tokens, bf16, trainer.micro_batches)
    floors = floor_ms(trainer.settings, trainer.micro_batches, tokens, shared, roofs)
    classes = {}
    for cls in CLASSES:
        term = terms.get(cls, dict(flops=0, bytes=0))  # communication, idle: no floor
        compute_s = term["flops"] / roofs["matmul_flops_best"]
        memory_s = term["bytes"] / roofs["copy_bytes_per_s_best"]
        regime = None  # the floor's: which of its two terms is longer
        if cls == "idle":
            regime = "overhead-bound"
        elif compute_s > memory_s:
            regime = "compute-bound"
        elif memory_s > 0:
            regime = "bandwidth-bound"
        classes[cls] = dict(measured_ms=split[cls] * 1e3, floor_ms=floors.get(cls, 0.0),
                            flops=term["flops"], bytes=term["bytes"], regime=regime)
    excess = {cls: c["measured_ms"] - c["floor_ms"] for cls, c in classes.items()}
    largest = max(excess, key=excess.get)
    busy = roofs["busy"] or min(shares) < BUSY_SHARE  # the roofs or the step slowed
    # A floor bounds its class only where its bytes come from memory at the copy's rate:
    # a GPU's L2 (tens of MB) is small beside these classes' GBs; a CPU's caches can hold
    # a small model's optimizer state and beat its own copy. A busy machine measures low
    # roofs. Either way the floors are estimates, not bounds: nothing to check then.
    checked = False
    if shared.device.type == "cuda" and not busy:
        checked = True
    low, high = FLOOR_PREDICTED[device_kind(shared)]
    step_ms = wall * 1e3
    floor_total = sum(c["floor_ms"] for c in classes.values())
    held = low <= step_ms / floor_total
    if high is not None:
        held = held and step_ms / floor_total <= high
    return dict(rung=trainer.name, timed_ms=timed_ms, busy=busy, checked=checked,
                cpu_shares=shares,
                predicted=[low, high], prediction_held=held,
                settings=trainer.settings, tokens=tokens,
                micro_batches=trainer.micro_batches, step_ms=step_ms,
                floor_ms=floor_total,
                matmul_flops=roofs["matmul_flops_best"],
                copy_bytes_per_s=roofs["copy_bytes_per_s_best"], classes=classes,
                largest_excess=largest, technique=TECHNIQUE[largest])


def report_floor(floor):
    low, high = floor["predicted"]
    expected = f"over {low:g}x"
    if high is not None:
        expected = f"{low:g}-{high:g}x"
    print(f"the floor table: predicted: the step {expected} its floor on this kind of "
          "device")
    print(f"{floor['rung']} on its own roofline: one profiled step of "
          f"{floor['step_ms']:.1f} ms (measured; its timed steps' median "
          f"{floor['timed_ms']:.1f} ms), class by class against its floor (derived)")
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
    if floor["busy"]:
        print("   (machine busy: the roofs or this step were slowed by other programs: "
              "the ratios are not findings)")
    if not floor["checked"]:
        print("   (no floor is checked against its time here: on a busy machine, or a "
              "CPU whose caches can beat its copy, a floor is an estimate, not a bound)")
    largest = floor["largest_excess"]
    worst = floor["classes"][largest]
    above = worst["measured_ms"] - worst["floor_ms"]
    mark = busy_mark(floor["busy"])
    print(f"derived: the step is {total:.2f}x its floor; {largest} is furthest above its "
          f"floor ({above:.1f} ms): the chapter's technique for it: {floor['technique']}"
          f"{mark}")
    below = floor_below_measured(floor)
    if floor["checked"] and below:
        print("derived: every class took at least its floor, as a lower bound must")
    if floor["checked"] and not below:
        print("derived: a class ran faster than its floor: it beat the measured roof, or "
              "the count of its FLOPs or bytes is too high (not a failed run: a timing)")
    held = "held"
    if not floor["prediction_held"]:
        held = "missed"
    print(f"prediction {held}: the step {expected} its floor, measured {total:.2f}x{mark}")


def floor_below_measured(floor):
    """Every floor at or below its measured time. A floor above it means its class beat
    the roofs measured for this run, or a count is wrong: reported, never a failed run,
    since both sides are timings."""
    for c in floor["classes"].values():
        if c["floor_ms"] > c["measured_ms"]:
            return False
    return True


def single_device(shared, roofs):
    """PREDICTION: each rung as PREDICTED says for this kind of device, printed before
    it runs; on a GPU the final rung ~10x the baseline's tokens/s, on a CPU 1-3x.

    The waterfall on one device: the baseline, every rung against the incumbent, the
    final rung on its own roofline, the rung its floor table predicts, the table again."""
    rows = []
    skipped = {}
    name, _, why = RUNGS[0]
    incumbent, started = start_first(name, why, BASELINE, shared, roofs)
    fix = [entry[0] for entry in RUNGS].index(FLOOR_FIX)
    incumbent = descend(incumbent, started, RUNGS[1:fix], shared, roofs, rows, skipped)
    timed_ms = row_of(rows, incumbent.name)["ms_per_step"]
    floors = [step_floor(incumbent, timed_ms, shared, roofs)]
    report_floor(floors[0])
    final = incumbent.name
    incumbent = descend(incumbent, None, RUNGS[fix:], shared, roofs, rows, skipped,
                        floor=floors[0])
    if incumbent.name != final:  # the fix was kept: the table again, re-measured
        timed_ms = row_of(rows, incumbent.name)["ms_per_step"]
        floors.append(step_floor(incumbent, timed_ms, shared, roofs))
        report_floor(floors[-1])
    for floor in floors:
        row_of(rows, floor["rung"])["floor"] = floor
    report_waterfall(rows)
    checks = dict(losses_track_baseline=True, time_split_adds_up=True)
    for row in rows:
        if row["loss_rel_gap"] > LOSS_TOLERANCE:
            checks["losses_track_baseline"] = False
        if min(row["profile"].values()) < 0:
            checks["time_split_adds_up"] = False
    for row, before in zip(rows[1:], rows):
        if row["settings"]["checkpoint"] and not before["settings"]["checkpoint"]:
            plain = dict(row["settings"], checkpoint=False)
            config = model_config(shared.sizes, plain)
            micro_batch = row["micro_batch_size"]
            without = activation_bytes(config, micro_batch, bf16=plain["bf16"])
            checks["checkpointing_lowers_memory"] = row["activation_bytes"] < without
    return dict(rungs=rows, skipped=skipped, final_rung=incumbent.name, checks=checks)


def headline(shared, final_settings, roofs):
    """PREDICTION: the same curve - the first EARLY_STEPS losses within LOSS_TOLERANCE,
    the smoothed curves within CURVE_TOLERANCE - while the final rung is 5-20x faster per
    step on a GPU, 1-3x on a CPU; its compile is paid once, before the timed steps.

    The chapter's opening claim: the baseline and the final rung trained for the same
    steps from one init on the same batches, interleaved: one loss curve against step,
    an order of magnitude apart against wall-clock."""
    rows = []
    name, _, why = RUNGS[0]
    base, started = start_first(name, why, BASELINE, shared, roofs)
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
                  headline_same_curve=curve <= CURVE_TOLERANCE)
    return dict(rungs=rows, headline=result, checks=checks)


def data_parallel(shared, final_settings, roofs):
    """PREDICTION (PREDICTED["+ DDP"]): over NVLink DDP reaches 85-100% of world x one
    GPU alone, the all-reduce hidden under backward; staged through host memory less; on
    CPU ranks (gloo) 30-100%. 16-bit gradients: ~1.0x on NVLink, a few % staged.

    Under torchrun: the final rung on each GPU alone, the whole batch in world times the
    micro-batches of one rank's share (the same work per GPU as DDP, the same losses to
    rounding), then DDP, then 16-bit gradients. DDP's tokens/s over world x one GPU alone
    leaves what DDP adds: the all-reduce not hidden under backward."""
    rows = []
    skipped = {}
    share = len(shared.batches[0][0]) // shared.world
    held = memory_held(shared.device)
    count, _, _ = size_rung(final_settings, shared, held, share)
    why = f"the batch in {shared.world} x the micro-batches of one rank's share"
    alone, started = start_first(ALONE, why, final_settings, shared, roofs,
                                 count=count * shared.world)
    entries = []
    for entry in RUNGS:
        if entry[0] in ("+ DDP", "+ bf16 gradient all-reduce"):
            entries.append(entry)
    descend(alone, started, entries, shared, roofs, rows, skipped)
    for row in rows[1:]:  # against world x one GPU alone
        row["scaling"] = row["speedup"] / shared.world
        row["scaling_low"] = row["speedup_low"] / shared.world
        row["scaling_high"] = row["speedup_high"] / shared.world
        print(f"derived: {row['name']}: scaling {row['scaling']:.1%} "
              f"[{row['scaling_low']:.1%}, {row['scaling_high']:.1%}] of "
              f"{shared.world} x one GPU alone")
    checks = dict(losses_track_baseline=True, time_split_adds_up=True)
    for row in rows:
        if row["loss_rel_gap"] > LOSS_TOLERANCE:
            checks["losses_track_baseline"] = False
        if min(row["profile"].values()) < 0:
            checks["time_split_adds_up"] = False
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

def report_run(result):
    """The run's verdicts: every prediction held or missed, the machine busy or not (with
    what it slowed), every check."""
    roofs = result["roofs"]
    shares = list(roofs["cpu_shares"])
    busy = []
    if roofs["busy"]:
        busy.append("the roofs")
    predictions = {}
    for row in result["rungs"]:
        predictions[row["name"]] = row["prediction_held"]
        shares += row["cpu_shares"]
        if row["busy"]:
            busy.append(row["name"])
        if "floor" in row:
            held = row["floor"]["prediction_held"]
            predictions[f"the floor table of {row['name']}"] = held
            shares += row["floor"]["cpu_shares"]
            if row["floor"]["busy"]:
                busy.append(f"the floor table of {row['name']}")
    result.update(predictions=predictions, cpu_shares=shares, machine_busy=bool(busy))
    for check, ok in result["checks"].items():
        verdict = "FAILED"
        if ok:
            verdict = "ok"
        print(f"check {check}: {verdict}")
    if busy:
        print(f"machine busy: other programs took the CPU during {', '.join(busy)}; the "
              "marked numbers are not findings")


def main():
    args = parse_args()
    json_file = None
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        json_file = open(args.json, "w")  # a path that cannot be written fails here
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no kineto log lines at each profile
    shared, result = setup(args)
    final_settings = None
    if args.headline or shared.world > 1:
        final_settings = read_final_rung(args.out)
    try:
        roofs = measure_roofs(shared)
        roofs["datasheet_flops"] = result["device"]["datasheet_flops"]
        report_roofs(roofs, result["device"]["name"], roofs["datasheet_flops"])
        error = accumulation_error(shared)
        report_accumulation(error)
        if args.headline:
            result.update(headline(shared, final_settings, roofs))
        elif shared.world > 1:
            result.update(data_parallel(shared, final_settings, roofs))
        else:
            result.update(single_device(shared, roofs))
    finally:
        if shared.world > 1:
            dist.destroy_process_group()
    result.update(roofs=roofs, accumulation_rel_diff=error)
    result["checks"]["accumulated_gradient_equals_full_batch"] = error <= ACCUM_TOLERANCE
    report_run(result)
    result["wall_s"] = time.perf_counter() - start
    print(f"wall time: {result['wall_s']:.0f} s")
    if shared.rank == 0:
        if args.headline:
            plot_headline(result, args.out / "07_capstone_torch_headline.png")
        elif shared.world > 1:
            plot_waterfall(result["rungs"], args.out / "07_capstone_torch_ddp.png")
        else:
            plot_waterfall(result["rungs"], args.out / "07_capstone_torch.png")
            write_final_rung(args.out, result)
    if json_file is not None:
        if shared.rank == 0:
            json.dump(result, json_file, indent=1)
        json_file.close()
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed:
        sys.exit(f"check failed: {', '.join(failed)}")

# --- Flags, the machine, the final rung's file.


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
                        help="as on a card of this many GiB: torch's allocator capped")
    parser.add_argument("--headline", action="store_true",
                        help="the baseline against the final rung of the last waterfall")
    parser.add_argument("--interconnect", choices=["default", "staged"],
                        default="default",
                        help="staged: NCCL without peer-to-peer, via host memory")
    # rank 0 prints a bad flag's message; the others exit 2 quietly
    if int(os.environ.get("RANK", "0")) > 0:
        with contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args()
    else:
        args = parser.parse_args()
    if args.quick and args.tokenizer == "gpt2":
        parser.error("--quick trains a toy vocabulary of UTF-8 bytes: --tokenizer gpt2 "
                     "needs a full run")
    if args.headline and "RANK" in os.environ:
        parser.error("--headline runs on one device: start it with python, not torchrun")
    return args


def memory_budget(device, gib):
    """Bytes torch's allocator may use: on a GPU its free memory (the CUDA context and
    other programs already hold the rest); with --memory-gb N, N GiB less what is held,
    the allocator capped there, as on an N GiB card. A CPU: None (nothing sized), or N
    GiB."""
    if device.type != "cuda":
        if gib is None:
            return None
        return gib * 2**30
    free, total = torch.cuda.mem_get_info(device)
    if gib is None:
        return free
    budget = min(free, gib * 2**30 - (total - free))
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    return budget


def setup(args):
    """The device (and under torchrun the process group), the sizes, the batches, one
    init, the memory budget; the first lines printed. Returns (Shared, the run's facts)."""
    # Two rungs step in turn on one GPU. In expandable segments, one rung's freed
    # activations serve the other's tensors of other sizes; in fixed segments, once both
    # peaks together pass the card, the allocator hands its cache back to the driver (a
    # wait for the whole device) at every switch. Set before torch's first CUDA tensor;
    # a reader's own setting (either name) stands.
    if not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    enough = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if args.device == "cuda" and not enough:
        sys.exit("error: --device cuda: fewer CUDA GPUs here than processes (one "
                 "GPU each)")
    device = torch.device("cpu")
    if args.device != "cpu" and enough:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if rank > 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports; errors still reach stderr
    if world > 1:  # torchrun started this process: a process group for the DDP rungs
        backend = "gloo"
        if device.type == "cuda":
            backend = "nccl"
        if args.interconnect == "staged":  # every GPU-to-GPU byte through host memory
            os.environ["NCCL_P2P_DISABLE"] = "1"
        dist.init_process_group(backend, timeout=timedelta(seconds=300))
    sizes = Sizes()
    if device.type == "cuda":
        sizes = GPU
    if args.quick:
        sizes = QUICK
    if args.batch is not None:
        sizes = replace(sizes, batch=args.batch, headline_batch=args.batch)
    batch = sizes.batch
    if args.headline:
        batch = sizes.headline_batch
    if batch % world:
        sys.exit(f"error: {batch} sequences per step do not split into {world} shares")
    compiler = "inductor"
    if args.quick and device.type == "cpu":  # the tests: dynamo captures the graphs and
        compiler = "eager"  # runs them eagerly (inductor's C++ build takes minutes)
    facts = describe_machine(device, compiler, args, world)
    budget = memory_budget(device, args.memory_gb)
    describe_memory(device, facts["device"]["memory_bytes"], budget, args.memory_gb)
    bf16_ok, bf16_why = has_bf16_tensor_cores(device)
    if not bf16_ok:
        print(f"bf16: {bf16_why}: the bf16 rungs are skipped")
    choice = args.tokenizer
    if args.quick:  # the toy vocabulary: UTF-8 bytes
        choice = "bytes"
    tokens, tokenizer = load_tokens(args.data, choice, sizes.block_size + 2)
    batches = []
    for i in range(max(BATCHES, sizes.headline_steps + 8)):
        x, y = get_batch(tokens, i, batch, sizes.block_size)
        batches.append((torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)))
    torch.manual_seed(0)  # one init for every rung (padded vocab; GPT-2's rows a prefix)
    init_state = GPT(model_config(sizes, dict(BASELINE, pad_vocab=True))).state_dict()
    flops = flops_per_token(model_config(sizes, BASELINE))  # GPT-2 as shipped: 50257
    shared = Shared(device, sizes, batches, init_state, compiler, budget,
                    energy_meter(device), flops, bf16_ok, bf16_why, rank, world)
    print(f"data: {len(tokens):,} tokens ({tokenizer}), {batch} x {sizes.block_size} "
          f"tokens per optimizer step on every card; model {sizes.model} "
          f"({sizes.n_layer} layers, d={sizes.n_embd})")
    print(f"derived: flops_per_token = 6N + 12LTd = {flops / 1e6:.1f} MFLOP")
    facts.update(sizes=asdict(sizes), tokenizer=tokenizer, flops_per_token=flops,
                 tokens_per_step=batch * sizes.block_size, memory_budget_bytes=budget)
    return shared, facts


def describe_machine(device, compiler, args, world):
    """The first line: the device, the frameworks; the run's facts for the JSON."""
    name = platform.machine()
    memory = None
    capability = None
    datasheet_flops = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
        capability = list(torch.cuda.get_device_capability(device))
        datasheet_flops = datasheet_bf16_peak(name)
    python = platform.python_version()
    print(f"device: {name} | torch {torch.__version__} | python {python} | compile "
          f"backend {compiler}")
    if world > 1:
        print(f"interconnect: {args.interconnect} ({world} processes, "
              f"{dist.get_backend()})")
    return dict(lesson="07_capstone_torch", quick=args.quick,
                device=dict(name=name, type=device.type, memory_bytes=memory,
                            capability=capability, datasheet_flops=datasheet_flops),
                framework=dict(torch=torch.__version__, python=python),
                world=world, interconnect=args.interconnect)


def describe_memory(device, memory, budget, gib):
    if device.type != "cuda":
        if budget is None:
            print("memory: a CPU: one micro-batch a step (--memory-gb N sizes for N GiB)")
        else:
            print(f"memory: sized for {gib} GiB (--memory-gb; a CPU's allocator is not "
                  "capped)")
        return
    if gib is None:
        print(f"memory: {memory / 2**30:.1f} GiB card, {budget / 2**30:.1f} GiB free "
              "for this run: each rung's micro-batches sized for it")
    else:
        print(f"memory: as on a {gib} GiB card: torch's allocator capped at "
              f"{budget / 2**30:.1f} GiB ({gib} less what the CUDA context holds)")
    name = "PYTORCH_ALLOC_CONF"
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        name = "PYTORCH_CUDA_ALLOC_CONF"
    print(f"memory: torch's allocator asked for {os.environ[name]} ({name})")


def write_final_rung(out, result):
    """The final rung's settings, for --headline and torchrun to read."""
    [row] = [row for row in result["rungs"] if row["name"] == result["final_rung"]]
    path = out / "07_capstone_torch_final_rung.json"
    with open(path, "w") as f:
        json.dump(dict(rung=row["name"], settings=row["settings"],
                       device=result["device"]["name"]), f, indent=1)
    print(f"final rung: {row['name']} (its settings in {path})")


def read_final_rung(out):
    """The settings of the last waterfall's final rung, from --out."""
    path = out / "07_capstone_torch_final_rung.json"
    if not path.is_file():
        sys.exit(f"error: {path}: no final rung yet: run the waterfall first "
                 f"(python 07_capstone_torch.py --out {out})")
    saved = json.loads(path.read_text())
    print(f"final rung: {saved['rung']}, as the waterfall on {saved['device']} found it "
          f"({path})")
    settings = dict(BASELINE)
    settings.update(saved["settings"])
    settings["ddp"] = False
    settings["bf16_grads"] = False
    return settings


if __name__ == "__main__":
    main()
