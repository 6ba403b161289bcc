"""
03_compile.py - Section 13.3: capture the graph, let a compiler fuse it.

A compiler sees many ops at once: it launches them as one kernel and keeps intermediates
in registers, not memory. PyTorch and JAX side by side:
  1. the overhead regime: 48 tiny ops in eager, torch.compile, CUDA graphs
     (mode="reduce-overhead", GPU only) and jax.jit; time and launches per call;
  2. the bandwidth regime: an unfused chain, fused, against the one-read-one-write floor,
     and the chain placed on the measured roofline by XLA's count of its FLOPs per byte;
  3. the compute regime: a big matmul, where compiling gains nothing;
  4. how capture works: torch.compile reads bytecode (graph breaks, recompiles, dynamic=,
     compile time), jax.jit traces (make_jaxpr, trace-time side effects, retraces,
     lower().compile().cost_analysis()).
Every compiled result is checked against eager (its error printed beside the tolerance);
a mismatch exits 1. No figure, and no multi-GPU mode: one device shows all of it.
Run (copy this file alone):
  python 03_compile.py                        # one GPU when present; otherwise the CPU
  python 03_compile.py --device cpu --quick   # seconds: what the tests run
Expect: CUDA graphs several x faster than eager, compile's one kernel faster still; the
fused chain near the floor on a GPU, well above it on a CPU (compute-bound there); the
compiled matmul within ~10% of eager, either way. A timing taken while the machine was busy, and all
derived from it, is marked "unreliable (machine busy)".
"""

import os
import signal
import sys

def interrupted(signum, frame):
    """Ctrl-C at any moment, even while torch and jax import: one line, exit 130.
    os._exit: an exception could be swallowed by a callback inside XLA or a compiler."""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)

if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted)  # before the imports below, which take seconds

import argparse
import ctypes
import json
import logging
import math
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax: torch needs memory
os.environ.setdefault("TEARDOWN_CUPTI", "0")  # keep the profiler's CUPTI beside CUDA graphs
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # silences the profiler's USDT start/stop lines
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

warnings.filterwarnings("ignore", message=".*Profiler clears events.*")

STEPS = 16    # the tiny chain: STEPS x (sin, mul, add) = 48 ops ...
TINY = 1024   # ... on 1024 fp32 values
SHAPES = [8, 16, 8, 32]  # input lengths for the recompile and retrace counts

# The "equals eager" checks: max |compiled - eager| / (1 + max |eager|) within a tolerance.
# fp32 variants differ only by rounding (their own sin, erf, fused multiply-adds): a few
# 1e-7 here. 1e-5 still fails bf16 where fp32 was meant (~1e-2), GELU's tanh approximation
# for the exact erf (~6e-5) and a dropped term of either chain (> 1e-2).
FP32_TOL = 1e-5
# bf16 results round apart by a bf16 step (at most 2^-7 of the largest value, 8e-3), or
# two where cuBLAS adds split-K partial sums in bf16; a wrong or transposed operand: O(1).
BF16_TOL = 2e-2
JAX_DTYPE = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}

# Each compiled variant is timed against its own op-by-op version
BASELINE = dict(torch_compile="eager", reduce_overhead="eager", jax_jit="jax_eager")

BUSY = "unreliable (machine busy)"

@dataclass
class Sizes:
    rows: int = 2048        # the bandwidth chain: x and the residual are rows x width fp32,
    width: int = 4096       #   32 MB each, beyond a CPU's caches (a GPU row: 1 GB, past L2)
    matmul_n: int = 1024    # the compute regime: an n x n by n x n matmul ...
    matmul_dtype: torch.dtype = torch.float32  # ... in this dtype
    ridge_n: int = 1024     # the fp32 n x n matmul that measures the fp32 roof
    reps: int = 7           # timed samples of each measurement
    tiny_reps: int = 30     # timed samples of the tiny chain
    tiny_calls: int = 1     # tiny-chain calls per sample: one, so a busy moment shows

SIZES = {
    "cpu": Sizes(),
    # a GPU queues launches: 50 calls a sample, so one sync is not counted in every call
    "cuda": Sizes(rows=65536, matmul_n=8192, matmul_dtype=torch.bfloat16, ridge_n=8192,
                  reps=10, tiny_reps=10, tiny_calls=50),
    "quick": Sizes(matmul_n=256, ridge_n=512, reps=3),
}

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

# Measuring

def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()

def finish(result):
    """A JAX call returns before its work is done: wait for it."""
    if isinstance(result, jax.Array):
        result.block_until_ready()

def unreliable(timing, rate=0.0, ceiling=math.inf):
    """The one rule: samples spread wider than their median, or a rate more than 10%
    above the ceiling it cannot exceed. Every number derived from such a timing is
    marked too."""
    spread = timing["max_s"] - timing["min_s"]
    return spread > timing["median_s"] or rate > 1.1 * ceiling

def mark(*doubts):
    """Printed after an unreliable number, and after every number derived from one."""
    if any(doubts):
        return " " + BUSY
    return ""

def timed(fn, device, reps, calls=1, warmup=3):
    """Warm up, then time `reps` samples of `calls` back-to-back calls; per call: the
    median, min and max seconds. The device is synchronised before each clock read
    (GPU work is asynchronous; on one stream, the last call done means all are done)."""
    for _ in range(warmup):
        finish(fn())
    samples = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        finish(fn())
        sync(device)
        samples.append((time.perf_counter() - start) / calls)
    median = statistics.median(samples)
    timing = dict(median_s=median, min_s=min(samples), max_s=max(samples))
    timing["unreliable"] = unreliable(timing)
    return timing

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

def measure(section, variants, device, reps, calls=1, tol=FP32_TOL):
    """Each compiled variant's first call (it compiles: kept out of the timings) and its
    error against eager; every variant's time per call; each compiled one's speedup."""
    compiled = [name for name in variants if name in BASELINE]
    first_call_s = {}
    for name in compiled:  # one timed call, no warm-up: the compile plus one run
        first_call_s[name] = timed(variants[name], device, reps=1, warmup=0)["median_s"]
    errors = {}
    for name in compiled:
        baseline = BASELINE[name]
        check = f"{name}_equals_{baseline}"
        errors[check] = max_error(variants[name](), variants[baseline]())
    # and the two frameworks agree: JAX's compiled result against PyTorch's eager one
    errors["jax_equals_torch_eager"] = max_error(variants["jax_jit"](), variants["eager"]())
    checks = {}
    for check, error in errors.items():
        checks[f"{section}_{check}"] = error <= tol
    times = {}
    for name, fn in variants.items():
        times[name] = timed(fn, device, reps, calls)
    speedup = {}
    for name in compiled:
        speedup[name] = times[BASELINE[name]]["median_s"] / times[name]["median_s"]
    return dict(time=times, compile_first_call_s=first_call_s, speedup_vs_eager=speedup,
                error=errors, tolerance=tol, checks=checks)

def called_from_aten(event):  # an aten op that another aten op called: not a dispatch
    if event.cpu_parent is None:
        return False
    return event.cpu_parent.name.startswith("aten::")

def launches_per_call(fn, device, calls=10):
    """torch.profiler's count. GPU: launch API calls (cudaLaunchKernel, cuLaunchKernel*,
    cudaGraphLaunch) and kernels run. CPU: ops dispatched (top-level aten ops and
    compiled graphs)."""
    fn()
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    if device == "cuda":
        launches = 0
        kernels = 0
        for event in prof.events():
            if "LaunchKernel" in event.name or "GraphLaunch" in event.name:
                launches += 1
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels += 1
        return dict(launches=launches / calls, gpu_kernels=kernels / calls)
    dispatched = 0
    for event in prof.events():
        if "CompiledFxGraph" in event.name:
            dispatched += 1
        if event.name.startswith("aten::") and not called_from_aten(event):
            dispatched += 1
    return dict(ops_dispatched=dispatched / calls)

# 1. The overhead regime

def overhead(sizes, device):
    """PREDICTION: each of the 48 tiny ops costs a few us of CPU dispatch (a GPU adds
    a launch) and far less device work: eager ~ 48 x dispatch. torch.compile: one
    fused kernel plus ~10-30 us of guards and launch. CUDA graphs: one graph launch,
    several x faster than eager, but an input copy keeps them behind compile's single
    kernel. jax.jit: one dispatch per call, not 48."""
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
    out = measure("overhead", variants, device, sizes.tiny_reps, sizes.tiny_calls)
    launches = {}
    for name in ("eager", "torch_compile", "reduce_overhead"):
        if name in variants:
            launches[name] = launches_per_call(variants[name], device)  # graphs warm by now
    eager_ops = jax.make_jaxpr(chain_jax)(x_jax).eqns  # one equation per op
    jit_ops = jax.make_jaxpr(jitted)(x_jax).eqns  # one: the call of the compiled chain
    out["launches_per_call"] = launches
    out["jax_ops_per_call"] = dict(jax_eager=len(eager_ops), jax_jit=len(jit_ops))
    out["n_ops"] = 3 * STEPS
    out["numel"] = TINY
    return out

# 2. The bandwidth regime

def roofs(sizes, device):
    """One timing of each roof the chain can meet: a copy of a chain-sized fp32 tensor
    (bytes/s) and an fp32 ridge_n^3 matmul (FLOP/s; PyTorch keeps TF32 off for it)."""
    source = torch.randn(sizes.rows, sizes.width, device=device)
    target = torch.empty_like(source)
    square = torch.randn(sizes.ridge_n, sizes.ridge_n, device=device)
    copy = timed(lambda: target.copy_(source), device, sizes.reps)
    matmul = timed(lambda: square @ square, device, sizes.reps)
    return dict(copy=copy, fp32_matmul=matmul)

def fastest(runs):  # a roof is the best this machine did: the run with the fastest sample
    return min(runs, key=lambda timing: timing["min_s"])

def bandwidth(sizes, device):
    """PREDICTION: every eager op reads its inputs from memory and writes its output:
    mul 2N + add 2N + gelu 2N + mul 2N + add 3N = 11 N values. Fused code reads x and
    the residual once and writes once: 3 N, the floor. So eager ~ 11/3 = 3.7x slower
    than fused, and fused time ~ 3 N x 4 B / copy bandwidth - IF the chain is
    bandwidth-bound. XLA counts ~5.7 FLOP per byte for it (the exact erf is a long
    polynomial): below a GPU's fp32 ridge (tens of FLOP/B: fused near the floor),
    above a CPU's (a few FLOP/B: compute-bound, several x above the floor)."""
    x = torch.randn(sizes.rows, sizes.width, device=device)
    residual = torch.randn(sizes.rows, sizes.width, device=device)
    a = torch.randn(sizes.width, device=device)
    b = torch.randn(sizes.width, device=device)
    c = torch.randn(sizes.width, device=device)
    inputs = [x, a, b, c, residual]
    inputs_jax = [jnp.asarray(to_numpy(t)) for t in inputs]
    compiled = torch.compile(unfused_torch)
    jitted = jax.jit(unfused_jax)
    variants = dict(eager=lambda: unfused_torch(*inputs),
                    torch_compile=lambda: compiled(*inputs),
                    jax_eager=lambda: unfused_jax(*inputs_jax),
                    jax_jit=lambda: jitted(*inputs_jax))
    before = roofs(sizes, device)
    out = measure("bandwidth", variants, device, sizes.reps)
    after = roofs(sizes, device)  # the roofs again: the better of the two is kept
    cost = jitted.lower(*inputs_jax).compile().cost_analysis()  # XLA's count of the chain
    out["rows"] = sizes.rows
    out["d"] = sizes.width
    out["roof_times"] = dict(copy=[before["copy"], after["copy"]],
                             fp32_matmul=[before["fp32_matmul"], after["fp32_matmul"]])
    out.update(on_roofline(out["time"], out["roof_times"], cost, sizes))
    return out

def on_roofline(times, roof_times, cost, sizes):
    """The chain against this machine's roofs: bytes, floor, ridge, regime, bound."""
    n = sizes.rows * sizes.width
    copy = fastest(roof_times["copy"])
    matmul = fastest(roof_times["fp32_matmul"])
    bytes_floor = 3 * n * 4
    copy_bandwidth = 2 * n * 4 / copy["min_s"]  # a copy reads and writes N fp32 values
    peak = 2 * sizes.ridge_n**3 / matmul["min_s"]
    floor_s = bytes_floor / copy_bandwidth
    ridge = peak / copy_bandwidth
    intensity = cost["flops"] / cost["bytes accessed"]
    regime = "bandwidth-bound"
    if intensity > ridge:
        regime = "compute-bound"
    vs_floor = {}
    for name, timing in times.items():
        vs_floor[name] = timing["median_s"] / floor_s
    # A fused chain faster than a roof allows means the roof was measured while busy
    fused_s = min(times["torch_compile"]["median_s"], times["jax_jit"]["median_s"])
    doubts = [unreliable(copy, bytes_floor / fused_s, copy_bandwidth),
              unreliable(matmul, cost["flops"] / fused_s, peak)]
    return dict(bytes_eager=11 * n * 4,
                bytes_floor=bytes_floor,
                copy_best_s=copy["min_s"],
                copy_bandwidth_Bps=copy_bandwidth,
                fp32_matmul_best_s=matmul["min_s"],
                fp32_peak_flops=peak,
                floor_s=floor_s,
                ridge_flop_per_byte=ridge,
                unreliable=any(doubts),  # the roofs, and all derived from them
                vs_floor=vs_floor,
                xla_flops=cost["flops"],
                xla_bytes=cost["bytes accessed"],
                intensity_flop_per_byte=intensity,
                regime=regime,
                roofline_bound_s=max(floor_s, cost["flops"] / peak))  # the slower roof

# 3. The compute regime

def compute(sizes, device):
    """PREDICTION: intensity 2n^3 / (3 n^2 x bytes) FLOP/byte, far above the ridge:
    the time is the tensor-core (CPU: SIMD) math inside one GEMM. Eager and compiled
    code call the same library kernel (cuBLAS / MKL / XLA's dot), so compiling changes
    the time by a few % at most: there is no chain to fuse, and one launch costs
    microseconds against milliseconds of math."""
    n = sizes.matmul_n
    dtype = sizes.matmul_dtype
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a_jax = jnp.asarray(to_numpy(a), dtype=JAX_DTYPE[dtype])
    b_jax = jnp.asarray(to_numpy(b), dtype=JAX_DTYPE[dtype])
    compiled = torch.compile(torch.matmul)
    jitted = jax.jit(jnp.matmul)
    variants = dict(eager=lambda: a @ b,
                    torch_compile=lambda: compiled(a, b),
                    jax_eager=lambda: jnp.matmul(a_jax, b_jax),
                    jax_jit=lambda: jitted(a_jax, b_jax))
    tol = FP32_TOL
    if dtype == torch.bfloat16:
        tol = BF16_TOL
    out = measure("matmul", variants, device, sizes.reps, tol=tol)
    flops_per_s = {}
    for name, timing in out["time"].items():
        flops_per_s[name] = 2 * n**3 / timing["median_s"]
    out.update(n=n, dtype=str(dtype), flops_per_s=flops_per_s,
               intensity_flop_per_byte=2 * n / (3 * a.element_size()))
    return out

# 4. How capture works, and where it breaks

def clean(x):
    return torch.sin(x) * 2 + 1

def dirty(x):
    y = torch.sin(x)
    print("    (print inside dirty() ran)")  # Dynamo cannot put a print in a graph: break
    scale = y.abs().max().item()  # a Python float leaves the graph: break
    return y / scale * 2 + 1

GRAPHS = []  # what torch.compile handed its backend, one graph per (re)compile
TRACES = []  # what jax.jit traced, one entry per trace

def counting_backend(graph_module, example_inputs):  # Dynamo calls it once per compile
    GRAPHS.append(graph_module)
    return graph_module.forward

def compiles_after_each(dynamic, device):
    """Graphs compiled so far after each call of clean() on SHAPES, with this dynamic=."""
    torch._dynamo.reset()
    GRAPHS.clear()
    compiled = torch.compile(clean, backend=counting_backend, dynamic=dynamic)
    after = []
    for n in SHAPES:
        compiled(torch.randn(n, device=device))
        after.append(len(GRAPHS))
    return after

def capture_torch(device):
    """PREDICTION: explain() finds 0 breaks in clean() and 2 in dirty() (print,
    .item()). New shapes: dynamic=False compiles once per shape (8, 16, 32: 3 graphs);
    the default compiles 8 statically, then on 16 recompiles with a symbolic size that
    32 reuses (2); dynamic=True compiles one symbolic graph (1). A repeated shape
    never recompiles."""
    torch._logging.set_logs(dynamo=logging.ERROR)  # the break reasons are printed below
    x = torch.randn(8, device=device)
    out = {}
    for fn in (clean, dirty):
        found = torch._dynamo.explain(fn)(x)
        reasons = []
        for broken in found.break_reasons:
            reasons.append(str(broken.reason).splitlines()[0][:90])  # its first line
        out[fn.__name__] = dict(graph_count=found.graph_count,
                                graph_break_count=found.graph_break_count,
                                break_reasons=reasons)
    compiles = dict(shapes=SHAPES)
    for dynamic in (False, None, True):
        compiles[f"dynamic={dynamic}"] = compiles_after_each(dynamic, device)
    out["compiles_for_shapes"] = compiles
    counts = []
    for dynamic in ("dynamic=False", "dynamic=None", "dynamic=True"):
        counts.append(compiles[dynamic])
    out["checks"] = dict(
        graph_breaks_found_in_dirty=out["dirty"]["graph_break_count"] > 0,
        no_graph_breaks_in_clean=out["clean"]["graph_break_count"] == 0,
        repeated_shape_does_not_recompile=all(after[2] == after[1] for after in counts),
        dynamic_true_compiles_once=compiles["dynamic=True"][-1] == 1)
    return out

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
        finish(jitted(*args))
        after.append(len(TRACES))
    return after

def capture_jax(sizes):
    """PREDICTION: jax.jit runs the Python function once per new input shape/dtype,
    with abstract tracers, so a Python counter inside counts traces: 1, 2, 2, 3 for
    shapes 8, 16, 8, 32. A static argument is part of the cache key: k = 2, 3, 2 -> 1,
    2, 2 traces. XLA's cost model sees the fused chain read and write once: bytes
    accessed ~ the 3 N x 4 B floor."""
    small = jnp.ones((2, 4))
    vector = jnp.ones(4)
    jaxpr = jax.make_jaxpr(unfused_jax)(small, vector, vector, vector, small)
    out = dict(jaxpr=str(jaxpr))
    shape_calls = [[jnp.ones(n)] for n in SHAPES]
    after_shapes = traces_after_each(jax.jit(counted), shape_calls)
    static_calls = [[jnp.ones(4), k] for k in (2, 3, 2)]
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
    lowered = fresh.lower(big, vec, vec, vec, big)  # traced to StableHLO
    lowered_at = time.perf_counter()
    cost = lowered.compile().cost_analysis()  # XLA compiles it, then counts FLOPs and bytes
    compiled_at = time.perf_counter()
    out["aot"] = dict(lower_s=lowered_at - start,
                      compile_s=compiled_at - lowered_at,
                      flops=cost["flops"],
                      bytes_accessed=cost["bytes accessed"],
                      bytes_floor=3 * sizes.rows * sizes.width * 4)
    out["checks"] = dict(jax_one_trace_per_new_shape=after_shapes == [1, 2, 2, 3],
                         jax_retrace_per_new_static_arg=after_static == [1, 2, 2])
    return out

# Reporting: one plain place, a line per fact

def span(timing, scale, unit):  # median [min-max], measured
    median = timing["median_s"] * scale
    low = timing["min_s"] * scale
    high = timing["max_s"] * scale
    doubt = mark(timing["unreliable"])
    return f"{median:9.2f} {unit} [{low:.2f}-{high:.2f}] measured{doubt}"

def report_times(r, notes, scale=1e3, unit="ms"):
    """A line per variant (its time, then its note), then each compiled one's speedup."""
    for name, timing in r["time"].items():
        print(f"  {name:16s} {span(timing, scale, unit)}; {notes[name]}")
    for name, speedup in r["speedup_vs_eager"].items():
        baseline = BASELINE[name]
        doubt = mark(r["time"][name]["unreliable"], r["time"][baseline]["unreliable"])
        print(f"  {name} speedup over {baseline}: {speedup:.2f}x (derived){doubt}")

def report_errors(r):
    for check, error in r["error"].items():
        print(f"  {check}: max error {error:.1e} (measured; tolerance {r['tolerance']:.0e})")

def report_overhead(r):
    notes = {}
    for name, counts in r["launches_per_call"].items():
        notes[name] = f"per call {counts}"
    for name, ops in r["jax_ops_per_call"].items():
        notes[name] = f"per call {ops} jaxpr op(s)"
    report_times(r, notes, 1e6, "us")
    if "reduce_overhead" not in r["time"]:
        print("  (CUDA graphs, mode='reduce-overhead', need a GPU: not run here)")
    for name, first in r["compile_first_call_s"].items():  # kept out of the timings above
        warm = r["time"][name]
        calls = first / warm["median_s"]
        print(f"  {name} first call {first:.2f} s (measured; it compiles)"
              f" = {calls:.0f} warm calls (derived){mark(warm['unreliable'])}")
    report_errors(r)

def report_bandwidth(r):
    roofs_doubt = mark(r["unreliable"])
    eager_gb = r["bytes_eager"] / 1e9
    floor_gb = r["bytes_floor"] / 1e9
    print(f"  bytes moved (derived): eager {eager_gb:.3f} GB (11 N x 4 B), fused"
          f" {floor_gb:.3f} GB (3 N x 4 B): eager {11 / 3:.2f}x slower, predicted")
    print(f"  copy roof {r['copy_bandwidth_Bps'] / 1e9:.3g} GB/s, fp32 matmul roof"
          f" {r['fp32_peak_flops'] / 1e9:.4g} GFLOP/s (measured, best of two){roofs_doubt}")
    print(f"  floor {r['floor_s'] * 1e3:.3f} ms, ridge {r['ridge_flop_per_byte']:.1f} FLOP/B"
          f" (derived){roofs_doubt}")
    notes = {}
    for name, ratio in r["vs_floor"].items():
        doubt = mark(r["unreliable"], r["time"][name]["unreliable"])
        notes[name] = f"{ratio:5.2f}x the floor (derived){doubt}"
    report_times(r, notes)
    print(f"  XLA counts {r['xla_flops']:.3g} FLOPs, {r['xla_bytes']:.3g} B:"
          f" {r['intensity_flop_per_byte']:.2f} FLOP/B (derived: XLA's cost model)")
    print(f"  so the fused chain is {r['regime']} here (derived){roofs_doubt}")
    bound_ms = r["roofline_bound_s"] * 1e3
    print(f"  roofline bound max(floor, FLOPs / roof) {bound_ms:.3f} ms (derived){roofs_doubt}")
    for name in ("torch_compile", "jax_jit"):
        timing = r["time"][name]
        ratio = timing["median_s"] / r["roofline_bound_s"]
        doubt = mark(r["unreliable"], timing["unreliable"])
        print(f"  {name} at {ratio:.2f}x the roofline bound (derived){doubt}")
    report_errors(r)

def report_compute(r):
    print(f"  intensity {r['intensity_flop_per_byte']:.0f} FLOP/B (derived), far above any ridge")
    notes = {}
    for name, rate in r["flops_per_s"].items():
        doubt = mark(r["time"][name]["unreliable"])
        notes[name] = f"{rate / 1e12:.3g} TFLOP/s (derived){doubt}"
    report_times(r, notes)
    report_errors(r)

def report_capture_torch(r):
    for name in ("clean", "dirty"):
        graphs = r[name]["graph_count"]
        breaks = r[name]["graph_break_count"]
        print(f"  {name}(): {graphs} graph(s), {breaks} graph break(s) (measured)"
              f" {r[name]['break_reasons']}")
    shapes = r["compiles_for_shapes"]["shapes"]
    for dynamic in ("dynamic=False", "dynamic=None", "dynamic=True"):
        after = r["compiles_for_shapes"][dynamic]
        print(f"  {dynamic:13s}: compiles after shapes {shapes}: {after} (measured)")

def report_capture_jax(r):
    print("  the jaxpr of the chain (what tracing recorded):")
    print("    " + r["jaxpr"].replace("\n", "\n    "))
    shapes = r["traces_for_shapes"]
    static = r["traces_for_static_args"]
    print(f"  traces after shapes {shapes['shapes']}: {shapes['traces_after_each']} (measured)")
    print(f"  static_argnums=1, k = {static['k']}: traces {static['traces_after_each']}"
          " (measured)")
    print(f"  without static_argnums: {r['nonstatic_loop_bound_error']}")
    aot = r["aot"]
    print(f"  lower {aot['lower_s']:.3f} s, compile {aot['compile_s']:.3f} s (measured)")
    print(f"  XLA's bytes accessed {aot['bytes_accessed']:.4g} against the floor"
          f" {aot['bytes_floor']:.4g} (3 N x 4 B)")

# Command line

def output_path(text):
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)

def check_writable(flag, folder):
    """Make the folder if it is missing and write a scratch file there: a path that
    cannot be written fails now, not after the run."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        sys.exit(f"error: {flag}: cannot write to {folder} ({error.strerror})")

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Section 13.3: capture the graph, fuse it.")
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=output_path, help="write every measured number here")
    parser.add_argument("--out", type=output_path, default=Path("out"),
                        help="folder for figures (this lesson draws none: it stays unmade)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: torch sees no CUDA GPU here; run with --device cpu")
    if args.json is not None:
        if args.json.is_dir():
            sys.exit(f"error: --json {args.json}: is a folder, not a file")
        check_writable("--json", args.json.parent)
    if args.out.exists() and not args.out.is_dir():
        sys.exit(f"error: --out {args.out}: exists and is not a folder")
    return args

def keep_freed_memory():
    """glibc: keep freed memory, as GPU caching allocators do, so a timed call does not
    pay for page faults on memory it just returned to the system."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(-4, 0)  # M_MMAP_MAX = 0
        libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD = 1 GB

def main():
    args = parse_args()
    device = "cpu"
    if args.device != "cpu" and torch.cuda.is_available():
        device = "cuda"
    sizes = SIZES[device]
    if args.quick:
        sizes = SIZES["quick"]
    name = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    if device == "cuda":
        memory_gib = torch.cuda.mem_get_info()[1] / 2**30
        name = f"{torch.cuda.get_device_name()}, {memory_gib:.0f} GiB"
    else:
        jax.config.update("jax_platforms", "cpu")
        keep_freed_memory()
    print(f"device: {name}")
    print(f"torch {torch.__version__}, jax {jax.__version__} on {jax.devices()[0]}")
    print("(torch.compile writes C++ or Triton code: seconds per function, less when cached)")
    torch.set_grad_enabled(False)  # inference only: no autograd graphs
    torch.manual_seed(0)

    print(f"\n1. Overhead regime: {3 * STEPS} elementwise ops on {TINY} fp32 values")
    results = dict(overhead=overhead(sizes, device))
    report_overhead(results["overhead"])

    print(f"\n2. Bandwidth regime: gelu(x*a + b)*c + residual, x {sizes.rows}x{sizes.width} fp32")
    results["bandwidth"] = bandwidth(sizes, device)
    report_bandwidth(results["bandwidth"])

    print(f"\n3. Compute regime: {sizes.matmul_n}^3 matmul, {sizes.matmul_dtype}")
    results["compute"] = compute(sizes, device)
    report_compute(results["compute"])

    print("\n4a. torch.compile captures bytecode: graph breaks and recompiles")
    results["capture_torch"] = capture_torch(device)
    report_capture_torch(results["capture_torch"])

    print("\n4b. jax.jit traces: jaxpr, trace-time side effects, retraces, AOT compile")
    results["capture_jax"] = capture_jax(sizes)
    report_capture_jax(results["capture_jax"])

    checks = {}
    for result in results.values():
        checks.update(result.pop("checks"))
    failed = [check for check, passed in checks.items() if not passed]
    print(f"\nchecks: {len(checks) - len(failed)} of {len(checks)} passed")
    if args.json is not None:
        versions = dict(torch=torch.__version__, jax=jax.__version__, jax_device=jax.devices()[0])
        report = dict(lesson="03_compile", quick=args.quick, checks=checks,
                      device=dict(type=device, name=name, **versions), **results)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if failed:
        sys.exit("error: checks failed: " + ", ".join(failed))

if __name__ == "__main__":
    main()
