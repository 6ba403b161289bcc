"""
02_hardware.py - Section 13.2: where the roofline's two numbers come from, measured here.

  1. memory hierarchy: read bandwidth against working-set size, 16 KB to GB; the cache cliffs
     (L2 on a GPU, L1/L2/L3 on a CPU) in a figure;
  2. tensor cores and the format ladder: matmul TFLOP/s in fp32, tf32, fp16, bf16, fp8
     (torch._scaled_mm, compute capability >= 8.9), each with its error vs float64 and its bits/eps/max;
  3. interconnects: host<->device, pageable vs pinned; GPU<->GPU peer copies when >= 2 GPUs;
  4. energy: watts (NVML) during a sustained matmul and copy -> pJ/FLOP, pJ/byte, beside
     Horowitz's ISSCC 2014 reference energies;
  5. prefill vs decode: a GPT-2 linear layer (768 -> 3072) at 1..8192 tokens crossing from
     bandwidth- to compute-bound near the measured ridge; decode ceiling = bandwidth / weight bytes;
  6. this machine's spec row (measured) beside reference rows for RTX 4090, A100, H100, H200.

Run: python 02_hardware.py (best device: one GPU ~1 min, a 2-core CPU about a minute);
     python 02_hardware.py --device cpu --quick --json out/02.json (smoke run, seconds).
     With several GPUs the same command also times GPU<->GPU copies and reports P2P.
Expect on an H200: >10 TB/s while the working set fits L2 (60 MB reported), ~4 TB/s from HBM;
fp8 > bf16 ~ fp16 (~800 TFLOP/s) > tf32 > fp32 (~50) with errors growing as bits shrink; pinned
H2D 2-3x pageable; the layer turns compute-bound near the ridge (~200 FLOP/byte). Every number
is labelled measured / derived / reference.
"""

import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from model_torch import GPTConfig, param_count

# Reference rows, dense (no sparsity), TFLOP/s and TB/s. Sources: NVIDIA H100 and H200 datasheets,
# A100 datasheet, Ada whitepaper appendix (RTX 4090; fp32 accumulate). Never measurements.
REFERENCE_ROWS = {
    "RTX 4090": dict(bf16=165, tf32=82.6, fp8=330, fp32=82.6, tb_per_s=1.01, l2_mb=72, gpu_link="PCIe 4.0 x16, no P2P"),
    "A100 SXM 80GB": dict(bf16=312, tf32=156, fp8=None, fp32=19.5, tb_per_s=2.0, l2_mb=40, gpu_link="NVLink 600 GB/s"),
    "H100 SXM": dict(bf16=989, tf32=495, fp8=1979, fp32=67, tb_per_s=3.35, l2_mb=50, gpu_link="NVLink 900 GB/s"),
    "H200 SXM": dict(bf16=989, tf32=495, fp8=1979, fp32=67, tb_per_s=4.8, l2_mb=50, gpu_link="NVLink 900 GB/s"),
}
# Reference energies, 45 nm (Horowitz, "Computing's energy problem", ISSCC 2014), in pJ.
# An FMA is 2 FLOPs (mult + add); a 64-bit word is 8 bytes.
HOROWITZ_PJ = {
    "fp16 FMA, per FLOP": (1.1 + 0.4) / 2, "fp32 FMA, per FLOP": (3.7 + 0.9) / 2,
    "8 KB cache read, per byte": 10 / 8, "1 MB cache read, per byte": 100 / 8,
    "DRAM read, per byte (low)": 1300 / 8, "DRAM read, per byte (high)": 2600 / 8,
}
FORMATS = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
           "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def bench(fn, reps, dev, warmup=2, wall=False, gap=0.0):
    """Median, min, max seconds of fn() after warmup. GPU: CUDA events (or the wall clock
    between synchronizes when host-side work counts, wall=True); CPU: perf_counter.
    gap > 0: idle that long before each sample, then one untimed call: every sample a burst."""
    for _ in range(warmup):
        fn()
    cuda, times = dev.type == "cuda", []
    for _ in range(reps):
        if gap:
            if cuda: torch.cuda.synchronize(dev)
            time.sleep(gap); fn()
        if cuda and not wall:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); fn(); end.record(); end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            if cuda: torch.cuda.synchronize(dev)
            t = time.perf_counter(); fn()
            if cuda: torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), max(times)


def cache_sizes(dev):
    """Cache sizes in bytes as the driver / kernel reports them (reported, not measured)."""
    if dev.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)
        return {"L2": l2} if l2 else {}
    sizes = {}
    for d in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            kind, level, size = (open(f"{d}/{f}").read().strip() for f in ("type", "level", "size"))
            if kind != "Instruction":
                sizes[f"L{level}"] = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]]
        except (OSError, ValueError, KeyError):
            pass
    return sizes


# 1. Memory hierarchy

def memory_hierarchy(dev, quick):
    # PREDICTION: read bandwidth is flat while the working set fits one cache level and drops at
    # each level's size. H200: > 10 TB/s in L1/L2, a cliff near the 50-60 MB L2, ~4 TB/s from HBM.
    # CPU: a cliff after each of L1d / L2 / L3, then DRAM (tens of GB/s).
    cuda = dev.type == "cuda"
    max_bytes = (4 << 30) if cuda else (16 << 20) if quick else (512 << 20)
    traffic = (4 << 30) if cuda else (32 << 20) if quick else (256 << 20)  # bytes read per call
    sizes = sorted({s for k in range(14, 33) for s in (1 << k, 3 << (k - 1)) if (16 << 10) <= s <= max_bytes})
    buffer = torch.empty(max_bytes // 4, device=dev).fill_(1.0)
    l2 = cache_sizes(dev).get("L2", 0) if cuda else 0
    points = []
    for size in sizes:
        n, repeats = size // 4, max(1, traffic // size)
        x = buffer[:n]
        # One kernel re-reads the same `size` bytes `repeats` times through a stride-0 view (no
        # copy), so even 16 KB is timed over GBs of traffic and launch overhead disappears.
        reread = lambda: x.expand(repeats, n).sum(dim=1)
        if size > l2 > 0:
            # Past a GPU's L2 that kernel flatters: its rows run side by side, so they share each
            # read through the cache (we measured 7 TB/s at 1 GB, above HBM's 4.8). Stream the
            # whole set once per kernel instead; at the largest sizes a launch is noise.
            reread = lambda: [x.sum() for _ in range(repeats)]
        med, lo, hi = bench(reread, 3 if quick else 5, dev, warmup=1)
        read = repeats * size
        points.append(dict(bytes=size, repeats=repeats, gb_per_s=read / med / 1e9,
                           gb_per_s_min=read / hi / 1e9, gb_per_s_max=read / lo / 1e9))
    del buffer
    caches = cache_sizes(dev)
    print(f"  caches (reported): " + (", ".join(f"{k} {v / 2**20:g} MB" for k, v in caches.items()) or "unknown"))
    print(f"  {'working set':>12} {'GB/s (measured, median)':>24} {'min-max':>18}")
    for p in points:
        if p["bytes"] & (p["bytes"] - 1) == 0:  # print powers of two, plot all
            print(f"  {p['bytes'] / 2**20:>9.3f} MB {p['gb_per_s']:>24.1f} {p['gb_per_s_min']:>8.1f}-{p['gb_per_s_max']:<8.1f}")
    peak = max(points, key=lambda p: p["gb_per_s"])
    print(f"  measured: fastest {peak['gb_per_s']:.0f} GB/s at {peak['bytes'] / 2**20:.2f} MB; "
          f"largest working set ({points[-1]['bytes'] / 2**20:.0f} MB) {points[-1]['gb_per_s']:.0f} GB/s "
          f"= {peak['gb_per_s'] / points[-1]['gb_per_s']:.1f}x slower ("
          + ("the main-memory roof)" if points[-1]["bytes"] > max(caches.values(), default=0) else "still in a cache)"))
    if any(p["bytes"] > l2 > 0 for p in points):
        print(f"  note (how measured): past the L2 ({l2 / 2**20:g} MB) each re-read is a separate x.sum() kernel, so the"
              f" smaller of those sizes include a fixed per-kernel cost (~us) and can read below the largest")
    return dict(points=points, caches_bytes=caches, main_memory_gb_per_s=points[-1]["gb_per_s"],
                fastest_gb_per_s=peak["gb_per_s"], fastest_bytes=peak["bytes"])


# 2. Tensor cores and the format ladder

def format_ladder(dev, quick):
    # PREDICTION: fewer bits -> more FLOP/s on tensor cores (H200 datasheet: fp32 67, tf32 495,
    # bf16/fp16 989, fp8 1979 TFLOP/s) and more error vs float64 (error ~ the format's eps:
    # fp32 ~1e-7 << tf32 ~ fp16 ~ 1e-4..1e-3 < bf16 ~ 1e-3 < fp8 ~ 1e-2). A CPU has no tensor cores.
    cuda = dev.type == "cuda"
    n = 8192 if cuda else 256 if quick else 512
    torch.manual_seed(0)
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)  # random, never zeros
    ref = a.double() @ b.double()
    formats, skipped = {}, {}
    for name, dtype in FORMATS.items():
        if name == "tf32" and not cuda:
            skipped[name] = "tf32 is a tensor-core mode of NVIDIA GPUs (Ampere+); not on a CPU"
            continue
        if name == "fp8" and cuda and torch.cuda.get_device_capability(dev) < (8, 9):
            skipped[name] = "fp8 tensor cores need compute capability >= 8.9 (Ada, Hopper)"
            continue
        try:
            torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
            if name == "fp8":  # per-tensor scales; mat2 must be column-major: b^T row-major, transposed
                fmax = torch.finfo(dtype).max
                sa, sb = a.abs().max().float() / fmax, b.abs().max().float() / fmax
                a8, b8 = (a / sa).to(dtype), (b.t().contiguous() / sb).to(dtype).t()
                def fn():
                    out = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                           use_fast_accum=cuda)
                    return out[0] if isinstance(out, tuple) else out
            else:
                ac, bc = a.to(dtype), b.to(dtype)
                fn = lambda: ac @ bc
            error = ((fn().double() - ref).norm() / ref.norm()).item()
            # each sample after 0.1 s idle: the rate the tensor cores give in bursts, as a training
            # step's matmuls see it; back to back for seconds the power limit slows them (section 4)
            med, lo, hi = bench(fn, 10 if cuda else 2 if quick else 3, dev, warmup=2 if cuda else 1,
                                gap=0.1 if cuda else 0.0)
        except Exception as e:  # an unsupported format on this build: say so, keep going
            skipped[name] = f"failed here: {type(e).__name__}: {str(e)[:150]}"
            continue
        finally:
            torch.set_float32_matmul_precision("highest")
        flop, info = 2 * n ** 3, torch.finfo(dtype)  # tf32: 1 sign, 8 exponent, 10 mantissa bits
        facts = dict(bits=19, eps=2.0 ** -10, max=info.max) if name == "tf32" else dict(bits=info.bits, eps=info.eps, max=info.max)
        formats[name] = dict(tflops=flop / med / 1e12, tflops_min=flop / hi / 1e12, tflops_max=flop / lo / 1e12,
                             rel_error=error, **facts)
    base = formats.get("fp32", {}).get("tflops")
    print(f"  {n}^3 matmuls, relative Frobenius error vs float64 on the same fp32 inputs")
    print(f"  {'format':>6} {'bits':>5} {'eps':>9} {'max':>9} | {'TFLOP/s (measured)':>19} {'x fp32':>7} {'rel. error':>11}")
    for name, r in formats.items():
        r["speedup_vs_fp32"] = r["tflops"] / base if base else None
        print(f"  {name:>6} {r['bits']:>5} {r['eps']:>9.2e} {r['max']:>9.3g} | {r['tflops']:>19.4g} "
              f"{r['speedup_vs_fp32'] or float('nan'):>7.3g} {r['rel_error']:>11.2e}")
    if "fp8" in formats and not cuda:
        print("  note: this CPU has no fp8 units; torch emulates fp8 there (no tensor cores), the error is still fp8's")
    for name, why in skipped.items():
        print(f"  {name}: skipped - {why}")
    print("  ladder (derived, x fp32): " + " : ".join(f"{k} {v['speedup_vs_fp32'] or 0:.3g}" for k, v in formats.items()))
    return dict(n=n, formats=formats, skipped=skipped)


# 3. Interconnects

def interconnect(dev, quick):
    # PREDICTION: pinned host->device runs near the link rate (PCIe Gen5 x16 ~ 63 GB/s per
    # direction, reference); pageable memory is first copied by the CPU into a pinned staging
    # buffer, so it runs at 1/2-1/3 of that. GPU<->GPU over NVLink: hundreds of GB/s.
    if dev.type != "cuda":
        print("  skipped: no GPU, so no host<->device or GPU<->GPU link to measure")
        return dict(skipped="no GPU: host<->device and GPU<->GPU links need CUDA")
    size = (256 << 20) if quick else (1 << 30)
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    pageable = torch.empty(size, dtype=torch.uint8).fill_(1)  # touched, so no page faults are timed
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1)
    result = dict(bytes=size)
    for name, fn in [("h2d_pageable", lambda: gpu.copy_(pageable)),
                     ("h2d_pinned", lambda: gpu.copy_(pinned, non_blocking=True)),
                     ("d2h_pageable", lambda: pageable.copy_(gpu)),
                     ("d2h_pinned", lambda: pinned.copy_(gpu, non_blocking=True))]:
        med, lo, hi = bench(fn, 5, dev, warmup=1, wall=True)
        result[f"{name}_gb_per_s"] = size / med / 1e9
        print(f"  {name:>13}: {size / med / 1e9:7.1f} GB/s measured (min-max {size / hi / 1e9:.1f}-{size / lo / 1e9:.1f})")
    result["h2d_pinned_over_pageable"] = result["h2d_pinned_gb_per_s"] / result["h2d_pageable_gb_per_s"]
    print(f"  derived: pinned / pageable H2D = {result['h2d_pinned_over_pageable']:.1f}x")
    if result["h2d_pinned_over_pageable"] > 3:
        print("  above the predicted 2-3x: pageable memory is staged through a pinned bounce buffer by one CPU"
              " thread, so its speed depends on the host; this one is slower than predicted")
    del pageable, pinned, gpu
    if torch.cuda.device_count() < 2:
        result["peer"] = "one GPU: no GPU<->GPU link to measure (P2P needs >= 2 GPUs)"
        print(f"  {result['peer']}")
        return result
    result["peer"] = {}
    for i, j in [(0, 1), (1, 0)]:
        src, dst = (torch.empty(size, dtype=torch.uint8, device=f"cuda:{k}") for k in (i, j))
        med, _, _ = bench(lambda: (dst.copy_(src), torch.cuda.synchronize(i), torch.cuda.synchronize(j)),
                          5, dev, warmup=1, wall=True)
        p2p = torch.cuda.can_device_access_peer(i, j)
        result["peer"][f"{i}->{j}"] = dict(p2p=p2p, gb_per_s=size / med / 1e9)
        print(f"  GPU{i} -> GPU{j}: {size / med / 1e9:7.1f} GB/s measured; P2P available: {p2p}")
    return result


# 4. Energy

def read_watts(dev):
    """Board power in watts: NVML through torch.cuda.power_draw (mW), else nvidia-smi, else None."""
    try:
        return torch.cuda.power_draw(dev) / 1e3
    except Exception:
        pass
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        index = (visible[dev.index or 0].strip() if visible[0].strip() else "") or str(dev.index or 0)
        out = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=power.draw", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        return float(out.stdout.strip().splitlines()[0])
    except Exception:
        return None


def sustained(fn, work_per_call, seconds, dev, settle=1.5):
    """Keep the GPU busy with fn for `seconds`; read power between chunks once NVML's ~1 s
    averaging window holds only this load. Returns (mean watts, work per second)."""
    fn(); torch.cuda.synchronize(dev)
    t = time.perf_counter(); fn(); torch.cuda.synchronize(dev)
    chunk = max(1, int(0.05 / (time.perf_counter() - t)))  # ~50 ms of work between readings
    watts, in_flight, calls, start = [], [], 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(chunk):
            fn()
        calls += chunk
        in_flight.append(torch.cuda.Event()); in_flight[-1].record()
        if len(in_flight) > 4:  # keep ~4 chunks queued: the GPU never idles, the clock stays honest
            in_flight.pop(0).synchronize()
        if time.perf_counter() - start > settle:
            watts.append(read_watts(dev))
    torch.cuda.synchronize(dev)
    rate = calls * work_per_call / (time.perf_counter() - start)
    watts = [w for w in watts if w is not None]
    return (statistics.mean(watts) if watts else float("nan")), rate


def energy(dev, quick, burst_bf16_tflops=None):
    # PREDICTION: moving a byte from DRAM costs ~100x more than a FLOP (Horowitz: DRAM ~160-325
    # pJ/byte vs fp16 FMA ~0.75 pJ/FLOP at 45 nm). On a 4-nm H200 both shrink, the gap stays.
    print("  reference (Horowitz ISSCC 2014, 45 nm): " + "; ".join(f"{k} {v:g} pJ" for k, v in HOROWITZ_PJ.items()))
    result = dict(reference_pj_horowitz_2014=HOROWITZ_PJ)
    if dev.type != "cuda" or read_watts(dev) is None:
        result["skipped"] = ("GPU power not readable (no NVML via torch.cuda.power_draw, no nvidia-smi)" if dev.type == "cuda"
                             else "no GPU power counter on a CPU run (CPU RAPL needs root); reference energies only")
        print(f"  skipped: {result['skipped']}")
        return result
    seconds = 2.5 if quick else 4.0
    torch.cuda.synchronize(dev); time.sleep(1.5)  # let the 1 s power average forget earlier work
    idle = []
    for _ in range(10):  # ~1 s of idle readings
        idle.append(read_watts(dev)); time.sleep(0.1)
    idle = statistics.mean([w for w in idle if w is not None] or [float("nan")])
    n = 8192
    a, b = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    mm_watts, flops = sustained(lambda: a @ b, 2 * n ** 3, seconds, dev)
    del a, b
    src = torch.randn(1 << 28, device=dev); dst = torch.empty_like(src)  # 1 GiB each
    copy_watts, bytes_per_s = sustained(lambda: dst.copy_(src), 2 * src.numel() * 4, seconds, dev)
    del src, dst
    result.update(idle_watts=idle, matmul_watts=mm_watts, matmul_tflops=flops / 1e12,
                  copy_watts=copy_watts, copy_gb_per_s=bytes_per_s / 1e9,
                  pj_per_flop=mm_watts / flops * 1e12, pj_per_flop_above_idle=(mm_watts - idle) / flops * 1e12,
                  pj_per_byte=copy_watts / bytes_per_s * 1e12, pj_per_byte_above_idle=(copy_watts - idle) / bytes_per_s * 1e12)
    print(f"  measured: idle {idle:.0f} W; bf16 matmul {mm_watts:.0f} W at {flops / 1e12:.0f} TFLOP/s; "
          f"copy {copy_watts:.0f} W at {bytes_per_s / 1e9:.0f} GB/s (read + write), {seconds:g} s each")
    print(f"  derived: {result['pj_per_flop']:.2f} pJ/FLOP ({result['pj_per_flop_above_idle']:.2f} above idle); "
          f"{result['pj_per_byte']:.1f} pJ/byte ({result['pj_per_byte_above_idle']:.1f} above idle); "
          f"a byte costs {result['pj_per_byte_above_idle'] / result['pj_per_flop_above_idle']:.0f} FLOPs of energy")
    if burst_bf16_tflops:  # the same matmul as the ladder's bf16 row, which ran in bursts
        result["matmul_sustained_over_burst"] = flops / 1e12 / burst_bf16_tflops
        print(f"  derived: sustained for {seconds:g} s the bf16 matmul runs at {result['matmul_sustained_over_burst']:.0%} of its"
              f" burst rate in section 2 ({burst_bf16_tflops:.0f} TFLOP/s): held at the board's power limit,"
              f" the clocks come down")
    return result


# 5. Prefill vs decode

def layer_intensity(tokens, d, f, elt):
    """FLOP per byte of y = x W^T: 2 M d f FLOPs over weights + input + output bytes."""
    return 2 * tokens * d * f / (elt * (d * f + tokens * d + tokens * f))


def prefill_vs_decode(dev, quick, peak_flops, bandwidth):
    # PREDICTION: intensity ~ tokens (bf16) while tokens << d, so the time is flat (reading the
    # 4.7 MB of weights) until tokens near the ridge point (peak / bandwidth, ~200 on an H200),
    # then grows linearly: decode (1 token) is bandwidth-bound, prefill (thousands) compute-bound.
    cuda = dev.type == "cuda"
    d, f = 768, 3072  # GPT-2 small MLP c_fc, no bias
    dtype = torch.bfloat16 if cuda else torch.float32
    elt = torch.finfo(dtype).bits // 8
    tokens = [2 ** k for k in range(14 if cuda else 7 if quick else 11)]
    copies = 32 if cuda else 2 if quick else 4  # rotate weights: 32 x 4.7 MB exceeds the L2
    weights = [torch.randn(f, d, device=dev, dtype=dtype) for _ in range(copies)]
    rows = []
    for m in tokens:
        x = torch.randn(m, d, device=dev, dtype=dtype)
        run = lambda: [F.linear(x, w) for w in weights]
        if cuda:  # a CUDA graph replays the 32 launches without CPU launch overhead
            run(); torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            fn = graph.replay
        else:
            fn = run
        med, lo, hi = bench(fn, 10 if cuda else 2 if quick else 3, dev, warmup=2 if cuda else 1)
        t = med / copies
        flop, nbytes = 2 * m * d * f, elt * (d * f + m * d + m * f)
        rows.append(dict(tokens=m, intensity=flop / nbytes, time_us=t * 1e6, tflops=flop / t / 1e12, gb_per_s=nbytes / t / 1e9))
        del fn, x
        if cuda: del graph
    # Measured crossover: where the flat (bandwidth) asymptote meets the linear (compute) one.
    flat = statistics.median(r["time_us"] for r in rows if r["tokens"] <= 8)
    slope = (rows[-1]["time_us"] - rows[-2]["time_us"]) / (rows[-1]["tokens"] - rows[-2]["tokens"])
    slope = slope if slope > 0 else rows[-1]["time_us"] / rows[-1]["tokens"]
    crossover = flat / slope
    ridge = peak_flops / bandwidth  # FLOP/byte, derived from this run's measurements
    x_ratio = layer_intensity(crossover, d, f, elt) / ridge
    den = 2 * d * f - ridge * elt * (d + f)  # tokens at which the layer's intensity equals the ridge
    ridge_tokens = ridge * elt * d * f / den if den > 0 else float("inf")
    print(f"  linear {d} -> {f}, {str(dtype).split('.')[-1]}, {copies} weight copies rotated; "
          f"ridge (derived) = {peak_flops / 1e12:.2f} TFLOP/s / {bandwidth / 1e9:.0f} GB/s = {ridge:.1f} FLOP/byte")
    print(f"  {'tokens':>6} {'FLOP/byte':>10} {'time us':>9} {'TFLOP/s':>9} {'GB/s':>8}   (measured; intensity derived)")
    for r in rows:
        print(f"  {r['tokens']:>6} {r['intensity']:>10.1f} {r['time_us']:>9.2f} {r['tflops']:>9.4g} {r['gb_per_s']:>8.0f}")
    print(f"  measured crossover: {crossover:.0f} tokens (flat {flat:.2f} us meets {slope * 1e3:.3f} ns/token); "
          f"its intensity {layer_intensity(crossover, d, f, elt):.0f} FLOP/byte = {x_ratio:.2f}x the ridge; "
          f"derived: intensity reaches the ridge at {ridge_tokens:.0f} tokens")
    frac = rows[0]["gb_per_s"] * 1e9 / bandwidth
    print(f"  derived: at 1 token the layer reads {rows[0]['gb_per_s']:.0f} GB/s = {frac:.0%} of the measured {bandwidth / 1e9:.0f} GB/s")
    if cuda and frac < 0.5:
        print("  the decode end is latency-bound (a per-kernel floor) for a layer this small, not bandwidth-bound"
              + (", which is why the measured crossover sits above the ridge" if x_ratio > 1 else ""))
    decode = {}
    for preset in ["gpt2", "gpt2-medium"]:
        n = param_count(GPTConfig.preset(preset), position=False)  # every weight matrix, lm_head included
        decode[preset] = dict(params=n, weight_bytes_bf16=2 * n, tokens_per_s_ceiling=bandwidth / (2 * n))
        print(f"  derived decode ceiling, batch 1, {preset} ({n / 1e6:.0f}M params, bf16 {2 * n / 1e6:.0f} MB): "
              f"<= {bandwidth / (2 * n):,.0f} tokens/s at {bandwidth / 1e9:.0f} GB/s")
    return dict(dtype=str(dtype).split(".")[-1], d_in=d, d_out=f, weight_copies=copies, rows=rows,
                flat_time_us=flat, slope_ns_per_token=slope * 1e3, crossover_tokens=crossover,
                crossover_over_ridge=x_ratio, ridge_flop_per_byte=ridge, ridge_tokens=ridge_tokens,
                peak_tflops_used=peak_flops / 1e12, bandwidth_gb_per_s_used=bandwidth / 1e9, decode=decode)


# 6. Spec table

def spec_table(name, ladder, hierarchy, links):
    fmts = ladder.get("formats", {})
    mine = {k: fmts[k]["tflops"] if k in fmts else None for k in ("bf16", "tf32", "fp8", "fp32")}
    l2 = max(hierarchy.get("caches_bytes", {}).values(), default=None)  # GPU: L2; CPU: its last level
    mine.update(tb_per_s=hierarchy.get("main_memory_gb_per_s", float("nan")) / 1e3, l2_mb=l2 / 2**20 if l2 else None,
                h2d_pinned_gb_per_s=links.get("h2d_pinned_gb_per_s"))
    fmt = lambda v: "-" if v is None else f"{v:.3g}"
    print(f"  {'TFLOP/s':>24} {'bf16':>7} {'tf32':>7} {'fp8':>7} {'fp32':>7} {'TB/s':>6} {'L2 MB':>6}   links "
          "(L2 as reported; a CPU shows its last level)")
    print(f"  {(name[:16] + ' (measured)'):>24} " + " ".join(f"{fmt(mine[k]):>7}" for k in ("bf16", "tf32", "fp8", "fp32"))
          + f" {fmt(mine['tb_per_s']):>6} {fmt(mine['l2_mb']):>6}   host->GPU pinned {fmt(mine['h2d_pinned_gb_per_s'])} GB/s")
    for gpu, r in REFERENCE_ROWS.items():
        print(f"  {(gpu + ' (ref.)'):>24} " + " ".join(f"{fmt(r[k]):>7}" for k in ("bf16", "tf32", "fp8", "fp32"))
              + f" {fmt(r['tb_per_s']):>6} {fmt(r['l2_mb']):>6}   {r['gpu_link']}")
    return dict(this_machine=mine, reference=REFERENCE_ROWS)



def figure(results, out_dir):
    try:
        import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
    except ImportError:
        print("figure skipped (matplotlib missing)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    h = results.get("hierarchy", {})
    if h.get("points"):
        ax = axes[0]
        ax.loglog([p["bytes"] for p in h["points"]], [p["gb_per_s"] for p in h["points"]], "o-")
        for level, size in h.get("caches_bytes", {}).items():
            ax.axvline(size, ls="--", c="gray"); ax.text(size, ax.get_ylim()[0], f" {level}", color="gray")
        ax.set(xlabel="working set (bytes)", ylabel="read GB/s (measured)", title="memory hierarchy")
    fmts = results.get("ladder", {}).get("formats", {})
    if fmts:
        ax = axes[1]
        ax.bar(list(fmts), [r["tflops"] for r in fmts.values()])
        for i, r in enumerate(fmts.values()):
            ax.text(i, r["tflops"], f"err {r['rel_error']:.0e}", ha="center", va="bottom", fontsize=8)
        ax.set(ylabel="TFLOP/s (measured)", title="format ladder (error vs float64)")
    pd = results.get("prefill_decode", {})
    if pd.get("rows"):
        ax = axes[2]
        m = [r["tokens"] for r in pd["rows"]]
        ax.loglog(m, [r["tflops"] for r in pd["rows"]], "o-", label="measured")
        roof = [min(pd["peak_tflops_used"], r["intensity"] * pd["bandwidth_gb_per_s_used"] / 1e3) for r in pd["rows"]]
        ax.loglog(m, roof, "k--", label="roofline (measured ceilings)")
        ax.axvline(pd["crossover_tokens"], c="r", ls=":", label=f"crossover {pd['crossover_tokens']:.0f}")
        ax.set(xlabel="tokens", ylabel="TFLOP/s", title="linear 768->3072: decode vs prefill"); ax.legend()
    fig.tight_layout(); fig.savefig(os.path.join(out_dir, "02_hardware.png"), dpi=120)
    print(f"figure: {os.path.join(out_dir, '02_hardware.png')}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", help="write every measured number here")
    parser.add_argument("--out", default="out", help="directory for the figure")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA GPU visible to torch; run with --device cpu")
    dev = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(dev)
        info = dict(type="cuda", name=props.name, memory_gb=props.total_memory / 1e9,
                    capability=list(torch.cuda.get_device_capability(dev)), count=torch.cuda.device_count())
    else:
        name = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "CPU") \
            if os.path.exists("/proc/cpuinfo") else "CPU"
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        info = dict(type="cpu", name=name, memory_gb=mem / 1e9, threads=torch.get_num_threads())
    info["torch"] = torch.__version__
    print(f"device: {info['name']} ({info['type']}), {info['memory_gb']:.0f} GB; torch {torch.__version__}; "
          f"{'quick' if args.quick else 'default'} sizes" + (f"; {info['threads']} threads" if dev.type == "cpu" else ""))
    results, checks = dict(lesson="02_hardware", device=info, quick=args.quick), {}

    def section(key, title, fn, *fargs):
        print(f"\n== {title}")
        try:
            results[key] = fn(*fargs)
            checks[f"{key}_ran"] = True
        except Exception as e:  # one broken part must not hide the others
            print(f"  FAILED: {type(e).__name__}: {e}")
            results[key] = dict(error=f"{type(e).__name__}: {e}")
            checks[f"{key}_ran"] = False
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return results[key]

    hierarchy = section("hierarchy", "1. memory hierarchy: read bandwidth vs working-set size", memory_hierarchy, dev, args.quick)
    ladder = section("ladder", "2. tensor cores and the format ladder", format_ladder, dev, args.quick)
    links = section("interconnect", "3. interconnects", interconnect, dev, args.quick)
    fmts = ladder.get("formats", {})
    section("energy", "4. energy per FLOP and per byte", energy, dev, args.quick, fmts.get("bf16", {}).get("tflops"))
    peak = fmts.get("bf16" if dev.type == "cuda" else "fp32", {}).get("tflops", float("nan")) * 1e12
    bandwidth = hierarchy.get("main_memory_gb_per_s", float("nan")) * 1e9
    prefill = section("prefill_decode", "5. prefill vs decode: one GPT-2 linear layer", prefill_vs_decode, dev, args.quick, peak, bandwidth)
    section("spec_table", "6. this machine beside the reference machines", spec_table, info["name"], ladder, hierarchy, links)

    # Self-checks (a failure exits non-zero) and the H200 targets (reported, not enforced).
    points = hierarchy.get("points", [])
    checks["bandwidth_curve_positive"] = bool(points) and all(math.isfinite(p["gb_per_s"]) and p["gb_per_s"] > 0 for p in points)
    bounds = dict(fp32=1e-4, tf32=5e-3, fp16=5e-3, bf16=2e-2, fp8=1e-1)  # ~ eps x a few, rel. Frobenius
    checks["ladder_errors_within_format"] = bool(fmts) and all(r["rel_error"] < bounds[k] for k, r in fmts.items())
    errs = [fmts[k]["rel_error"] for k in ("fp32", "tf32", "bf16", "fp8") if k in fmts]
    checks["ladder_error_grows_as_bits_shrink"] = len(errs) >= 2 and "fp32" in fmts and "bf16" in fmts and errs == sorted(errs)
    rows = prefill.get("rows", [])
    # measured, not arithmetic: more tokens share one read of the weights, so FLOP/s must rise
    checks["prefill_throughput_rises"] = len(rows) > 1 and rows[-1]["tflops"] > 3 * rows[0]["tflops"]
    if "H200" in info["name"]:
        tf = lambda k: fmts.get(k, {}).get("tflops", 0)
        ic = results.get("interconnect", {})
        targets = dict(bf16_at_least_750_tflops=tf("bf16") >= 750,
                       ladder_order_fp8_bf16_tf32_fp32=tf("fp8") > tf("bf16") > tf("tf32") > tf("fp32") > 0,
                       bf16_close_to_fp16=abs(tf("bf16") / max(tf("fp16"), 1e-9) - 1) < 0.15,
                       pinned_h2d_at_least_2x_pageable=ic.get("h2d_pinned_over_pageable", 0) >= 2,
                       crossover_within_2x_of_ridge=0.5 <= prefill.get("crossover_over_ridge", 0) <= 2)
        results["targets"] = targets
        print("\ntargets (H200): " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in targets.items()))
    else:
        print(f"\ntargets: not evaluated - they are for an H200, this is {info['name']}")
    results["checks"] = checks
    print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))
    os.makedirs(args.out, exist_ok=True)
    figure(results, args.out)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1, default=float)
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
