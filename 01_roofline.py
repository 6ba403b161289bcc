"""
01_roofline.py - Section 13.1: the map (the roofline) and the method (measure, then classify).

An op is held back by how fast the machine does arithmetic, or by how fast it moves bytes,
or - when it is small - by neither: by the fixed cost of asking for it at all. This script
finds out which, on your machine, in the section's order:

  1. The two ceilings: peak matmul FLOP/s (bf16 on a GPU, fp32 on a CPU) and memory
     bandwidth (a large copy, bytes read + written). Their ratio is the ridge point.
  2. A dozen ops, vector add to large matmul: FLOPs and bytes counted, time measured.
  3. Each op classified from its measurement - compute-, bandwidth- or overhead-bound - next
     to what its arithmetic intensity predicted; tiny ops show the flat per-call floor.
  4. Measurement discipline, shown by running it: no synchronisation, first call vs warm,
     median vs mean, JAX with and without block_until_ready.
  5. The roofline figure with every op on it (out/01_roofline.png).

Run:
  python 01_roofline.py                  # CUDA if present, else CPU (about a minute on 2 cores)
  python 01_roofline.py --device cpu     # force the CPU
  python 01_roofline.py --quick          # a few seconds: the smoke run the tests use
  python 01_roofline.py --json r.json    # every number, machine-readable
One device is enough: with several GPUs it measures cuda:0 (no torchrun).

Expect on an H200: ~800 TFLOP/s bf16, ~4.2 TB/s, a ridge near 190 FLOP/byte; big matmuls
compute-bound, elementwise and norm ops near the memory roof, tiny ops at a floor of a few
microseconds. On a small CPU: tens of GFLOP/s, 5-20 GB/s, a ridge of a few FLOP/byte.
"""

import os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # else JAX takes 75% of the GPU

import argparse
import ctypes
import importlib.metadata
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from model_torch import datasheet_bf16_peak

# Reference memory bandwidths (NVIDIA datasheets, as in REFERENCES.md), printed beside ours.
DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "RTX 4090": 1.01e12}

# Step 3's rule in two numbers (printed where it is applied).
FLAT = 2         # overhead-bound: time < 2x the same op on toy inputs (every dimension <= 8)
NEAR_ROOF = 0.5  # an op at >= 50% of its roof is "near" it; under that, "far below"


def si(x, unit=""):
    """812.3e12 -> '812 T' + unit."""
    for p, s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= p:
            return f"{x / p:.3g} {s}{unit}"
    return f"{x:.3g} {unit}"


def secs(t):
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


# ------------------------------------------------------------------------------------------
# Honest timing: warm up, wait for the device before reading a clock, repeat, take the median.

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device, reps, target_s, warmup_s=0.0, gap_s=0.0):
    """Seconds per call of fn(): the cold first call, then `reps` warm samples. A sample
    averages `inner` back-to-back calls so that microsecond ops outlast the clock; on a GPU,
    CUDA events bracket the calls and we wait for the end event before reading it.
    gap_s > 0: the device idles that long before each sample (then one untimed call wakes
    its clocks), so every sample is a burst, not part of a power-limited marathon."""
    sync(device)
    t0 = time.perf_counter(); fn(); sync(device); first = time.perf_counter() - t0
    t0 = time.perf_counter(); fn(); sync(device); one = time.perf_counter() - t0
    inner = max(1, min(1000, round(target_s / one)))
    deadline = time.perf_counter() + warmup_s  # a GPU raises its clocks under load: let it
    while time.perf_counter() < deadline:
        fn(); sync(device)
    samples = []
    for _ in range(reps):
        if gap_s:
            time.sleep(gap_s); fn(); sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record(); end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
    return dict(median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples),
                first_s=first, inner=inner, samples_s=samples)


def rotating(fn, shapes, z, device, dtype=None):
    """fn over random inputs of these shapes, cycling through enough copies that together they
    exceed the last-level cache three times over: a warm cache must not flatter the bytes/s."""
    dtype = dtype or z["dtype"]
    nbytes = sum(math.prod(s) for s in shapes) * dtype.itemsize
    copies = max(2, min(64, math.ceil(3 * z["cache"] / nbytes)))
    sets = [[torch.randn(s, device=device, dtype=dtype) for s in shapes] for _ in range(copies)]
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


# ------------------------------------------------------------------------------------------
# 1. The two ceilings

def measure_ceilings(z, device, ref_flops, ref_bw):
    # PREDICTION: a big square matmul does ~n/3 FLOPs per byte, far right of any ridge, so it
    # runs at the compute roof; a copy does no arithmetic, so it runs at the memory roof.
    # On an H200: ~80% of the 989 TFLOP/s datasheet bf16 peak and ~90% of its 4.8 TB/s.
    # The roof is what the chip does in bursts of a few ms, as the ops below run: on a GPU each
    # matmul sample follows an idle gap. Sustained for a second, an H200 reaches its 700 W
    # power limit and lowers its clocks (PREDICTION: ~10-15% slower; measured below, and
    # 02_hardware.py's energy section measures the watts).
    # The roof is the best the chip does on a large matmul, so try three shapes and keep the
    # fastest (as Bekman's mamf-finder searches shapes): one shape can tile the chip unevenly.
    n, dt = z["peak_n"], str(z["dtype"]).replace("torch.", "")
    tried = {}
    for M, K, N in [(n, n, n), (n // 2, n // 2, n // 2), (n, n // 2, 2 * n)]:
        t = measure(rotating(torch.matmul, [(M, K), (K, N)], z, device), device, z["reps"],
                    z["target_s"], z["warmup_s"], z["burst_gap_s"])
        tried[f"{M}x{K}x{N}"] = dict(flops=2 * M * K * N, **t)
    shape, mm = max(tried.items(), key=lambda kv: kv[1]["flops"] / kv[1]["median_s"])
    flops = mm["flops"]
    sustained = None
    if z["burst_gap_s"]:  # the same matmul back to back, after a full second of it
        M, K, N = map(int, shape.split("x"))
        sustained = measure(rotating(torch.matmul, [(M, K), (K, N)], z, device), device, z["reps"],
                            z["target_s"], warmup_s=1.0)
    src = torch.randn(z["copy_n"], device=device, dtype=z["dtype"])
    dst = torch.empty_like(src)
    cp = measure(lambda: dst.copy_(src), device, z["reps"], z["target_s"], z["warmup_s"])
    moved = 2 * src.numel() * z["elem"]  # every byte read once and written once
    peak, bw = flops / mm["median_s"], moved / cp["median_s"]
    print(f"\n1. The two ceilings (measured; median of {z['reps']}, spread min-max)")
    print(f"  compute roof {si(peak, 'FLOP/s'):>14}   {dt} matmul {shape}, the fastest of "
          + ", ".join(f"{k} {si(v['flops'] / v['median_s'], 'FLOP/s')}" for k, v in tried.items())
          + f"   ({si(flops / mm['max_s'])}-{si(flops / mm['min_s'])})")
    if sustained:
        print(f"  (sustained)  {si(flops / sustained['median_s'], 'FLOP/s'):>14}   the same matmul back to back after"
              f" 1 s of it: {sustained['median_s'] / mm['median_s'] - 1:.0%} slower per call (derived) - the power limit"
              f" (each roof sample above followed {z['burst_gap_s'] * 1e3:.0f} ms idle)")
    print(f"  memory roof  {si(bw, 'B/s'):>14}   copy of {si(moved / 2, 'B')}, bytes read + written"
          f"   ({si(moved / cp['max_s'])}-{si(moved / cp['min_s'])})")
    print(f"  ridge point  {peak / bw:>8.1f} FLOP/B   (derived: compute roof / memory roof). An op doing"
          f" fewer FLOPs per byte waits on memory, more on arithmetic")
    if ref_flops and ref_bw:
        print(f"  reference    datasheet {si(ref_flops, 'FLOP/s')} dense bf16, {si(ref_bw, 'B/s')}:"
              f" measured = {peak / ref_flops:.0%} and {bw / ref_bw:.0%} of the paper numbers")
    return dict(peak_flops=peak, bandwidth_bytes_per_s=bw, ridge_flop_per_byte=peak / bw,
                copy_is_exact=torch.equal(dst, src), matmul=dict(shape=shape, dtype=dt, **mm),
                matmul_shapes_tried={k: v["flops"] / v["median_s"] for k, v in tried.items()},
                matmul_burst_gap_s=z["burst_gap_s"],
                matmul_sustained=sustained and dict(flops_per_s=flops / sustained["median_s"], **sustained),
                copy=dict(bytes_moved=moved, **cp),
                reference=dict(datasheet_bf16_flops=ref_flops, datasheet_bandwidth=ref_bw))


# ------------------------------------------------------------------------------------------
# 2. A dozen ops on the roofline

def count(n):
    return si(n).replace(" ", "")


def make_ops(z):
    """key: (label, function, input shapes, FLOPs, minimum bytes, dtype), all counted on paper.
    Minimum bytes: every input read once, every output written once - no kernel moves fewer.
    Elementwise ops, norms and reductions run in fp32 (activations, optimizer math), the
    matmuls in the compute roof's dtype; bytes are bytes, so both meet the same memory roof."""
    e, v, n = z["elem"], torch.float32.itemsize, z["n"]
    (R, C), (Rn, Cn) = z["softmax_shape"], z["norm_shape"]
    t, m, (M, K, N), (T, D), B = z["tiny"], z["medium"], z["large"], z["decode"], z["bmm"]
    fp32, mm = torch.float32, z["dtype"]
    return {
        "vector_add_tiny": ("vector add 1k", torch.add, [(1024,)] * 2, 1024, 3 * 1024 * v, fp32),
        "vector_add": (f"vector add {count(n)}", torch.add, [(n,)] * 2, n, 3 * n * v, fp32),
        "scale": (f"scale x*2 {count(n)}", lambda x: x * 2.0, [(n,)], n, 2 * n * v, fp32),
        # GELU: ~8 FLOPs per element by convention (the erf counted as one)
        "gelu": (f"GELU {count(n)}", F.gelu, [(n,)], 8 * n, 2 * n * v, fp32),
        # softmax, per element: max, subtract, exp, sum, divide
        "softmax": (f"softmax {count(R)}x{C}", lambda x: torch.softmax(x, -1), [(R, C)],
                    5 * R * C, 2 * R * C * v, fp32),
        # layernorm, per element: mean, subtract, square, sum, normalise, gain, bias (+1)
        "layernorm": (f"layernorm {count(Rn)}x{Cn}", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
                      [(Rn, Cn), (Cn,), (Cn,)], 8 * Rn * Cn, (2 * Rn * Cn + 2 * Cn) * v, fp32),
        "sum": (f"sum {count(n)}", torch.sum, [(n,)], n, (n + 1) * v, fp32),
        "matmul_tiny": (f"matmul {t}^3", torch.matmul, [(t, t)] * 2, 2 * t**3, 3 * t * t * e, mm),
        "matmul_decode": (f"matmul {T} tok x {D}^2", torch.matmul, [(T, D), (D, D)],
                          2 * T * D * D, (2 * T * D + D * D) * e, mm),
        "bmm_small": (f"bmm {count(B)} x 64^3", torch.bmm, [(B, 64, 64)] * 2,
                      2 * B * 64**3, 3 * B * 64 * 64 * e, mm),
        "matmul_medium": (f"matmul {m}^3", torch.matmul, [(m, m)] * 2, 2 * m**3, 3 * m * m * e, mm),
        "matmul_large": (f"matmul {M}x{K}x{N}", torch.matmul, [(M, K), (K, N)],
                         2 * M * K * N, (M * K + K * N + M * N) * e, mm),
    }


def place_ops(z, device, peak, bw):
    # PREDICTION: elementwise ops, norms and reductions do 1-8 FLOPs per element moved: a
    # few FLOP/byte at most, left of the ridge, under the memory roof. A matmul's intensity
    # grows with its smallest dimension: a few tokens against a big weight, or 64x64 blocks,
    # stay left of a GPU's ridge; square matmuls of thousands cross it to the compute roof.
    print("\n2. A dozen ops on the roofline (FLOPs and bytes counted, time measured, the rest derived)")
    print(f"  {'op':<26}{'FLOPs':>9}{'bytes':>9}{'FLOP/B':>8}{'bound':>13}{'time':>11}"
          f"{'achieved':>13}{'bytes/s':>11}{'% bound':>8}")
    ops = {}
    for key, (label, fn, shapes, flops, nbytes, dtype) in make_ops(z).items():
        t = measure(rotating(fn, shapes, z, device, dtype), device, z["reps"], z["target_s"])
        toy_shapes = [tuple(min(d, 8) for d in s) for s in shapes]  # the same call, ~no work
        toy = measure(rotating(fn, toy_shapes, z, device, dtype), device, z["reps"], z["target_s"])
        time_s, intensity = t.pop("median_s"), flops / nbytes
        bound = min(peak, intensity * bw)  # the roofline: the FLOP/s this op can attain
        ops[key] = dict(label=label, flops=flops, bytes=nbytes, intensity=intensity, bound_flops=bound,
                        time_s=time_s, toy_time_s=toy["median_s"], achieved_flops=flops / time_s,
                        achieved_bytes_per_s=nbytes / time_s, fraction_of_bound=flops / time_s / bound,
                        predicted="compute" if intensity >= peak / bw else "bandwidth", **t)
        print(f"  {label:<26}{si(flops):>9}{si(nbytes):>9}{intensity:>8.3g}{si(bound, 'FLOP/s'):>13}"
              f"{secs(time_s):>11}{si(flops / time_s, 'FLOP/s'):>13}{si(nbytes / time_s, 'B/s'):>11}"
              f"{flops / time_s / bound:>8.0%}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    over = [op for op in ops.values() if op["fraction_of_bound"] > 1]
    if any(op["intensity"] * bw >= peak for op in over):
        print("  above 100% of the compute roof (derived): the roof is a median over samples of three"
              " shapes; another shape, or its own sample spread, can land a few % above it")
    if any(op["intensity"] * bw < peak for op in over):
        print("  above 100% of the memory roof (derived): the copy roof counts 2 bytes per element"
              + (" moved,\n    but a CPU's write-allocate reads the destination first, so a copy moves 3"
                 " (an add 4 for 3 counted): adds and scales can beat the copy" if device.type == "cpu"
                 else " moved, half of them writes;\n    ops that mostly read (a sum, a matmul streaming its"
                      " weights) run a few % faster than a copy"))
    return ops


# ------------------------------------------------------------------------------------------
# 3. The three regimes, classified from the measurement

def overhead_sweep(z, device, bw):
    # PREDICTION: a vector add of 64 elements costs what one of 64 thousand does: the fixed
    # cost of a call (Python, PyTorch's dispatcher, a kernel launch), a few microseconds. Time
    # grows with size only once the bytes take longer than that: past floor x bandwidth.
    sweep = []
    for p in z["sweep"]:
        t = measure(rotating(torch.add, [(2**p,)] * 2, z, device, torch.float32), device, z["reps"],
                    z["target_s"])
        sweep.append(dict(elements=2**p, bytes=3 * 2**p * 4, time_s=t["median_s"]))
    floor = statistics.median(s["time_s"] for s in sweep[:3])
    i = next((i for i, s in enumerate(sweep) if s["time_s"] > 2 * floor), None)
    grown = sweep[0]["bytes"] if i == 0 else None
    if i:  # sizes step 4x: interpolate log-log between the two points that bracket 2x the floor
        (b0, t0), (b1, t1) = [(sweep[j]["bytes"], sweep[j]["time_s"]) for j in (i - 1, i)]
        grown = b0 * (b1 / b0) ** (math.log(2 * floor / t0) / math.log(t1 / t0))
    return dict(floor_s=floor, sweep=sweep, crossover_bytes=grown, predicted_crossover_bytes=floor * bw)


def classify(op, peak, bw):
    """Overhead first: time flat in size (measured at two sizes). Else the roof the op comes
    nearer to, as a fraction of each measured ceiling."""
    if op["time_s"] < FLAT * op["toy_time_s"]:
        return "overhead"
    return "compute" if op["achieved_flops"] / peak >= op["achieved_bytes_per_s"] / bw else "bandwidth"


def regimes(z, device, ops, peak, bw):
    print("\n3. The three regimes, from the measurement")
    ov = overhead_sweep(z, device, bw)
    print("  vector add, time per call against size (measured):\n   "
          + "  ".join(f"{count(s['elements'])}:{secs(s['time_s'])}" for s in ov["sweep"]))
    print(f"  overhead floor {secs(ov['floor_s'])} per call (the 3 smallest sizes); time doubles from it at"
          f" {si(ov['crossover_bytes'] or math.nan, 'B')} per call (derived: interpolated log-log; predicted:"
          f" floor x bandwidth = {si(ov['predicted_crossover_bytes'], 'B')})")
    print(f"  rule: overhead-bound if the time is under {FLAT}x the same op's on toy inputs (every"
          f" dimension <= 8): flat in size;\n        else bound by the roof it comes nearer to"
          f" (the larger fraction: achieved/peak FLOP/s or achieved/peak bytes/s),\n        'near'"
          f" at >= {NEAR_ROOF:.0%} of it, else 'far below': other costs too (per-call, non-matmul"
          f" math, a partly idle chip)")
    print(f"  {'op':<26}{'FLOP/B':>8}{'x toy':>8}{'% bound':>9}   {'intensity predicts':<20}measured")
    for op in ops.values():
        op["measured"] = classify(op, peak, bw)
        op["near_roof"] = op["measured"] != "overhead" and op["fraction_of_bound"] >= NEAR_ROOF
        how = "" if op["measured"] == "overhead" else " (near)" if op["near_roof"] else " (far below)"
        note = "" if op["measured"] == op["predicted"] else "   <- the roofline cannot see this"
        print(f"  {op['label']:<26}{op['intensity']:>8.3g}{op['time_s'] / op['toy_time_s']:>8.1f}"
              f"{op['fraction_of_bound']:>9.0%}   {op['predicted'] + '-bound':<20}"
              f"{op['measured']}-bound{how}{note}")
    print("  Left of the ridge the memory roof is always the nearer one, right of it the compute roof."
          " What only the\n  measurement tells: whether per-call overhead swamps the op, and how"
          " near its roof it gets.")
    return ov


# ------------------------------------------------------------------------------------------
# 4. Measurement discipline, shown by running it

def unsynchronised_clock(z, device, peak):
    # PREDICTION (GPU): torch.matmul returns once the kernel is queued, so a clock read right
    # after measures the launch (~10 us), not the work (~1 ms), and "achieves" more FLOP/s
    # than the chip has. On a CPU, PyTorch has no queue: the call returns with the result.
    n, k = z["peak_n"], 10 if device.type == "cuda" else 3
    a, b = (torch.randn(n, n, device=device, dtype=z["dtype"]) for _ in range(2))
    a @ b; sync(device)
    t0 = time.perf_counter()
    for _ in range(k):
        a @ b
    no_sync = (time.perf_counter() - t0) / k
    sync(device)
    synced = (time.perf_counter() - t0) / k  # the same calls, the clock read after waiting
    print(f"  (a) {n}^3 matmul, clock read without synchronising: {secs(no_sync)}"
          f" = {si(2 * n**3 / no_sync, 'FLOP/s')};  after synchronize: {secs(synced)}"
          f" = {si(2 * n**3 / synced, 'FLOP/s')}")
    out = dict(no_sync_s=no_sync, sync_s=synced, apparent_flops=2 * n**3 / no_sync)
    if device.type == "cuda":
        print(f"      the unsynchronised clock is {synced / no_sync:.0f}x too fast - it claims"
              f" {2 * n**3 / no_sync / peak:.0f}x the compute roof, which is impossible")
    else:
        out["skipped"] = ("on a CPU PyTorch runs each op synchronously (the call returns with its"
                          " result), so there is no queue to forget to wait for: both clocks agree")
        print(f"      skipped: {out['skipped']}")
    return out


def first_vs_warm(ceilings):
    # PREDICTION: the first call pays one-off costs - library handles and kernel loading on a
    # GPU, the OS handing out fresh pages on a CPU - so it is slower than the warm calls, and
    # the mean of a loop timed from that first call is dragged up while its median is not.
    out = {}
    for name in ("matmul", "copy"):
        t = ceilings[name]
        loop = [t["first_s"]] + t["samples_s"]  # a timing loop with no warm-up
        out[name] = dict(first_s=t["first_s"], warm_median_s=t["median_s"],
                         loop_mean_s=statistics.fmean(loop), loop_median_s=statistics.median(loop))
        print(f"  (b) {name:<6} first call {secs(t['first_s']):>9} = {t['first_s'] / t['median_s']:.1f}x"
              f" a warm call;  (c) a loop from the first call: mean {secs(out[name]['loop_mean_s'])},"
              f" median {secs(out[name]['loop_median_s'])}")
    return out


def jax_dispatch(z, device):
    # PREDICTION: JAX dispatches asynchronously on every backend, the CPU included: a jitted
    # call hands back an Array before it is computed, so without block_until_ready the clock
    # reads only the dispatch. Its first call also traces and compiles: an outlier.
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("  (d) jax is not installed: its half of this demonstration is skipped")
        return dict(skipped="jax is not installed")
    n, dtype = z["jax_n"], jnp.bfloat16 if z["dtype"] == torch.bfloat16 else jnp.float32
    platform = jax.devices()[0].platform
    if platform != {"cuda": "gpu", "cpu": "cpu"}[device.type]:  # e.g. jax without its CUDA plugin
        print(f"  (d) JAX runs on {platform} here, not on {device.type}: a 1024^3 fp32 matmul instead")
        n, dtype = 1024, jnp.float32
    a, b = (jax.random.normal(k, (n, n), dtype) for k in jax.random.split(jax.random.key(0)))
    f = jax.jit(lambda a, b: a @ b)
    t0 = time.perf_counter(); f(a, b).block_until_ready(); first = time.perf_counter() - t0
    unblocked, blocked = [], []
    for _ in range(z["reps"] + 2):
        t0 = time.perf_counter()
        y = f(a, b)
        unblocked.append(time.perf_counter() - t0)
        y.block_until_ready()
        blocked.append(time.perf_counter() - t0)  # the same call, the clock read after waiting
    ub, bl, loop = statistics.median(unblocked), statistics.median(blocked), [first] + blocked
    is_async = ub < 0.5 * bl
    print(f"  (d) JAX on {platform}, {n}^3 matmul: without block_until_ready {secs(ub)}"
          f" = {si(2 * n**3 / ub, 'FLOP/s')};  with it {secs(bl)} = {si(2 * n**3 / bl, 'FLOP/s')}")
    print(f"      dispatch is {'asynchronous' if is_async else 'NOT asynchronous'} on {platform};"
          f" first call (trace + compile) {secs(first)} = {first / bl:.0f}x a warm call;"
          f" a loop from it: mean {secs(statistics.fmean(loop))}, median {secs(statistics.median(loop))}")
    return dict(platform=platform, n=n, unblocked_s=ub, blocked_s=bl, dispatch_is_async=is_async,
                first_call_s=first, loop_mean_s=statistics.fmean(loop),
                loop_median_s=statistics.median(loop), version=jax.__version__)


# ------------------------------------------------------------------------------------------
# 5. The figure

def figure(path, ops, ceilings, ov):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "figure skipped: matplotlib is not installed"
    peak, bw = ceilings["peak_flops"], ceilings["bandwidth_bytes_per_s"]
    colors = {"compute": "tab:red", "bandwidth": "tab:blue", "overhead": "tab:gray"}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw=dict(width_ratios=[3, 2]))
    lo, hi = (f(op["intensity"] for op in ops.values()) for f in (min, max))
    xs = [lo / 3 * (9 * hi / lo) ** (i / 200) for i in range(201)]
    ax.loglog(xs, [min(peak, x * bw) for x in xs], "k-", lw=2, label="roofline (measured ceilings)")
    ax.axvline(peak / bw, color="k", ls=":", lw=1)
    ax.text(peak / bw, peak * 1.15, f" ridge {peak / bw:.3g} FLOP/B", fontsize=9)
    for op in ops.values():
        ax.scatter(op["intensity"], op["achieved_flops"], color=colors[op["measured"]], zorder=3)
        ax.annotate(op["label"], (op["intensity"], op["achieved_flops"]), fontsize=7,
                    xytext=(4, -3), textcoords="offset points")
    for regime, c in colors.items():
        ax.scatter([], [], color=c, label=f"measured: {regime}-bound")
    ax.set(xlabel="arithmetic intensity (FLOP / byte)", ylabel="achieved FLOP/s",
           title="The roofline, every op placed by its measurement")
    ax.legend(fontsize=8, loc="lower right")
    nbytes = [s["bytes"] for s in ov["sweep"]]
    ax2.loglog(nbytes, [s["time_s"] * 1e6 for s in ov["sweep"]], "o-", label="vector add (measured)")
    ax2.axhline(ov["floor_s"] * 1e6, color="tab:gray", ls="--", label=f"floor {ov['floor_s'] * 1e6:.1f} us")
    ax2.loglog(nbytes, [x / bw * 1e6 for x in nbytes], "k:", label="bytes / bandwidth")
    ax2.set(xlabel="bytes moved per call", ylabel="time per call (us)", title="The overhead floor")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------------------

def sizes(device, quick):
    """On a GPU, sizes well past its L2 that fill the chip; on a CPU, what runs the whole
    script in about a minute on 2 cores (--quick: a few seconds)."""
    if device.type == "cuda":
        return dict(dtype=torch.bfloat16, peak_n=8192, copy_n=2**29, n=2**28,
                    softmax_shape=(2**18, 1024), norm_shape=(2**16, 4096),
                    tiny=64, medium=4096, large=(8192, 4096, 16384), decode=(16, 16384), bmm=2**16,
                    sweep=range(6, 29, 2), jax_n=8192, reps=5 if quick else 20, target_s=2e-3,
                    warmup_s=0.05, burst_gap_s=0.1)
    if quick:
        z = dict(peak_n=768, copy_n=2**23, n=2**22, softmax_shape=(2**12, 1024),
                 norm_shape=(2**12, 1024), medium=192, large=(256, 512, 2048),
                 decode=(1, 2048), bmm=2**10, sweep=range(6, 21, 2), jax_n=512, reps=3, target_s=1e-3)
    else:
        z = dict(peak_n=2048, copy_n=2**26, n=2**24, softmax_shape=(2**14, 1024),
                 norm_shape=(2**14, 1024), medium=384, large=(1024, 1024, 4096),
                 decode=(1, 4096), bmm=2**12, sweep=range(6, 25, 2), jax_n=1024, reps=7, target_s=2e-2)
    return dict(dtype=torch.float32, tiny=16, warmup_s=0.0, burst_gap_s=0.0, **z)


def keep_freed_memory():
    """glibc hands a big CPU tensor fresh pages from the OS on every call, and touching each
    4 KB page for the first time costs more than a vector add's arithmetic. A GPU's caching
    allocator keeps freed memory; ask glibc to do the same (M_MMAP_MAX = 0, M_TRIM_THRESHOLD = 1 GB)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.mallopt(-4, 0) == 1 and libc.mallopt(-1, 2**30) == 1
    except (OSError, AttributeError):
        return False


def describe(device):
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return dict(type="cuda", name=p.name, memory_bytes=p.total_memory, gpus=torch.cuda.device_count(),
                    cache_bytes=getattr(p, "L2_cache_size", 50 * 2**20))
    cpuinfo, llc = Path("/proc/cpuinfo"), Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    names = [l.split(":")[1].strip() for l in cpuinfo.read_text().splitlines()
             if l.startswith("model name")] if cpuinfo.exists() else []
    return dict(type="cpu", name=names[0] if names else "CPU", threads=torch.get_num_threads(),
                memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                cache_bytes=int(llc.read_text().strip("K\n")) * 1024 if llc.exists() else 32 * 2**20)


def main():
    ap = argparse.ArgumentParser(description="Section 13.1: the roofline, the three regimes, honest timing")
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (the tests')")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--json", type=Path, help="write every measured number here")
    ap.add_argument("--out", type=Path, default=Path("out"), help="folder for the figure")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: PyTorch sees no CUDA GPU here; run with --device cpu")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # JAX on the same device as torch
    jax_version = next((d.version for d in importlib.metadata.distributions(name="jax")), None)
    dev = describe(device)
    z = dict(sizes(device, args.quick), cache=dev["cache_bytes"])
    z["elem"] = torch.tensor([], dtype=z["dtype"]).element_size()
    print(f"device: {dev['name']} ({device.type}), memory {si(dev['memory_bytes'], 'B')},"
          f" last-level cache {si(dev['cache_bytes'], 'B')}")
    print(f"torch {torch.__version__}, jax {jax_version or 'not installed'}; {'--quick' if args.quick else 'full'}"
          f" run: matmuls in {str(z['dtype']).replace('torch.', '')}, other ops in float32, {z['reps']} timed"
          f" samples per measurement,"
          f" inputs rotated past the cache")
    if device.type == "cpu" and keep_freed_memory():
        print("CPU: glibc told to keep freed memory, as a GPU's caching allocator does, so big outputs"
              " do not pay first-touch page faults on every call")
    ref_flops = datasheet_bf16_peak(dev["name"]) if device.type == "cuda" else None  # reference
    ref_bw = next((v for k, v in DATASHEET_BANDWIDTH.items() if k in dev["name"]), None)  # reference

    results = dict(lesson="01_roofline", device=dict(dev, torch=torch.__version__, jax=jax_version),
                   quick=args.quick, sizes={k: str(v) if isinstance(v, (range, torch.dtype)) else v
                                            for k, v in z.items()}, checks={}, errors={})

    def attempt(name, fn, *a):  # one failed experiment must not lose the others
        try:
            return fn(*a)
        except Exception as e:
            print(f"  !! {name} failed: {type(e).__name__}: {e}")
            results["errors"][name] = f"{type(e).__name__}: {e}"
            results["checks"][f"{name}_ran"] = False

    ceil = results["ceilings"] = attempt("ceilings", measure_ceilings, z, device, ref_flops, ref_bw)
    if ceil:
        peak, bw = ceil["peak_flops"], ceil["bandwidth_bytes_per_s"]
        results["checks"].update(ceilings_positive=peak > 0 and bw > 0, copy_is_exact=ceil["copy_is_exact"])
        ops = results["ops"] = attempt("ops", place_ops, z, device, peak, bw)
        ov = results["overhead"] = ops and attempt("regimes", regimes, z, device, ops, peak, bw)
        print("\n4. Measurement discipline, shown by running it")
        unsync = attempt("unsynchronised", unsynchronised_clock, z, device, peak)
        results["discipline"] = dict(unsynchronised=unsync, first_vs_warm=first_vs_warm(ceil),
                                     jax=attempt("jax", jax_dispatch, z, device))
        if unsync and device.type == "cuda":
            results["checks"]["unsynchronised_clock_is_wrong"] = unsync["no_sync_s"] < 0.5 * unsync["sync_s"]
        if ops and ov:
            args.out.mkdir(parents=True, exist_ok=True)
            results["figure"] = attempt("figure", figure, args.out / "01_roofline.png", ops, ceil, ov)
            print(f"\n5. Figure: {results['figure']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        print(f"JSON: {args.json}")
    failed = [k for k, ok in results["checks"].items() if not ok]
    if failed:
        print(f"FAILED checks: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
