"""02_hardware.py - Section 13.2: where the roofline's two numbers come from.

The peak FLOP/s and the bandwidth of Section 13.1, measured here, in the section's order:
1. read bandwidth from KB to GB working sets: the cache cliffs (out/02_hardware.png);
2. the format ladder, fp32 to fp8: FLOP/s, error against float64, each format's facts;
3. host <-> device copies, pageable and pinned; GPU -> GPU, direct and staged;
4. energy per FLOP and per byte (NVML) beside Horowitz's per-operation references;
5. a GPT-2 linear layer from 1 to 8192 tokens (prefill vs decode), then a real batch-1
   decode step of GPT-2 with a KV cache against its bandwidth ceiling;
6. this machine beside the datasheets of the RTX 4090, A100, H100 and H200.

Copy it with model_torch.py. Run: python 02_hardware.py (a GPU, or a 2-core CPU: about a
minute; with two GPUs visible, part 3 copies between them); --quick --device cpu: seconds.
Every number is labelled measured, derived or reference; a failed self-check (an error
against float64, the KV-cache decode, a peer copy's bytes) exits non-zero.
"""

import os
import signal
import sys


def interrupted(signum, frame):
    """Ctrl-C at any moment, even while torch is still importing: one line, exit 130."""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted)

import argparse
import json
import math
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

try:  # first: a missing file is said at once, not after torch has imported
    from model_torch import GPT, GPTConfig, param_count
except ModuleNotFoundError as missing:
    if missing.name != "model_torch":
        raise
    sys.exit("error: 02_hardware.py needs model_torch.py: copy it into the same folder")
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# Datasheets, dense, never measurements (NVIDIA's A100, H100 and H200 datasheets; the Ada
# whitepaper for the RTX 4090). Columns: TFLOP/s in bf16, tf32, fp8 and fp32 (all with
# fp32 accumulation), memory TB/s, L2 MB, the GPU-to-GPU link.
REFERENCE_ROWS = {
    "RTX 4090 (ref.)": (165, 82.6, 330, 82.6, 1.01, 72, "PCIe 4.0 x16, no P2P"),
    "A100 SXM 80GB (ref.)": (312, 156, None, 19.5, 2.0, 40, "NVLink 600 GB/s"),
    "H100 SXM (ref.)": (989, 495, 1979, 67, 3.35, 50, "NVLink 900 GB/s"),
    "H200 SXM (ref.)": (989, 495, 1979, 67, 4.8, 50, "NVLink 900 GB/s"),
}

# Energies at 45 nm in pJ (Horowitz, ISSCC 2014); an FMA is 2 FLOPs, a 64-bit word 8 bytes.
HOROWITZ_PJ = {
    "fp16 FMA, per FLOP": 1.5 / 2,
    "fp32 FMA, per FLOP": 4.6 / 2,
    "8 KB cache read, per byte": 10 / 8,
    "1 MB cache read, per byte": 100 / 8,
    "DRAM read, per byte (low)": 1300 / 8,
    "DRAM read, per byte (high)": 2600 / 8,
}

# The ladder, most bits first (tf32 is fp32 storage multiplied on tensor cores).
FORMATS = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
           "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# The largest relative error against float64 each format may show: a few times what it
# showed on a CPU and an H200. Each bound catches the rung below it computed in its place
# (fp32 done in tf32 shows ~3e-4, tf32 or fp16 done in bf16 ~3e-3, bf16 done in fp8 ~4e-2).
ERROR_BOUND = {"fp32": 1e-5, "tf32": 1e-3, "fp16": 1e-3, "bf16": 1e-2, "fp8": 1e-1}
# The decode step's fp32 logits against the full forward: a cache slot off by one, a wrong
# position or a causal mask on the one new token move them by far more than this.
DECODE_BOUND = 1e-4
BURST_GAP_S = 0.1  # GPU: idle this long before each tensor-core sample, so it is a burst
CPU = torch.device("cpu")

@dataclass(frozen=True)
class Sizes:
    """A 2-core CPU's sizes (about a minute in all); GPU and QUICK name what differs."""
    dtype: torch.dtype = torch.float32  # 5: the layer's and the decode step's format
    reps: int = 3                       # timed samples of each measurement
    largest_set: int = 512 << 20        # 1: the largest working set, bytes
    bytes_a_sample: int = 256 << 20     # 1: bytes read in one timed sample
    ladder_n: int = 512                 # 2: the matmuls are (n x n) @ (n x n)
    emulated_fp8_n: int = 128           # 2: n for fp8 on a CPU (emulated, slow)
    ladder_calls: int = 1               # 2: matmuls in one timed sample
    link_bytes: int = 0                 # 3: bytes in one copy (a GPU's only)
    energy_s: float = 0.0               # 4: seconds under load for each power reading
    max_tokens_log2: int = 10           # 5: the layer sees 1, 2, 4, ... 2**this tokens
    weight_copies: int = 4              # 5: layer copies used in turn (none stays cached)
    decode_preset: str = "gpt2"         # 5b: the decode step's model
    context: int = 128                  # 5b: tokens already in the KV cache
    steps: int = 1                      # 5b: decode steps in one timed sample

# A GPU: working sets far past L2, matmuls that fill the chip.
GPU = Sizes(dtype=torch.bfloat16, reps=10, largest_set=4 << 30, bytes_a_sample=16 << 30,
            ladder_n=8192, ladder_calls=4, link_bytes=1 << 30, energy_s=4.0,
            max_tokens_log2=13, weight_copies=32, context=512, steps=10)
QUICK = Sizes(reps=2, largest_set=16 << 20, bytes_a_sample=32 << 20, ladder_n=256,
              max_tokens_log2=6, weight_copies=2, decode_preset="tiny", context=32)

class Timing(NamedTuple):
    """Seconds: the median of the samples, their fastest and their slowest."""
    median: float
    low: float
    high: float

class Rate(NamedTuple):
    """A measured ceiling later parts are compared against, and whether to trust it."""
    per_s: float
    unreliable: bool

def timing_of(samples):
    return Timing(statistics.median(samples), min(samples), max(samples))

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def bench(fn, device, reps=10, warmup=3):
    """Call fn `warmup` times, then time `reps` calls one by one. GPU work is asynchronous,
    so the device is synchronised before every clock read."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return timing_of(samples)

def unreliable(timing, rate=0.0, ceiling=math.inf):
    """Samples spread wider than their median, or a rate more than 10% above the ceiling it
    cannot exceed: the machine was busy, the number is not to be trusted."""
    spread = timing.high - timing.low
    return spread > timing.median or rate > 1.1 * ceiling

def mark(is_unreliable):
    """What a number from an untrustworthy measurement, and all derived from it, carries."""
    if is_unreliable:
        return "  unreliable (machine busy)"
    return ""

def cache_sizes(device):
    """The caches a working set falls out of: a GPU's L2 (the driver's number); a CPU's
    data caches, L1 to L3, as Linux reports them (none on other systems)."""
    if device.type == "cuda":
        return {"L2": torch.cuda.get_device_properties(device).L2_cache_size}
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        if (index / "type").read_text().strip() == "Instruction":
            continue
        size = (index / "size").read_text().strip()  # in KB: "32K", "32768K"
        if size.endswith("K"):
            level = (index / "level").read_text().strip()
            caches[f"L{level}"] = int(size[:-1]) * 1024
    return caches

def working_sets(largest):
    """16 KB, 24 KB, 32 KB, 48 KB, ...: two sizes an octave, up to `largest` bytes."""
    sizes = []
    for k in range(14, 33):
        for size in (2**k, 3 * 2 ** (k - 1)):
            if size <= largest:
                sizes.append(size)
    return sorted(sizes)

def reread(x, repeats, kernel_each):
    """Read x `repeats` times. One kernel over a stride-0 view (no copy) times even 16 KB;
    past a GPU's L2 that flatters (its rows share reads through the cache), so there each
    re-read is a kernel of its own."""
    if kernel_each:
        for _ in range(repeats):
            x.sum()
    else:
        x.expand(repeats, x.numel()).sum(dim=1)

def memory_hierarchy(device, sizes):
    # PREDICTION: flat while the working set fits a cache level, a step down past each: a
    # GPU reads its L2 (tens of MB) several times faster than its HBM (a few TB/s); a CPU
    # steps down after L1d, L2 and L3 (tens of KB, MB, tens of MB) to tens of GB/s.
    caches = cache_sizes(device)
    gpu_l2_bytes = None
    if device.type == "cuda":
        gpu_l2_bytes = caches["L2"]
    buffer = torch.ones(sizes.largest_set // 4, device=device)
    points = []
    for size in working_sets(sizes.largest_set):
        x = buffer[: size // 4]
        repeats = max(1, sizes.bytes_a_sample // size)
        past_l2 = gpu_l2_bytes is not None and size > gpu_l2_bytes
        timing = bench(lambda: reread(x, repeats, past_l2), device, sizes.reps, warmup=1)
        gb_per_s = repeats * size / timing.median / 1e9
        points.append(dict(bytes=size, gb_per_s=gb_per_s, unreliable=unreliable(timing)))
    fastest = max(points, key=lambda p: p["gb_per_s"])
    largest = points[-1]
    return dict(points=points, caches=caches, gpu_l2_bytes=gpu_l2_bytes,
                fastest_gb_per_s=fastest["gb_per_s"], fastest_unreliable=fastest["unreliable"],
                main_memory_gb_per_s=largest["gb_per_s"],
                main_memory_unreliable=largest["unreliable"])

def fp8_matmul(a, b, fast_accumulation):
    """a @ b in fp8 (e4m3): each matrix scaled by one number into fp8's range, b stored
    column-major as torch._scaled_mm requires, the product in bf16."""
    fp8 = torch.float8_e4m3fn
    scale_a = a.abs().max() / torch.finfo(fp8).max
    scale_b = b.abs().max() / torch.finfo(fp8).max
    a8 = (a / scale_a).to(fp8)
    b8 = (b.t().contiguous() / scale_b).to(fp8).t()
    def matmul():
        return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b,
                                out_dtype=torch.bfloat16, use_fast_accum=fast_accumulation)
    return matmul

def ladder_matmul(name, a, b, cuda):
    """A function computing a @ b in the format `name`, its inputs cast once."""
    if name == "fp8":
        return fp8_matmul(a, b, fast_accumulation=cuda)
    a_cast = a.to(FORMATS[name])
    b_cast = b.to(FORMATS[name])
    def matmul():
        return a_cast @ b_cast
    return matmul

def measure_format(name, a, b, device, sizes):
    """One rung of the ladder: a @ b's error against float64, its FLOP/s, its format."""
    cuda = device.type == "cuda"
    if name == "tf32":
        torch.set_float32_matmul_precision("high")  # fp32 matmuls on tensor cores
    matmul = ladder_matmul(name, a, b, cuda)
    reference = a.double() @ b.double()
    error = (matmul().double() - reference).norm() / reference.norm()
    def burst():
        for _ in range(sizes.ladder_calls):
            matmul()
    samples = []
    for _ in range(sizes.reps):
        if cuda:
            time.sleep(BURST_GAP_S)  # idle first: each sample a burst, not a hot chip's
        samples.append(bench(burst, device, reps=1, warmup=1).median)
    torch.set_float32_matmul_precision("highest")
    timing = timing_of(samples)
    n = a.size(0)
    flop = 2 * n**3 * sizes.ladder_calls
    info = torch.finfo(FORMATS[name])
    bits = info.bits
    eps = info.eps
    if name == "tf32":  # 1 sign, 8 exponent and 10 mantissa bits: fp32's range, fp16's eps
        bits = 19
        eps = 2.0**-10
    return dict(n=n, tflops=flop / timing.median / 1e12, rel_error=error.item(), bits=bits,
                eps=eps, max=info.max, unreliable=unreliable(timing))

def format_ladder(device, sizes):
    # PREDICTION: fewer bits, more FLOP/s on tensor cores (H100/H200 datasheet: fp32 67,
    # tf32 495, bf16 and fp16 989, fp8 1979 TFLOP/s) and more error against float64, each
    # about its format's eps: fp32 ~1e-7 << tf32 ~ fp16 ~1e-4 < bf16 ~1e-3 < fp8 ~1e-2.
    # A CPU has no tensor cores: its bf16 is no faster than fp32 unless it has bf16
    # matrix instructions, and its fp8 is emulated, far slower.
    cuda = device.type == "cuda"
    skipped = {}
    if not cuda:
        skipped["tf32"] = "a tensor-core mode of NVIDIA GPUs (Ampere and later), not on a CPU"
    if cuda and torch.cuda.get_device_capability(device) < (8, 9):
        capability = torch.cuda.get_device_capability(device)
        skipped["fp8"] = f"fp8 tensor cores need compute capability 8.9; here {capability}"
    torch.manual_seed(0)
    n = sizes.ladder_n
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    formats = {}
    for name in FORMATS:
        if name in skipped:
            continue
        m = n
        if name == "fp8" and not cuda:
            m = sizes.emulated_fp8_n  # emulated: n**3 would take seconds
        formats[name] = measure_format(name, a[:m, :m], b[:m, :m], device, sizes)
    for row in formats.values():
        row["speedup_vs_fp32"] = None  # a smaller matmul (emulated fp8): not comparable
        if row["n"] == n:
            row["speedup_vs_fp32"] = row["tflops"] / formats["fp32"]["tflops"]
    return dict(n=n, formats=formats, skipped_formats=skipped)

def host_copies(device, n):
    """Host -> device and back, n bytes, from pageable and from pinned host memory."""
    gpu = torch.empty(n, dtype=torch.uint8, device=device)
    pageable = torch.ones(n, dtype=torch.uint8)  # touched: no page faults inside a timing
    pinned = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    copies = {
        "h2d_pageable": lambda: gpu.copy_(pageable),
        "h2d_pinned": lambda: gpu.copy_(pinned, non_blocking=True),
        "d2h_pageable": lambda: pageable.copy_(gpu),
        "d2h_pinned": lambda: pinned.copy_(gpu, non_blocking=True),
    }
    rates = {}
    for name, copy in copies.items():
        timing = bench(copy, device, reps=5, warmup=1)
        rates[name] = dict(gb_per_s=n / timing.median / 1e9, unreliable=unreliable(timing))
    return rates

def peer_copy(i, j, n):
    """n bytes from GPU i to GPU j: direct (NVLink, or PCIe peer-to-peer), then staged
    through pinned host memory. Synchronising GPU j waits for either."""
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=f"cuda:{i}")
    dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{j}")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    direct = bench(lambda: dst.copy_(src), dst.device, reps=5, warmup=1)
    exact = [torch.equal(dst.cpu(), src.cpu())]
    def staged_copy():
        pinned.copy_(src)  # GPU i -> host; returns once the bytes are there
        dst.copy_(pinned, non_blocking=True)  # host -> GPU j
    dst.zero_()
    staged = bench(staged_copy, dst.device, reps=5, warmup=1)
    exact.append(torch.equal(dst.cpu(), src.cpu()))
    return dict(direct_gb_per_s=n / direct.median / 1e9,
                staged_gb_per_s=n / staged.median / 1e9,
                direct_over_staged=staged.median / direct.median,
                exact=all(exact),
                p2p_available=torch.cuda.can_device_access_peer(i, j),
                unreliable=unreliable(direct) or unreliable(staged))

def interconnects(device, sizes):
    # PREDICTION: pinned host->device near the link's rate (PCIe Gen5 x16: ~63 GB/s a
    # direction); pageable memory is first copied by a CPU thread into a pinned buffer: a
    # fraction of that. GPU->GPU over NVLink (450 GB/s each way): hundreds of GB/s; staged
    # through the host (no P2P, as on the book's machine) the bytes make two PCIe trips in
    # turn: about half the pinned rate, one order of magnitude below NVLink, not two.
    if device.type != "cuda":
        return dict(skipped="no GPU: no link to measure")
    links = dict(host=host_copies(device, sizes.link_bytes), peer={})
    gpus = torch.cuda.device_count()
    if gpus < 2:
        links["peer_skipped"] = f"{gpus} GPU: a peer copy needs two"
        return links
    links["peer"]["0->1"] = peer_copy(0, 1, sizes.link_bytes)
    links["peer"]["1->0"] = peer_copy(1, 0, sizes.link_bytes)
    return links

def power_reader(device):
    """A function reading the GPU board's power in watts (NVML, an average over ~1 s), or
    the reason there is none. A CPU's (RAPL) would need root."""
    if device.type != "cuda":
        return "no GPU power reading here"
    try:
        import pynvml
    except ModuleNotFoundError:
        return "no NVML binding: pip install nvidia-ml-py"
    try:
        torch.cuda.power_draw(device)
    except (RuntimeError, pynvml.NVMLError) as e:  # no driver; a board reporting no power
        return f"NVML gives no power here: {e}"
    return lambda: torch.cuda.power_draw(device) / 1e3

def sustained_power(fn, seconds, device, read_watts):
    """Call fn for `seconds` in ~50 ms chunks, reading the power after each chunk once
    NVML's 1 s average covers load alone: (mean watts, calls a second)."""
    one_call = bench(fn, device, reps=1, warmup=1).median
    chunk = max(1, round(0.05 / one_call))
    calls = 0
    watts = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(chunk):
            fn()
        calls += chunk
        sync(device)
        if time.perf_counter() - start > 1.5:
            watts.append(read_watts())
    return statistics.mean(watts), calls / (time.perf_counter() - start)

def energy(device, sizes):
    # PREDICTION: a byte from DRAM costs ~100x a FLOP (Horowitz: DRAM ~160-325 pJ/byte, an
    # fp16 FLOP ~0.75 pJ at 45 nm); at 4 nm both shrink and the gap stays.
    result = dict(reference_pj_horowitz_2014=HOROWITZ_PJ, seconds=sizes.energy_s)
    read_watts = power_reader(device)
    if isinstance(read_watts, str):
        result["unmeasured"] = read_watts
        return result
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty(1 << 28, device=device)
    watts, calls_per_s = sustained_power(lambda: a @ b, sizes.energy_s, device, read_watts)
    result["matmul_watts"] = watts
    result["matmul_flops_per_s"] = calls_per_s * 2 * 8192**3
    result["pj_per_flop"] = watts / result["matmul_flops_per_s"] * 1e12
    watts, calls_per_s = sustained_power(lambda: dst.copy_(src), sizes.energy_s, device,
                                         read_watts)
    result["copy_watts"] = watts
    result["copy_bytes_per_s"] = calls_per_s * 2 * src.nbytes  # read and written
    result["pj_per_byte"] = watts / result["copy_bytes_per_s"] * 1e12
    return result

def time_layer(x, weights, device, reps):
    """Seconds per call of y = x W^T, the weight copies taken in turn. On a GPU one CUDA
    graph replays them all, ten times a sample, without launch costs."""
    def layers():
        for w in weights:
            F.linear(x, w)
    run = layers
    replays = 1
    if device.type == "cuda":
        layers()  # warm up before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers()
        run = graph.replay
        replays = 10
    def sample():
        for _ in range(replays):
            run()
    timing = bench(sample, device, reps, warmup=2)
    calls = replays * len(weights)
    return Timing(timing.median / calls, timing.low / calls, timing.high / calls)

def prefill_decode(device, sizes, peak, bandwidth):
    # PREDICTION: y = x W^T with W 768 x 3072 (GPT-2's MLP) does 2 d f FLOPs a token over
    # ~d f weight bytes. Its time stays flat (reading the weights, and a per-kernel floor
    # of a few us) until the intensity nears the ridge, then grows linearly with the
    # tokens: decode (1 token) is bandwidth-bound, prefill (thousands) compute-bound.
    d = 768
    f = 3072
    elt = sizes.dtype.itemsize
    weights = [torch.randn(f, d, device=device, dtype=sizes.dtype)
               for _ in range(sizes.weight_copies)]
    rows = []
    for k in range(sizes.max_tokens_log2 + 1):
        tokens = 2**k
        x = torch.randn(tokens, d, device=device, dtype=sizes.dtype)
        timing = time_layer(x, weights, device, sizes.reps)
        flop = 2 * tokens * d * f
        nbytes = elt * (d * f + tokens * d + tokens * f)  # W, x and y, once each
        intensity = flop / nbytes
        roof = min(peak.per_s, intensity * bandwidth.per_s)
        flops = flop / timing.median
        rows.append(dict(tokens=tokens, intensity=intensity, time_us=timing.median * 1e6,
                         tflops=flops / 1e12, gb_per_s=nbytes / timing.median / 1e9,
                         roof_tflops=roof / 1e12,
                         unreliable=unreliable(timing, flops, roof)))
    # The crossover: where the flat part (up to 8 tokens) meets the line through the last two.
    flat_rows = [r for r in rows if r["tokens"] <= 8]
    flat_us = statistics.median(r["time_us"] for r in flat_rows)
    growth_us = rows[-1]["time_us"] - rows[-2]["time_us"]
    crossover = None
    crossover_intensity = None
    if growth_us > 0:  # on a busy machine the time may not grow: no crossover to derive
        crossover = flat_us / (growth_us / rows[-2]["tokens"])
        crossover_bytes = elt * (d * f + crossover * (d + f))
        crossover_intensity = 2 * crossover * d * f / crossover_bytes
    used = flat_rows + rows[-2:]
    return dict(dtype=str(sizes.dtype).removeprefix("torch."), rows=rows,
                flat_time_us=flat_us, crossover_tokens=crossover,
                crossover_intensity=crossover_intensity,
                crossover_unreliable=any(r["unreliable"] for r in used),
                ridge_flop_per_byte=peak.per_s / bandwidth.per_s,
                ridge_unreliable=peak.unreliable or bandwidth.unreliable,
                throughput_ratio_last_over_first=rows[-1]["tflops"] / rows[0]["tflops"],
                throughput_ratio_unreliable=rows[0]["unreliable"] or rows[-1]["unreliable"],
                peak_tflops_used=peak.per_s / 1e12, bandwidth_gb_per_s_used=bandwidth.per_s / 1e9)

def cached_forward(model, idx, start, cache):
    """GPT-2's forward of the tokens idx (1, T) at positions start, start + 1, ...: each
    layer writes their keys and values into its cache and attends over all it holds."""
    T = idx.size(1)
    C = model.config.n_embd
    heads = model.config.n_head
    end = start + T
    positions = torch.arange(start, end, device=idx.device)
    x = model.transformer.wte(idx) + model.transformer.wpe(positions)
    for block, (keys, values) in zip(model.transformer.h, cache):
        q, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=2)
        q = q.view(1, T, heads, C // heads).transpose(1, 2)
        k = k.view(1, T, heads, C // heads).transpose(1, 2)
        v = v.view(1, T, heads, C // heads).transpose(1, 2)
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        # A prefill from position 0 needs the causal mask; one new token sees every key.
        causal = T > 1
        y = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end],
                                           is_causal=causal)
        x = x + block.attn.c_proj(y.transpose(1, 2).reshape(1, T, C))
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.transformer.ln_f(x))

class CountOps(TorchDispatchMode):
    """Counts the operations a call dispatches (views launch no kernel: not counted)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if not func.is_view:
            self.count += 1
        return func(*args, **kwargs)

def kv_cache(config, length, device):
    """Keys and values of `length` positions for every layer, zeros to start with."""
    shape = (1, config.n_head, length, config.n_embd // config.n_head)
    cache = []
    for _ in range(config.n_layer):
        cache.append((torch.zeros(shape, device=device), torch.zeros(shape, device=device)))
    return cache

@torch.no_grad()
def decode_step(device, sizes, bandwidth):
    # PREDICTION: at batch 1 a decode step reads every weight once: GPT-2 124M in bf16,
    # ~250 MB, ~60 us at 4 TB/s. But it dispatches ~150 operations from Python, each a few
    # us of CPU time to launch on a GPU: eager decode is overhead-bound, ~1 ms, and the
    # operations times the cost of one tiny op is much of it (CUDA graphs, Section 13.3,
    # remove it). A CPU is bandwidth-bound.
    config = GPTConfig.preset(sizes.decode_preset)
    context = sizes.context
    torch.manual_seed(0)
    model = GPT(config).to(device).eval()
    idx = torch.randint(0, 50257, (1, context + 1), device=device)  # GPT-2's vocabulary
    # The check, in fp32: fill the cache with a prefill, decode one token, compare.
    cache = kv_cache(config, context + 1, device)
    cached_forward(model, idx[:, :context], 0, cache)
    logits = cached_forward(model, idx[:, context:], context, cache)[0, -1]
    full = model(idx)[0][0, -1]
    error = (logits - full).abs().max() / full.abs().max()
    # The timing, in the lesson's format.
    model.to(sizes.dtype)
    cache = [(keys.to(sizes.dtype), values.to(sizes.dtype)) for keys, values in cache]
    token = idx[:, context:]
    with CountOps() as counter:
        cached_forward(model, token, context, cache)
    def decode():
        for _ in range(sizes.steps):
            cached_forward(model, token, context, cache)
    def tiny_ops():
        for _ in range(200):
            token.add_(0)
    eager = bench(decode, device, sizes.reps, warmup=2)
    tiny = bench(tiny_ops, device, sizes.reps, warmup=2)
    # Timed as on a CPU (no synchronisation): the host's time to issue one token's work.
    host = bench(lambda: cached_forward(model, token, context, cache), CPU, sizes.reps, 2)
    weights = param_count(config, position=False)  # one row of the position table: left out
    kv = 2 * config.n_layer * (context + 1) * config.n_embd  # keys and values, every layer
    nbytes = sizes.dtype.itemsize * (weights + kv)
    eager_us = eager.median / sizes.steps * 1e6
    ceiling_us = nbytes / bandwidth.per_s * 1e6
    tiny_op_us = tiny.median / 200 * 1e6
    tokens_per_s = {}
    for preset in ("gpt2", "gpt2-medium"):
        weight_bytes = 2 * param_count(GPTConfig.preset(preset), position=False)
        tokens_per_s[preset] = bandwidth.per_s / weight_bytes
    return dict(preset=sizes.decode_preset, dtype=str(sizes.dtype).removeprefix("torch."),
                context=context, bytes_per_step=nbytes, ceiling_us=ceiling_us,
                ceiling_unreliable=bandwidth.unreliable, eager_us=eager_us,
                eager_unreliable=unreliable(eager, ceiling_us / eager_us, 1),
                ops_per_step=counter.count, launch_floor_us=tiny_op_us,
                launch_floor_unreliable=unreliable(tiny),
                dispatch_us=counter.count * tiny_op_us, host_issue_us=host.median * 1e6,
                host_unreliable=unreliable(host), bf16_tokens_per_s_ceiling=tokens_per_s,
                cached_vs_full_rel_error=error.item())

def spec_table(name, formats, bandwidth, gpu_l2_bytes, host_link):
    """This machine's row (measured; - where it has no such number) above the reference
    rows. host_link: the pinned host->GPU copy of part 3, on a GPU."""
    row = []
    row_unreliable = bandwidth.unreliable
    for key in ("bf16", "tf32", "fp8", "fp32"):
        if key in formats:
            row.append(formats[key]["tflops"])
            row_unreliable = row_unreliable or formats[key]["unreliable"]
        else:
            row.append(None)
    row.append(bandwidth.per_s / 1e12)
    l2_mb = None
    if gpu_l2_bytes is not None:
        l2_mb = gpu_l2_bytes / 2**20
    row.append(l2_mb)
    link = "-"
    if host_link is not None:
        link = f"host->GPU pinned {host_link['gb_per_s']:.3g} GB/s"
        row_unreliable = row_unreliable or host_link["unreliable"]
    row.append(link)
    rows = {f"{name[:16]} (measured)": tuple(row), **REFERENCE_ROWS}
    return dict(rows=rows, measured_row_unreliable=row_unreliable)

def figure(hierarchy, device_name, out):
    """Read bandwidth against working-set size, the caches marked: out/02_hardware.png."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plt.switch_backend("Agg")
    points = hierarchy["points"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    sizes = [p["bytes"] for p in points]
    ax.loglog(sizes, [p["gb_per_s"] for p in points], "o-", label="measured")
    busy = [p for p in points if p["unreliable"]]
    if busy:
        ax.loglog([p["bytes"] for p in busy], [p["gb_per_s"] for p in busy], "rx",
                  markersize=10, label="unreliable (machine busy)")
    for level, size in hierarchy["caches"].items():
        ax.axvline(size, ls="--", c="gray")
        ax.annotate(level, (size, 1.02), xycoords=("data", "axes fraction"), ha="center")
    ticks = [2**k for k in range(14, 33, 2) if 2**k <= sizes[-1]]
    ax.set_xticks(ticks, [size_label(t) for t in ticks])
    ax.tick_params(axis="x", which="minor", bottom=False)
    ax.yaxis.set_major_formatter("{x:g}")  # 20, not 2 x 10^1
    ax.yaxis.set_minor_formatter("{x:g}")
    ax.set(xlabel="working set", ylabel="read bandwidth (GB/s)")
    ax.set_title(f"Read bandwidth against working-set size\non {device_name}", pad=16)
    ax.legend()
    path = out / "02_hardware.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

def size_label(nbytes):
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"

def report_hierarchy(h):
    for p in h["points"][::2]:  # 16 KB, 32 KB, ...; the JSON has the sizes between
        print(f"  {size_label(p['bytes']):>7}: {p['gb_per_s']:8.1f} GB/s (measured)"
              f"{mark(p['unreliable'])}")
    for level, size in h["caches"].items():
        print(f"  {level}: {size_label(size)} (reported by the system)")
    fastest = h["fastest_gb_per_s"]
    print(f"  fastest: {fastest:.1f} GB/s (measured){mark(h['fastest_unreliable'])}")
    largest = h["main_memory_gb_per_s"]
    print(f"  largest set: {largest:.1f} GB/s (measured){mark(h['main_memory_unreliable'])}")

def report_ladder(ladder):
    fp32 = ladder["formats"]["fp32"]
    print(f"  {ladder['n']}^3: bits, eps, max (finfo); TFLOP/s (measured), x fp32"
          " (derived); error vs float64 (measured)")
    for name, r in ladder["formats"].items():
        busy = r["unreliable"] or fp32["unreliable"]
        speedup = "-"
        if r["speedup_vs_fp32"] is not None:
            speedup = f"{r['speedup_vs_fp32']:.3g}x"
        print(f"  {name:>4}: {r['bits']:2} {r['eps']:.1e} {r['max']:8.3g};"
              f" {r['tflops']:8.4g} {speedup:>7}; {r['rel_error']:.1e}{mark(busy)}")
    for name, r in ladder["formats"].items():
        if r["n"] != ladder["n"]:
            print(f"  {name:>4}: emulated (no fp8 unit on a CPU), so timed at {r['n']}^3"
                  " (no x fp32)")
    for name, why in ladder["skipped_formats"].items():
        print(f"  {name:>4}: skipped - {why}")

def report_links(links):
    for name, r in links["host"].items():
        print(f"  {name}: {r['gb_per_s']:.1f} GB/s (measured){mark(r['unreliable'])}")
    if "peer_skipped" in links:
        print(f"  GPU -> GPU: skipped - {links['peer_skipped']}")
    for pair, r in links["peer"].items():
        print(f"  GPU {pair}: direct {r['direct_gb_per_s']:.1f}, staged"
              f" {r['staged_gb_per_s']:.1f} GB/s (measured) = {r['direct_over_staged']:.1f}x"
              f" (derived); P2P {r['p2p_available']}{mark(r['unreliable'])}")
    print('  the chapter: staging is "roughly two orders of magnitude below a datacenter'
          ' NVLink"')

def report_energy(e):
    for name, pj in e["reference_pj_horowitz_2014"].items():
        print(f"  {name}: {pj:g} pJ (reference: Horowitz, ISSCC 2014, 45 nm)")
    if "unmeasured" in e:
        print(f"  measured: nothing - {e['unmeasured']}")
        return
    tflops = e["matmul_flops_per_s"] / 1e12
    gb_per_s = e["copy_bytes_per_s"] / 1e9
    print(f"  bf16 matmul, {e['seconds']:g} s: {e['matmul_watts']:.0f} W at {tflops:.0f}"
          " TFLOP/s (measured)")
    print(f"  copy, {e['seconds']:g} s: {e['copy_watts']:.0f} W at {gb_per_s:.0f} GB/s read"
          " + written (measured)")
    print(f"  = {e['pj_per_flop']:.2f} pJ/FLOP and {e['pj_per_byte']:.1f} pJ/byte (derived,"
          " idle power included)")

def report_prefill(pd):
    print(f"  ridge: {pd['peak_tflops_used']:.3g} TFLOP/s / {pd['bandwidth_gb_per_s_used']:.0f}"
          f" GB/s = {pd['ridge_flop_per_byte']:.1f} FLOP/byte (derived)"
          f"{mark(pd['ridge_unreliable'])}")
    print("  tokens, FLOP/byte (counted): us, TFLOP/s, GB/s (measured)")
    for r in pd["rows"]:
        print(f"  {r['tokens']:6} {r['intensity']:6.1f}: {r['time_us']:9.2f}"
              f" {r['tflops']:9.4g} {r['gb_per_s']:6.0f}{mark(r['unreliable'])}")
    if pd["crossover_tokens"] is None:
        print("  crossover: not derived - the time did not grow at the largest token counts")
    else:
        print(f"  crossover: {pd['crossover_tokens']:.0f} tokens,"
              f" {pd['crossover_intensity']:.0f} FLOP/byte (derived: the flat"
              f" {pd['flat_time_us']:.2f} us meets the linear part)"
              f"{mark(pd['crossover_unreliable'])}")
    ratio = pd["throughput_ratio_last_over_first"]
    print(f"  most tokens: {ratio:.0f}x the FLOP/s of 1 (derived)"
          f"{mark(pd['throughput_ratio_unreliable'])}")

def report_decode(step):
    print(f"  {step['preset']} in {step['dtype']}, {step['context']} tokens cached:"
          f" {step['bytes_per_step'] / 1e6:.0f} MB read a token (counted)")
    ceiling_busy = mark(step["ceiling_unreliable"])
    print(f"  ceiling: {step['ceiling_us']:.1f} us a token (derived: bytes / bandwidth)"
          f"{ceiling_busy}")
    print(f"  eager: {step['eager_us']:.1f} us a token (measured){mark(step['eager_unreliable'])}")
    print(f"  dispatch: {step['ops_per_step']} operations a token (counted) x"
          f" {step['launch_floor_us']:.2f} us (measured, a tiny op) ="
          f" {step['dispatch_us']:.1f} us (derived){mark(step['launch_floor_unreliable'])}")
    print(f"  host: {step['host_issue_us']:.1f} us a token to issue its operations (measured,"
          f" no sync){mark(step['host_unreliable'])}")
    print("  where the host's time nears eager's, the device waits for Python")
    print(f"  cached == full forward (fp32): {step['cached_vs_full_rel_error']:.1e} max"
          " rel. error")
    for preset, tokens_per_s in step["bf16_tokens_per_s_ceiling"].items():
        print(f"  ceiling, batch 1, {preset} in bf16: {tokens_per_s:,.0f} tokens/s (derived)"
              f"{ceiling_busy}")

def report_spec(table):
    print(f"  {'TFLOP/s':>24}    bf16    tf32     fp8    fp32    TB/s   L2 MB  link")
    for label, row in table["rows"].items():
        numbers = ""
        for value in row[:6]:
            text = "-"  # a number this machine has not got
            if value is not None:
                text = format(value, ".3g")
            numbers += f" {text:>7}"
        print(f"  {label:>24}{numbers}  {row[6]}")
    if table["measured_row_unreliable"]:
        print(f"  the measured row:{mark(True)}")

def run_experiments(device, sizes, info, out):
    """The section in order. Each part prints its numbers as soon as it has them; a later
    part gets the ceilings it is compared against as arguments."""
    print("\n1. Memory hierarchy: read bandwidth against working-set size")
    hierarchy = memory_hierarchy(device, sizes)
    report_hierarchy(hierarchy)
    bandwidth = Rate(hierarchy["main_memory_gb_per_s"] * 1e9,
                     hierarchy["main_memory_unreliable"])

    print("\n2. Tensor cores and the format ladder")
    ladder = format_ladder(device, sizes)
    report_ladder(ladder)
    compute = ladder["formats"]["fp32"]  # a CPU's roof: fp32
    if device.type == "cuda":
        compute = ladder["formats"]["bf16"]
    peak = Rate(compute["tflops"] * 1e12, compute["unreliable"])

    print("\n3. Interconnects: host <-> device, pageable and pinned; GPU -> GPU, direct"
          " and staged")
    links = interconnects(device, sizes)
    host_link = None
    if "skipped" in links:
        print(f"  skipped: {links['skipped']}")
    else:
        report_links(links)
        host_link = links["host"]["h2d_pinned"]

    print(f"\n4. Energy per FLOP and per byte (on a GPU: {2 * GPU.energy_s:g} s under load)")
    power = energy(device, sizes)
    report_energy(power)

    print("\n5. Prefill vs decode: one GPT-2 linear layer, 768 -> 3072, from 1 token to"
          " thousands")
    prefill = prefill_decode(device, sizes, peak, bandwidth)
    report_prefill(prefill)

    print("\n5b. Prefill vs decode: a real batch-1 decode step of GPT-2 with a KV cache")
    step = decode_step(device, sizes, bandwidth)
    report_decode(step)

    print("\n6. This machine beside the reference machines")
    table = spec_table(info["name"], ladder["formats"], bandwidth, hierarchy["gpu_l2_bytes"],
                       host_link)
    report_spec(table)

    print("\nFigure: read bandwidth against working-set size")
    path = figure(hierarchy, info["name"], out)
    if path is None:
        print("  skipped: matplotlib is not installed")
    else:
        print(f"  {path}")
        path = str(path)
    return dict(hierarchy=hierarchy, ladder=ladder, interconnect=links, energy=power,
                prefill_decode=prefill, decode_step=step, spec_table=table,
                figure=path)

def self_checks(formats, peers, decode_error):
    """Correctness only: timing is reported above and never decides the exit code."""
    errors = []  # most bits first
    for name in ("fp32", "tf32", "bf16", "fp8"):
        if name in formats:
            errors.append(formats[name]["rel_error"])
    within = [r["rel_error"] < ERROR_BOUND[name] for name, r in formats.items()]
    return dict(ladder_errors_within_format=all(within),
                ladder_error_grows_as_bits_shrink=errors == sorted(errors),
                decode_cache_matches_full_forward=decode_error < DECODE_BOUND,
                peer_copies_exact=all(r["exact"] for r in peers.values()))

def describe(device):
    """The machine: its name, memory and GPUs, and the torch version."""
    name = "CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux
        found = re.search(r"model name\s*: (.+)", cpuinfo.read_text())
        if found:
            name = found.group(1)
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = props.name
        memory_gb = props.total_memory / 1e9
    return dict(name=name, type=device.type, memory_gb=memory_gb,
                gpus=torch.cuda.device_count(), torch=torch.__version__)

def json_file(text):
    """--json: a file. Its folder is made now, and the file opened, so a path that cannot
    be written is refused before the work."""
    path = Path(text)
    if text == "" or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.open("a").close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {e.strerror}")
    return path

def out_folder(text):
    """--out: a folder for the figure, made now if missing."""
    path = Path(text)
    if text == "":
        raise argparse.ArgumentTypeError("'' is not a folder name")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, or a folder that cannot be written
        raise argparse.ArgumentTypeError(f"cannot make the folder {text}: {e.strerror}")
    if not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {text}")
    return path

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Section 13.2: where the two numbers come from")
    parser.add_argument("--quick", action="store_true",
                        help="a CPU run in seconds (the tests'); a GPU's run is short already")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=json_file, help="write every measured number here")
    parser.add_argument("--out", type=out_folder, default="out", help="folder for the figure")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: PyTorch sees no CUDA GPU here; run with --device cpu")
    return args

def main():
    args = parse_args()
    device = CPU
    if args.device != "cpu" and torch.cuda.is_available():
        device = torch.device("cuda:0")
    sizes = Sizes()
    if device.type == "cuda":
        sizes = GPU
    elif args.quick:
        sizes = QUICK
    info = describe(device)
    print(f"device: {info['name']} ({device.type}), {info['memory_gb']:.0f} GB,"
          f" {info['gpus']} GPUs; torch {torch.__version__}")
    result = dict(lesson="02_hardware", device=info, quick=args.quick)
    result.update(run_experiments(device, sizes, info, args.out))
    peers = result["interconnect"].get("peer", {})
    decode_error = result["decode_step"]["cached_vs_full_rel_error"]
    result["checks"] = self_checks(result["ladder"]["formats"], peers, decode_error)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"JSON: {args.json}")
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed:
        sys.exit(f"error: self-check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
