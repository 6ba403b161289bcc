"""02_hardware.py - Section 13.2: where the roofline's two numbers come from.

Section 13.1 measured a peak FLOP/s and a memory bandwidth. This file takes both apart on
your machine, in the section's order:
1. the memory hierarchy: read bandwidth from 16 KB to GB working sets, the cache cliffs
   (figure: out/02_hardware.png);
2. tensor cores and the format ladder: matmul FLOP/s in fp32, tf32, fp16, bf16 and fp8,
   each with its error against float64 and its format's facts;
3. interconnects: host <-> GPU copies from pageable and pinned memory; GPU -> GPU,
   direct and staged through the host, when two GPUs are visible;
4. energy: the board's watts under a matmul and under a copy (NVML) -> pJ per FLOP and
   per byte, beside Horowitz's per-operation energies;
5. prefill vs decode: a GPT-2 linear layer from 1 to thousands of tokens against the
   ridge point, then a real batch-1 decode step of GPT-2 with a KV cache;
6. this machine beside the reference rows of the RTX 4090, A100, H100 and H200.

Copy it with model_torch.py. Run:
    python 02_hardware.py                  # one GPU: ~40 s; a 2-core CPU: ~30 s
    CUDA_VISIBLE_DEVICES=0,1 python 02_hardware.py  # part 3 copies between two GPUs
    python 02_hardware.py --quick --device cpu      # seconds (what the tests run)
Each experiment prints its prediction for this kind of device, its numbers (measured,
derived or reference) and whether the prediction held. Comparisons are timed
interleaved and carry their spread; a machine busy with other programs is named. A
failed self-check (a format's error against float64, the KV-cache decode against a full
forward, a peer copy's bytes) exits non-zero after the JSON is written; a timing never.
"""

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode  # see "Extending PyTorch"

import model_torch
from model_torch import GPT, GPTConfig, param_count

# The ladder, most bits first. tf32 is fp32 storage multiplied on tensor cores.
FORMATS = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}
# The largest relative error against float64 each format may show: a few times what it
# shows on a CPU and an H200. Each bound catches the rung below computed in its place
# (fp32 done in tf32 shows ~3e-4, tf32 or fp16 in bf16 ~3e-3, bf16 in fp8 ~4e-2).
ERROR_BOUND = {"fp32": 1e-5, "tf32": 1e-3, "fp16": 1e-3, "bf16": 1e-2, "fp8": 1e-1}
# The error grows down each chain (tf32 and fp16 keep 10 mantissa bits each: neither is
# below the other).
ERROR_CHAINS = [["fp32", "tf32", "bf16", "fp8"], ["fp32", "fp16", "bf16", "fp8"]]
# The decode step's fp32 logits against the full forward: a cache slot off by one, a
# wrong position or a causal mask on the one new token move them by far more.
DECODE_BOUND = 1e-4
BURST_GAP_S = 0.1  # GPU: idle this long before each matmul sample: it runs as a burst
GRAPH_REPLAYS = 10  # GPU: replays of the linear layer's CUDA graph in one sample
TINY_OPS = 200  # bare add_ calls in one sample: the cost of one dispatch
D_MODEL = 768  # part 5's layer is GPT-2's MLP up-projection, 768 -> 3072
D_FF = 3072
ENERGY_N = 8192  # part 4's matmul is (n x n) @ (n x n)
ENERGY_COPY_BYTES = 1 << 30  # part 4's copy

# Energies per operation at 45 nm, in pJ (Horowitz, "Computing's energy problem (and
# what we can do about it)", ISSCC 2014). A read is of one 64-bit word.
HOROWITZ_PJ = {
    "fp16 add": 0.4,
    "fp16 multiply": 1.1,
    "fp32 add": 0.9,
    "fp32 multiply": 3.7,
    "8 KB cache read": 10,
    "1 MB cache read": 100,
    "DRAM read, low": 1300,
    "DRAM read, high": 2600,
}

# Link rates a direction, GB/s. PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 encoding / 8
# (PCI-SIG); 5.0 doubles it. NVLink 4 on an H100/H200: 18 links x 25 GB/s (NVIDIA's H100
# datasheet gives 900 GB/s, both directions together).
PCIE4_X16_GB_S = 31.5
PCIE5_X16_GB_S = 63.0
NVLINK4_GB_S = 450.0


@dataclass(frozen=True)
class Reference:
    """A card's datasheet numbers beside model_torch.DATASHEETS' bf16 peak and memory
    bandwidth."""
    label: str
    tf32: float  # dense tensor-core TFLOP/s
    fp8: float  # dense, fp32 accumulate; None: no fp8 tensor cores
    fp32: float  # without tensor cores
    l2_mb: float
    l2_source: str
    link: str  # GPU to GPU


# By the exact name torch.cuda.get_device_name() gives. Sources: NVIDIA's Ada whitepaper
# (RTX 4090), A100 and Hopper whitepapers, H100 and H200 datasheets. The H200 datasheet
# gives no L2 size: 50 MB is the H100 SXM's, on the same GH100 die (60 MB in full).
REFERENCE_ROWS = {
    "NVIDIA GeForce RTX 4090": Reference(
        "RTX 4090", 82.6, 330, 82.6, 72, "Ada whitepaper", "PCIe 4.0 x16, no P2P"),
    "NVIDIA A100-SXM4-80GB": Reference(
        "A100 SXM 80GB", 156, None, 19.5, 40, "A100 whitepaper", "NVLink 600 GB/s"),
    "NVIDIA H100 80GB HBM3": Reference(
        "H100 SXM", 495, 1979, 67, 50, "Hopper whitepaper", "NVLink 900 GB/s"),
    "NVIDIA H200": Reference(
        "H200 SXM", 495, 1979, 67, 50,
        "the H100 SXM's, Hopper whitepaper; the H200 datasheet gives none",
        "NVLink 900 GB/s"),
}


@dataclass(frozen=True)
class Sizes:
    """A 2-core CPU's sizes (half a minute in all); GPU and QUICK name what differs."""
    reps: int = 5                    # timed rounds of every interleaved measurement
    largest_set: int = 512 << 20     # 1: the largest working set, bytes
    bytes_a_sample: int = 256 << 20  # 1: bytes read in one timed sample
    ladder_n: int = 512              # 2: the matmuls are (n x n) @ (n x n)
    emulated_fp8_n: int = 128        # 2: n for fp8 on a CPU (emulated, slow)
    ladder_calls: int = 1            # 2: matmuls in one timed sample
    link_bytes: int = 0              # 3: bytes in one copy (a GPU's only)
    energy_s: float = 0.0            # 4: seconds under load for each power reading
    max_tokens_log2: int = 10        # 5: the layer sees 1, 2, 4, ... 2**this tokens
    weight_copies: int = 4           # 5: layer copies used in turn (none stays cached)
    decode_preset: str = "gpt2"      # 5b: the decode step's model
    context: int = 128               # 5b: tokens already in the KV cache
    steps: int = 1                   # 5b: decode steps in one timed sample


# A GPU: working sets far past L2, matmuls that fill the chip.
GPU = Sizes(reps=10, largest_set=4 << 30, bytes_a_sample=16 << 30, ladder_n=8192,
            ladder_calls=4, link_bytes=1 << 30, energy_s=4.0, max_tokens_log2=13,
            weight_copies=32, context=512, steps=10)
GPU_QUICK = replace(GPU, reps=3, largest_set=1 << 30, bytes_a_sample=4 << 30,
                    ladder_n=4096, link_bytes=256 << 20, energy_s=2.0)
QUICK = Sizes(reps=3, largest_set=16 << 20, bytes_a_sample=32 << 20, ladder_n=256,
              max_tokens_log2=6, weight_copies=2, decode_preset="tiny", context=32)

# ---------------------------------------------------------------------------------------
# What this device has: tensor cores, by compute capability.

def has_bf16_tensor_cores(device):
    """bf16 (and tf32) tensor cores came with compute capability 8.0 (A100, RTX 30xx); a
    V100 (7.0) or a T4 (7.5) has fp16 tensor cores only. A CPU has none."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def working_dtype(device):
    """The format parts 4 and 5 run in: bf16 on tensor cores, fp16 on a GPU without bf16
    tensor cores, fp32 on a CPU (its fastest)."""
    if device.type != "cuda":
        return torch.float32
    if has_bf16_tensor_cores(device):
        return torch.bfloat16
    return torch.float16


def formats_skipped(device):
    """The rungs of the ladder this device cannot run, each with the reason."""
    if device.type != "cuda":
        return {"tf32": "a mode of NVIDIA tensor cores, not of a CPU"}
    capability = torch.cuda.get_device_capability(device)
    skipped = {}
    if not has_bf16_tensor_cores(device):
        needs = f"needs compute capability 8.0; this GPU has {capability}"
        skipped["tf32"] = f"tf32 tensor cores: {needs}"
        skipped["bf16"] = f"bf16 tensor cores: {needs}"
    if capability < (8, 9):
        skipped["fp8"] = f"fp8 tensor cores: need compute capability 8.9, not {capability}"
    return skipped


# ---------------------------------------------------------------------------------------
# 1. The memory hierarchy

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


def read_probe(x, repeats, kernel_each, device):
    """A function reading x `repeats` times. One kernel over a stride-0 view (no copy)
    times even 16 KB; past a GPU's L2 that flatters (its rows share reads through the
    cache), so there each re-read is a kernel of its own."""
    def read():
        if kernel_each:
            for _ in range(repeats):
                x.sum()
        else:
            x.expand(repeats, x.numel()).sum(dim=1)
        sync(device)
    return read


def memory_hierarchy(device, sizes):
    """Prediction: read bandwidth stays flat while the working set fits a cache level and
    steps down past each. A GPU reads its L2 (40-72 MB on an A100, H100, H200 or RTX
    4090) several times faster than its memory (1-5 TB/s); a CPU steps down after L1d,
    L2 and L3 (tens of KB, about a MB, tens of MB) to main memory's tens of GB/s. Either
    way the fastest reads run >= 2x the largest set's. Each round times every size."""
    caches = cache_sizes(device)
    levels = []
    for level, size in caches.items():
        levels.append(f"{level} {size_label(size)}")
    print(f"predicted: flat within each cache ({', '.join(levels)}), a step down past"
          " each; the fastest reads >= 2x the largest set's")
    result = dict(caches=caches, cpu_shares=[cpu_share()])
    buffer = torch.ones(sizes.largest_set // 4, device=device)
    points = []
    probes = []
    for size in working_sets(sizes.largest_set):
        repeats = max(1, sizes.bytes_a_sample // size)
        past_l2 = device.type == "cuda" and size > caches["L2"]
        points.append(dict(bytes=size, repeats=repeats))
        probes.append(read_probe(buffer[: size // 4], repeats, past_l2, device))
    seconds = interleaved(probes, sizes.reps)
    mark_busy(result)
    for point, samples in zip(points, seconds):
        point["seconds"] = samples
        point["bytes_per_s"] = [point["repeats"] * point["bytes"] / t for t in samples]
        point["gb_per_s"] = spread([rate / 1e9 for rate in point["bytes_per_s"]])
    fastest = max(points, key=lambda point: point["gb_per_s"]["median"])
    largest = points[-1]
    cache_over_memory = ratio(fastest["bytes_per_s"], largest["bytes_per_s"])
    cliff = None  # the first set past the fastest read below half its rate
    for point in points[points.index(fastest):]:
        if point["gb_per_s"]["median"] < fastest["gb_per_s"]["median"] / 2:
            cliff = point["bytes"]
            break
    result.update(points=points, fastest=fastest, largest=largest,
                  cache_over_memory=cache_over_memory, cliff_bytes=cliff,
                  prediction_held=cache_over_memory["median"] >= 2)
    return result


def report_hierarchy(h):
    print(f"  measured: read GB/s, median [min, max], every octave{busy_mark(h['busy'])}")
    for point in h["points"][::2]:
        print(f"  {size_label(point['bytes']):>8}: {with_spread(point['gb_per_s'])}")
    caches = []
    for level, size in h["caches"].items():
        caches.append(f"{level} {size_label(size)}")
    print(f"  reference: caches as the system reports them: {', '.join(caches)}")
    fastest = h["fastest"]
    print(f"  derived: the fastest, {number(fastest['gb_per_s']['median'])} GB/s at"
          f" {size_label(fastest['bytes'])}, reads {with_spread(h['cache_over_memory'])}x"
          f" the largest set ({size_label(h['largest']['bytes'])})"
          f"{noise_mark(h['cache_over_memory'], h['busy'])}")
    if h["cliff_bytes"] is None:
        print("  derived: no set read below half the fastest rate")
    else:
        print(f"  derived: reads fall below half the fastest rate from"
              f" {size_label(h['cliff_bytes'])} on{busy_mark(h['busy'])}")
    print(verdict(h, f"the fastest read {number(h['cache_over_memory']['median'])}x the"
                     " largest set (predicted >= 2x)"))


# ---------------------------------------------------------------------------------------
# 2. Tensor cores and the format ladder

def fp8_matmul(a, b, fast_accumulation):
    """a @ b in fp8 (e4m3): each matrix scaled by one number into fp8's range (448 at
    most), b stored column-major as torch._scaled_mm requires, the product in bf16.
    torch._scaled_mm is private, and torch's only fp8 matmul: the section teaches fp8,
    so it is used here; its signature may change between versions."""
    fp8 = torch.float8_e4m3fn
    scale_a = a.abs().max() / torch.finfo(fp8).max
    scale_b = b.abs().max() / torch.finfo(fp8).max
    a8 = (a / scale_a).to(fp8)
    b8 = (b.t().contiguous() / scale_b).to(fp8).t()

    def matmul():
        return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b,
                                out_dtype=torch.bfloat16,
                                use_fast_accum=fast_accumulation)
    return matmul


def tf32_matmul(a, b):
    """a @ b with fp32 inputs multiplied on tf32 tensor cores, the switch on for this
    matmul only (torch's default is true fp32)."""
    def matmul():
        torch.backends.cuda.matmul.allow_tf32 = True
        product = a @ b
        torch.backends.cuda.matmul.allow_tf32 = False
        return product
    return matmul


def cast_matmul(a, b, dtype):
    """a @ b in dtype, the inputs cast once, here."""
    a_cast = a.to(dtype)
    b_cast = b.to(dtype)

    def matmul():
        return a_cast @ b_cast
    return matmul


def burst(matmul, calls, device):
    """A function calling matmul `calls` times, then waiting for the device."""
    def run():
        for _ in range(calls):
            matmul()
        sync(device)
    return run


def relative_error(matmul, a, b):
    """||matmul() - a @ b|| / ||a @ b||, a @ b computed in float64."""
    reference = a.double() @ b.double()
    return ((matmul().double() - reference).norm() / reference.norm()).item()


def format_facts(name):
    """Bits, machine epsilon and largest value of a format (torch.finfo; tf32 by hand:
    1 sign, 8 exponent and 10 mantissa bits: fp32's range, fp16's epsilon)."""
    info = torch.finfo(FORMATS[name])
    if name == "tf32":
        return dict(bits=19, eps=2.0**-10, max=info.max)
    return dict(bits=info.bits, eps=info.eps, max=info.max)


def ladder_checks(errors):
    """Each format's error within its bound; the error growing down each chain."""
    within = True
    for name, error in errors.items():
        if error >= ERROR_BOUND[name]:
            within = False
    grows = True
    for chain in ERROR_CHAINS:
        present = [errors[name] for name in chain if name in errors]
        if present != sorted(present):
            grows = False
    return dict(ladder_errors_within_format=within,
                ladder_error_grows_as_bits_shrink=grows)


def format_ladder(device, sizes):
    """Prediction: fewer bits, more FLOP/s and more error. On tensor cores bf16 runs >=
    1.5x fp32 (datasheets, TFLOP/s: an H100 or H200 fp32 67, tf32 495, fp16 and bf16 989,
    fp8 1979: 15x; an RTX 4090 fp32 82.6, bf16 165, fp8 330, the last two with fp32
    accumulate: 2x). A CPU has no tensor cores: its bf16 is no faster than fp32 (<= 1.1x;
    far slower without bf16 matrix instructions) and its fp8 is emulated. On any device
    the error against float64 grows as bits shrink, each near its format's eps: fp32
    ~1e-7, tf32 and fp16 ~1e-4, bf16 ~1e-3, fp8 ~1e-2."""
    cuda = device.type == "cuda"
    low = "bf16"  # the rung a GPU trains in
    if cuda and not has_bf16_tensor_cores(device):
        low = "fp16"
    if cuda:
        print(f"predicted: {low} on tensor cores >= 1.5x fp32's FLOP/s; the error grows"
              " as bits shrink (fp32 ~1e-7 ... fp8 ~1e-2)")
    else:
        print("predicted: no tensor cores: bf16 <= 1.1x fp32's FLOP/s; the error grows"
              " as bits shrink (fp32 ~1e-7 ... fp8 ~1e-2)")
    result = dict(n=sizes.ladder_n, low_precision=low, skipped=formats_skipped(device),
                  cpu_shares=[cpu_share()])
    torch.manual_seed(0)
    n = sizes.ladder_n
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    rows = {}
    probes = []
    for name in FORMATS:
        if name in result["skipped"]:
            continue
        m = n
        if name == "fp8" and not cuda:
            m = sizes.emulated_fp8_n  # emulated: n**3 would take seconds
        if name == "fp8":
            matmul = fp8_matmul(a[:m, :m], b[:m, :m], fast_accumulation=cuda)
        elif name == "tf32":
            matmul = tf32_matmul(a, b)
        else:
            matmul = cast_matmul(a, b, FORMATS[name])
        error = relative_error(matmul, a[:m, :m], b[:m, :m])
        rows[name] = dict(n=m, rel_error=error, **format_facts(name))
        probes.append(burst(matmul, sizes.ladder_calls, device))
    gap = 0.0
    if cuda:
        gap = BURST_GAP_S
    seconds = interleaved(probes, sizes.reps, gap)
    mark_busy(result)
    for row, samples in zip(rows.values(), seconds):
        flop = 2 * row["n"] ** 3 * sizes.ladder_calls
        row["seconds"] = samples
        row["tflops"] = spread([flop / t / 1e12 for t in samples])
        row["x_fp32"] = None  # a smaller matmul (emulated fp8): no ratio to fp32's
        if row["n"] == n:
            row["x_fp32"] = ratio(rows["fp32"]["seconds"], samples)
    errors = {}
    for name, row in rows.items():
        errors[name] = row["rel_error"]
    checks = ladder_checks(errors)
    speedup = rows[low]["x_fp32"]["median"]
    held = speedup <= 1.1
    if cuda:
        held = speedup >= 1.5
    if not checks["ladder_error_grows_as_bits_shrink"]:
        held = False
    result.update(formats=rows, checks=checks, prediction_held=held)
    return result


def report_ladder(ladder):
    busy = ladder["busy"]
    print(f"  (n x n) @ (n x n), n = {ladder['n']}{busy_mark(busy)}")
    print(f"  {'format':>6} {'bits':>4} {'eps':>7} {'max':>8}  {'TFLOP/s':<28}"
          f" {'x fp32':<28} error")
    for name, row in ladder["formats"].items():
        speed = "-"
        if name == "fp32":
            speed = "1"
        elif row["x_fp32"] is not None:
            speed = with_spread(row["x_fp32"]) + noise_mark(row["x_fp32"], busy)
        print(f"  {name:>6} {row['bits']:4} {row['eps']:7.1e} {row['max']:8.3g}"
              f"  {with_spread(row['tflops']):<28} {speed:<28} {row['rel_error']:.1e}")
    print("  legend: bits, eps, max from torch.finfo; TFLOP/s measured, median [min, max];"
          " x fp32 derived: fp32's time over this format's, pair by pair of interleaved"
          " samples; error measured: relative, against float64")
    for name, row in ladder["formats"].items():
        if row["n"] != ladder["n"]:
            print(f"  {name}: emulated (no fp8 unit on a CPU), so timed at"
                  f" {row['n']}^3, no x fp32")
    for name, why in ladder["skipped"].items():
        print(f"  {name}: skipped - {why}")
    for name, ok in ladder["checks"].items():
        print(check_line(name, ok))
    low = ladder["low_precision"]
    speedup = number(ladder["formats"][low]["x_fp32"]["median"])
    grows = "did not grow"
    if ladder["checks"]["ladder_error_grows_as_bits_shrink"]:
        grows = "grew"
    print(verdict(ladder, f"{low} ran {speedup}x fp32; the error {grows} as bits shrank"))


# ---------------------------------------------------------------------------------------
# 3. Interconnects

def link_reference():
    """The chapter's comparison in its references' numbers: NVLink 4 against GPU -> GPU
    bytes staged through host memory over PCIe 4.0 x16, as on the book's box (RTX 4090s,
    no P2P). Staged, each byte crosses PCIe twice: at PCIe's rate when the two trips
    overlap, at half of it when they take turns."""
    return dict(pcie4_x16_gb_per_s=PCIE4_X16_GB_S, nvlink4_gb_per_s=NVLINK4_GB_S,
                nvlink_over_staged_overlapped=NVLINK4_GB_S / PCIE4_X16_GB_S,
                nvlink_over_staged_in_turn=NVLINK4_GB_S / (PCIE4_X16_GB_S / 2))


def copy_probe(dst, src, devices):
    """A function copying src into dst, then waiting for every device it touched."""
    def copy():
        dst.copy_(src, non_blocking=True)
        for device in devices:
            torch.cuda.synchronize(device)
    return copy


def host_copies(device, n, reps):
    """Host -> GPU and GPU -> host, n bytes, pageable and pinned, the four interleaved.
    A pageable copy goes through a pinned staging buffer, filled by a CPU thread."""
    gpu = torch.empty(n, dtype=torch.uint8, device=device)
    pageable = torch.ones(n, dtype=torch.uint8)  # touched: no page faults when timed
    pinned = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    probes = {
        "host->GPU pageable": copy_probe(gpu, pageable, [device]),
        "host->GPU pinned": copy_probe(gpu, pinned, [device]),
        "GPU->host pageable": copy_probe(pageable, gpu, [device]),
        "GPU->host pinned": copy_probe(pinned, gpu, [device]),
    }
    seconds = dict(zip(probes, interleaved(list(probes.values()), reps)))
    rows = {}
    for name, samples in seconds.items():
        rows[name] = dict(seconds=samples, gb_per_s=spread([n / t / 1e9 for t in samples]))
    to_gpu = ratio(seconds["host->GPU pageable"], seconds["host->GPU pinned"])
    to_host = ratio(seconds["GPU->host pageable"], seconds["GPU->host pinned"])
    return dict(rows=rows, pinned_over_pageable={"host->GPU": to_gpu, "GPU->host": to_host})


def peer_copy(i, j, n, reps):
    """n bytes from GPU i to GPU j, direct (NVLink, or PCIe peer-to-peer; without P2P
    the driver stages it itself) and staged through pinned host memory, interleaved;
    and whether each delivered every byte."""
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=f"cuda:{i}")
    dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{j}")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    both = [src.device, dst.device]
    direct = copy_probe(dst, src, both)
    to_host = copy_probe(pinned, src, both)
    to_gpu = copy_probe(dst, pinned, both)

    def staged():
        to_host()
        to_gpu()

    direct()
    direct_exact = torch.equal(dst.cpu(), src.cpu())
    dst.zero_()
    staged()
    staged_exact = torch.equal(dst.cpu(), src.cpu())
    seconds = interleaved([direct, staged], reps)
    return dict(seconds=seconds, exact=all([direct_exact, staged_exact]),
                p2p_available=torch.cuda.can_device_access_peer(i, j),
                direct_gb_per_s=spread([n / t / 1e9 for t in seconds[0]]),
                staged_gb_per_s=spread([n / t / 1e9 for t in seconds[1]]),
                direct_over_staged=ratio(seconds[1], seconds[0]))


def interconnects(device, sizes):
    """Prediction: pinned host <-> GPU copies run near the PCIe link's rate (Gen4 x16
    31.5, Gen5 x16 63 GB/s a direction, less protocol overhead); pageable ones >= 1.5x
    slower. Between two GPUs with P2P the direct copy beats the one staged through the
    host (whose bytes cross PCIe twice): over NVLink (450 GB/s a direction) by about an
    order of magnitude. Without P2P (the book's RTX 4090s) the driver stages it too."""
    result = dict(reference=link_reference(), cpu_shares=[], busy=False, checks={},
                  peer={})
    if device.type != "cuda":
        result["skipped"] = "no GPU: no link to measure"
        return result
    print(f"predicted: pinned >= 1.5x pageable, near PCIe's {PCIE4_X16_GB_S:g} (Gen4) or"
          f" {PCIE5_X16_GB_S:g} GB/s (Gen5); two GPUs with P2P: direct beats staged")
    result["cpu_shares"].append(cpu_share())
    result["host"] = host_copies(device, sizes.link_bytes, sizes.reps)
    gpus = torch.cuda.device_count()
    if gpus < 2:
        result["peer_skipped"] = f"{gpus} GPU visible: a peer copy needs two"
    else:
        result["peer"]["0->1"] = peer_copy(0, 1, sizes.link_bytes, sizes.reps)
        result["peer"]["1->0"] = peer_copy(1, 0, sizes.link_bytes, sizes.reps)
    mark_busy(result)
    held = result["host"]["pinned_over_pageable"]["host->GPU"]["median"] >= 1.5
    exact = True
    for peer in result["peer"].values():
        if not peer["exact"]:
            exact = False
        if peer["p2p_available"] and peer["direct_over_staged"]["low"] <= 1:
            held = False  # with P2P, direct must beat staged beyond the spread
    if result["peer"]:
        result["checks"] = dict(peer_copies_exact=exact)
    result["prediction_held"] = held
    return result


def report_links(links):
    reference = links["reference"]
    overlapped = reference["nvlink_over_staged_overlapped"]
    in_turn = reference["nvlink_over_staged_in_turn"]
    print(f"  reference: PCIe 4.0 x16 {reference['pcie4_x16_gb_per_s']:g} GB/s a direction"
          f" (PCI-SIG); NVLink 4 {reference['nvlink4_gb_per_s']:g} GB/s a direction"
          " (NVIDIA's H100 and H200 datasheets)")
    print("  derived: the book's box stages GPU->GPU bytes through host memory, over PCIe"
          f" twice: NVLink moves {overlapped:.0f}x (the trips overlapped) to"
          f" {in_turn:.0f}x (in turn) as much, 10^{math.log10(overlapped):.1f} to"
          f" 10^{math.log10(in_turn):.1f}")
    if "skipped" in links:
        print(f"  measured: nothing - {links['skipped']}")
        return
    mark = busy_mark(links["busy"])
    for name, row in links["host"]["rows"].items():
        print(f"  measured: {name} {with_spread(row['gb_per_s'])} GB/s{mark}")
    for direction, r in links["host"]["pinned_over_pageable"].items():
        print(f"  derived: {direction} pinned runs {with_spread(r)}x pageable"
              f"{noise_mark(r, links['busy'])}")
    if "peer_skipped" in links:
        print(f"  GPU -> GPU: skipped - {links['peer_skipped']}")
    for pair, peer in links["peer"].items():
        print(f"  measured: GPU {pair} direct {with_spread(peer['direct_gb_per_s'])} GB/s,"
              f" staged {with_spread(peer['staged_gb_per_s'])} GB/s;"
              f" P2P available: {peer['p2p_available']}{mark}")
        r = peer["direct_over_staged"]
        print(f"  derived: GPU {pair} direct runs {with_spread(r)}x staged,"
              f" 10^{math.log10(r['median']):.1f} on this machine"
              f"{noise_mark(r, links['busy'])}")
    for name, ok in links["checks"].items():
        print(check_line(name, ok))
    host = links["host"]["pinned_over_pageable"]["host->GPU"]["median"]
    measured = f"pinned host->GPU ran {number(host)}x pageable (predicted >= 1.5x)"
    for pair, peer in links["peer"].items():
        if peer["p2p_available"]:
            low = number(peer["direct_over_staged"]["low"])
            measured += f"; GPU {pair} direct ran >= {low}x staged (predicted > 1)"
    print(verdict(links, measured))


# ---------------------------------------------------------------------------------------
# 4. Energy

def horowitz_per_flop_and_byte(pj):
    """Per-operation energies as pJ per FLOP (a fused multiply-add, an add and a
    multiply, is 2 FLOPs) and pJ per byte (a 64-bit word is 8 bytes); a DRAM byte's
    energy in FLOPs."""
    fp16_flop = (pj["fp16 add"] + pj["fp16 multiply"]) / 2
    fp32_flop = (pj["fp32 add"] + pj["fp32 multiply"]) / 2
    dram = [pj["DRAM read, low"] / 8, pj["DRAM read, high"] / 8]
    return dict(fp16_pj_per_flop=fp16_flop, fp32_pj_per_flop=fp32_flop,
                cache_8kb_pj_per_byte=pj["8 KB cache read"] / 8,
                cache_1mb_pj_per_byte=pj["1 MB cache read"] / 8,
                dram_pj_per_byte=dram,
                dram_byte_over_fp16_flop=[dram[0] / fp16_flop, dram[1] / fp16_flop],
                dram_byte_over_fp32_flop=[dram[0] / fp32_flop, dram[1] / fp32_flop])


def matmul_flop(n):
    """(n x n) @ (n x n): n^2 outputs, each n multiplies and n adds."""
    return 2 * n**3


def copy_traffic(nbytes):
    """A device copy of nbytes reads them once and writes them once."""
    return 2 * nbytes


def energy_figures(matmul_watts, flops_per_s, copy_watts, bytes_per_s):
    """pJ per FLOP and per byte from the board's watts (joules a second) and the work
    done a second; and how many FLOPs' energy one byte costs."""
    pj_per_flop = matmul_watts / flops_per_s * 1e12
    pj_per_byte = copy_watts / bytes_per_s * 1e12
    return dict(pj_per_flop=pj_per_flop, pj_per_byte=pj_per_byte,
                byte_over_flop=pj_per_byte / pj_per_flop)


def board_watts(device):
    """The board's power in watts: NVML's average over its last sample period (1/6 s to
    1 s, by product), which torch.cuda.power_draw gives in milliwatts."""
    return torch.cuda.power_draw(device) / 1000


def power_unreadable(device):
    """Why this machine's power cannot be read, or None when NVML gives it."""
    if device.type != "cuda":
        return "no GPU power reading here (a CPU's RAPL counters need root)"
    try:
        import pynvml
    except ModuleNotFoundError:
        return "no NVML binding: pip install nvidia-ml-py"
    try:
        board_watts(device)
    except (RuntimeError, pynvml.NVMLError) as error:  # no driver; no power sensor
        return f"NVML gives no power reading here: {error}"
    return None


def sustained_power(fn, seconds, device, read_watts, settle_s=1.5):
    """Call fn for `seconds` in ~50 ms chunks; once NVML's average covers the load alone
    (after settle_s), read the watts after each chunk. The readings, fn's calls a
    second."""
    start = time.perf_counter()
    fn()
    sync(device)
    chunk = max(1, round(0.05 / (time.perf_counter() - start)))
    calls = 0
    readings = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(chunk):
            fn()
        calls += chunk
        sync(device)
        if time.perf_counter() - start > settle_s:
            readings.append(read_watts(device))
    calls_per_s = calls / (time.perf_counter() - start)
    return dict(readings=readings, watts=spread(readings),
                mean_watts=statistics.mean(readings), calls_per_s=calls_per_s)


def energy(device, sizes):
    """Prediction: moving a byte costs far more than a FLOP on it. Horowitz (45 nm): a
    DRAM byte 162-325 pJ, an fp16 FLOP 0.75 pJ: 217-433x. On a modern GPU the board's
    power (idle included, and every part of the chip a copy or a matmul keeps busy)
    puts a copied byte at 30-1000x a 16-bit tensor-core FLOP. A CPU's power is not
    readable without root."""
    result = dict(reference_pj=HOROWITZ_PJ,
                  reference=horowitz_per_flop_and_byte(HOROWITZ_PJ),
                  cpu_shares=[], busy=False)
    unreadable = power_unreadable(device)
    if unreadable is not None:
        result["unmeasured"] = unreadable
        return result
    print("predicted: a byte copied costs 30-1000x a 16-bit tensor-core FLOP"
          " (Horowitz: 217-433x)")
    result["cpu_shares"].append(cpu_share())
    dtype = working_dtype(device)
    a = torch.randn(ENERGY_N, ENERGY_N, device=device, dtype=dtype)
    b = torch.randn(ENERGY_N, ENERGY_N, device=device, dtype=dtype)
    src = torch.ones(ENERGY_COPY_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    matmul = sustained_power(lambda: a @ b, sizes.energy_s, device, board_watts)
    copy = sustained_power(lambda: dst.copy_(src), sizes.energy_s, device, board_watts)
    mark_busy(result)
    flops_per_s = matmul["calls_per_s"] * matmul_flop(ENERGY_N)
    bytes_per_s = copy["calls_per_s"] * copy_traffic(src.nbytes)
    figures = energy_figures(matmul["mean_watts"], flops_per_s, copy["mean_watts"],
                             bytes_per_s)
    held = 30 <= figures["byte_over_flop"] <= 1000
    result.update(dtype=str(dtype).removeprefix("torch."), seconds=sizes.energy_s,
                  matmul=matmul, copy=copy, flops_per_s=flops_per_s,
                  bytes_per_s=bytes_per_s, **figures, prediction_held=held)
    return result


def report_energy(e):
    references = []
    for name, pj in e["reference_pj"].items():
        references.append(f"{name} {pj:g}")
    print(f"  reference: pJ at 45 nm, a read of 64 bits (Horowitz, ISSCC 2014):"
          f" {', '.join(references)}")
    r = e["reference"]
    dram = r["dram_pj_per_byte"]
    print(f"  derived: per FLOP fp16 {r['fp16_pj_per_flop']:g}, fp32"
          f" {r['fp32_pj_per_flop']:g} pJ; per byte: 8 KB cache"
          f" {r['cache_8kb_pj_per_byte']:g}, 1 MB cache {r['cache_1mb_pj_per_byte']:g},"
          f" DRAM {dram[0]:g} to {dram[1]:g} pJ")
    fp16 = r["dram_byte_over_fp16_flop"]
    fp32 = r["dram_byte_over_fp32_flop"]
    print(f"  derived: a DRAM byte costs {fp16[0]:.0f}-{fp16[1]:.0f}x an fp16 FLOP,"
          f" {fp32[0]:.0f}-{fp32[1]:.0f}x an fp32 FLOP")
    if "unmeasured" in e:
        print(f"  measured: nothing - {e['unmeasured']}")
        return
    mark = busy_mark(e["busy"])
    print(f"  measured: {e['dtype']} matmul {ENERGY_N}^3 for {e['seconds']:g} s:"
          f" {with_spread(e['matmul']['watts'])} W at"
          f" {number(e['flops_per_s'] / 1e12)} TFLOP/s{mark}")
    print(f"  measured: a copy for {e['seconds']:g} s: {with_spread(e['copy']['watts'])} W"
          f" at {number(e['bytes_per_s'] / 1e9)} GB/s read + written{mark}")
    byte_over_flop = number(e["byte_over_flop"])
    print(f"  derived: {number(e['pj_per_flop'])} pJ per FLOP, {number(e['pj_per_byte'])}"
          f" pJ per byte (mean watts, idle power included): a byte costs"
          f" {byte_over_flop}x a FLOP{mark}")
    print(verdict(e, f"a byte cost {byte_over_flop}x a FLOP (predicted 30-1000x)"))


# ---------------------------------------------------------------------------------------
# 5. Prefill vs decode: one linear layer, then a real decode step

def layer_flop_and_bytes(tokens, itemsize):
    """y = x W^T, W d_ff x d_model: 2 t d f FLOPs; W, x and y each moved once."""
    flop = 2 * tokens * D_MODEL * D_FF
    nbytes = itemsize * (D_MODEL * D_FF + tokens * D_MODEL + tokens * D_FF)
    return dict(flop=flop, bytes=nbytes, intensity=flop / nbytes)


def tokens_at_intensity(intensity, itemsize):
    """The token count at which the layer reaches `intensity` FLOP/byte; None when no
    count does (as tokens grow, the intensity tends to 2 d f / (itemsize (d + f)))."""
    room = 2 * D_MODEL * D_FF - intensity * itemsize * (D_MODEL + D_FF)
    if room <= 0:
        return None
    return intensity * itemsize * D_MODEL * D_FF / room


def layer_probe(x, weights, device):
    """A function running y = x W^T for each weight copy in turn. On a GPU one CUDA
    graph holds them all and replays GRAPH_REPLAYS times a call, no launch costs."""
    def layers():
        for w in weights:
            F.linear(x, w)
    if device.type != "cuda":
        return layers
    layers()  # warm up before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()

    def replays():
        for _ in range(GRAPH_REPLAYS):
            graph.replay()
        sync(device)
    return replays


def crossover(rows, itemsize):
    """Where the flat part (1-8 tokens) meets the line through the last two rows: the
    token count and its intensity (None when the time did not grow), the flat time."""
    flat = statistics.median([row["time_us"]["median"] for row in rows[:4]])
    growth_us = rows[-1]["time_us"]["median"] - rows[-2]["time_us"]["median"]
    if growth_us <= 0:  # on a busy machine the time may not grow
        return dict(flat_us=flat, tokens=None, intensity=None)
    tokens = flat / (growth_us / rows[-2]["tokens"])
    intensity = layer_flop_and_bytes(tokens, itemsize)["intensity"]
    return dict(flat_us=flat, tokens=tokens, intensity=intensity)


def prefill_decode(device, sizes, peak, bandwidth, roofs_busy):
    """Prediction: y = x W^T with GPT-2's 3072 x 768 weight does 2 d f FLOPs a token over
    ~d f weight bytes. Its time stays flat (reading the weights, and a kernel's floor of
    a few us) until the intensity nears the ridge, peak / bandwidth (~200 FLOP/byte on an
    H100 or H200 in bf16, ~160 on an RTX 4090, ~10 on a CPU in fp32), then grows with
    the tokens: decode (1 token) is bandwidth-bound, prefill (thousands) compute-bound.
    The crossover lies within 4x of the ridge. peak: FLOP/s of part 2; bandwidth: bytes
    a second of part 1's largest set."""
    dtype = working_dtype(device)
    ridge = peak / bandwidth
    ridge_tokens = tokens_at_intensity(ridge, dtype.itemsize)
    if ridge_tokens is None:
        print(f"predicted: the ridge, {number(ridge)} FLOP/byte, is out of this layer's"
              " reach: bandwidth-bound at every token count")
    else:
        print(f"predicted: flat up to ~{ridge_tokens:.0f} tokens (the ridge,"
              f" {number(ridge)} FLOP/byte), then growing; the crossover within 4x of it")
    result = dict(dtype=str(dtype).removeprefix("torch."), peak_flops=peak,
                  bandwidth=bandwidth, ridge=ridge, roofs_busy=roofs_busy,
                  cpu_shares=[cpu_share()])
    torch.manual_seed(0)
    weights = []
    for _ in range(sizes.weight_copies):
        weights.append(torch.randn(D_FF, D_MODEL, device=device, dtype=dtype))
    calls = sizes.weight_copies  # layer calls in one sample
    if device.type == "cuda":
        calls = sizes.weight_copies * GRAPH_REPLAYS
    rows = []
    probes = []
    inputs = []  # a CUDA graph reads its input's memory at every replay: keep each alive
    for k in range(sizes.max_tokens_log2 + 1):
        x = torch.randn(2**k, D_MODEL, device=device, dtype=dtype)
        inputs.append(x)  # (the next capture empties torch's cache: a freed x would go)
        rows.append(dict(tokens=2**k, **layer_flop_and_bytes(2**k, dtype.itemsize)))
        probes.append(layer_probe(x, weights, device))
    seconds = interleaved(probes, sizes.reps)
    mark_busy(result)
    for row, samples in zip(rows, seconds):
        row["seconds"] = [t / calls for t in samples]  # one call's
        row["time_us"] = spread([t * 1e6 for t in row["seconds"]])
        row["tflops"] = spread([row["flop"] / t / 1e12 for t in row["seconds"]])
        row["gb_per_s"] = spread([row["bytes"] / t / 1e9 for t in row["seconds"]])
        row["roof_tflops"] = min(peak, row["intensity"] * bandwidth) / 1e12
        row["roofline_regime"] = "bandwidth-bound"
        if row["intensity"] >= ridge:
            row["roofline_regime"] = "compute-bound"
    first = rows[0]
    last = rows[-1]
    most_over_one = ratio([last["flop"] / t for t in last["seconds"]],
                          [first["flop"] / t for t in first["seconds"]])
    meet = crossover(rows, dtype.itemsize)
    held = False
    if meet["intensity"] is not None:
        held = ridge / 4 <= meet["intensity"] <= 4 * ridge
    result.update(rows=rows, crossover=meet, flops_most_over_one=most_over_one,
                  prediction_held=held)
    return result


def report_prefill_decode(pd):
    mark = busy_mark(pd["busy"])
    print(f"  derived: ridge = {number(pd['peak_flops'] / 1e12)} TFLOP/s (part 2) /"
          f" {number(pd['bandwidth'] / 1e9)} GB/s (part 1's largest set) ="
          f" {number(pd['ridge'])} FLOP/byte{busy_mark(pd['roofs_busy'])}")
    print(f"  {'tokens':>6} {'FLOP/byte':>9}  {'time us':<26} {'TFLOP/s':>8} {'GB/s':>7}"
          f" {'roof TFLOP/s':>12}  roofline's regime{mark}")
    for row in pd["rows"]:
        intensity = number(row["intensity"])
        tflops = number(row["tflops"]["median"])
        gb_per_s = number(row["gb_per_s"]["median"])
        roof = number(row["roof_tflops"])
        print(f"  {row['tokens']:6} {intensity:>9}  {with_spread(row['time_us']):<26}"
              f" {tflops:>8} {gb_per_s:>7} {roof:>12}  {row['roofline_regime']}")
    print(f"  legend: FLOP/byte counted ({pd['dtype']}: W, x and y moved once); time"
          " measured, median [min, max]; TFLOP/s and GB/s at the median; roof ="
          " min(peak, FLOP/byte x bandwidth), derived")
    meet = pd["crossover"]
    if meet["tokens"] is None:
        print(f"  derived: no crossover - the time did not grow at the largest token"
              f" counts{mark}")
    else:
        print(f"  derived: the flat {number(meet['flat_us'])} us (1-8 tokens) meets the"
              f" line through the last two rows at {number(meet['tokens'])} tokens,"
              f" {number(meet['intensity'])} FLOP/byte:"
              f" {number(meet['intensity'] / pd['ridge'])}x the ridge{mark}")
    r = pd["flops_most_over_one"]
    print(f"  derived: {pd['rows'][-1]['tokens']} tokens run {with_spread(r)}x the FLOP/s"
          f" of 1 token{noise_mark(r, pd['busy'])}")
    where = "none"
    if meet["intensity"] is not None:
        where = f"{number(meet['intensity'] / pd['ridge'])}x the ridge"
    print(verdict(pd, f"the crossover at {where} (predicted within 4x)"))


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


def kv_cache(config, length, device, dtype=torch.float32):
    """Keys and values of `length` positions for every layer, zeros to start with."""
    shape = (1, config.n_head, length, config.n_embd // config.n_head)
    cache = []
    for _ in range(config.n_layer):
        keys = torch.zeros(shape, device=device, dtype=dtype)
        values = torch.zeros(shape, device=device, dtype=dtype)
        cache.append((keys, values))
    return cache


def decode_bytes(config, context, itemsize):
    """Bytes a batch-1 decode step reads: every weight once (the tied head counted once,
    the one position-table row left out), the keys and values of every cached token."""
    weights = param_count(config, position=False)
    kv = 2 * config.n_layer * (context + 1) * config.n_embd
    return itemsize * (weights + kv)


def decode_ceilings(bandwidth):
    """Batch-1 decode tokens a second at most: bandwidth / 16-bit weight bytes."""
    ceilings = {}
    for preset in ("gpt2", "gpt2-medium"):
        weight_bytes = 2 * param_count(GPTConfig.preset(preset), position=False)
        ceilings[preset] = bandwidth / weight_bytes
    return ceilings


def time_decode(model, token, context, cache, device, sizes):
    """Each round: `steps` decode steps read by two clocks - when the host has issued
    the last operation, and when the device has finished it - then TINY_OPS bare add_
    calls (one dispatch's cost). Seconds a step issued and finished, and a tiny op's."""
    scratch = torch.zeros(1, device=device)
    clocks = dict(issued=[], finished=[], tiny=[])
    for round_ in range(sizes.reps + 1):  # round 0 warms up
        sync(device)
        start = time.perf_counter()
        for _ in range(sizes.steps):
            cached_forward(model, token, context, cache)
        issued = time.perf_counter() - start
        sync(device)
        finished = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(TINY_OPS):
            scratch.add_(1)
        sync(device)
        tiny = time.perf_counter() - start
        if round_ > 0:
            clocks["issued"].append(issued / sizes.steps)
            clocks["finished"].append(finished / sizes.steps)
            clocks["tiny"].append(tiny / TINY_OPS)
    return clocks


@torch.no_grad()
def decode_step(device, sizes, bandwidth, bandwidth_busy):
    """Prediction: at batch 1 a decode step reads every weight once: GPT-2 124M in bf16
    is ~250 MB, ~60 us at 4 TB/s. On a GPU it also dispatches ~150 operations from
    Python, each costing more host time (5-20 us: Python, argument handling, launch)
    than its kernel needs: eager decode is overhead-bound, >= 10x that ceiling, the
    host still issuing for >= half of the step (CUDA graphs or a compiler, Section 13.3,
    remove that). A CPU's issuing thread runs each operation itself, so nothing overlaps
    and the step is its work: bandwidth-bound, within 3x of the ceiling, dispatch under
    10% of the step."""
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
    error = ((logits - full).abs().max() / full.abs().max()).item()
    # The timing, in the lesson's format.
    dtype = working_dtype(device)
    model.to(dtype)
    cache = kv_cache(config, context + 1, device, dtype)
    token = idx[:, context:]
    with CountOps() as counter:
        cached_forward(model, token, context, cache)
    nbytes = decode_bytes(config, context, dtype.itemsize)
    ceiling_us = nbytes / bandwidth * 1e6
    if device.type == "cuda":
        print(f"predicted: overhead-bound: >= 10x the ceiling of {number(ceiling_us)} us"
              f" a token, the host issuing its {counter.count} ops for >= half the step")
    else:
        print(f"predicted: bandwidth-bound: within 3x of the ceiling of"
              f" {number(ceiling_us)} us a token; {counter.count} ops x a tiny op's"
              " dispatch under 10% of the step")
    result = dict(device=device.type, preset=sizes.decode_preset,
                  dtype=str(dtype).removeprefix("torch."), context=context,
                  bytes_per_step=nbytes, bandwidth=bandwidth,
                  bandwidth_busy=bandwidth_busy, ceiling_us=ceiling_us,
                  ops_per_step=counter.count, cached_vs_full_rel_error=error,
                  cpu_shares=[cpu_share()])
    clocks = time_decode(model, token, context, cache, device, sizes)
    mark_busy(result)
    dispatch = [counter.count * t for t in clocks["tiny"]]
    eager_us = spread([t * 1e6 for t in clocks["finished"]])
    over_ceiling = eager_us["median"] / ceiling_us
    issue_share = ratio(clocks["issued"], clocks["finished"])
    dispatch_share = ratio(dispatch, clocks["finished"])
    issue_over_dispatch = ratio(clocks["issued"], dispatch)
    held = over_ceiling <= 3 and dispatch_share["median"] < 0.1
    if device.type == "cuda":
        held = over_ceiling >= 10 and issue_share["median"] >= 0.5
    result.update(clocks=clocks, eager_us=eager_us,
                  issued_us=spread([t * 1e6 for t in clocks["issued"]]),
                  tiny_op_us=spread([t * 1e6 for t in clocks["tiny"]]),
                  dispatch_us=spread([t * 1e6 for t in dispatch]),
                  eager_over_ceiling=over_ceiling, issue_share=issue_share,
                  dispatch_share=dispatch_share, issue_over_dispatch=issue_over_dispatch,
                  tokens_per_s_ceiling=decode_ceilings(bandwidth),
                  checks=dict(decode_cache_matches_full_forward=error < DECODE_BOUND),
                  prediction_held=held)
    return result


def report_decode_step(step):
    mark = busy_mark(step["busy"])
    bandwidth_mark = busy_mark(step["bandwidth_busy"])
    print(f"  {step['preset']} in {step['dtype']}, {step['context']} tokens cached:"
          f" {number(step['bytes_per_step'] / 1e6)} MB read a token (counted)")
    print(f"  derived: ceiling {number(step['ceiling_us'])} us a token (those bytes /"
          f" {number(step['bandwidth'] / 1e9)} GB/s){bandwidth_mark}")
    over = f"{number(step['eager_over_ceiling'])}x the ceiling"
    print(f"  measured: eager {with_spread(step['eager_us'])} us a token, synchronised:"
          f" {over}{mark}")
    issued = f"{number(100 * step['issue_share']['median'])}%"
    if step["device"] == "cuda":
        print(f"  measured: the host had issued the step's ops after"
              f" {with_spread(step['issued_us'])} us, {issued} of the step{mark}")
    else:
        print(f"  measured: issuing ended at {with_spread(step['issued_us'])} us,"
              f" {issued} of the step: a CPU's thread runs each op before it issues the"
              " next")
    dispatch = f"{number(100 * step['dispatch_share']['median'])}%"
    print(f"  measured: a bare add_ {with_spread(step['tiny_op_us'])} us; derived: x"
          f" {step['ops_per_step']} ops (counted) = {with_spread(step['dispatch_us'])}"
          f" us, {dispatch} of the step{mark}")
    print(f"  cached == full forward (fp32): {step['cached_vs_full_rel_error']:.1e} max"
          " rel. error")
    for name, ok in step["checks"].items():
        print(check_line(name, ok))
    for preset, tokens_per_s in step["tokens_per_s_ceiling"].items():
        print(f"  derived: batch-1 ceiling of {preset} in 16 bits: {number(tokens_per_s)}"
              f" tokens/s (bandwidth / weight bytes){bandwidth_mark}")
    eager = f"{number(step['eager_us']['median'])} us a token"
    if step["device"] == "cuda":
        r = step["issue_over_dispatch"]
        print(f"  derived: issuing an op of the model took {with_spread(r)}x a bare add_"
              " (module calls, argument handling, attention choosing its kernel)"
              f"{noise_mark(r, step['busy'])}")
        print(verdict(step, f"{eager}, {over}, the host issuing for {issued} of it"
                            " (predicted >= 10x, >= 50%)"))
    else:
        print(verdict(step, f"{eager}, {over}, dispatch {dispatch} (predicted within 3x,"
                            " under 10%)"))


# ---------------------------------------------------------------------------------------
# 6. This machine beside the reference machines

def spec_table(machine, ladder, hierarchy, links):
    """This machine's row (measured) above the reference rows (bf16 peak and bandwidth
    from model_torch.DATASHEETS, the rest from REFERENCE_ROWS); the share of its own
    datasheet this card reached; and where its L2 differs from its reference row's,
    both numbers."""
    mine = dict(label=machine["name"][:24], source="measured", bf16=None, tf32=None,
                fp8=None, fp32=None, l2_mb=None, link="-",
                tb_per_s=hierarchy["largest"]["gb_per_s"]["median"] / 1e3)
    for name in ("bf16", "tf32", "fp8", "fp32"):
        row = ladder["formats"].get(name)
        if row is not None and row["n"] == ladder["n"]:  # not an emulated fp8
            mine[name] = row["tflops"]["median"]
    if machine["type"] == "cuda":
        mine["l2_mb"] = hierarchy["caches"]["L2"] / 2**20
        pinned = links["host"]["rows"]["host->GPU pinned"]["gb_per_s"]["median"]
        mine["link"] = f"host->GPU pinned {number(pinned)} GB/s"
    rows = [mine]
    for name, extra in REFERENCE_ROWS.items():
        sheet = model_torch.datasheet(name)
        rows.append(dict(label=extra.label, source="reference",
                         bf16=sheet.bf16_flops / 1e12, tf32=extra.tf32, fp8=extra.fp8,
                         fp32=extra.fp32, tb_per_s=sheet.bandwidth / 1e12,
                         l2_mb=extra.l2_mb, link=extra.link))
    busy = any([ladder["busy"], hierarchy["busy"]])
    result = dict(rows=rows, of_datasheet=None, l2=None, busy=busy)
    sheet = model_torch.datasheet(machine["name"])
    if sheet is not None:
        result["of_datasheet"] = dict(tb_per_s=mine["tb_per_s"] * 1e12 / sheet.bandwidth)
        if mine["bf16"] is not None:
            result["of_datasheet"]["bf16"] = mine["bf16"] * 1e12 / sheet.bf16_flops
    extra = REFERENCE_ROWS.get(machine["name"])
    if extra is not None and round(mine["l2_mb"]) != extra.l2_mb:
        result["l2"] = dict(label=extra.label, reference_mb=extra.l2_mb,
                            source=extra.l2_source, reported_mb=mine["l2_mb"],
                            cliff_bytes=hierarchy["cliff_bytes"])
    return result


def report_spec_table(table):
    columns = ["bf16", "tf32", "fp8", "fp32", "tb_per_s", "l2_mb"]
    print(f"  {'':>26} {'bf16':>7} {'tf32':>7} {'fp8':>7} {'fp32':>7} {'TB/s':>7}"
          f" {'L2 MB':>7}  link")
    for row in table["rows"]:
        cells = ""
        for column in columns:
            text = "-"  # a number this machine or card has not got
            if row[column] is not None:
                text = number(row[column])
            cells += f" {text:>7}"
        label = f"{row['label']} ({row['source']})"
        print(f"  {label:>26}{cells}  {row['link']}")
    print("  legend: TFLOP/s dense (fp32 accumulate), memory TB/s, L2 MB. measured: parts"
          " 1-3 of this run (TB/s: the largest set's reads); reference: datasheets (bf16"
          f" and TB/s from model_torch.DATASHEETS); -: none{busy_mark(table['busy'])}")
    of_datasheet = table["of_datasheet"]
    if of_datasheet is not None:
        reached = f"{100 * of_datasheet['tb_per_s']:.0f}% of its datasheet's bandwidth"
        if "bf16" in of_datasheet:
            peak = f"{100 * of_datasheet['bf16']:.0f}% of its datasheet's bf16 peak"
            reached = f"{peak} and {reached}"
        print(f"  derived: this card reached {reached}{busy_mark(table['busy'])}")
    l2 = table["l2"]
    if l2 is not None:
        cliff = "no set read below half the fastest rate"
        if l2["cliff_bytes"] is not None:
            cliff = (f"reads fell below half the fastest rate from"
                     f" {size_label(l2['cliff_bytes'])}")
        print(f"  reference: the {l2['label']} row's L2 is {number(l2['reference_mb'])} MB"
              f" ({l2['source']}); measured: the driver reports"
              f" {number(l2['reported_mb'])} MB for this card, and in part 1 {cliff}")


def figure(hierarchy, device_name, out):
    """Read bandwidth against working-set size, its spread shaded, the caches marked."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plt.switch_backend("Agg")
    points = hierarchy["points"]
    sizes = [point["bytes"] for point in points]
    medians = [point["gb_per_s"]["median"] for point in points]
    lows = [point["gb_per_s"]["low"] for point in points]
    highs = [point["gb_per_s"]["high"] for point in points]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    ax.loglog(sizes, medians, "o-", label="median")
    ax.fill_between(sizes, lows, highs, alpha=0.3, label="min to max")
    for level, size in hierarchy["caches"].items():
        ax.axvline(size, ls="--", c="gray")
        ax.annotate(level, (size, 1.02), xycoords=("data", "axes fraction"), ha="center")
    ticks = [2**k for k in range(14, 33, 2) if 2**k <= sizes[-1]]
    ax.set_xticks(ticks, [size_label(t) for t in ticks])
    ax.tick_params(axis="x", which="minor", bottom=False)
    ax.yaxis.set_major_formatter("{x:g}")  # 20, not 2 x 10^1
    ax.yaxis.set_minor_formatter("{x:g}")
    ax.set(xlabel="working set", ylabel="read bandwidth (GB/s), measured")
    title = f"Read bandwidth against working-set size\non {device_name}"
    ax.set_title(title + busy_mark(hierarchy["busy"]), pad=16)
    ax.legend()
    path = out / "02_hardware.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------
# The tools every experiment above uses: timing on a machine that may be busy
# (interleaved samples, medians with their spread), and printing.

BUSY_SHARE = 0.9  # below this share of a core, other programs were taking the CPU


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


def interleaved(fns, reps, gap_s=0.0):
    """Seconds of each call of each function, the functions called in turn (A, B, A, B,
    ...), so a machine slowed for a while slows every side alike. Each function
    synchronises its own device before it returns. One untimed round first (warm-up);
    gap_s: idle before each timed call (a GPU matmul then runs as a burst, not on a
    chip still hot from the one before)."""
    for fn in fns:
        fn()
    seconds = [[] for _ in fns]
    for _ in range(reps):
        for samples, fn in zip(seconds, fns):
            time.sleep(gap_s)
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return seconds


def spread(samples):
    """The median of some samples, with the lowest and the highest."""
    return dict(median=statistics.median(samples), low=min(samples), high=max(samples))


def ratio(numerators, denominators):
    """A ratio of two interleaved measurements: the median of the per-pair ratios
    a_i / b_i, with their lowest and highest."""
    return spread([a / b for a, b in zip(numerators, denominators)])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mark_busy(experiment):
    """An experiment's closing CPU-share sample (its opening one was taken before it
    measured; the lesson's own threads are idle at both): busy when either is below
    BUSY_SHARE."""
    experiment["cpu_shares"].append(cpu_share())
    experiment["busy"] = min(experiment["cpu_shares"]) < BUSY_SHARE


def number(x):
    """Three significant figures without an exponent: 17068, 4.23, 0.00133."""
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.3g}"


def with_spread(s):
    """'median [low, high]' of a spread."""
    return f"{number(s['median'])} [{number(s['low'])}, {number(s['high'])}]"


def busy_mark(busy):
    if busy:
        return " (machine busy)"
    return ""


def noise_mark(r, busy):
    """What a printed ratio carries: it is a finding only when its whole range lies on
    one side of 1 and the machine was not busy."""
    if busy:
        return " (machine busy)"
    if r["low"] <= 1 <= r["high"]:
        return " (within noise)"
    return ""


def verdict(experiment, measured):
    """The line that closes an experiment: whether its prediction held, by what."""
    held = "missed"
    if experiment["prediction_held"]:
        held = "held"
    return f"  prediction {held}: {measured}{busy_mark(experiment['busy'])}"


def check_line(name, ok):
    if ok:
        return f"  check {name}: ok"
    return f"  check {name}: FAILED"


def size_label(nbytes):
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------------------------------
# The run: the machine, flags and files.

def describe(device):
    """The machine: its name, memory, GPUs and threads, and the torch version."""
    name = "CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux
        found = re.search(r"model name\s*: (.+)", cpuinfo.read_text())
        if found:
            name = found.group(1)
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    capability = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = props.name
        memory_gb = props.total_memory / 1e9
        capability = f"{props.major}.{props.minor}"
    return dict(name=name, type=device.type, memory_gb=memory_gb, capability=capability,
                gpus=torch.cuda.device_count(), threads=torch.get_num_threads(),
                torch=torch.__version__)


def report_machine(machine, device):
    print(f"device: {machine['name']} ({machine['type']}), {machine['memory_gb']:.0f} GB,"
          f" {machine['gpus']} GPUs visible, {machine['threads']} CPU threads;"
          f" torch {machine['torch']}")
    sheet = model_torch.datasheet(machine["name"])
    if sheet is None:
        print(f"reference: no datasheet row for {machine['name']}: roofs measured only")
    else:
        print(f"reference: the {machine['name']}'s datasheet: bf16"
              f" {number(sheet.bf16_flops / 1e12)} TFLOP/s dense,"
              f" {number(sheet.bandwidth / 1e12)} TB/s")
    if device.type == "cuda" and not has_bf16_tensor_cores(device):
        print(f"this GPU (compute capability {machine['capability']}) has no bf16 tensor"
              " cores: fp16 stands in for bf16 below; tf32, bf16 and fp8 are skipped")


def summarise(experiments):
    """The JSON's top level: every CPU-share sample, whether any experiment ran on a busy
    machine, each prediction's verdict and each self-check."""
    shares = []
    busy = []
    predictions = {}
    checks = {}
    for name, experiment in experiments.items():
        shares += experiment["cpu_shares"]
        if experiment["busy"]:
            busy.append(name)
        if "prediction_held" in experiment:
            predictions[name] = experiment["prediction_held"]
        checks.update(experiment.get("checks", {}))
    if busy:
        print(f"\nmachine busy: other programs took the CPU during {', '.join(busy)};"
              " the marked numbers are not findings")
    return dict(machine_busy=bool(busy), cpu_shares=shares, predictions=predictions,
                checks=checks)


def pick_device(choice):
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda:0")
    if choice == "cuda":
        sys.exit("error: --device cuda: PyTorch sees no CUDA GPU here")
    return torch.device("cpu")


def pick_sizes(device, quick):
    if device.type == "cuda" and quick:
        return GPU_QUICK
    if device.type == "cuda":
        return GPU
    if quick:
        return QUICK
    return Sizes()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--out", type=Path, default=Path("out"), help="figure folder")
    return parser.parse_args()


def main():
    args = parse_args()
    json_file = None
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        json_file = open(args.json, "w")  # a path that cannot be written fails here
    args.out.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    sizes = pick_sizes(device, args.quick)
    machine = describe(device)
    report_machine(machine, device)

    print("\n1. Memory hierarchy: read bandwidth against working-set size")
    hierarchy = memory_hierarchy(device, sizes)
    report_hierarchy(hierarchy)

    print("\n2. Tensor cores and the format ladder")
    ladder = format_ladder(device, sizes)
    report_ladder(ladder)

    print("\n3. Interconnects: host <-> GPU, pageable and pinned; GPU -> GPU")
    links = interconnects(device, sizes)
    report_links(links)

    print("\n4. Energy per FLOP and per byte")
    power = energy(device, sizes)
    report_energy(power)

    print(f"\n5. Prefill vs decode: one GPT-2 linear layer, {D_MODEL} -> {D_FF}, from 1"
          " token to thousands")
    roof_format = ladder["low_precision"]  # a GPU's bf16 (fp16 before sm80)
    if device.type == "cpu":
        roof_format = "fp32"  # a CPU's fastest
    peak = ladder["formats"][roof_format]["tflops"]["median"] * 1e12
    bandwidth = hierarchy["largest"]["gb_per_s"]["median"] * 1e9
    roofs_busy = any([hierarchy["busy"], ladder["busy"]])
    layer = prefill_decode(device, sizes, peak, bandwidth, roofs_busy)
    report_prefill_decode(layer)

    print("\n5b. Prefill vs decode: a real batch-1 decode step of GPT-2 with a KV cache")
    step = decode_step(device, sizes, bandwidth, hierarchy["busy"])
    report_decode_step(step)

    print("\n6. This machine beside the reference machines")
    table = spec_table(machine, ladder, hierarchy, links)
    report_spec_table(table)

    path = figure(hierarchy, machine["name"], args.out)
    print("\nFigure: read bandwidth against working-set size")
    if path is None:
        print("  skipped: matplotlib is not installed")
    else:
        print(f"  {path}")
        path = str(path)

    experiments = dict(memory_hierarchy=hierarchy, format_ladder=ladder,
                       interconnect=links, energy=power, prefill_decode=layer,
                       decode_step=step)
    result = dict(lesson="02_hardware", device=machine, quick=args.quick)
    result.update(summarise(experiments))
    result.update(experiments, spec_table=table, figure=path)
    if json_file is not None:
        json.dump(result, json_file, indent=1)
        json_file.close()
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed:
        sys.exit(f"check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
