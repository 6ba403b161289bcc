"""
03_compile.py - Section 13.3: capture the graph, let a compiler fuse it.

A compiler sees many ops at once: it launches them as one kernel and keeps intermediates in
registers, not memory. PyTorch and JAX side by side: 1. the overhead regime (48 tiny ops: eager,
torch.compile, CUDA graphs via mode="reduce-overhead", jax.jit; time and launches per call);
2. the bandwidth regime (an unfused chain, fused, the one-read-one-write floor, and the chain on
the measured roofline); 3. the compute regime (a big matmul: compiling gains nothing); 4. how
capture works: torch.compile reads bytecode (graph breaks, recompiles, dynamic=, compile time),
jax.jit traces (make_jaxpr, trace-time side effects, retraces, cost_analysis()).
Every compiled result is checked against eager; a mismatch exits 1. No figure, no multi-GPU mode.
Run (copy this file alone):
  python 03_compile.py                        # one GPU when present; otherwise the CPU
  python 03_compile.py --device cpu --quick   # seconds: what the tests run
Expect: CUDA graphs several x faster than eager, compile's one kernel faster still; the fused
chain near the floor on a GPU, well above it on a CPU (compute-bound there); the matmul +- a few %.
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
from collections import namedtuple
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
STEPS, TINY = 16, 1024  # the tiny chain: 16 x (sin, mul, add) = 48 ops on 1024 fp32 values
TOL = 1e-4  # fp32: max |compiled - eager| <= TOL * (1 + max |eager|)
# rows x width fp32: the bandwidth chain, beyond the caches; matmul: n of the n^3 matmul in dtype;
# ridge_n: of the fp32 matmul that measures the fp32 roof; calls: tiny-chain calls per repetition
Sizes = namedtuple("Sizes", "rows width matmul dtype ridge_n reps calls")
SIZES = {"cuda": Sizes(65536, 4096, 8192, torch.bfloat16, 8192, 10, 50),
         "cpu": Sizes(2048, 4096, 1024, torch.float32, 1024, 7, 100),
         "quick": Sizes(2048, 4096, 256, torch.float32, 512, 3, 20)}

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

def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()

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

def timed(fn, device, reps, calls=1):  # bench of `calls` back-to-back calls, per call: a dict
    def run():
        for _ in range(calls - 1):
            fn()
        jax.block_until_ready(fn())  # one stream: the last result done means all are done
    median, low, high = bench(run, device, reps)
    return dict(median_s=median / calls, min_s=low / calls, max_s=high / calls)

def to_numpy(t):  # a torch tensor on any device or a JAX array, as float32 numpy
    return np.asarray(t.float().cpu() if isinstance(t, torch.Tensor) else t, dtype=np.float32)

def close(got, want, tol):  # max |got - want| <= tol * (1 + max |want|)
    got, want = to_numpy(got), to_numpy(want)
    return bool(np.max(np.abs(got - want)) <= tol * (1 + np.max(np.abs(want))))

def equal_to_eager(section, fns, tol):  # each compiled result against its own eager one
    want, want_jax = to_numpy(fns["eager"]()), fns["jax_eager"]()
    checks = {f"{section}_{name}_equals_eager": close(fn(), want, tol)
              for name, fn in fns.items() if name not in ("eager", "jax_eager", "jax_jit")}
    checks[f"{section}_jax_jit_equals_jax_eager"] = close(fns["jax_jit"](), want_jax, tol)
    checks[f"{section}_jax_equals_torch_eager"] = close(fns["jax_jit"](), want, tol)
    return checks

def measure(section, fns, device, reps, calls=1, tol=TOL):
    """First calls (compiles, kept out of the timings), checks against eager, timings, speedups."""
    compiled = [name for name in fns if name not in ("eager", "jax_eager")]
    first = {name: bench(lambda: jax.block_until_ready(fns[name]()), device, reps=1, warmup=0)[0]
             for name in compiled}  # one timed call, no warm-up: the compile + one run
    checks = equal_to_eager(section, fns, tol)
    times = {name: timed(fn, device, reps, calls) for name, fn in fns.items()}
    median = {name: t["median_s"] for name, t in times.items()}
    baseline = dict(jax_jit="jax_eager")  # jax.jit against JAX op by op, torch against eager
    speedup = {name: median[baseline.get(name, "eager")] / median[name] for name in compiled}
    return dict(time=times, compile_first_call_s=first, speedup_vs_eager=speedup, checks=checks)

def launches_per_call(fn, device, calls=10):
    """torch.profiler's count. GPU: launch API calls (cudaLaunchKernel, cuLaunchKernel*,
    cudaGraphLaunch), kernels run. CPU: ops dispatched (top-level aten ops + compiled graphs)."""
    fn()
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device == "cuda")
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    events = prof.events()
    if device == "cuda":
        launches = sum("LaunchKernel" in e.name or "GraphLaunch" in e.name for e in events)
        kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
        return dict(launches=launches / calls, gpu_kernels=kernels / calls)
    nested = [e.cpu_parent and e.cpu_parent.name.startswith("aten::") for e in events]
    top_aten = sum(e.name.startswith("aten::") and not inner for e, inner in zip(events, nested))
    graphs = sum("CompiledFxGraph" in e.name for e in events)
    return dict(ops_dispatched=(top_aten + graphs) / calls)

def xla_cost(compiled):  # XLA's own count: (flops, bytes accessed), None where not reported
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list of dicts in some versions
    return cost.get("flops"), cost.get("bytes accessed")

def overhead(sizes, device):
    """PREDICTION: each of the 48 tiny ops costs a few us of CPU dispatch (a GPU adds a launch) and
    far less device work: eager ~ 48 x dispatch. torch.compile: one fused kernel plus ~10-30 us of
    guards and launch. CUDA graphs: one graph launch, several x faster than eager, but an input
    copy keeps them behind compile's single kernel. jax.jit: one dispatch per call, not 48."""
    x = torch.randn(TINY, device=device)
    x_jax = jnp.asarray(to_numpy(x))
    compiled, jitted = torch.compile(chain_torch), jax.jit(chain_jax)
    fns = dict(eager=lambda: chain_torch(x), torch_compile=lambda: compiled(x))
    if device == "cuda":
        graphed = torch.compile(chain_torch, mode="reduce-overhead")  # inductor + CUDA graphs
        fns["reduce_overhead"] = lambda: graphed(x)
    fns.update(jax_eager=lambda: chain_jax(x_jax), jax_jit=lambda: jitted(x_jax))
    out = measure("overhead", fns, device, sizes.reps, sizes.calls)
    out["launches_per_call"] = {k: launches_per_call(fn, device)  # after the graphs' warm-up
                                for k, fn in fns.items() if not k.startswith("jax")}
    out["jax_ops_per_call"] = dict(jax_eager=len(jax.make_jaxpr(chain_jax)(x_jax).eqns),
                                   jax_jit=len(jax.make_jaxpr(jitted)(x_jax).eqns))
    return dict(out, n_ops=3 * STEPS, numel=TINY)

def bandwidth(sizes, device):
    """PREDICTION: every eager op reads its inputs from memory and writes its output: mul 2N +
    add 2N + gelu 2N + mul 2N + add 3N = 11 N values. Fused code reads x and the residual once and
    writes once: 3 N, the floor. So eager ~ 11/3 = 3.7x slower than fused, and fused time ~ 3 N x
    4 B / copy bandwidth - IF the chain is bandwidth-bound. XLA counts ~5.7 FLOP per byte for it
    (the exact erf is a long polynomial): below a GPU's fp32 ridge (tens of FLOP/B: fused near the
    floor), above a CPU's (a few FLOP/B: compute-bound, several x above the floor)."""
    n = sizes.rows * sizes.width
    gen = torch.Generator(device=device).manual_seed(0)
    x, residual = (torch.randn(sizes.rows, sizes.width, device=device, generator=gen) for _ in "xr")
    a, b, c = (torch.randn(sizes.width, device=device, generator=gen) for _ in "abc")
    args = (x, a, b, c, residual)
    args_jax = [jnp.asarray(to_numpy(t)) for t in args]
    copy_into = torch.empty_like(x)
    square = torch.randn(sizes.ridge_n, sizes.ridge_n, device=device, generator=gen)
    roofs = dict(copy=lambda: copy_into.copy_(x), fp32_matmul=lambda: square @ square)  # TF32 off
    roof_times = {k: [timed(fn, device, sizes.reps)] for k, fn in roofs.items()}
    compiled, jitted = torch.compile(unfused_torch), jax.jit(unfused_jax)
    fns = dict(eager=lambda: unfused_torch(*args), torch_compile=lambda: compiled(*args),
               jax_eager=lambda: unfused_jax(*args_jax), jax_jit=lambda: jitted(*args_jax))
    out = measure("bandwidth", fns, device, sizes.reps)
    for name, fn in roofs.items():  # again: a roof is the best this machine did, busy or not
        roof_times[name].append(timed(fn, device, sizes.reps))
    copy_s, matmul_s = (min(t["min_s"] for t in roof_times[k]) for k in roofs)
    bytes_per_s, peak = 2 * n * 4 / copy_s, 2 * sizes.ridge_n**3 / matmul_s
    out.update(rows=sizes.rows, d=sizes.width, bytes_eager=11 * n * 4, bytes_floor=3 * n * 4,
               roof_times=roof_times, copy_best_s=copy_s, copy_bandwidth_Bps=bytes_per_s,
               fp32_matmul_best_s=matmul_s, fp32_peak_flops=peak, floor_s=3 * n * 4 / bytes_per_s,
               ridge_flop_per_byte=peak / bytes_per_s)
    out["vs_floor"] = {k: v["median_s"] / out["floor_s"] for k, v in out["time"].items()}
    # faster than the floor by more than 10%: the copy ran while the machine was busy
    out["unreliable"] = min(out["vs_floor"]["torch_compile"], out["vs_floor"]["jax_jit"]) < 0.9
    out["xla_flops"], out["xla_bytes"] = xla_cost(jitted.lower(*args_jax).compile())
    out["intensity_flop_per_byte"] = out["xla_flops"] / out["xla_bytes"]  # the chain's, by XLA
    out["regime"] = "bandwidth-bound"
    if out["intensity_flop_per_byte"] > out["ridge_flop_per_byte"]:
        out["regime"] = "compute-bound"
    out["roofline_bound_s"] = max(out["floor_s"], out["xla_flops"] / peak)  # the slower roof
    return out

def compute(sizes, device):
    """PREDICTION: intensity 2n^3 / (3 n^2 x bytes) FLOP/byte, far above the ridge: the time is
    the tensor-core (CPU: SIMD) math inside one GEMM. Eager and compiled code call the same
    library kernel (cuBLAS / MKL / XLA's dot), so compiling changes the time by a few % at most:
    there is no chain to fuse, and one launch costs microseconds against milliseconds of math."""
    n, dtype, jax_dtype = sizes.matmul, sizes.dtype, jnp.dtype(str(sizes.dtype).split(".")[1])
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=gen).to(dtype) for _ in "ab")
    a_jax, b_jax = (jnp.asarray(to_numpy(t), dtype=jax_dtype) for t in (a, b))
    compiled, jitted = torch.compile(torch.matmul), jax.jit(jnp.matmul)
    fns = dict(eager=lambda: a @ b, torch_compile=lambda: compiled(a, b),
               jax_eager=lambda: jnp.matmul(a_jax, b_jax), jax_jit=lambda: jitted(a_jax, b_jax))
    tol = {torch.bfloat16: 2e-2}.get(dtype, TOL)  # bf16 keeps 8 bits of mantissa
    out = measure("matmul", fns, device, sizes.reps, tol=tol)
    out.update(n=n, dtype=str(dtype), intensity_flop_per_byte=2 * n / (3 * a.element_size()),
               flops_per_s={k: 2 * n**3 / v["median_s"] for k, v in out["time"].items()})
    return out

# How capture works, and where it breaks
def clean(x):
    return torch.sin(x) * 2 + 1

def dirty(x):
    y = torch.sin(x)
    print("    (print inside dirty() ran)")  # Dynamo cannot put a print in a graph: break
    scale = y.abs().max().item()               # a Python float leaves the graph: break
    return y / scale * 2 + 1

GRAPHS, TRACES = [], []  # what torch.compile hands its backend / what jax.jit traces, per call

def counting_backend(graph_module, example_inputs):  # Dynamo calls it once per (re)compile
    GRAPHS.append(graph_module)
    return graph_module.forward

def capture_torch(device):
    """PREDICTION: explain() finds 0 breaks in clean() and 2 in dirty() (print, .item()). New
    shapes: dynamic=False compiles once per shape (8, 16, 32: 3 graphs); the default compiles 8
    statically, then on 16 recompiles with a symbolic size that 32 reuses (2); dynamic=True
    compiles one symbolic graph (1). A repeated shape never recompiles."""
    torch._logging.set_logs(dynamo=logging.ERROR)  # the break reasons are printed below
    out, x, shapes = {}, torch.randn(8, device=device), [8, 16, 8, 32]
    for fn in (clean, dirty):
        found = torch._dynamo.explain(fn)(x)
        reasons = [str(r.reason).splitlines()[0][:90] for r in found.break_reasons]
        out[fn.__name__] = dict(graph_count=found.graph_count,
                                graph_break_count=found.graph_break_count, break_reasons=reasons)
    out["compiles_for_shapes"] = dict(shapes=shapes)
    for dynamic in (False, None, True):
        torch._dynamo.reset()
        GRAPHS.clear()
        compiled = torch.compile(clean, backend=counting_backend, dynamic=dynamic)
        after = []
        for n in shapes:
            compiled(torch.randn(n, device=device))
            after.append(len(GRAPHS))
        out["compiles_for_shapes"][f"dynamic={dynamic}"] = after
    counts = list(out["compiles_for_shapes"].values())[1:]
    out["checks"] = dict(graph_breaks_found_in_dirty=out["dirty"]["graph_break_count"] > 0,
                         no_graph_breaks_in_clean=out["clean"]["graph_break_count"] == 0,
                         repeated_shape_does_not_recompile=all(c[2] == c[1] for c in counts),
                         dynamic_true_compiles_once=counts[-1][-1] == 1)
    return out

def counted(x):
    TRACES.append(x.shape)  # a Python side effect: runs while tracing, not when the code runs
    return jnp.sin(x) * 2 + 1

def power(x, k):  # a Python loop over k: k must be a concrete Python int
    TRACES.append(k)
    for _ in range(k):
        x = x * x
    return x

def capture_jax(sizes):
    """PREDICTION: jax.jit runs the Python function once per new input shape/dtype, with abstract
    tracers, so a Python counter inside counts traces: 1, 2, 2, 3 for shapes 8, 16, 8, 32. A
    static argument is part of the cache key: k = 2, 3, 2 -> 1, 2, 2 traces. XLA's cost model
    sees the fused chain read and write once: bytes accessed ~ the 3 N x 4 B floor."""
    small, vector = jnp.ones((2, 4)), jnp.ones(4)
    out = dict(jaxpr=str(jax.make_jaxpr(unfused_jax)(small, vector, vector, vector, small)))
    TRACES.clear()
    f, p = jax.jit(counted), jax.jit(power, static_argnums=1)
    after_shapes, after_static = [], []
    for n in (8, 16, 8, 32):
        jax.block_until_ready(f(jnp.ones(n)))
        after_shapes.append(len(TRACES))
    for k in (2, 3, 2):
        jax.block_until_ready(p(jnp.ones(4), k))
        after_static.append(len(TRACES) - after_shapes[-1])
    out["traces_for_shapes"] = dict(shapes=[8, 16, 8, 32], traces_after_each=after_shapes)
    out["traces_for_static_args"] = dict(k=[2, 3, 2], traces_after_each=after_static)
    try:
        jax.jit(power)(jnp.ones(4), 2)
        out["nonstatic_loop_bound_error"] = None
    except Exception as e:  # range() over a tracer
        out["nonstatic_loop_bound_error"] = type(e).__name__
    big = jax.ShapeDtypeStruct((sizes.rows, sizes.width), jnp.float32)
    vec = jax.ShapeDtypeStruct((sizes.width,), jnp.float32)
    fresh = jax.jit(lambda *xs: unfused_jax(*xs))  # a new function: jit's cache has not seen it
    start = time.perf_counter()
    lowered = fresh.lower(big, vec, vec, vec, big)  # trace to StableHLO
    lowered_at = time.perf_counter()
    compiled = lowered.compile()  # XLA compiles it; its cost model then counts FLOPs and bytes
    out["aot"] = dict(lower_s=lowered_at - start, compile_s=time.perf_counter() - lowered_at,
                      bytes_floor=3 * sizes.rows * sizes.width * 4)
    out["aot"]["flops"], out["aot"]["bytes_accessed"] = xla_cost(compiled)
    out["checks"] = dict(jax_one_trace_per_new_shape=after_shapes == [1, 2, 2, 3],
                         jax_retrace_per_new_static_arg=after_static == [1, 2, 2])
    return out

def span(t, scale=1e3, unit="ms"):  # median [min-max]; a spread wider than the median is noise
    busy = " unreliable (machine busy)" * (t["max_s"] - t["min_s"] > t["median_s"])
    low, high = t["min_s"] * scale, t["max_s"] * scale
    return f"{t['median_s'] * scale:9.2f} {unit} [{low:.2f}-{high:.2f}]{busy}"

def report_times(r, extra, scale=1e3, unit="ms"):  # a line per variant, then the speedups
    for name, t in r["time"].items():
        print(f"  {name:16s} {span(t, scale, unit)} measured; {extra(name)}")
    speedups = ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup_vs_eager"].items())
    print(f"  speedup from compiling (derived; jax_jit against JAX op by op): {speedups}")

def report_overhead(r):
    counts = dict(r["launches_per_call"])
    counts.update({name: dict(jaxpr_ops=ops) for name, ops in r["jax_ops_per_call"].items()})
    report_times(r, lambda name: f"per call {counts[name]}", 1e6, "us")
    if "reduce_overhead" not in r["time"]:
        print("  (CUDA graphs, mode='reduce-overhead', need a GPU: not run here)")
    for name, first in r["compile_first_call_s"].items():  # kept out of every timing above
        calls = first / r["time"][name]["median_s"]
        print(f"  {name} first call {first:.2f} s (measured; it compiles) = {calls:.0f} warm calls (derived)")

def report_bandwidth(r):
    busy = " unreliable (machine busy)" * r["unreliable"]  # a fused chain faster than the floor
    print(f"  bytes moved (derived): eager {r['bytes_eager'] / 1e9:.3f} GB (11 N x 4 B), fused "
          f"{r['bytes_floor'] / 1e9:.3f} GB (3 N x 4 B): eager {11 / 3:.2f}x slower, predicted")
    print(f"  roofs (measured, best of two): copy {r['copy_bandwidth_Bps'] / 1e9:.3g} GB/s, fp32 matmul "
          f"{r['fp32_peak_flops'] / 1e9:.4g} GFLOP/s; derived: floor {r['floor_s'] * 1e3:.3f} ms, "
          f"ridge {r['ridge_flop_per_byte']:.1f} FLOP/B{busy}")
    report_times(r, lambda name: f"{r['vs_floor'][name]:5.2f}x the floor (derived)")
    print(f"  XLA counts {r['xla_flops']:.3g} FLOPs, {r['xla_bytes']:.3g} B: "
          f"{r['intensity_flop_per_byte']:.2f} FLOP/B, so {r['regime']} here (derived){busy}")
    ratios = ", ".join(f"{k} {r['time'][k]['median_s'] / r['roofline_bound_s']:.2f}x"
                       for k in ("torch_compile", "jax_jit"))
    print(f"  roofline bound max(floor, FLOPs / roof) {r['roofline_bound_s'] * 1e3:.3f} ms; fused "
          f"time against it: {ratios} (derived)")

def report_compute(r):
    print(f"  intensity {r['intensity_flop_per_byte']:.0f} FLOP/B (derived), far above any ridge")
    report_times(r, lambda name: f"{r['flops_per_s'][name] / 1e12:.3g} TFLOP/s (derived)")

def report_capture_torch(r):
    for name in ("clean", "dirty"):
        print(f"  {name}(): {r[name]['graph_count']} graph(s), {r[name]['graph_break_count']} "
              f"graph break(s) (measured) {r[name]['break_reasons']}")
    for key, after in list(r["compiles_for_shapes"].items())[1:]:
        print(f"  {key:13s}: compiles after shapes [8, 16, 8, 32]: {after} (measured)")

def report_capture_jax(r):
    print("  the jaxpr of the chain (what tracing recorded):")
    print("    " + r["jaxpr"].replace("\n", "\n    "))
    shapes, static = r["traces_for_shapes"], r["traces_for_static_args"]
    print(f"  traces after shapes {shapes['shapes']}: {shapes['traces_after_each']} (measured)")
    print(f"  static_argnums=1, k = {static['k']}: traces {static['traces_after_each']} (measured)")
    print(f"  without static_argnums: {r['nonstatic_loop_bound_error']}")
    aot = r["aot"]
    print(f"  lower {aot['lower_s']:.3f} s, compile {aot['compile_s']:.3f} s (measured); XLA's "
          f"bytes accessed {aot['bytes_accessed']} vs the floor {aot['bytes_floor']} (3 N x 4 B)")

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
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Section 13.3: capture the graph, fuse it.")
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", help="write every measured number here")
    parser.add_argument("--out", default="out", help="folder for figures (this lesson draws none)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: torch sees no CUDA GPU here; run with --device cpu")
    check_outputs(args)
    return args

def main():
    args = parse_args()
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    sizes = SIZES["quick" if args.quick else device]
    name = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    if device == "cuda":
        name = f"{torch.cuda.get_device_name()}, {torch.cuda.mem_get_info()[1] / 2**30:.0f} GiB"
    else:
        jax.config.update("jax_platforms", "cpu")
        libc = ctypes.CDLL(None)  # keep freed memory, as GPU caching allocators do: no page faults
        if hasattr(libc, "mallopt"):  # glibc
            libc.mallopt(-4, 0)  # M_MMAP_MAX = 0
            libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD = 1 GB
    print(f"device: {name}")
    print(f"torch {torch.__version__}, jax {jax.__version__} on {jax.devices()[0]}")
    print("(torch.compile writes C++ or Triton code: seconds per function, less when cached)")
    torch.set_grad_enabled(False)  # inference only: no autograd graphs
    print(f"\n1. Overhead regime: {3 * STEPS} elementwise ops on {TINY} fp32 values")
    results = dict(overhead=overhead(sizes, device))
    report_overhead(results["overhead"])
    print(f"\n2. Bandwidth regime: gelu(x*a + b)*c + residual, x {sizes.rows}x{sizes.width} fp32")
    results["bandwidth"] = bandwidth(sizes, device)
    report_bandwidth(results["bandwidth"])
    print(f"\n3. Compute regime: {sizes.matmul}^3 matmul, {sizes.dtype}")
    results["compute"] = compute(sizes, device)
    report_compute(results["compute"])
    print("\n4a. torch.compile captures bytecode: graph breaks and recompiles")
    results["capture_torch"] = capture_torch(device)
    report_capture_torch(results["capture_torch"])
    print("\n4b. jax.jit traces: jaxpr, trace-time side effects, retraces, AOT compile")
    results["capture_jax"] = capture_jax(sizes)
    report_capture_jax(results["capture_jax"])
    checks = {k: v for r in results.values() for k, v in r.pop("checks").items()}
    print("\nchecks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))
    if args.json:
        versions = dict(torch=torch.__version__, jax=jax.__version__, jax_device=jax.devices()[0])
        write_json(args.json, dict(lesson="03_compile", quick=args.quick, checks=checks,
                                   device=dict(type=device, name=name, **versions), **results))
    if not all(checks.values()):
        sys.exit("error: checks failed: " + ", ".join(k for k, v in checks.items() if not v))

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
