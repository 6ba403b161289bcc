"""
03_compile.py - Section 13.3: capture the graph, let a compiler fuse it.

A compiler that sees many ops at once can launch them as one kernel and keep the
intermediates in registers instead of memory. What that buys depends on the regime, so
the file measures one case of each, in PyTorch and in JAX side by side:
  1. overhead-bound: 48 tiny ops, eager against torch.compile, CUDA graphs
     (mode="reduce-overhead", GPU only) and jax.jit; time and launches per call;
  2. bandwidth-bound: a five-op chain, unfused against fused, against the floor of its
     bytes counted on paper; its regime from XLA's FLOP count and the measured ridge;
  3. compute-bound: a big matmul, where compiling does not pay;
  4. how capture works and where it breaks: torch.compile reads bytecode (graph breaks
     found with torch._dynamo.explain, recompiles, dynamic=); jax.jit traces (make_jaxpr,
     side effects at trace time, retraces, lower().compile().cost_analysis()).
Every compiled result is checked against eager; a mismatch exits non-zero. Timings are
interleaved (eager, compiled, eager, compiled, ...) and every ratio carries the spread
of its pairs. When other programs take the CPU, the run says so and marks its numbers.

Run (this file alone; no model file):
  python 03_compile.py                        # one GPU when present, else the CPU
  python 03_compile.py --device cpu --quick   # what the tests run
Expect compiled code several times faster than eager where overhead or bytes bind, and
no faster on the matmul. On a GPU the fused chain runs near its byte floor; on a CPU it
sits near the ridge, and there are no CUDA graphs. torch.compile writes C++ (CPU) or
Triton (GPU) code: seconds per function the first time, less once Inductor's cache has it.
"""

import argparse
import ctypes
import json
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

# Before jax and torch start: torch needs GPU memory too (JAX would take 75% of it), the
# profiler runs after CUDA graphs (keep its CUPTI loaded), and prints no start/stop lines
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TEARDOWN_CUPTI", "0")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # 4a prints the graph breaks itself


@dataclass
class Sizes:
    tiny_reps: int = 20     # 1: timed samples of the tiny chain, each of ...
    tiny_calls: int = 10    #    ... this many calls in a row (a sample is their mean)
    rows: int = 2048        # 2: x and the residual are rows x width fp32: 32 MB each,
    width: int = 4096       #    beyond a CPU's caches (a GPU row: 1 GB, far past its L2)
    ridge_n: int = 1024     # 2: the fp32 ridge_n^3 matmul that measures the FLOP roof
    matmul_n: int = 1024    # 3: the compute regime's n x n by n x n matmul ...
    matmul_dtype: torch.dtype = torch.float32  # ... in this dtype
    reps: int = 7           # 2, 3: timed samples of each variant


CPU = Sizes()
# A GPU queues launches: 50 calls a sample, so one synchronisation is not in every call.
# Its rows follow the card's memory (gpu_sizes): 65536 where 1 GiB tensors fit
GPU = Sizes(tiny_reps=10, tiny_calls=50, rows=65536, ridge_n=8192, matmul_n=8192,
            matmul_dtype=torch.bfloat16, reps=10)
QUICK = Sizes(tiny_reps=5, ridge_n=512, matmul_n=512, reps=3)
HELD_AT_PEAK = 12  # 2: chain-sized tensors torch's and JAX's allocators hold at the peak


def gpu_sizes(memory_bytes):
    """The GPU row with the chain's tensors at 1 GiB each (far past any L2), or smaller
    where HELD_AT_PEAK of them would take more than half the card: inputs, a copy target,
    eager's intermediates and outputs in torch, the same again in JAX."""
    tensor_bytes = min(2**30, memory_bytes // (2 * HELD_AT_PEAK))
    rows = tensor_bytes // (GPU.width * 4) // 1024 * 1024
    return replace(GPU, rows=rows)


def choose_sizes(device, quick):
    """--quick's sizes on any device; else the CPU's, or the GPU's from its memory."""
    if quick:
        return QUICK
    if device == "cpu":
        return CPU
    memory = torch.cuda.mem_get_info()[1]
    sizes = gpu_sizes(memory)
    held_gib = HELD_AT_PEAK * sizes.rows * sizes.width * 4 / 2**30
    print(f"derived: chain tensors {sizes.rows} x {sizes.width} fp32, {HELD_AT_PEAK} held at"
          f" the peak: {held_gib:.1f} of {memory / 2**30:.0f} GiB")
    return sizes

STEPS = 16    # 1: the tiny chain is STEPS x (sin, mul, add) = 48 ops ...
TINY = 1024   #    ... on 1024 fp32 values
SHAPES = [8, 16, 8, 32]  # 4: input lengths for the recompile and retrace counts

# "Equals eager": max |compiled - eager| / (1 + max |eager|) within a tolerance. fp32
# variants differ only by rounding (their own sin, erf, fused multiply-adds): a few 1e-7.
# 1e-5 still fails bf16 where fp32 was meant (~1e-2), GELU's tanh approximation for the
# exact erf (~6e-5) and a dropped term of either chain (> 1e-2).
FP32_TOL = 1e-5
# bf16 results round apart by a bf16 step (at most 2^-7 of the largest value, 8e-3), or
# two where cuBLAS adds split-K partial sums in bf16; a wrong or transposed operand: O(1).
BF16_TOL = 2e-2
JAX_DTYPE = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}

# Each compiled variant against its own op-by-op version
COMPILED = dict(torch_compile="eager", reduce_overhead="eager", jax_jit="jax_eager")


def chain_torch(x):
    for _ in range(STEPS):
        x = torch.sin(x) * 1.1 + 0.1
    return x


def chain_jax(x):
    for _ in range(STEPS):
        x = jnp.sin(x) * 1.1 + 0.1
    return x


def unfused_torch(x, a, b, c, residual):  # 5 ops: mul, add, gelu, mul, add
    return F.gelu(x * a + b) * c + residual


def unfused_jax(x, a, b, c, residual):
    return jax.nn.gelu(x * a + b, approximate=False) * c + residual


# 1. The overhead regime

OVERHEAD_LEAST = {  # 1's prediction: the least speed-up of each compiled variant
    "cuda": dict(torch_compile=5.0, reduce_overhead=2.0, jax_jit=10.0),
    "cpu": dict(torch_compile=2.0, jax_jit=3.0),
}


def dispatches_per_call(fn, device, calls=10):
    """torch.profiler's count of what one call sends down: the ops Python dispatched (its
    top-level events: eager's aten ops, or one compiled region) and, on a GPU, the kernel
    launches (cudaLaunchKernel, cuLaunchKernel*, cudaGraphLaunch) and the kernels run."""
    fn()
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    dispatched = 0
    launches = 0
    kernels = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
        elif event.cpu_parent is None and not event.name.startswith("cuda"):
            dispatched += 1
        if "LaunchKernel" in event.name or "GraphLaunch" in event.name:
            launches += 1
    counts = dict(dispatched=dispatched / calls)
    if device == "cuda":
        counts["launches"] = launches / calls
        counts["kernels"] = kernels / calls
    return counts


def calls_to_pay_back(first_s, op_by_op_s, compiled_s):
    """How many calls repay a compile: the first call's extra seconds over a warm call,
    divided by what each warm call saves against op by op."""
    return (first_s - compiled_s) / (op_by_op_s - compiled_s)


def speedups_held(speedups, least):
    """Held when every predicted speed-up reaches its least value and is a finding (faster
    in every pair)."""
    for name, smallest in least.items():
        speedup = speedups[name]
        if speedup["median"] < smallest or speedup["min"] <= 1:
            return False
    return True


def overhead(sizes, device):
    """PREDICTION: each of the 48 ops costs a few us of CPU to dispatch (a GPU adds a
    kernel launch) and almost no work on 1024 values, so eager ~ 48 dispatches: ~0.2 ms on
    a CPU, ~0.5 ms on a GPU; JAX dispatches an op alone in tens of us. GPU: torch.compile
    >= 5x faster than eager (one Triton kernel, one launch, guards of ~20 us), CUDA graphs
    >= 2x (one graph launch, plus a copy of the input into the graph's memory), jax.jit
    >= 10x faster than JAX op by op. CPU: no CUDA graphs; torch.compile >= 2x (Inductor
    writes one C++ loop), jax.jit >= 3x."""
    least = OVERHEAD_LEAST[device]
    said = []
    for name, smallest in least.items():
        said.append(f"{name} >= {smallest:g}x as fast as {COMPILED[name]}")
    print(f"  predicted: {', '.join(said)}")
    if device == "cpu":
        print("  predicted: no CUDA graphs on a CPU; torch.compile's kernel is Inductor's C++")
    shares = [cpu_share()]
    x = torch.randn(TINY, device=device)
    x_jax = jnp.asarray(to_numpy(x))
    compiled = torch.compile(chain_torch)
    jitted = jax.jit(chain_jax)
    variants = dict(eager=lambda: chain_torch(x), torch_compile=lambda: compiled(x))
    if device == "cuda":
        graphed = torch.compile(chain_torch, mode="reduce-overhead")  # Inductor + CUDA graphs
        variants["reduce_overhead"] = lambda: graphed(x)
    variants["jax_eager"] = lambda: chain_jax(x_jax)
    variants["jax_jit"] = lambda: jitted(x_jax)
    out = measure("overhead", variants, sizes.tiny_reps, sizes.tiny_calls)
    per_call = {}
    for name in ("eager", "torch_compile", "reduce_overhead"):
        if name in variants:
            per_call[name] = dispatches_per_call(variants[name], device)
    per_call["jax_eager"] = dict(jaxpr_equations=len(jax.make_jaxpr(chain_jax)(x_jax).eqns))
    per_call["jax_jit"] = dict(jaxpr_equations=len(jax.make_jaxpr(jitted)(x_jax).eqns))
    shares.append(cpu_share())
    pays_back = {}
    for name, speedup in out["speedup"].items():
        pays_back[name] = None
        if speedup["min"] > 1:  # faster in every pair
            op_by_op_s = out["time"][COMPILED[name]]["median"]
            compiled_s = out["time"][name]["median"]
            pays_back[name] = calls_to_pay_back(out["first_call_s"][name], op_by_op_s, compiled_s)
    out.update(n_ops=3 * STEPS, per_call=per_call, pays_back_after_calls=pays_back,
               predicted_least=least, cpu_shares=shares, busy=is_busy(shares),
               checks=equal_checks(out["error"], FP32_TOL), tolerance=FP32_TOL)
    out["prediction_held"] = speedups_held(out["speedup"], least)
    return out


def report_overhead(r):
    notes = {}
    for name, counts in r["per_call"].items():
        parts = []
        for what, count in counts.items():
            parts.append(f"{count:g} {what}")
        notes[name] = ", ".join(parts)
    report_times(r, notes, 1e6, "us", "measured: per call")
    print("  (dispatched: calls Python made into torch, a compiled one's guard check"
          " included; launches, kernels: CUDA's; jaxpr_equations: ops JAX dispatches)")
    if "reduce_overhead" not in r["time"]:
        print("  CUDA graphs (mode='reduce-overhead') need a GPU: not run here")
    print("  (a speed-up is the median of per-pair ratios op-by-op / compiled, [min, max])")
    report_speedups(r)
    busy = busy_mark(r["busy"])
    for name, seconds in r["first_call_s"].items():
        calls = r["pays_back_after_calls"][name]
        repaid = "derived: no repayment count: not faster in every pair"
        if calls is not None:
            repaid = f"derived: repays its compile after {calls:,.0f} calls"
        print(f"  measured: {name}'s first call {seconds:.2f} s (it compiles); {repaid}{busy}")
    report_checks(r)
    measured = []
    finding = True
    for name in r["predicted_least"]:
        measured.append(f"{name} {r['speedup'][name]['median']:.2f}x")
        if not beyond_noise(r["speedup"][name]):
            finding = False
    report_prediction(r["prediction_held"], ", ".join(measured), finding, r["busy"])


# 2. The bandwidth regime

BANDWIDTH_PREDICTED = {  # 2's prediction: torch.compile's least speed-up over eager, and
    "cuda": dict(speedup=3.0, most_x_bound=1.5),  # the most times its roofline bound
    "cpu": dict(speedup=1.3, most_x_bound=3.0),
}


def chain_bytes(rows, width):
    """The chain's bytes counted on paper (fp32: 4 B a value; x and the residual are
    rows x width = N values, a, b and c width-long vectors). Eager runs one op at a time:
    each reads its inputs from memory and writes its output there. Fused code reads x,
    a, b, c and the residual once and writes the result once."""
    n = rows * width
    eager_values = [
        n + width + n,  # t1 = x * a: read x and a, write t1
        n + width + n,  # t2 = t1 + b
        n + n,          # t3 = gelu(t2)
        n + width + n,  # t4 = t3 * c
        n + n + n,      # t4 + residual: read both, write the result
    ]
    fused_values = n + n + 3 * width + n  # read x, the residual, a, b, c; write the result
    return dict(eager=4 * sum(eager_values), fused=4 * fused_values)


def on_roofline(samples, n, ridge_n, bytes_fused, xla_flops, xla_bytes):
    """The chain against the roofs measured beside it, round by round (sample i of every
    variant came from the same round): the copy bandwidth (a copy reads and writes N fp32
    values), the matmul's FLOP/s (2 ridge_n^3), their ratio the ridge, the floor (the
    fused bytes at the copy bandwidth), the bound (the slower of the floor and the
    chain's FLOPs at the matmul's rate)."""
    copy_bandwidth = []
    matmul_flops = []
    floor_s = []
    bound_s = []
    for copy_s, matmul_s in zip(samples["copy"], samples["fp32_matmul"]):
        bandwidth_Bps = 2 * n * 4 / copy_s
        flops_per_s = 2 * ridge_n**3 / matmul_s
        floor = bytes_fused / bandwidth_Bps
        copy_bandwidth.append(bandwidth_Bps)
        matmul_flops.append(flops_per_s)
        floor_s.append(floor)
        bound_s.append(max(floor, xla_flops / flops_per_s))
    intensity = xla_flops / xla_bytes
    ridge = ratio(matmul_flops, copy_bandwidth)
    regime = "bandwidth-bound"
    if intensity > ridge["median"]:
        regime = "compute-bound"
    x_bound = {}
    for name in ("eager", "torch_compile", "jax_eager", "jax_jit"):
        x_bound[name] = ratio(samples[name], bound_s)
    return dict(copy_bandwidth_Bps=summary(copy_bandwidth),
                fp32_matmul_flops=summary(matmul_flops),
                ridge_flop_per_byte=ridge,
                floor_s=summary(floor_s),
                bound_s=summary(bound_s),
                intensity_flop_per_byte=intensity,
                regime=regime,
                regime_is_finding=intensity > ridge["max"] or intensity < ridge["min"],
                x_bound=x_bound)


def keep_freed_memory():
    """Linux's C library (glibc) maps a large block fresh from the system and hands it
    back when it is freed (from 32 MB up, and smaller ones depending on what it has seen),
    so the next tensor that size pays a page fault on each of its 4 KB pages while the
    system zeroes them: a fresh 32 MB tensor then costs several times its bytes. A GPU's
    caching allocator keeps freed blocks; here glibc is asked to do the same, so the chain
    is timed on its bytes, not on page faults. Returns whether it applied."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):  # not glibc
        return False
    libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: large blocks from the heap, not fresh mappings
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD = 1 GB: keep freed memory up to that
    return True


def bandwidth_held(speedup, x_bound, predicted):
    """Held when torch.compile is at least the predicted times faster than eager, faster in
    every pair, and its median at most the predicted times its roofline bound."""
    if speedup["median"] < predicted["speedup"] or speedup["min"] <= 1:
        return False
    return x_bound["median"] <= predicted["most_x_bound"]


def bandwidth(sizes, device):
    """PREDICTION: on paper (chain_bytes) eager moves 11 N fp32 values, fused code 3 N: if
    the chain is bandwidth-bound, fused is ~11/3 = 3.7x faster than eager and runs at the
    floor, the fused bytes at the copy bandwidth. XLA counts ~5.7 FLOP per byte for it
    (the exact erf is a polynomial). GPU: the fp32 ridge is well above that (datasheets:
    H100 SXM 67 TFLOP/s over 3.35 TB/s = 20 FLOP/B, RTX 4090 82.6 over 1.01 = 82), so the
    chain is bandwidth-bound: torch.compile >= 3x faster than eager and within 1.5x of its
    bound, the floor. CPU: a core's ridge is a few FLOP/B, so the chain sits near it, on
    either side: torch.compile >= 1.3x faster than eager (one pass instead of five, in
    Inductor's C++), within 3x of the roofline bound."""
    predicted = BANDWIDTH_PREDICTED[device]
    print(f"  predicted: torch_compile >= {predicted['speedup']:g}x as fast as eager, at"
          f" most {predicted['most_x_bound']:g}x its roofline bound")
    if device == "cpu":
        print("  predicted: the chain near a CPU's ridge (either regime); Inductor's C++ fuses it")
    shares = [cpu_share()]
    if device == "cpu" and keep_freed_memory():
        print("  CPU: freed memory kept from here on, as a GPU's caching allocator keeps it")
    x = torch.randn(sizes.rows, sizes.width, device=device)
    residual = torch.randn(sizes.rows, sizes.width, device=device)
    a = torch.randn(sizes.width, device=device)
    b = torch.randn(sizes.width, device=device)
    c = torch.randn(sizes.width, device=device)
    inputs = [x, a, b, c, residual]
    inputs_jax = []
    for t in inputs:
        inputs_jax.append(jnp.asarray(to_numpy(t)))
    target = torch.empty_like(x)
    square = torch.randn(sizes.ridge_n, sizes.ridge_n, device=device)
    compiled = torch.compile(unfused_torch)
    jitted = jax.jit(unfused_jax)
    variants = dict(eager=lambda: unfused_torch(*inputs),
                    torch_compile=lambda: compiled(*inputs),
                    jax_eager=lambda: unfused_jax(*inputs_jax),
                    jax_jit=lambda: jitted(*inputs_jax),
                    copy=lambda: target.copy_(x),  # the bandwidth roof, measured beside
                    fp32_matmul=lambda: square @ square)  # the FLOP roof (TF32 stays off)
    out = measure("bandwidth", variants, sizes.reps)
    cost = jitted.lower(*inputs_jax).compile().cost_analysis()  # XLA's count (see 4b)
    shares.append(cpu_share())
    paper = chain_bytes(sizes.rows, sizes.width)
    out.update(rows=sizes.rows, width=sizes.width, ridge_n=sizes.ridge_n,
               bytes_eager=paper["eager"], bytes_fused=paper["fused"],
               xla_flops=cost["flops"], xla_bytes=cost["bytes accessed"])
    out.update(on_roofline(out["samples_s"], sizes.rows * sizes.width, sizes.ridge_n,
                           paper["fused"], cost["flops"], cost["bytes accessed"]))
    out.update(cpu_shares=shares, busy=is_busy(shares), predicted=predicted,
               checks=equal_checks(out["error"], FP32_TOL), tolerance=FP32_TOL)
    out["prediction_held"] = bandwidth_held(out["speedup"]["torch_compile"],
                                            out["x_bound"]["torch_compile"], predicted)
    return out


def report_bandwidth(r):
    busy = busy_mark(r["busy"])
    n = r["rows"] * r["width"]
    eager_mb = r["bytes_eager"] / 1e6
    fused_mb = r["bytes_fused"] / 1e6
    print(f"  derived: bytes on paper, N = {n:,} and d = {r['width']}: eager {eager_mb:.1f} MB"
          f" (11 N + 3 d values of 4 B), fused {fused_mb:.1f} MB (3 N + 3 d)")
    notes = {}
    for name, x_bound in r["x_bound"].items():
        notes[name] = f"{ratio_text(x_bound)}{mark(beyond_noise(x_bound), False)}"
    notes["copy"] = "the bandwidth roof: reads and writes N values"
    notes["fp32_matmul"] = f"the FLOP roof: {r['ridge_n']}^3, fp32"
    report_times(r, notes, 1e3, "ms", "derived: x the roofline bound, median [min, max]")
    print("  (each derived number below: median [min, max] over the rounds)")
    bandwidth = spread_text(r["copy_bandwidth_Bps"], 1e-9, "GB/s")
    print(f"  derived: copy bandwidth {bandwidth}{busy}")
    flops = spread_text(r["fp32_matmul_flops"], 1e-9, "GFLOP/s")
    print(f"  derived: fp32 matmul {flops}{busy}")
    ridge = r["ridge_flop_per_byte"]
    print(f"  derived: ridge {spread_text(ridge, 1, 'FLOP/B')}{busy}")
    floor = spread_text(r["floor_s"], 1e3, "ms")
    print(f"  derived: floor {floor}: the fused bytes at the copy bandwidth{busy}")
    bound = spread_text(r["bound_s"], 1e3, "ms")
    print(f"  derived: roofline bound {bound}: the slower of the floor and the chain's FLOPs"
          f" at the matmul's rate{busy}")
    print(f"  derived: XLA's cost analysis of the jitted chain: {r['xla_flops']:.3g} FLOPs,"
          f" {r['xla_bytes']:.4g} B: {r['intensity_flop_per_byte']:.2f} FLOP/B")
    print(f"  derived: the fused chain is {r['regime']} here: {r['intensity_flop_per_byte']:.2f}"
          f" FLOP/B against the ridge's {ridge['median']:.1f}"
          f"{mark(r['regime_is_finding'], r['busy'])}")
    report_speedups(r)
    report_checks(r)
    speedup = r["speedup"]["torch_compile"]["median"]
    x_bound = r["x_bound"]["torch_compile"]["median"]
    measured = f"torch_compile {speedup:.2f}x as fast as eager, {x_bound:.2f}x its roofline bound"
    finding = beyond_noise(r["speedup"]["torch_compile"])
    report_prediction(r["prediction_held"], measured, finding, r["busy"])


# 3. The compute regime

COMPUTE_MOST = 1.1  # 3's prediction: compiling a lone matmul speeds it up at most this much


def compute_held(speedups):
    """Held when no compiled variant's median speed-up is above COMPUTE_MOST."""
    for speedup in speedups.values():
        if speedup["median"] > COMPUTE_MOST:
            return False
    return True


def compute(sizes, device):
    """PREDICTION: a matmul does 2 n^3 FLOPs on 3 n^2 values: 2n / (3 x bytes a value)
    FLOP per byte (GPU: 8192 in bf16, 2731; CPU: 1024 in fp32, 171), far above the ridge,
    so its time is arithmetic (a GPU's tensor cores, a CPU's SIMD multiply-adds) and its
    bytes at the copy bandwidth take a small part of it. Eager and compiled code call the
    same library GEMM (cuBLAS, oneDNN or MKL, XLA's dot) and there is nothing to fuse: on
    any device, compiling speeds it up 1.1x at most, and its wrapper may cost a little."""
    print(f"  predicted: torch_compile and jax_jit at most {COMPUTE_MOST:g}x as fast as op by op;"
          " the matmul far slower than its bytes at the copy's bandwidth")
    shares = [cpu_share()]
    n = sizes.matmul_n
    dtype = sizes.matmul_dtype
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    target = torch.empty_like(a)
    a_jax = jnp.asarray(to_numpy(a), dtype=JAX_DTYPE[dtype])
    b_jax = jnp.asarray(to_numpy(b), dtype=JAX_DTYPE[dtype])
    compiled = torch.compile(torch.matmul)
    jitted = jax.jit(jnp.matmul)
    variants = dict(eager=lambda: a @ b,
                    torch_compile=lambda: compiled(a, b),
                    jax_eager=lambda: jnp.matmul(a_jax, b_jax),
                    jax_jit=lambda: jitted(a_jax, b_jax),
                    copy=lambda: target.copy_(a))  # reads and writes n^2 values
    out = measure("matmul", variants, sizes.reps)
    shares.append(cpu_share())
    bytes_s = []  # the matmul's 3 n^2 values at the copy's bandwidth, round by round
    for copy_s in out["samples_s"]["copy"]:
        bytes_s.append(copy_s * 3 / 2)
    x_bytes = ratio(out["samples_s"]["eager"], bytes_s)
    flops_per_s = {}
    for name in ("eager", "torch_compile", "jax_eager", "jax_jit"):
        flops_per_s[name] = 2 * n**3 / out["time"][name]["median"]
    regime = "bandwidth-bound"
    if x_bytes["median"] > 1:
        regime = "compute-bound"
    tol = FP32_TOL
    if dtype == torch.bfloat16:
        tol = BF16_TOL
    out.update(n=n, dtype=str(dtype), flops_per_s=flops_per_s,
               intensity_flop_per_byte=2 * n / (3 * a.element_size()),
               eager_x_bytes_time=x_bytes, regime=regime, cpu_shares=shares,
               busy=is_busy(shares), checks=equal_checks(out["error"], tol), tolerance=tol)
    out["prediction_held"] = compute_held(out["speedup"])
    return out


def report_compute(r):
    notes = {"copy": f"{r['n']}^2 values read and written: the bandwidth beside"}
    for name, rate in r["flops_per_s"].items():
        notes[name] = f"{rate / 1e12:.3g} TFLOP/s"
    report_times(r, notes, 1e3, "ms", "derived: FLOP/s at the median")
    x_bytes = r["eager_x_bytes_time"]
    print(f"  derived: intensity {r['intensity_flop_per_byte']:.0f} FLOP/B; eager takes"
          f" {ratio_text(x_bytes)} the time of its 3 n^2 values at the copy's bandwidth:"
          f" {r['regime']}{mark(beyond_noise(x_bytes), r['busy'])}")
    report_speedups(r)
    report_checks(r)
    measured = []
    finding = True
    for name, speedup in r["speedup"].items():
        measured.append(f"{name} {speedup['median']:.2f}x")
        if not beyond_noise(speedup):
            finding = False
    report_prediction(r["prediction_held"], ", ".join(measured), finding, r["busy"])


# 4a. torch.compile captures bytecode: graph breaks and recompiles

def clean(x):
    return torch.sin(x) * 2 + 1


def dirty(x):
    y = torch.sin(x)
    print("    (print inside dirty() ran)")  # Dynamo cannot put a print in a graph: break
    scale = y.abs().max().item()  # a Python float leaves the graph: break
    return y / scale * 2 + 1


GRAPHS = []  # what torch.compile handed its backend, one graph per (re)compile


def counting_backend(graph_module, example_inputs):  # Dynamo calls it once per compile
    GRAPHS.append(graph_module)
    return graph_module.forward  # run the captured graph as it is: nothing to build


def compiles_after_each(dynamic, device):
    """Graphs compiled so far after each call of clean() on SHAPES, with this dynamic=."""
    torch.compiler.reset()
    GRAPHS.clear()
    compiled = torch.compile(clean, backend=counting_backend, dynamic=dynamic)
    after = []
    for n in SHAPES:
        compiled(torch.randn(n, device=device))
        after.append(len(GRAPHS))
    return after


TORCH_CAPTURE_PREDICTED = dict(  # 4a's prediction: the counts, on any device
    clean=dict(graph_count=1, graph_break_count=0),
    dirty=dict(graph_count=3, graph_break_count=2),
    compiles_for_shapes={"dynamic=False": [1, 2, 2, 3],
                         "dynamic=None": [1, 2, 2, 2],
                         "dynamic=True": [1, 1, 1, 1]},
)


def capture_torch(device):
    """PREDICTION (any device): explain() finds 1 graph and 0 breaks in clean(), 3 graphs
    and 2 breaks in dirty() (the print, the .item()). After shapes 8, 16, 8, 32:
    dynamic=False compiles once per new shape ([1, 2, 2, 3] graphs so far); the default
    (None) compiles 8 static, then recompiles on 16 with a symbolic size that 32 reuses
    ([1, 2, 2, 2]); dynamic=True compiles one symbolic graph ([1, 1, 1, 1]). A repeated
    shape never recompiles."""
    print("  predicted: clean() 1 graph, 0 breaks; dirty() 3 graphs, 2 breaks; graphs after"
          " each shape: dynamic=False [1, 2, 2, 3], None [1, 2, 2, 2], True [1, 1, 1, 1]")
    x = torch.randn(8, device=device)
    found = {}
    reasons = {}
    for fn in (clean, dirty):
        explained = torch._dynamo.explain(fn)(x)
        found[fn.__name__] = dict(graph_count=explained.graph_count,
                                  graph_break_count=explained.graph_break_count)
        reasons[fn.__name__] = []
        for broken in explained.break_reasons:
            reasons[fn.__name__].append(str(broken.reason).splitlines()[0][:90])  # first line
    compiles = {}
    for dynamic in (False, None, True):
        compiles[f"dynamic={dynamic}"] = compiles_after_each(dynamic, device)
    found["compiles_for_shapes"] = compiles
    repeated = True  # the third shape repeats the first
    for after in compiles.values():
        if after[2] != after[1]:
            repeated = False
    checks = dict(graph_breaks_found_in_dirty=found["dirty"]["graph_break_count"] > 0,
                  no_graph_breaks_in_clean=found["clean"]["graph_break_count"] == 0,
                  repeated_shape_does_not_recompile=repeated,
                  dynamic_true_compiles_once=compiles["dynamic=True"][-1] == 1)
    return dict(found, shapes=SHAPES, break_reasons=reasons, checks=checks,
                cpu_shares=[], busy=False,  # nothing timed here: counts only
                prediction_held=found == TORCH_CAPTURE_PREDICTED)


def report_capture_torch(r):
    for name in ("clean", "dirty"):
        graphs = r[name]["graph_count"]
        breaks = r[name]["graph_break_count"]
        print(f"  measured: {name}(): {graphs} graph(s), {breaks} graph break(s)"
              f" {r['break_reasons'][name]}")
    for dynamic, after in r["compiles_for_shapes"].items():
        print(f"  measured: {dynamic:13s}: graphs compiled after shapes {r['shapes']}: {after}")
    report_checks(r)
    report_prediction(r["prediction_held"], "the counts above", True, False)


# 4b. jax.jit traces: jaxpr, side effects at trace time, retraces, compiling ahead of time

TRACES = []  # what jax.jit traced, one entry per trace


def counted(x):
    TRACES.append(x.shape)  # a Python side effect: runs while tracing, not when the code runs
    return jnp.sin(x) * 2 + 1


def power(x, k):  # a Python loop over k: k must be a concrete Python int
    TRACES.append(k)
    for _ in range(k):
        x = x * x
    return x


def traces_after_each(jitted, calls):
    """Traces so far after each call of a jitted function, on these lists of arguments."""
    TRACES.clear()
    after = []
    for args in calls:
        jitted(*args).block_until_ready()
        after.append(len(TRACES))
    return after


def capture_jax(sizes):
    """PREDICTION (any device): jax.jit runs the Python function once per new input shape,
    on abstract tracers, so a Python counter inside counts traces: [1, 2, 2, 3] after
    shapes 8, 16, 8, 32. A static argument is part of the cache key: k = 2, 3, 2 gives
    [1, 2, 2]; without static_argnums, range(k) over a tracer raises
    TracerIntegerConversionError. XLA's cost analysis sees the fused chain read its inputs
    and write its result once: bytes accessed within 10% of the 3 N x 4 B floor."""
    print("  predicted: traces [1, 2, 2, 3] for shapes, [1, 2, 2] for k = 2, 3, 2;"
          " XLA's bytes within 10% of the floor")
    shares = [cpu_share()]
    small = jnp.ones((2, 4))
    vector = jnp.ones(4)
    jaxpr = jax.make_jaxpr(unfused_jax)(small, vector, vector, vector, small)
    out = dict(jaxpr=jaxpr.pretty_print(use_color=False))  # no terminal colour codes
    shape_calls = []
    for n in SHAPES:
        shape_calls.append([jnp.ones(n)])
    after_shapes = traces_after_each(jax.jit(counted), shape_calls)
    static_calls = []
    for k in (2, 3, 2):
        static_calls.append([jnp.ones(4), k])
    after_static = traces_after_each(jax.jit(power, static_argnums=1), static_calls)
    out["traces_for_shapes"] = dict(shapes=SHAPES, traces_after_each=after_shapes)
    out["traces_for_static_args"] = dict(k=[2, 3, 2], traces_after_each=after_static)
    out["nonstatic_loop_bound_error"] = None
    try:
        jax.jit(power)(jnp.ones(4), 2)
    except jax.errors.TracerIntegerConversionError as error:  # range() over a tracer
        out["nonstatic_loop_bound_error"] = type(error).__name__

    big = jax.ShapeDtypeStruct((sizes.rows, sizes.width), jnp.float32)
    vec = jax.ShapeDtypeStruct((sizes.width,), jnp.float32)
    fresh = jax.jit(lambda *xs: unfused_jax(*xs))  # a new function: no cache has seen it
    start = time.perf_counter()
    lowered = fresh.lower(big, vec, vec, vec, big)  # traced to StableHLO, no data needed
    lowered_at = time.perf_counter()
    cost = lowered.compile().cost_analysis()  # XLA compiles it, then counts FLOPs and bytes
    compiled_at = time.perf_counter()
    shares.append(cpu_share())
    floor = chain_bytes(sizes.rows, sizes.width)["fused"]
    out["aot"] = dict(lower_s=lowered_at - start,
                      compile_s=compiled_at - lowered_at,
                      flops=cost["flops"],
                      bytes_accessed=cost["bytes accessed"],
                      bytes_floor=floor)
    near_floor = abs(cost["bytes accessed"] / floor - 1) < 0.1
    raised = out["nonstatic_loop_bound_error"] is not None
    out.update(cpu_shares=shares, busy=is_busy(shares))
    out["prediction_held"] = all([after_shapes == [1, 2, 2, 3], after_static == [1, 2, 2],
                                  raised, near_floor])
    out["checks"] = dict(jax_one_trace_per_new_shape=after_shapes == [1, 2, 2, 3],
                         jax_retrace_per_new_static_arg=after_static == [1, 2, 2])
    return out


def report_capture_jax(r):
    print("  the jaxpr of the chain (what tracing recorded):")
    print("    " + r["jaxpr"].replace("\n", "\n    "))
    shapes = r["traces_for_shapes"]
    static = r["traces_for_static_args"]
    print(f"  measured: traces after shapes {shapes['shapes']}: {shapes['traces_after_each']}")
    print(f"  measured: static_argnums=1, k = {static['k']}: traces {static['traces_after_each']}")
    print(f"  measured: without static_argnums: {r['nonstatic_loop_bound_error']}")
    aot = r["aot"]
    print(f"  measured: lower {aot['lower_s']:.3f} s, compile {aot['compile_s']:.3f} s"
          f"{busy_mark(r['busy'])}")
    print(f"  derived: XLA's bytes accessed {aot['bytes_accessed']:.4g} against the floor"
          f" {aot['bytes_floor']:.4g} counted on paper (3 N + 3 d values of 4 B)")
    report_checks(r)
    report_prediction(r["prediction_held"], "the counts and bytes above", True, False)


# The tools every experiment above uses: timing on a machine that may be busy
# (interleaved samples, medians with their spread), checking against eager, and printing

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


def interleaved(fns, reps):
    """Seconds of each call of each function, the functions called in turn (A, B, A, B,
    ...), so a machine slowed for a while slows every side alike. Each function
    synchronises its own device before it returns."""
    seconds = [[] for _ in fns]
    for _ in range(reps):
        for samples, fn in zip(seconds, fns):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return seconds


def is_busy(shares):
    """An experiment was busy when any share of a core sampled around it is below BUSY_SHARE."""
    return min(shares) < BUSY_SHARE


def summary(samples):
    """Median, min and max of a list of samples (seconds, bytes/s, ...)."""
    return dict(median=statistics.median(samples), min=min(samples), max=max(samples))


def ratio(numerators, denominators):
    """The median of the per-pair ratios a_i / b_i, with their min and max."""
    pairs = []
    for a, b in zip(numerators, denominators):
        pairs.append(a / b)
    return dict(median=statistics.median(pairs), min=min(pairs), max=max(pairs))


def beyond_noise(r):
    """A ratio says something only when all its pairs lie on one side of 1."""
    return r["min"] > 1 or r["max"] < 1


def mark(finding, busy):
    """What follows a printed result: nothing when it is a finding."""
    if busy:
        return " (machine busy)"
    if not finding:
        return " (within noise)"
    return ""


def busy_mark(busy):
    """What follows a printed timing of a busy experiment."""
    if busy:
        return " (machine busy)"
    return ""


def timed(fn, calls):
    """fn called `calls` times, then waited for: a JAX call returns before its work is
    done, and so does a CUDA launch. On one stream, the last call done means all are."""
    def call():
        for _ in range(calls - 1):
            fn()
        out = fn()
        if isinstance(out, jax.Array):
            out.block_until_ready()
        elif out.is_cuda:
            torch.cuda.synchronize()
    return call


def first_call_s(fn):
    """Seconds of a compiled function's first call: it captures, compiles, then runs."""
    start = time.perf_counter()
    timed(fn, 1)()
    return time.perf_counter() - start


def to_numpy(t):  # a torch tensor on any device, or a JAX array, as float32 numpy
    if isinstance(t, torch.Tensor):
        t = t.float().cpu()
    return np.asarray(t, dtype=np.float32)


def max_error(got, want):
    """max |got - want| / (1 + max |want|): relative for large values, absolute near 0."""
    got = to_numpy(got)
    want = to_numpy(want)
    worst = np.max(np.abs(got - want))
    return float(worst / (1 + np.max(np.abs(want))))


def measure(section, variants, reps, calls=1):
    """What experiments 1-3 share: each compiled variant's first call (it compiles: kept
    out of the timings) and its error against its op-by-op version; then every variant
    timed, interleaved, after a warm-up; each compiled one's speed-up, pair by pair."""
    first_calls = {}
    errors = {}
    for name, baseline in COMPILED.items():
        if name in variants:
            first_calls[name] = first_call_s(variants[name])
            errors[f"{section}_{name}_equals_{baseline}"] = max_error(variants[name](),
                                                                    variants[baseline]())
    # and the two frameworks agree: JAX's compiled result against PyTorch's eager one
    errors[f"{section}_jax_equals_torch_eager"] = max_error(variants["jax_jit"](),
                                                            variants["eager"]())
    fns = []
    for fn in variants.values():
        fns.append(timed(fn, calls))
    for fn in fns:  # warm-up: compiled code loaded, caches and the allocator filled
        fn()
    samples = {}
    for name, seconds in zip(variants, interleaved(fns, reps)):
        per_call = []
        for sample in seconds:
            per_call.append(sample / calls)
        samples[name] = per_call
    times = {}
    for name, per_call in samples.items():
        times[name] = summary(per_call)
    speedup = {}
    for name, baseline in COMPILED.items():
        if name in variants:
            speedup[name] = ratio(samples[baseline], samples[name])
    return dict(first_call_s=first_calls, error=errors, samples_s=samples, time=times,
                speedup=speedup)


def equal_checks(errors, tol):
    checks = {}
    for name, error in errors.items():
        checks[name] = error <= tol
    return checks


def spread_text(spread, scale, unit):  # "186.6 us [184.8, 288.5]": median [min, max]
    median = spread["median"] * scale
    low = spread["min"] * scale
    high = spread["max"] * scale
    return f"{median:.2f} {unit} [{low:.2f}, {high:.2f}]"


def ratio_text(r):  # "2.97x [2.10, 3.50]": median [min, max] of the per-pair ratios
    return f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]"


def report_times(r, notes, scale, unit, note_header):
    """A table: each variant's time per call, then its note."""
    busy = busy_mark(r["busy"])
    print(f"  {'variant':16s} {'measured: time per call, median [min, max]':44s} {note_header}")
    for name, timing in r["time"].items():
        print(f"  {name:16s} {spread_text(timing, scale, unit):>34s}{'':10s} {notes[name]}{busy}")


def report_speedups(r):
    for name, speedup in r["speedup"].items():
        finding = beyond_noise(speedup)
        print(f"  derived: {name} {ratio_text(speedup)} as fast as {COMPILED[name]}"
              f"{mark(finding, r['busy'])}")


def report_checks(r):
    """`check <name>: ok` or `FAILED`, with the measured error where the check has one."""
    errors = {}
    if "error" in r:
        errors = r["error"]
    for name, passed in r["checks"].items():
        verdict = "ok"
        if not passed:
            verdict = "FAILED"
        detail = ""
        if name in errors:
            detail = f" (measured: max error {errors[name]:.1e}; tolerance {r['tolerance']:.0e})"
        print(f"  check {name}: {verdict}{detail}")


def report_prediction(held, measured, finding, busy):
    """`prediction held: ...` or `missed`, marked when the ratios it rests on are noise."""
    verdict = "missed"
    if held:
        verdict = "held"
    print(f"  prediction {verdict}: {measured}{mark(finding, busy)}")


def main():
    args = parse_args()
    json_file = None
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        json_file = open(args.json, "w")  # a path that cannot be written fails here, first
    device = pick_device(args.device)
    described = describe(device)
    sizes = choose_sizes(device, args.quick)
    torch.set_grad_enabled(False)  # inference only: no autograd graphs
    torch.manual_seed(0)

    print(f"\n1. Overhead regime: {3 * STEPS} elementwise ops on {TINY} fp32 values")
    overhead_result = overhead(sizes, device)
    report_overhead(overhead_result)

    print(f"\n2. Bandwidth regime: gelu(x*a + b)*c + residual, x {sizes.rows} x {sizes.width} fp32")
    bandwidth_result = bandwidth(sizes, device)
    report_bandwidth(bandwidth_result)

    print(f"\n3. Compute regime: {sizes.matmul_n}^3 matmul, {sizes.matmul_dtype}")
    compute_result = compute(sizes, device)
    report_compute(compute_result)

    print("\n4a. torch.compile captures bytecode: graph breaks and recompiles")
    capture_torch_result = capture_torch(device)
    report_capture_torch(capture_torch_result)

    print("\n4b. jax.jit traces: jaxpr, trace-time side effects, retraces, AOT compile")
    capture_jax_result = capture_jax(sizes)
    report_capture_jax(capture_jax_result)

    results = dict(overhead=overhead_result, bandwidth=bandwidth_result, compute=compute_result,
                   capture_torch=capture_torch_result, capture_jax=capture_jax_result)
    run = gather(results)
    print()
    if run["busy_during"]:
        print(f"machine busy: other programs took the CPU during {', '.join(run['busy_during'])};"
              " the marked numbers are not findings")
    else:
        print(f"machine busy: no (every sampled share of a core >= {BUSY_SHARE})")
    print(f"checks: {sum(run['checks'].values())} of {len(run['checks'])} ok")
    if json_file is not None:
        result = dict(lesson="03_compile", quick=args.quick, device=described,
                      machine_busy=len(run["busy_during"]) > 0, cpu_shares=run["cpu_shares"],
                      checks=run["checks"], predictions=run["predictions"], **results)
        json.dump(result, json_file, indent=1)
        json_file.close()
    failed = []
    for name, ok in run["checks"].items():
        if not ok:
            failed.append(name)
    if failed:
        sys.exit(f"check failed: {', '.join(failed)}")


# Flags, device, machine

def gather(results):
    """Every experiment's checks, predictions and CPU shares, and the busy ones' names."""
    run = dict(checks={}, predictions={}, cpu_shares=[], busy_during=[])
    for name, result in results.items():
        run["checks"].update(result["checks"])
        run["predictions"][name] = result["prediction_held"]
        run["cpu_shares"].extend(result["cpu_shares"])
        if result["busy"]:
            run["busy_during"].append(name)
    return run


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="figure folder (this lesson draws none)")
    return parser.parse_args()


def pick_device(asked):
    """CUDA when torch sees a GPU (unless --device cpu), else the CPU; JAX on the same."""
    if asked == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: torch sees no CUDA GPU here; run with --device cpu")
    if asked != "cpu" and torch.cuda.is_available():
        if jax.default_backend() != "gpu":
            sys.exit("error: torch sees a GPU that JAX cannot use: install JAX's CUDA build"
                     " (pip install 'jax[cuda13]'), or run with --device cpu")
        return "cuda"
    jax.config.update("jax_platforms", "cpu")
    return "cpu"


def describe(device):
    """Print what this run measures on, and return it for the JSON."""
    name = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    if device == "cuda":
        memory_gib = torch.cuda.mem_get_info()[1] / 2**30
        name = f"{torch.cuda.get_device_name()}, {memory_gib:.0f} GiB"
    print(f"device: {name}")
    print(f"torch {torch.__version__}, jax {jax.__version__} on {jax.devices()[0]}")
    return dict(type=device, name=name, torch=torch.__version__, jax=jax.__version__,
                jax_device=str(jax.devices()[0]))


if __name__ == "__main__":
    main()
