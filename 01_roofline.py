"""
01_roofline.py - Section 13.1: the map (the roofline) and the method (measure, then classify).

A computation is limited either by how fast the machine does arithmetic or by how fast it
moves bytes - or, when it is small, by neither: by the fixed cost of asking for it at all.
This script measures which, on your machine, in the section's order:

  1. The two ceilings: peak matmul FLOP/s (bf16 on a GPU, fp32 on a CPU) and memory
     bandwidth (a large copy, bytes read + written). Their ratio is the ridge point.
  2. A dozen ops - vector add to a large matmul - with FLOPs and minimum bytes counted on
     paper, timed, and placed against their roofline bound.
  3. Each op classified from its measurement (compute-, bandwidth- or overhead-bound) next
     to what its arithmetic intensity predicted; a sweep of tiny ops shows the flat
     per-call floor and the size where it stops dominating.
  4. Measurement discipline, shown by running it: a clock read without synchronising, the
     first call against warm ones, median against mean, and JAX with and without
     block_until_ready.
  5. The roofline figure with every op on it: out/01_roofline.png.

Run:
  python 01_roofline.py                  # CUDA if present, else CPU (about a minute on 2 cores)
  python 01_roofline.py --device cpu     # force the CPU
  python 01_roofline.py --quick          # a few seconds: the smoke run the tests use
  python 01_roofline.py --json r.json    # every number, machine-readable
It uses one device; on a machine with several GPUs it measures cuda:0 (no torchrun needed).

Expect on an H200: ~800 TFLOP/s bf16 and ~4.2 TB/s, a ridge near 190 FLOP/byte; the big
matmuls compute-bound, elementwise and normalisation ops within ~10-20% of the bandwidth roof,
tiny ops at a floor of a few microseconds whatever their size. On a laptop-class CPU: tens
to hundreds of GFLOP/s, 10-50 GB/s, a ridge of a few FLOP/byte.
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

# Reference memory bandwidths (NVIDIA datasheets; see REFERENCES.md), printed beside ours.
DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "RTX 4090": 1.01e12}

# The classification rule of step 3, one place, printed as it is applied.
OVERHEAD_FACTOR = 3   # time within 3x of a near-empty call: the fixed cost dominates
NEAR_ROOF = 0.5       # at >= 50% of its roof an op is "near" it, below that "far below"


def si(x, unit=""):
    """812.3e12 -> '812 T' + unit."""
    for p, s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= p:
            return f"{x / p:.3g} {s}{unit}"
    return f"{x:.3g} {unit}"


def secs(t):
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


# ------------------------------------------------------------------------------------------
# Honest timing: warm up, synchronise before reading a clock, repeat, report the median.

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device, reps, target_s, warmup_s=0.0):
    """Seconds per call of fn(): the cold first call, then `reps` warm samples. Each sample
    averages `inner` back-to-back calls so that microsecond ops outlast the clock; on a GPU,
    CUDA events bracket those calls and we wait for the end event before reading it."""
    sync(device)
    t0 = time.perf_counter(); fn(); sync(device); first = time.perf_counter() - t0
    t0 = time.perf_counter(); fn(); sync(device); one = time.perf_counter() - t0
    inner = max(1, min(1000, round(target_s / one)))
    deadline = time.perf_counter() + warmup_s  # GPUs raise their clocks under load: let them
    while time.perf_counter() < deadline:
        fn(); sync(device)
    samples = []
    for _ in range(reps):
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
    return dict(first_s=first, median_s=statistics.median(samples), mean_s=statistics.fmean(samples),
                min_s=min(samples), max_s=max(samples), inner=inner, samples_s=samples)


def rotating(fn, shapes, z, device):
    """fn over random inputs of these shapes, cycling through enough copies that together they
    exceed the last-level cache three times over: a warm cache must not flatter the bytes/s."""
    nbytes = sum(math.prod(s) for s in shapes) * z["elem"]
    copies = max(2, min(64, math.ceil(3 * z["cache"] / nbytes)))
    sets = [[torch.randn(s, device=device, dtype=z["dtype"]) for s in shapes] for _ in range(copies)]
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


# ------------------------------------------------------------------------------------------
# 1. The two ceilings

def measure_ceilings(z, device, ref_flops, ref_bw):
    # PREDICTION: a big square matmul does ~n/3 FLOPs per byte (bf16), far right of any ridge,
    # so it runs at the compute roof; a copy does no arithmetic, so it runs at the memory roof.
    # On an H200 expect ~80% of the 989 TFLOP/s datasheet and ~90% of its 4.8 TB/s.
    n = z["peak_n"]
    mm = measure(rotating(torch.matmul, [(n, n), (n, n)], z, device), device, z["reps"],
                 z["target_s"], z["warmup_s"])
    src = torch.randn(z["copy_n"], device=device, dtype=z["dtype"])
    dst = torch.empty_like(src)
    cp = measure(lambda: dst.copy_(src), device, z["reps"], z["target_s"], z["warmup_s"])
    copy_ok = torch.equal(dst, src)
    moved = 2 * src.numel() * z["elem"]  # read once + written once
    peak, bw = 2 * n**3 / mm["median_s"], moved / cp["median_s"]
    del src, dst
    print("\n1. The two ceilings (measured)")
    dt = str(z["dtype"]).replace("torch.", "")
    print(f"  compute roof  {si(peak, 'FLOP/s'):>15}   {dt} matmul {n}x{n}x{n}, median of {z['reps']}"
          f" (spread {si(2 * n**3 / mm['max_s'])}-{si(2 * n**3 / mm['min_s'])})")
    print(f"  memory roof   {si(bw, 'B/s'):>15}   copy of {si(moved / 2, 'B')}, bytes read + written,"
          f" median of {z['reps']} (spread {si(moved / cp['max_s'])}-{si(moved / cp['min_s'])})")
    print(f"  ridge point   {peak / bw:>9.1f} FLOP/B   (derived: compute roof / memory roof) - ops with"
          f" fewer FLOPs per byte wait on memory, ops with more wait on arithmetic")
    if ref_flops:  # reference: datasheet numbers, see REFERENCES.md
        print(f"  reference     datasheet {si(ref_flops, 'FLOP/s')} dense bf16 and {si(ref_bw, 'B/s')}:"
              f" we reach {peak / ref_flops:.0%} and {bw / ref_bw:.0%} of the paper numbers")
    return dict(peak_flops=peak, bandwidth_bytes_per_s=bw, ridge_flop_per_byte=peak / bw,
                matmul=dict(n=n, dtype=dt, **mm), copy=dict(bytes_moved=moved, **cp),
                copy_is_exact=copy_ok, reference=dict(datasheet_bf16_flops=ref_flops,
                                                      datasheet_bandwidth=ref_bw))


# ------------------------------------------------------------------------------------------
# 2. A dozen ops on the roofline

def count(n):
    return si(n).replace(" ", "")


def make_ops(z):
    """key: (label, function, input shapes, FLOPs, minimum bytes), counted on paper. Minimum
    bytes = every input read once + every output written once; no kernel can move fewer."""
    e, n, R, C = z["elem"], z["n"], z["rows"], z["cols"]
    t, m, (M, K, N), (T, D), B = z["tiny"], z["medium"], z["large"], z["decode"], z["bmm"]
    return {
        "vector_add_tiny": ("vector add 1k", torch.add, [(1024,)] * 2, 1024, 3 * 1024 * e),
        "vector_add": (f"vector add {count(n)}", torch.add, [(n,)] * 2, n, 3 * n * e),
        "scale": (f"scale x*2 {count(n)}", lambda x: x * 2.0, [(n,)], n, 2 * n * e),
        # GELU: ~8 FLOPs per element by convention (a transcendental counted as one)
        "gelu": (f"GELU {count(n)}", F.gelu, [(n,)], 8 * n, 2 * n * e),
        # softmax per element: max, subtract, exp, sum, divide
        "softmax": (f"softmax {count(R)}x{C}", lambda x: torch.softmax(x, -1), [(R, C)],
                    5 * R * C, 2 * R * C * e),
        # layernorm per element: mean, subtract, square, sum, scale, gain, bias (+1 slack)
        "layernorm": (f"layernorm {count(R)}x{C}", lambda x, w, b: F.layer_norm(x, (C,), w, b),
                      [(R, C), (C,), (C,)], 8 * R * C, (2 * R * C + 2 * C) * e),
        "sum": (f"sum {count(n)}", torch.sum, [(n,)], n, (n + 1) * e),
        "matmul_tiny": (f"matmul {t}^3", torch.matmul, [(t, t)] * 2, 2 * t**3, 3 * t * t * e),
        "matmul_decode": (f"matmul {T} tok x {D}^2", torch.matmul, [(T, D), (D, D)],
                          2 * T * D * D, (2 * T * D + D * D) * e),
        "bmm_small": (f"bmm {count(B)} x 64^3", torch.bmm, [(B, 64, 64)] * 2,
                      2 * B * 64**3, 3 * B * 64 * 64 * e),
        "matmul_medium": (f"matmul {m}^3", torch.matmul, [(m, m)] * 2, 2 * m**3, 3 * m * m * e),
        "matmul_large": (f"matmul {M}x{K}x{N}", torch.matmul, [(M, K), (K, N)],
                         2 * M * K * N, (M * K + K * N + M * N) * e),
    }


def place_ops(z, device, peak, bw):
    # PREDICTION: elementwise ops, norms and reductions do ~1-8 FLOPs per element, so their
    # intensity is a few FLOP/byte at most: far left of the ridge, held by the memory roof. A
    # matmul's intensity grows with its smallest dimension: 64x64 batches and a few tokens
    # against a big weight stay left of a GPU's ridge; square matmuls of thousands cross it.
    print("\n2. A dozen ops on the roofline (FLOPs, bytes: counted; time: measured; rest derived)")
    print(f"  {'op':<26}{'FLOPs':>9}{'bytes':>9}{'FLOP/B':>8}{'bound':>13}{'time':>11}"
          f"{'achieved':>13}{'bytes/s':>11}{'% bound':>8}")
    ops = {}
    for key, (label, fn, shapes, flops, nbytes) in make_ops(z).items():
        t = measure(rotating(fn, shapes, z, device), device, z["reps"], z["target_s"])
        intensity = flops / nbytes
        bound = min(peak, intensity * bw)  # the roofline: attainable FLOP/s
        achieved = flops / t["median_s"]
        ops[key] = dict(label=label, flops=flops, bytes=nbytes, intensity=intensity,
                        bound_flops=bound, achieved_flops=achieved,
                        achieved_bytes_per_s=nbytes / t["median_s"], fraction_of_bound=achieved / bound,
                        predicted="compute" if intensity >= peak / bw else "bandwidth",
                        time_s=t["median_s"], **{k: v for k, v in t.items() if k != "median_s"})
        print(f"  {label:<26}{si(flops):>9}{si(nbytes):>9}{intensity:>8.3g}{si(bound, 'FLOP/s'):>13}"
              f"{secs(t['median_s']):>11}{si(achieved, 'FLOP/s'):>13}{si(nbytes / t['median_s'], 'B/s'):>11}"
              f"{achieved / bound:>8.0%}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return ops


# ------------------------------------------------------------------------------------------
# 3. The three regimes, classified from the measurement

def overhead_sweep(z, device, bw):
    # PREDICTION: a vector add of 64 elements costs what one of 64 thousand does: the fixed
    # cost of a call (Python, PyTorch's dispatcher, a kernel launch) - a few microseconds.
    # Time starts to grow with size only once moving the bytes takes longer than that.
    sweep = []
    for p in z["sweep"]:
        n = 2**p
        t = measure(rotating(torch.add, [(n,)] * 2, z, device), device, z["reps"], z["target_s"])
        sweep.append(dict(elements=n, bytes=3 * n * z["elem"], time_s=t["median_s"]))
    floor = statistics.median(s["time_s"] for s in sweep[:3])
    grown = next((s for s in sweep if s["time_s"] > 2 * floor), None)
    return dict(floor_s=floor, sweep=sweep, predicted_crossover_bytes=floor * bw,
                crossover_bytes=grown and grown["bytes"])


def classify(op, peak, bw, floor):
    """Step 3's rule: overhead first (measured time against the measured floor), else the
    roof the op comes nearer to, as a fraction of each measured ceiling."""
    if op["time_s"] < OVERHEAD_FACTOR * floor:
        return "overhead"
    return "compute" if op["achieved_flops"] / peak >= op["achieved_bytes_per_s"] / bw else "bandwidth"


def regimes(z, device, ops, peak, bw):
    print("\n3. The three regimes, from the measurement")
    ov = overhead_sweep(z, device, bw)
    floor = ov["floor_s"]
    print(f"  tiny-op sweep, vector add (measured):  "
          + "  ".join(f"{count(s['elements'])}:{secs(s['time_s'])}" for s in ov["sweep"]))
    print(f"  overhead floor {secs(floor)} per call (median of the 3 smallest sizes); the time"
          f" doubles from it at {si(ov['crossover_bytes'] or float('nan'), 'B')} moved per call"
          f" (predicted: floor x bandwidth = {si(ov['predicted_crossover_bytes'], 'B')})")
    print(f"  rule: overhead-bound if the time is within {OVERHEAD_FACTOR}x of the floor - the work is too"
          f" small to matter, time is flat in size;\n"
          f"        else bound by the roof it comes nearer to (the larger of achieved/peak FLOP/s and"
          f" achieved/peak bytes/s),\n"
          f"        'near' it at >= {NEAR_ROOF:.0%}, 'far below' under that: something else costs too"
          f" (per-call costs, non-matmul math, a chip only partly filled)")
    print(f"  {'op':<26}{'FLOP/B':>8}{'x floor':>9}{'% bound':>9}   {'intensity predicts':<20}measured")
    for op in ops.values():
        op["measured"] = classify(op, peak, bw, floor)
        op["times_floor"] = op["time_s"] / floor
        op["near_roof"] = op["measured"] != "overhead" and op["fraction_of_bound"] >= NEAR_ROOF
        how = "" if op["measured"] == "overhead" else " (near)" if op["near_roof"] else " (far below)"
        agree = "" if op["measured"] == op["predicted"] else "   <- the roofline cannot see this"
        print(f"  {op['label']:<26}{op['intensity']:>8.3g}{op['times_floor']:>9.1f}"
              f"{op['fraction_of_bound']:>9.0%}   {op['predicted'] + '-bound':<20}"
              f"{op['measured']}-bound{how}{agree}")
    print("  Above the ridge the compute roof is always the nearer one, below it the memory roof: the"
          " measurement adds\n  what intensity cannot - whether the fixed cost of a call swamps the"
          " op, and how near its roof it gets.")
    return ov


# ------------------------------------------------------------------------------------------
# 4. Measurement discipline, shown by running it

def unsynchronised_clock(z, device, peak):
    # PREDICTION (GPU): torch.matmul returns once the kernel is queued; a clock read then
    # measures the launch (~10 us), not the work (~1 ms), and "achieves" more FLOP/s than the
    # chip has. On a CPU PyTorch has no queue: the call returns with the result.
    n, k = z["peak_n"], 10 if device.type == "cuda" else 3
    a, b = (torch.randn(n, n, device=device, dtype=z["dtype"]) for _ in range(2))
    a @ b; sync(device)
    t0 = time.perf_counter()
    for _ in range(k):
        a @ b
    no_sync = (time.perf_counter() - t0) / k
    sync(device)
    synced = (time.perf_counter() - t0) / k  # same clock, same calls, read after waiting
    print("  (a) a clock read without waiting for the device")
    print(f"  clock without synchronising: {secs(no_sync)} per {n}^3 matmul"
          f" -> {si(2 * n**3 / no_sync, 'FLOP/s')};  after synchronize: {secs(synced)}"
          f" -> {si(2 * n**3 / synced, 'FLOP/s')}")
    out = dict(no_sync_s=no_sync, sync_s=synced, apparent_flops=2 * n**3 / no_sync)
    if device.type == "cuda":
        print(f"    the unsynchronised number is {synced / no_sync:.0f}x too fast:"
              f" {2 * n**3 / no_sync / peak:.0f}x the compute roof - impossible")
    else:
        out["skipped"] = ("CPU: PyTorch runs CPU ops synchronously (the call returns with the"
                          " result), so there is no queue to forget; both clocks agree")
        print(f"    skipped: {out['skipped']}")
    return out


def first_vs_warm(ceilings, ops):
    # PREDICTION: the first call pays one-off costs - library handles and kernel loading on a
    # GPU, fresh pages from the OS on a CPU - so it is slower than every warm call after it,
    # and a mean over a loop that includes it is dragged up while the median is not.
    print("  (b) first call against warm calls, (c) median against mean")
    cases = dict(matmul_peak=ceilings["matmul"], copy=ceilings["copy"], **ops)
    out = {}
    for key, t in cases.items():
        naive = [t["first_s"]] + t["samples_s"]  # a loop timed from its very first call
        out[key] = dict(first_s=t["first_s"], warm_median_s=t.get("median_s", t.get("time_s")),
                        naive_mean_s=statistics.fmean(naive), naive_median_s=statistics.median(naive))
    for key in ("matmul_peak", "copy"):
        r = out[key]
        print(f"  {key:<12} first call {secs(r['first_s']):>10}   warm median {secs(r['warm_median_s']):>10}"
              f"   ({r['first_s'] / r['warm_median_s']:.1f}x)   a loop from the first call: mean"
              f" {secs(r['naive_mean_s'])}, median {secs(r['naive_median_s'])}")
    return out


def jax_dispatch(z, device):
    # PREDICTION: JAX dispatches asynchronously on every backend, CPU included: a jitted call
    # hands back an Array before it is computed, so without block_until_ready the clock reads
    # only the dispatch. The first call also traces and compiles.
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("  jax is not installed: the JAX half of this demonstration is skipped")
        return dict(skipped="jax is not installed")
    print("  (d) JAX, with and without block_until_ready")
    n, dtype = z["jax_n"], jnp.bfloat16 if z["dtype"] == torch.bfloat16 else jnp.float32
    platform = jax.devices()[0].platform
    if platform != {"cuda": "gpu", "cpu": "cpu"}[device.type]:  # e.g. jax without its CUDA plugin
        print(f"  JAX runs on {platform} here, not on {device.type}: a smaller fp32 matmul")
        n, dtype = 1024, jnp.float32
    ka, kb = jax.random.split(jax.random.key(0))
    a, b = jax.random.normal(ka, (n, n), dtype), jax.random.normal(kb, (n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    t0 = time.perf_counter(); f(a, b).block_until_ready(); first = time.perf_counter() - t0
    unblocked, blocked = [], []
    for _ in range(z["reps"] + 2):
        t0 = time.perf_counter()
        y = f(a, b)
        unblocked.append(time.perf_counter() - t0)
        y.block_until_ready()
        blocked.append(time.perf_counter() - t0)  # same call, clock read after waiting
    ub, bl = statistics.median(unblocked), statistics.median(blocked)
    print(f"  JAX on {platform} ({n}^3 matmul): without block_until_ready {secs(ub)}"
          f" -> {si(2 * n**3 / ub, 'FLOP/s')};  with it {secs(bl)} -> {si(2 * n**3 / bl, 'FLOP/s')}")
    async_ = ub < 0.5 * bl
    print(f"    dispatch is {'asynchronous' if async_ else 'NOT asynchronous'} here"
          + (" - on a CPU too: JAX needs block_until_ready everywhere" if async_ and platform == "cpu" else ""))
    naive = [first] + blocked  # a loop timed from its very first call
    print(f"    first call (trace + compile + run) {secs(first)} = {first / bl:.0f}x a warm call; a loop"
          f" timed from it: mean {secs(statistics.fmean(naive))}, median {secs(statistics.median(naive))}")
    return dict(platform=platform, n=n, unblocked_s=ub, blocked_s=bl, first_call_s=first,
                dispatch_is_async=async_, naive_mean_s=statistics.fmean(naive),
                naive_median_s=statistics.median(naive), version=jax.__version__)


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
    lo = min(op["intensity"] for op in ops.values()) / 3
    hi = max(op["intensity"] for op in ops.values()) * 3
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, x * bw) for x in xs], "k-", lw=2, label="roofline (measured ceilings)")
    ax.axvline(peak / bw, color="k", ls=":", lw=1)
    ax.text(peak / bw, peak * 1.15, f" ridge {peak / bw:.3g} FLOP/B", fontsize=9)
    for op in ops.values():
        ax.scatter(op["intensity"], op["achieved_flops"], color=colors[op["measured"]], zorder=3)
        ax.annotate(op["label"], (op["intensity"], op["achieved_flops"]), fontsize=7,
                    xytext=(4, -3), textcoords="offset points")
    for regime, c in colors.items():
        ax.scatter([], [], color=c, label=f"measured: {regime}")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
           ylabel="achieved FLOP/s", title="The roofline, with every op placed by its measurement")
    ax.legend(fontsize=8, loc="lower right")
    sweep = ov["sweep"]
    ax2.loglog([s["bytes"] for s in sweep], [s["time_s"] * 1e6 for s in sweep], "o-", label="vector add")
    ax2.axhline(ov["floor_s"] * 1e6, color="tab:gray", ls="--", label=f"floor {ov['floor_s'] * 1e6:.1f} us")
    b = [s["bytes"] for s in sweep]
    ax2.loglog(b, [x / bw * 1e6 for x in b], "k:", label="bytes / bandwidth")
    ax2.set(xlabel="bytes moved per call", ylabel="time per call (us)", title="The overhead floor")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------------------

def sizes(device, quick):
    """Problem sizes: on a GPU, well past its L2 and big enough to fill it; on a CPU, what
    finishes the whole script in about a minute on 2 cores (--quick: a few seconds)."""
    if device.type == "cuda":
        return dict(dtype=torch.bfloat16, peak_n=8192, copy_n=2**29, n=2**28, rows=2**18, cols=1024,
                    tiny=64, medium=2048, large=(8192, 4096, 16384), decode=(16, 8192), bmm=2**16,
                    sweep=range(6, 29, 2), jax_n=8192, reps=5 if quick else 20,
                    target_s=2e-3, warmup_s=0.05 if quick else 0.5)
    if quick:
        z = dict(peak_n=768, copy_n=2**23, n=2**22, rows=2**12, medium=192, large=(256, 512, 2048),
                 decode=(1, 2048), bmm=2**10, sweep=range(6, 21, 2), jax_n=512, reps=3, target_s=1e-3)
    else:
        z = dict(peak_n=2048, copy_n=2**26, n=2**24, rows=2**14, medium=384, large=(1024, 1024, 4096),
                 decode=(1, 4096), bmm=2**12, sweep=range(6, 25, 2), jax_n=1024, reps=7, target_s=2e-2)
    return dict(dtype=torch.float32, cols=1024, tiny=16, warmup_s=0.0, **z)


def keep_freed_memory():
    """On Linux/glibc, a big CPU tensor is fresh memory from the OS every call, and first touch
    of each 4 KB page costs more than a vector add's arithmetic; a GPU's caching allocator
    avoids this. Ask glibc to keep freed memory, as that allocator does."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.mallopt(-3, 2**30) == 1 and libc.mallopt(-1, 2**30) == 1  # MMAP_/TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def describe(device):
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return dict(type="cuda", name=p.name, memory_bytes=p.total_memory,
                    cache_bytes=getattr(p, "L2_cache_size", 50 * 2**20), count=torch.cuda.device_count())
    name = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                "CPU") if os.path.exists("/proc/cpuinfo") else "CPU"
    llc = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    cache = int(llc.read_text().strip().rstrip("K")) * 1024 if llc.exists() else 32 * 2**20
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return dict(type="cpu", name=name, memory_bytes=mem, cache_bytes=cache, threads=torch.get_num_threads())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--json", type=Path, help="write every measured number here")
    ap.add_argument("--out", type=Path, default=Path("out"), help="folder for the figure")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: PyTorch sees no CUDA GPU here; run with --device cpu")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # JAX on the same device as torch
    try:
        jax_version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        jax_version = None
    dev = describe(device)
    z = dict(sizes(device, args.quick), cache=dev["cache_bytes"])
    z["elem"] = torch.tensor([], dtype=z["dtype"]).element_size()
    print(f"device: {dev['name']} ({device.type}), memory {si(dev['memory_bytes'], 'B')},"
          f" last-level cache {si(dev['cache_bytes'], 'B')}")
    print(f"torch {torch.__version__}, jax {jax_version or 'not installed'};"
          f" {'quick' if args.quick else 'full'} run in {str(z['dtype']).replace('torch.', '')},"
          f" {z['reps']} timed samples per op, inputs rotated to exceed the cache 3x")
    if device.type == "cpu" and keep_freed_memory():
        print("CPU: glibc asked to keep freed memory (as a GPU caching allocator does), so big"
              " outputs do not pay first-touch page faults on every call")
    ref_flops = datasheet_bf16_peak(dev["name"]) if device.type == "cuda" else None
    ref_bw = next((v for k, v in DATASHEET_BANDWIDTH.items() if k in dev["name"]), None)

    results = dict(lesson="01_roofline", device=dict(dev, torch=torch.__version__, jax=jax_version),
                   quick=args.quick, sizes={k: list(v) if isinstance(v, range) else str(v)
                                            if isinstance(v, torch.dtype) else v for k, v in z.items()},
                   checks={}, errors={})

    def attempt(name, fn, *a):  # one failed experiment must not lose the others
        try:
            return fn(*a)
        except Exception as e:
            print(f"  !! {name} failed: {type(e).__name__}: {e}")
            results["errors"][name] = f"{type(e).__name__}: {e}"
            results["checks"][f"{name}_ran"] = False

    ceil = attempt("ceilings", measure_ceilings, z, device, ref_flops, ref_bw)
    if ceil:
        results["ceilings"] = ceil
        peak, bw = ceil["peak_flops"], ceil["bandwidth_bytes_per_s"]
        results["checks"]["ceilings_positive"] = peak > 0 and bw > 0
        results["checks"]["copy_is_exact"] = ceil["copy_is_exact"]
        ops = attempt("ops", place_ops, z, device, peak, bw)
        if ops:
            results["ops"] = ops
            ov = attempt("regimes", regimes, z, device, ops, peak, bw)
            results["overhead"] = ov
        print("\n4. Measurement discipline, shown by running it")
        sync_demo = attempt("unsynchronised", unsynchronised_clock, z, device, peak)
        results["discipline"] = dict(unsynchronised=sync_demo)
        if sync_demo and device.type == "cuda":
            results["checks"]["unsynchronised_timing_is_faster"] = sync_demo["no_sync_s"] < 0.5 * sync_demo["sync_s"]
        if ops:
            results["discipline"]["first_vs_warm"] = attempt("first_vs_warm", first_vs_warm, ceil, ops)
        results["discipline"]["jax"] = attempt("jax", jax_dispatch, z, device)
        if ops and ov:
            args.out.mkdir(parents=True, exist_ok=True)
            fig = attempt("figure", figure, args.out / "01_roofline.png", ops, ceil, ov)
            print(f"\n5. Figure: {fig}")
            results["figure"] = fig
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        print(f"JSON written to {args.json}")
    failed = [k for k, ok in results["checks"].items() if not ok]
    if failed:
        print(f"FAILED checks: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
