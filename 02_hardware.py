"""02_hardware.py - Section 13.2: where the roofline's two numbers come from, measured here:
1. read bandwidth from KB to GB working sets (the cache cliffs: out/02_hardware.png); 2. the
format ladder, fp32 to fp8, FLOP/s and error; 3. host<->device copies, pageable vs pinned, and
GPU->GPU direct vs staged through the host; 4. energy per FLOP and per byte beside Horowitz's;
5. a GPT-2 layer from 1 to 8192 tokens (prefill vs decode), then a batch-1 decode step with a KV
cache against its bandwidth ceiling; 6. this machine beside the datasheets. Copy it with
model_torch.py. Run: python 02_hardware.py (a GPU or a 2-core CPU: ~1 min; with two GPUs visible,
section 3 uses both); --quick --device cpu --json r.json: seconds."""

import argparse, json, math, os, re, statistics, sys, time
from collections import namedtuple
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model_torch import GPT, GPTConfig, param_count

# Datasheets (A100, H100, H200; Ada whitepaper for the RTX 4090), dense, never measurements:
# TFLOP/s in bf16, tf32, fp8, fp32 (fp32 accumulate); TB/s; L2 MB; the GPU-to-GPU link.
REFERENCE_ROWS = {"RTX 4090 (ref.)": (165, 82.6, 330, 82.6, 1.01, 72, "PCIe 4.0 x16, no P2P"),
                  "A100 SXM 80GB (ref.)": (312, 156, None, 19.5, 2.0, 40, "NVLink 600 GB/s"),
                  "H100 SXM (ref.)": (989, 495, 1979, 67, 3.35, 50, "NVLink 900 GB/s"),
                  "H200 SXM (ref.)": (989, 495, 1979, 67, 4.8, 50, "NVLink 900 GB/s")}
# Energies at 45 nm, pJ (Horowitz, ISSCC 2014); an FMA is 2 FLOPs, a 64-bit word 8 bytes.
HOROWITZ_PJ = {"fp16 FMA, per FLOP": 1.5 / 2, "fp32 FMA, per FLOP": 4.6 / 2,
               "8 KB cache read, per byte": 10 / 8, "1 MB cache read, per byte": 100 / 8,
               "DRAM read, per byte (low)": 1300 / 8, "DRAM read, per byte (high)": 2600 / 8}
FORMATS = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
           "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
ERROR_BOUND = dict(fp32=1e-4, tf32=5e-3, fp16=5e-3, bf16=2e-2, fp8=1e-1)  # ~eps x a few
BUSY = "   unreliable (machine busy)"
CPU = torch.device("cpu")
BURST_GAP_S = 0.1  # GPU: idle this long before each tensor-core sample, so it is a burst
# Sizes: section 5's dtype; samples; 1: largest working set, bytes read a sample; 2: n, matmuls a
# sample; 3: bytes a copy; 4: seconds a power reading; 5: up to 2**k tokens, layer copies rotated;
# the decode model, context, steps a sample. GPU: past L2, filling the chip; CPU: ~1 min, 2 cores.
Sizes = namedtuple("Sizes", "dtype reps hierarchy_max traffic ladder_n ladder_calls link_bytes"
                            " energy_s max_tokens_log2 weight_copies decode_preset context steps")
SIZES = dict(cuda=Sizes(torch.bfloat16, 10, 4 << 30, 16 << 30, 8192, 4, 1 << 30, 4, 13, 32, "gpt2", 512, 10),
             cpu=Sizes(torch.float32, 3, 512 << 20, 256 << 20, 512, 1, 0, 0, 10, 4, "gpt2", 128, 1),
             quick=Sizes(torch.float32, 2, 16 << 20, 32 << 20, 256, 1, 0, 0, 6, 2, "tiny", 32, 1))

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
def bench(fn, device, reps=10, warmup=3):
    """Call fn warmup times, then time reps calls: (median, min, max) seconds. GPU work is
    asynchronous, so the device is synchronised before every clock read."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)
def unreliable(timing, rate=0.0, ceiling=math.inf):
    """Samples spread wider than their median, or a rate 10% above a ceiling: do not trust."""
    median, low, high = timing
    return high - low > median or rate > 1.1 * ceiling

def memory_hierarchy(device, sizes, result):
    """1. Memory hierarchy: read bandwidth against working-set size"""
    # PREDICTION: flat while the working set fits a cache level, a step down past each: a GPU
    # reads its L2 (tens of MB) several times faster than its HBM (a few TB/s); a CPU steps down
    # after L1d, L2 and L3 (sizes: its datasheet) to tens of GB/s.
    l2_bytes, points, buffer = None, [], torch.ones(sizes.hierarchy_max // 4, device=device)
    if device.type == "cuda":
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size  # the driver's number
    for size in sorted(s for k in range(14, 33) for s in (2**k, 3 * 2**(k - 1)) if s <= sizes.hierarchy_max):
        x, repeats = buffer[:size // 4], max(1, sizes.traffic // size)
        # Re-read x: one kernel over a stride-0 view (no copy) times even 16 KB. Past a GPU's L2
        # that flatters (its rows share reads through the cache): there, one kernel per re-read.
        def reread():
            if l2_bytes and size > l2_bytes:
                return [x.sum() for _ in range(repeats)]
            return x.expand(repeats, x.numel()).sum(dim=1)
        timing = bench(reread, device, sizes.reps, 1)
        points.append(dict(bytes=size, gb_per_s=repeats * size / timing[0] / 1e9,
                           unreliable=unreliable(timing)))
    return dict(points=points, l2_bytes=l2_bytes, main_memory_gb_per_s=points[-1]["gb_per_s"],
                fastest_gb_per_s=max(p["gb_per_s"] for p in points))
def report_hierarchy(h):
    for p in h["points"][::2]:  # 16 KB, 32 KB, 64 KB, ...; the JSON has the sizes between too
        busy = BUSY * p["unreliable"]
        print(f"  {p['bytes'] / 2**20:9.3f} MB: {p['gb_per_s']:8.1f} GB/s (measured){busy}")
    print(f"  fastest {h['fastest_gb_per_s']:.0f}, largest set {h['main_memory_gb_per_s']:.0f} GB/s (measured)")

def ladder_matmul(name, dtype, a, b, cuda):
    if name != "fp8":
        a_cast, b_cast = a.to(dtype), b.to(dtype)
        return lambda: a_cast @ b_cast
    scale_a, scale_b = (m.abs().max() / torch.finfo(dtype).max for m in (a, b))  # per tensor
    a8, b8 = (a / scale_a).to(dtype), (b.t().contiguous() / scale_b).to(dtype).t()  # b8 col-major
    return lambda: torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b,
                                    out_dtype=torch.bfloat16, use_fast_accum=cuda)
def format_ladder(device, sizes, result):
    """2. Tensor cores and the format ladder"""
    # PREDICTION: fewer bits, more FLOP/s on tensor cores (H100/H200 datasheet: fp32 67, tf32 495,
    # bf16 and fp16 989, fp8 1979 TFLOP/s) and more error against float64, ~ each format's eps:
    # fp32 ~1e-7 << tf32 ~ fp16 ~1e-4 < bf16 ~1e-3 < fp8 ~1e-2. A CPU has no tensor cores.
    cuda, formats, skipped = device.type == "cuda", {}, {}
    n, calls = sizes.ladder_n, sizes.ladder_calls  # calls: matmuls per timed sample
    if not cuda:
        skipped["tf32"] = "tf32 is a tensor-core mode of NVIDIA GPUs (Ampere+), not on a CPU"
    torch.manual_seed(0)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    reference = a.double() @ b.double()
    for name, dtype in FORMATS.items():
        if name in skipped:
            continue
        torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
        try:  # a format this build or chip does not offer (fp8 before Ada) is skipped, with why
            matmul, samples = ladder_matmul(name, dtype, a, b, cuda), []
            error = ((matmul().double() - reference).norm() / reference.norm()).item()
            for _ in range(sizes.reps):  # each sample a burst, after BURST_GAP_S idle on a GPU
                time.sleep(BURST_GAP_S * cuda)
                samples.append(bench(lambda: [matmul() for _ in range(calls)], device, 1, 1)[0])
        except (RuntimeError, TypeError, AttributeError) as e:
            skipped[name] = f"failed here: {type(e).__name__}: {str(e)[:150]}"
            continue
        timing, info = (statistics.median(samples), min(samples), max(samples)), torch.finfo(dtype)
        formats[name] = dict(tflops=2 * n**3 * calls / timing[0] / 1e12, rel_error=error,
                             bits=info.bits, eps=info.eps, max=info.max, unreliable=unreliable(timing))
    torch.set_float32_matmul_precision("highest")
    if "tf32" in formats:  # 1 sign, 8 exponent, 10 mantissa bits
        formats["tf32"].update(bits=19, eps=2.0 ** -10)
    for r in formats.values():
        r["speedup_vs_fp32"] = r["tflops"] / formats["fp32"]["tflops"]
    return dict(n=n, formats=formats, skipped_formats=skipped)
def report_ladder(ladder):
    print(f"  {ladder['n']}^3: bits, eps, max (finfo); TFLOP/s (measured), x fp32; error vs float64")
    for name, r in ladder["formats"].items():
        print(f"  {name:>4}: {r['bits']:2} {r['eps']:.1e} {r['max']:8.3g}; {r['tflops']:8.4g}"
              f" {r['speedup_vs_fp32']:6.3g}x; {r['rel_error']:.1e}{BUSY * r['unreliable']}")
    for name, why in ladder["skipped_formats"].items():
        print(f"  {name:>4}: skipped - {why}")

def interconnects(device, sizes, result):
    """3. Interconnects: host <-> device, pageable and pinned; GPU -> GPU, direct and staged"""
    # PREDICTION: pinned host->device near the link rate (PCIe Gen5 x16 ~63 GB/s a direction);
    # pageable memory is first copied by a CPU thread into a pinned buffer: a fraction of that.
    # GPU->GPU over NVLink (450 GB/s each way): hundreds of GB/s; staged through the host (no P2P,
    # as on the book's machine), two PCIe trips in turn: one order of magnitude below, not two.
    if device.type != "cuda":
        return dict(skipped="no GPU: no link to measure")
    n, gpus, out = sizes.link_bytes, torch.cuda.device_count(), dict(host={}, peer={})
    gpu = torch.empty(n, dtype=torch.uint8, device=device)
    pageable = torch.ones(n, dtype=torch.uint8)  # touched: no page faults timed
    pinned = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    for name, copy in {"h2d_pageable": lambda: gpu.copy_(pageable),
                       "h2d_pinned": lambda: gpu.copy_(pinned, non_blocking=True),
                       "d2h_pageable": lambda: pageable.copy_(gpu),
                       "d2h_pinned": lambda: pinned.copy_(gpu, non_blocking=True)}.items():
        timing = bench(copy, device, reps=5, warmup=1)
        out["host"][name] = dict(gb_per_s=n / timing[0] / 1e9, unreliable=unreliable(timing))
    if gpus < 2:
        return dict(out, peer_skipped=f"{gpus} GPU: a peer copy needs two")
    for i, j in [(0, 1), (1, 0)]:  # direct, then staged through pinned memory; syncing j waits
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=f"cuda:{i}")
        dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{j}")
        direct = bench(lambda: dst.copy_(src), dst.device, reps=5, warmup=1)
        exact = torch.equal(dst.cpu(), src.cpu())
        staged = bench(lambda: dst.copy_(pinned.copy_(src), non_blocking=True), dst.device, 5, 1)
        out["peer"][f"{i}->{j}"] = dict(
            direct_gb_per_s=n / direct[0] / 1e9, staged_gb_per_s=n / staged[0] / 1e9,
            direct_over_staged=staged[0] / direct[0], exact=exact,
            p2p_available=torch.cuda.can_device_access_peer(i, j),
            unreliable=unreliable(direct) or unreliable(staged))
    return out
def report_links(links):
    for name, r in links["host"].items():
        print(f"  {name}: {r['gb_per_s']:.1f} GB/s (measured){BUSY * r['unreliable']}")
    if "peer_skipped" in links:
        print(f"  GPU -> GPU: skipped - {links['peer_skipped']}")
    for pair, r in links["peer"].items():  # measured GB/s; their ratio derived
        print(f"  GPU {pair}: direct {r['direct_gb_per_s']:.1f}, staged {r['staged_gb_per_s']:.1f}"
              f" GB/s = {r['direct_over_staged']:.1f}x; P2P {r['p2p_available']}"
              + BUSY * r["unreliable"])
    print('  the chapter: staging is "roughly two orders of magnitude below a datacenter NVLink"')

def energy(device, sizes, result):
    """4. Energy per FLOP and per byte (a GPU: about 10 s)"""
    # PREDICTION: a byte from DRAM costs ~100x a FLOP (Horowitz: DRAM ~160-325 pJ/byte against
    # ~0.75 pJ per fp16 FLOP at 45 nm); at 4 nm both shrink and the gap stays.
    out = dict(reference_pj_horowitz_2014=HOROWITZ_PJ, seconds=sizes.energy_s)
    try:  # the board's power in mW, NVML's ~1 s average (a CPU's, RAPL, would need root)
        torch.cuda.power_draw(device)
    except Exception:  # no GPU, or no NVML binding (pip install nvidia-ml-py)
        return dict(out, unmeasured="no GPU power reading here")
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    src, dst = torch.randn(1 << 28, device=device), torch.empty(1 << 28, device=device)
    for name, unit, fn, amount in [("matmul", "flop", lambda: a @ b, 2 * 8192**3),
                                   ("copy", "byte", lambda: dst.copy_(src), 2 * src.nbytes)]:
        # energy_s of ~50 ms chunks; power read after each, once NVML's 1 s average is all load
        chunk, calls, watts = max(1, round(0.05 / bench(fn, device, reps=1, warmup=1)[0])), 0, []
        start = time.perf_counter()
        while time.perf_counter() - start < sizes.energy_s:
            for _ in range(chunk):
                fn()
            calls += chunk
            sync(device)
            if time.perf_counter() - start > 1.5:
                watts.append(torch.cuda.power_draw(device) / 1e3)
        out[f"{name}_watts"] = statistics.mean(watts)
        out[f"{name}_{unit}s_per_s"] = calls * amount / (time.perf_counter() - start)  # copy: r + w
        out[f"pj_per_{unit}"] = out[f"{name}_watts"] / out[f"{name}_{unit}s_per_s"] * 1e12
    return out
def report_energy(e):
    for name, pj in e["reference_pj_horowitz_2014"].items():
        print(f"  {name}: {pj:g} pJ (reference: Horowitz, ISSCC 2014, 45 nm)")
    if "unmeasured" in e:
        print(f"  measured: nothing - {e['unmeasured']}")
        return
    tflops, gb_per_s = e["matmul_flops_per_s"] / 1e12, e["copy_bytes_per_s"] / 1e9
    print(f"  bf16 matmul, {e['seconds']} s: {e['matmul_watts']:.0f} W at {tflops:.0f} TFLOP/s"
          f" (measured) = {e['pj_per_flop']:.2f} pJ/FLOP (derived, idle power included)")
    print(f"  copy, {e['seconds']} s: {e['copy_watts']:.0f} W at {gb_per_s:.0f} GB/s read + written"
          f" (measured) = {e['pj_per_byte']:.1f} pJ/byte (derived, idle power included)")

def prefill_decode(device, sizes, result):
    """5. Prefill vs decode: one GPT-2 linear layer, 768 -> 3072, from 1 token to thousands"""
    # PREDICTION: y = x W^T (W 768 x 3072, GPT-2's MLP): 2 d f FLOPs a token over ~d f weight bytes.
    # The time stays flat (reading the weights; a per-kernel floor of a few us) until the intensity
    # nears the ridge, then grows linearly: decode (1 token) bandwidth-, prefill compute-bound.
    compute = {"cuda": "bf16", "cpu": "fp32"}[device.type]
    peak_flops = result["ladder"]["formats"][compute]["tflops"] * 1e12
    bandwidth = result["hierarchy"]["main_memory_gb_per_s"] * 1e9
    d, f, dtype, elt, rows = 768, 3072, sizes.dtype, sizes.dtype.itemsize, []
    weights = [torch.randn(f, d, device=device, dtype=dtype) for _ in range(sizes.weight_copies)]
    for tokens in [2**k for k in range(sizes.max_tokens_log2 + 1)]:
        x = torch.randn(tokens, d, device=device, dtype=dtype)
        run, replays = (lambda: [F.linear(x, w) for w in weights]), 1
        if device.type == "cuda":  # one CUDA graph replays all the layers without launch costs
            run()
            graph, replays = torch.cuda.CUDAGraph(), 10
            with torch.cuda.graph(graph):
                run()
            run = graph.replay
        timing = bench(lambda: [run() for _ in range(replays)], device, sizes.reps, 2)
        seconds = timing[0] / replays / sizes.weight_copies
        flop, nbytes = 2 * tokens * d * f, elt * (d * f + tokens * d + tokens * f)
        tflops, roof = flop / seconds / 1e12, min(peak_flops, flop / nbytes * bandwidth) / 1e12
        rows.append(dict(tokens=tokens, intensity=flop / nbytes, time_us=seconds * 1e6,
                         tflops=tflops, gb_per_s=nbytes / seconds / 1e9, roof_tflops=roof,
                         unreliable=unreliable(timing, tflops, roof)))
    flat = statistics.median(r["time_us"] for r in rows if r["tokens"] <= 8)
    slope = max(rows[-1]["time_us"] - rows[-2]["time_us"], 1e-9) / rows[-2]["tokens"]
    crossover = flat / slope  # tokens where the flat asymptote meets the linear one
    return dict(dtype=str(dtype)[6:], rows=rows, flat_time_us=flat, crossover_tokens=crossover,
                crossover_intensity=2 * crossover * d * f / (d * f + crossover * (d + f)) / elt,
                ridge_flop_per_byte=peak_flops / bandwidth,
                throughput_ratio_last_over_first=rows[-1]["tflops"] / rows[0]["tflops"],
                peak_tflops_used=peak_flops / 1e12, bandwidth_gb_per_s_used=bandwidth / 1e9)
def report_prefill(pd):
    print(f"  ridge: {pd['peak_tflops_used']:.3g} TFLOP/s / {pd['bandwidth_gb_per_s_used']:.0f}"
          f" GB/s = {pd['ridge_flop_per_byte']:.1f} FLOP/byte (derived)")
    print("  tokens, FLOP/byte (counted): us, TFLOP/s, GB/s (measured)")
    for r in pd["rows"]:
        print(f"  {r['tokens']:6} {r['intensity']:6.1f}: {r['time_us']:9.2f} {r['tflops']:9.4g}"
              f" {r['gb_per_s']:6.0f}{BUSY * r['unreliable']}")
    print(f"  crossover: {pd['crossover_tokens']:.0f} tokens, {pd['crossover_intensity']:.0f}"
          f" FLOP/byte (derived: the flat {pd['flat_time_us']:.2f} us meets the linear part)")
    print(f"  most tokens: {pd['throughput_ratio_last_over_first']:.0f}x the FLOP/s of 1 (derived)")

def cached_forward(model, idx, start, cache):
    """GPT-2's forward of tokens idx (1, T) at positions start.., keys and values cached per layer."""
    T, C, heads, end = idx.size(1), model.config.n_embd, model.config.n_head, start + idx.size(1)
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(start, end, device=idx.device))
    for block, (keys, values) in zip(model.transformer.h, cache):
        q, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(1, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))
        keys[:, :, start:end], values[:, :, start:end] = k, v
        y = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], is_causal=T > 1)
        x = x + block.attn.c_proj(y.transpose(1, 2).reshape(1, T, C))
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.transformer.ln_f(x))

class CountOps(TorchDispatchMode):  # the operations a call dispatches (views launch no kernel)
    count = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not getattr(func, "is_view", False)
        return func(*args, **(kwargs or {}))

@torch.no_grad()
def decode_step(device, sizes, result):
    """5b. Prefill vs decode: a real batch-1 decode step of GPT-2 with a KV cache"""
    # PREDICTION: at batch 1 a decode step reads every weight once: GPT-2 124M in bf16, ~250 MB,
    # ~60 us at 4 TB/s. But it dispatches ~150 operations from Python, each a few us of CPU time
    # to launch on a GPU: eager decode is overhead-bound, ~1 ms, and operations x the cost of one
    # tiny op is most of it (CUDA graphs, section 13.3, remove it). A CPU is bandwidth-bound.
    config, context = GPTConfig.preset(sizes.decode_preset), sizes.context
    with torch.device(device):
        model, idx = GPT(config).eval(), torch.randint(0, 50257, (1, context + 1))
        shape = (1, config.n_head, context + 1, config.n_embd // config.n_head)
        cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.n_layer)]
    cached_forward(model, idx[:, :context], 0, cache)  # the check, in fp32: cached == full forward
    logits = cached_forward(model, idx[:, context:], context, cache)[0, -1]
    full = model(idx)[0][0, -1]
    model.to(sizes.dtype)
    cache = [(keys.to(sizes.dtype), values.to(sizes.dtype)) for keys, values in cache]
    token, steps = idx[:, context:], sizes.steps
    with CountOps() as counter:
        cached_forward(model, token, context, cache)
    eager = bench(lambda: [cached_forward(model, token, context, cache) for _ in range(steps)],
                  device, sizes.reps, 2)
    tiny_op = bench(lambda: [token.add_(0) for _ in range(200)], device, sizes.reps, 2)[0] / 200
    # bench told the device is a CPU never synchronises: the host's time to issue a token's work
    host = bench(lambda: cached_forward(model, token, context, cache), CPU, sizes.reps, 2)[0]
    nbytes = sizes.dtype.itemsize * (param_count(config, position=False)
                                     + 2 * config.n_layer * (context + 1) * config.n_embd)
    bandwidth, eager_us = result["hierarchy"]["main_memory_gb_per_s"] * 1e9, eager[0] / steps * 1e6
    ceiling_us = nbytes / bandwidth * 1e6
    weights = {p: param_count(GPTConfig.preset(p), position=False) for p in ("gpt2", "gpt2-medium")}
    return dict(preset=sizes.decode_preset, dtype=str(sizes.dtype)[6:], context=context,
                bytes_per_step=nbytes, ceiling_us=ceiling_us, eager_us=eager_us,
                ops_per_step=counter.count, launch_floor_us=tiny_op * 1e6,
                dispatch_us=counter.count * tiny_op * 1e6, host_issue_us=host * 1e6,
                unreliable=unreliable(eager, ceiling_us / eager_us, 1),
                bf16_tokens_per_s_ceiling={p: bandwidth / (2 * n) for p, n in weights.items()},
                cached_vs_full_rel_error=((logits - full).abs().max() / full.abs().max()).item())
def report_decode(step):
    print(f"  {step['preset']} in {step['dtype']}, {step['context']} tokens cached:"
          f" {step['bytes_per_step'] / 1e6:.0f} MB read a token (counted),"
          f" ceiling {step['ceiling_us']:.1f} us (derived: / bandwidth)")
    print(f"  eager: {step['eager_us']:.1f} us per token (measured){BUSY * step['unreliable']}")
    print(f"  dispatch: {step['ops_per_step']} operations a token (counted) x"
          f" {step['launch_floor_us']:.2f} us (measured, a tiny op) = {step['dispatch_us']:.1f} us")
    print(f"  host: {step['host_issue_us']:.1f} us per token to issue its operations (measured,"
          " no sync): where it nears eager, the device waits for Python")
    print(f"  cached == full forward (fp32): {step['cached_vs_full_rel_error']:.1e} max rel. error")
    print("  ceiling, batch 1, in bf16: " + ", ".join(f"{preset} {tokens_per_s:,.0f} tokens/s" for
          preset, tokens_per_s in step["bf16_tokens_per_s_ceiling"].items()) + " (derived)")

def spec_table(device, sizes, result):
    """6. This machine beside the reference machines"""
    formats, links = result["ladder"]["formats"], result["interconnect"].get("host", {})
    tflops = [formats.get(k, {}).get("tflops") for k in ("bf16", "tf32", "fp8", "fp32")]
    l2_mb, link = (result["hierarchy"]["l2_bytes"] or 0) / 2**20, "-"
    if "h2d_pinned" in links:
        link = f"host->GPU pinned {links['h2d_pinned']['gb_per_s']:.3g} GB/s"
    mine = (*tflops, result["hierarchy"]["main_memory_gb_per_s"] / 1e3, l2_mb, link)
    return {f"{result['device']['name'][:16]} (measured)": mine, **REFERENCE_ROWS}
def report_spec(table):
    print(f"  {'TFLOP/s':>24}    bf16    tf32     fp8    fp32    TB/s   L2 MB  link")
    for label, row in table.items():  # a number this machine has not got prints as -
        numbers = "".join(f" {format(value, '.3g') if value else '-':>7}" for value in row[:6])
        print(f"  {label:>24}{numbers}  {row[6]}")

def figure(device, sizes, result):
    """Figure: read bandwidth against working-set size"""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return dict(skipped="matplotlib is not installed: figure skipped")
    plt.switch_backend("Agg")
    points, l2_bytes = result["hierarchy"]["points"], result["hierarchy"]["l2_bytes"]
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    ax.loglog([p["bytes"] for p in points], [p["gb_per_s"] for p in points], "o-")
    if l2_bytes:
        ax.axvline(l2_bytes, ls="--", c="gray")  # the L2 size the driver reports
    ax.set(xlabel="working set (bytes)", ylabel="read GB/s", title=result["device"]["name"])
    path = Path(result["out"]) / "02_hardware.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return dict(path=str(path))

SECTIONS = [  # the lesson in order: (JSON key, experiment, report of its numbers)
    ("hierarchy", memory_hierarchy, report_hierarchy), ("ladder", format_ladder, report_ladder),
    ("interconnect", interconnects, report_links), ("energy", energy, report_energy),
    ("prefill_decode", prefill_decode, report_prefill), ("decode_step", decode_step, report_decode),
    ("spec_table", spec_table, report_spec), ("figure", figure, lambda r: print(f"  {r['path']}"))]

def check_outputs(args):
    """Refuse unusable output paths before the work, not after it."""
    if args.json and (Path(args.json).is_dir() or not Path(args.json).parent.resolve().is_dir()):
        sys.exit(f"error: --json {args.json}: not a file in an existing folder")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        sys.exit(f"error: --out {args.out}: exists and is not a folder")
def write_json(path, result):
    """Write atomically: a temporary file, then a rename (never a half-written file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Section 13.2: where the two numbers come from")
    parser.add_argument("--quick", action="store_true", help="seconds (the tests' run)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", help="write every measured number here")
    parser.add_argument("--out", default="out", help="folder for the figure")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: PyTorch sees no CUDA GPU here; run with --device cpu")
    check_outputs(args)
    gpu = args.device != "cpu" and torch.cuda.is_available()
    args.device = torch.device("cuda:0" if gpu else "cpu")
    return args

def main():
    args = parse_args()
    device = args.device
    sizes = SIZES["quick" if args.quick and device.type == "cpu" else device.type]
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = (re.findall(r"model name\s*: (.+)", cpuinfo) + ["CPU"])[0]
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory_gb = props.name, props.total_memory / 1e9
    info = dict(name=name, type=device.type, memory_gb=memory_gb, gpus=torch.cuda.device_count(),
                torch=torch.__version__)
    print(f"device: {name} ({device.type}), {memory_gb:.0f} GB, {info['gpus']} GPUs; torch"
          f" {torch.__version__}")
    result = dict(lesson="02_hardware", device=info, quick=args.quick, out=args.out)
    for key, experiment, report in SECTIONS:
        print(f"\n{experiment.__doc__}")
        result[key] = experiment(device, sizes, result)
        if "skipped" in result[key]:  # a part this machine cannot run says why
            print(f"  skipped: {result[key]['skipped']}")
        else:
            report(result[key])
    # Self-checks: correctness only. Timing is reported above and never decides the exit code.
    formats, peers = result["ladder"]["formats"], result["interconnect"].get("peer", {})
    errors = [formats[k]["rel_error"] for k in ("fp32", "tf32", "bf16", "fp8") if k in formats]
    result["checks"] = dict(
        ladder_errors_within_format=all(r["rel_error"] < ERROR_BOUND[k] for k, r in formats.items()),
        ladder_error_grows_as_bits_shrink=errors == sorted(errors),
        decode_cache_matches_full_forward=result["decode_step"]["cached_vs_full_rel_error"] < 1e-3,
        peer_copies_exact=all(r["exact"] for r in peers.values()))
    if args.json:
        write_json(args.json, result)
        print(f"JSON: {args.json}")
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed:
        sys.exit(f"error: self-check failed: {', '.join(failed)}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
