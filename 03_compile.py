"""
03_compile.py - Section 13.3: capture the graph, let a compiler fuse it.

A compiler sees many ops at once, so it can (a) launch them as one kernel and (b) keep the
intermediates in registers instead of memory. That attacks two of the three regimes and
leaves the third alone. Measured here, PyTorch and JAX side by side:

  1. overhead regime: 48 tiny elementwise ops. Eager pays a dispatch (and on a GPU a kernel
     launch) per op; torch.compile fuses them into one kernel; CUDA graphs
     (mode="reduce-overhead") replay the call as one graph, which pays when a call holds many
     kernels, not once compile has fused it into one; jax.jit: one dispatch.
  2. bandwidth regime: gelu(x*a + b)*c + residual on tensors far larger than the caches.
     Eager makes 5 passes over memory (11 N values moved), fused code makes one (3 N); the
     fused time is compared with the floor that a measured copy bandwidth sets.
  3. compute regime: a big matmul. Compiling gains nothing: the time is the math of one
     GEMM kernel, which eager and compiled code both call.
  4. how capture works: torch.compile reads Python bytecode (graph breaks at .item() and
     print, recompiles on new shapes, dynamic=True, compile time paid once); jax.jit traces
     (make_jaxpr, Python side effects at trace time only, a retrace per new shape or static
     argument, lower().compile().cost_analysis()).
Every compiled result is checked against eager; a mismatch exits non-zero.

Run:
  python 03_compile.py                  # one GPU if present (~3 min on an H200)
  python 03_compile.py --device cpu     # ~2 min on 2 cores: inductor compiles C++ on the CPU
  python 03_compile.py --quick          # smoke run (the very first run also fills
                                        # inductor's compile cache: ~20 s more)
  There is no multi-GPU mode: compilation is a one-device story.

Expect on an H200: CUDA graphs >= 5x faster per call than eager on the tiny chain; the fused
chain within 1.3x of the one-read-one-write floor while eager is ~3.7x slower; the matmul
changes by a few % at most. On the CPU the same directions, noisier, and no CUDA graphs.
"""

import argparse
import ctypes
import json
import logging
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax: torch needs memory too
os.environ.setdefault("TEARDOWN_CUPTI", "0")  # keep the profiler's CUPTI attached: safer beside CUDA graphs
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from model_torch import datasheet_bf16_peak

STEPS = 16  # the tiny chain: 16 x (sin, mul, add) = 48 ops
TOL = 1e-4  # fp32: compiled vs eager, max |difference| <= TOL * (1 + max |eager|)


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


# ---------------------------------------------------------------------------------------
# Timing: warm up, synchronize before reading the clock, repeat, report median and spread.

def bench(fn, sync, reps=10, inner=1, warmup=3):
    for _ in range(warmup):
        out = fn()
    sync(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        sync(out)
        times.append((time.perf_counter() - t0) / inner)
    return {"median_s": float(np.median(times)), "min_s": min(times), "max_s": max(times)}


def first_call_s(fn, sync):  # compile (or a compile-cache hit) + one run
    t0 = time.perf_counter()
    sync(fn())
    return time.perf_counter() - t0


def us(t, unit="us", k=1e6):  # median [min-max]
    return f"{t['median_s'] * k:9.2f} {unit}  [{t['min_s'] * k:.2f}-{t['max_s'] * k:.2f}]"


def ms(t):
    return us(t, "ms", 1e3)


def close(name, got, want, res, tol=TOL):
    """max |got - want| <= tol * (1 + max |want|), printed and recorded as a check."""
    got, want = np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32)
    err, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
    ok = err <= tol * (1 + scale)
    print(f"  check {name}: max |diff| {err:.2e} (tolerance {tol * (1 + scale):.1e}) -> {'ok' if ok else 'MISMATCH'}")
    res["checks"][name] = bool(ok)


def launches_per_call(fn, sync, device, calls=10):
    """Measured with torch.profiler. GPU: kernel-launch API calls (cudaLaunchKernel,
    cuLaunchKernel*, cudaGraphLaunch) and kernels seen on the GPU. CPU: ops dispatched
    (top-level aten ops + calls into a compiled graph): a CPU has no kernel launches."""
    sync(fn())
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            out = fn()
        sync(out)
    events = prof.events()
    if device == "cuda":
        launches = sum("LaunchKernel" in e.name or "GraphLaunch" in e.name for e in events)
        kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
        return {"launches": launches / calls, "gpu_kernels": kernels / calls}
    top_aten = sum(e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))
                   for e in events)
    graph_calls = sum("CompiledFxGraph" in e.name for e in events)
    return {"ops_dispatched": (top_aten + graph_calls) / calls}


# ---------------------------------------------------------------------------------------
# 1. Overhead regime

def exp_overhead(S, device, sync, jsync, res):
    # PREDICTION: each of the 48 tiny ops costs a few us of CPU dispatch (plus a launch on a
    # GPU) but well under that of device work, so eager time ~ 48 x dispatch. torch.compile
    # fuses the chain into 1 kernel but keeps ~10-30 us of Python guards and launch; CUDA
    # graphs (reduce-overhead) replay it as one graph: >= 5x faster than eager on an H200 (but
    # they add an input copy and a graph launch, so they cannot beat compile's one kernel).
    # jax.jit likewise: one dispatch per call instead of 48.
    print(f"\n1. Overhead regime: {3 * STEPS} elementwise ops on {S['tiny']} fp32 values")
    x = torch.randn(S["tiny"], device=device)
    fns = {"eager": lambda: chain_torch(x)}
    compiled = torch.compile(chain_torch)
    compile_s = {"torch_compile": first_call_s(lambda: compiled(x), sync)}
    fns["torch_compile"] = lambda: compiled(x)
    if device == "cuda":
        graphed = torch.compile(chain_torch, mode="reduce-overhead")  # inductor + CUDA graphs
        compile_s["reduce_overhead"] = first_call_s(lambda: graphed(x), sync)
        fns["reduce_overhead"] = lambda: graphed(x)
        # the eager chain captured as a CUDA graph by hand: 1 launch, but still 48 kernels
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                chain_torch(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = chain_torch(static_x)
        fns["cuda_graph_of_eager"] = lambda: (graph.replay(), static_out)[1]
    else:
        print("  CPU: mode='reduce-overhead' means CUDA graphs, which need a GPU: not run here")
    out = {"n_ops": 3 * STEPS, "numel": S["tiny"], "time_per_call": {}, "launches_per_call": {},
           "compile_first_call_s": compile_s}
    want = chain_torch(x).cpu().numpy()
    for name, fn in fns.items():  # all timed (and CUDA graphs recorded) before any profiling
        out["time_per_call"][name] = bench(fn, sync, reps=S["reps"], inner=S["inner_tiny"])
        if name != "eager":
            close(f"overhead_{name}_equals_eager", fn().clone().cpu().numpy(), want, res)
    for name, fn in fns.items():
        try:
            out["launches_per_call"][name] = launches_per_call(fn, sync, device)
        except Exception as e:  # the profiler is a diagnostic; never let it sink the lesson
            out["launches_per_call"][name] = None
            print(f"  (profiler failed for {name}: {e!r})")
        print(f"  torch {name:20s} {us(out['time_per_call'][name])}  measured; per call {out['launches_per_call'][name]}")
    xj = jnp.asarray(x.cpu().numpy())
    jitted = jax.jit(chain_jax)
    compile_s["jax_jit"] = first_call_s(lambda: jitted(xj), jsync)
    for name, fn in {"jax_eager": lambda: chain_jax(xj), "jax_jit": lambda: jitted(xj)}.items():
        t = out["time_per_call"][name] = bench(fn, jsync, reps=S["reps"], inner=S["inner_tiny"])
        print(f"  {name:26s} {us(t)}  measured; ops dispatched per call (counted from the jaxpr): "
              f"{len(jax.make_jaxpr(chain_jax if name == 'jax_eager' else jitted)(xj).eqns)}")
    close("overhead_jax_jit_equals_jax_eager", jitted(xj), chain_jax(xj), res)
    close("overhead_jax_equals_torch_eager", jitted(xj), want, res)
    eager = out["time_per_call"]["eager"]["median_s"]
    out["speedup_vs_eager"] = {k: eager / v["median_s"] for k, v in out["time_per_call"].items() if "jax" not in k}
    out["speedup_jax_jit_vs_jax_eager"] = (out["time_per_call"]["jax_eager"]["median_s"]
                                          / out["time_per_call"]["jax_jit"]["median_s"])
    print("  derived speedup vs eager: " + ", ".join(f"{k} {v:.1f}x" for k, v in out["speedup_vs_eager"].items())
          + f"; jax jit vs jax eager {out['speedup_jax_jit_vs_jax_eager']:.1f}x")
    print("  compile (first call, measured, kept out of the timings): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in compile_s.items()))
    if device == "cpu" and out["speedup_vs_eager"]["torch_compile"] < 1:
        print("  (compiled slower here: inductor's C++ kernel opens an OpenMP parallel region, whose"
              " threads wait for a free core on a busy machine; run it on a quiet one)")
    if device == "cuda" and out["speedup_vs_eager"]["reduce_overhead"] < out["speedup_vs_eager"]["torch_compile"]:
        print("  (reduce_overhead slower than torch_compile: compile already fused the chain into one kernel, so"
              " graphs have little to save\n   and their bookkeeping - input copy, graph launch - costs more;"
              " graphs pay when a call holds many kernels: cuda_graph_of_eager)")
    if device == "cuda":
        res["targets"]["cuda_graphs_5x_faster_than_eager"] = out["speedup_vs_eager"]["reduce_overhead"] >= 5
    res["overhead"] = out


# ---------------------------------------------------------------------------------------
# 2. Bandwidth regime

def exp_bandwidth(S, device, sync, jsync, res):
    rows, d = S["rows"], S["d"]
    n, size = rows * d, 4
    # PREDICTION: every eager op reads its inputs from memory and writes its output:
    # mul 2N + add 2N + gelu 2N + mul 2N + add 3N = 11 N values. Fused code reads x and the
    # residual once and writes once: 3 N, the floor. So eager ~ 11/3 = 3.7x slower than
    # fused, and fused time ~ 3 N x 4 bytes / copy bandwidth (within 1.3x on an H200).
    eager_bytes, floor_bytes = 11 * n * size, 3 * n * size
    print(f"\n2. Bandwidth regime: gelu(x*a + b)*c + residual, x of {rows}x{d} fp32 ({n * size / 2**20:.0f} MiB)")
    print(f"  derived bytes moved: eager {eager_bytes / 1e9:.3f} GB (11 N x 4 B), "
          f"floor {floor_bytes / 1e9:.3f} GB (3 N x 4 B): predicted eager/fused {11 / 3:.2f}x")
    gen = torch.Generator(device=device).manual_seed(0)
    x, residual = (torch.randn(rows, d, device=device, generator=gen) for _ in range(2))
    a, b, c = (torch.randn(d, device=device, generator=gen) for _ in range(3))
    copy_dst = torch.empty_like(x)
    t_copy = bench(lambda: copy_dst.copy_(x), sync, reps=S["reps"], inner=S["inner_big"])
    copy_bw = 2 * n * size / t_copy["median_s"]
    floor_s = floor_bytes / copy_bw
    print(f"  copy (read+write)      {ms(t_copy)}  measured: {copy_bw / 1e9:.3g} GB/s -> floor {floor_s * 1e3:.3f} ms derived")
    out = {"rows": rows, "d": d, "bytes_eager": eager_bytes, "bytes_floor": floor_bytes,
           "copy_time": t_copy, "copy_bandwidth_Bps": copy_bw, "floor_s": floor_s, "time": {},
           "compile_first_call_s": {}}
    compiled = torch.compile(unfused_torch)
    args = (x, a, b, c, residual)
    out["compile_first_call_s"]["torch_compile"] = first_call_s(lambda: compiled(*args), sync)
    want = unfused_torch(*args)
    got = compiled(*args)
    close("bandwidth_torch_compile_equals_eager", got[:256].cpu(), want[:256].cpu(), res)
    err = (got - want).abs().max().item()  # and the whole tensor, on the device
    res["checks"]["bandwidth_torch_compile_equals_eager"] &= err <= TOL * (1 + want.abs().max().item())
    del got
    xs = [jnp.asarray(t.cpu().numpy()) for t in args]
    jitted = jax.jit(unfused_jax)
    out["compile_first_call_s"]["jax_jit"] = first_call_s(lambda: jitted(*xs), jsync)
    close("bandwidth_jax_jit_equals_jax_eager", jitted(*xs)[:256], unfused_jax(*xs)[:256], res)
    close("bandwidth_jax_equals_torch_eager", jitted(*xs)[:256], want[:256].cpu(), res)
    del want
    for name, fn, s in [("eager", lambda: unfused_torch(*args), sync), ("torch_compile", lambda: compiled(*args), sync),
                        ("jax_eager", lambda: unfused_jax(*xs), jsync), ("jax_jit", lambda: jitted(*xs), jsync)]:
        t = out["time"][name] = bench(fn, s, reps=S["reps"], inner=S["inner_big"])
        bw = (eager_bytes if "eager" in name else floor_bytes) / t["median_s"]
        print(f"  {name:22s} {ms(t)}  measured; {t['median_s'] / floor_s:5.2f}x the floor, "
              f"{bw / 1e9:.3g} GB/s derived (its own bytes)")
    out["vs_floor"] = {k: v["median_s"] / floor_s for k, v in out["time"].items()}
    if 0.8 <= min(out["vs_floor"]["torch_compile"], out["vs_floor"]["jax_jit"]) < 1:
        print("  (a fused time below its floor: the floor uses the measured copy bandwidth, which a fused"
              " kernel can slightly beat)")
    out["speedup_torch_compile_vs_eager"] = out["time"]["eager"]["median_s"] / out["time"]["torch_compile"]["median_s"]
    out["speedup_jax_jit_vs_jax_eager"] = out["time"]["jax_eager"]["median_s"] / out["time"]["jax_jit"]["median_s"]
    print(f"  derived speedup of fusion: torch {out['speedup_torch_compile_vs_eager']:.2f}x, "
          f"jax {out['speedup_jax_jit_vs_jax_eager']:.2f}x (predicted {11 / 3:.2f}x)")
    if device == "cuda":
        res["targets"]["torch_fused_within_1.3x_of_floor"] = out["vs_floor"]["torch_compile"] <= 1.3
        res["targets"]["jax_fused_within_1.3x_of_floor"] = out["vs_floor"]["jax_jit"] <= 1.3
    res["bandwidth"] = out


# ---------------------------------------------------------------------------------------
# 3. Compute regime: compiling does not pay

def exp_matmul(S, device, sync, jsync, res):
    n, dtype = S["mm"], S["mm_dtype"]
    size = torch.tensor([], dtype=dtype).element_size()
    # PREDICTION: intensity 2n^3 / (3 n^2 x bytes) FLOP/byte is far above the ridge: the time
    # is the tensor-core (CPU: SIMD) math inside one GEMM. Eager and compiled code call the
    # same library kernel (cuBLAS / MKL / XLA's dot), so compiling gains < 10%: there is no
    # chain to fuse and the one launch costs us against ms of math.
    print(f"\n3. Compute regime: {n}x{n} @ {n}x{n} {str(dtype).split('.')[1]} "
          f"(intensity {2 * n ** 3 / (3 * n * n * size):.0f} FLOP/byte, derived)")
    gen = torch.Generator(device=device).manual_seed(0)
    A, B = (torch.randn(n, n, device=device, generator=gen).to(dtype) for _ in range(2))
    matmul = lambda p, q: p @ q  # noqa: E731
    compiled = torch.compile(matmul)
    out = {"n": n, "dtype": str(dtype), "time": {}, "compile_first_call_s": {}}
    out["compile_first_call_s"]["torch_compile"] = first_call_s(lambda: compiled(A, B), sync)
    jdt = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    Aj, Bj = (jnp.asarray(t.float().cpu().numpy(), dtype=jdt) for t in (A, B))
    jitted = jax.jit(matmul)
    out["compile_first_call_s"]["jax_jit"] = first_call_s(lambda: jitted(Aj, Bj), jsync)
    tol = 2e-2 if dtype == torch.bfloat16 else TOL  # bf16 keeps 8 bits of mantissa
    want = matmul(A, B).float()
    scale = want.abs().max().item()
    close("matmul_torch_compile_equals_eager", compiled(A, B).float().cpu() / scale, want.cpu() / scale, res, tol)
    close("matmul_jax_jit_equals_torch_eager", np.asarray(jitted(Aj, Bj), np.float32) / scale, want.cpu() / scale, res, tol)
    peak = datasheet_bf16_peak(torch.cuda.get_device_name()) if device == "cuda" else None
    for name, fn, s in [("eager", lambda: matmul(A, B), sync), ("torch_compile", lambda: compiled(A, B), sync),
                        ("jax_eager", lambda: matmul(Aj, Bj), jsync), ("jax_jit", lambda: jitted(Aj, Bj), jsync)]:
        t = out["time"][name] = bench(fn, s, reps=S["reps"], inner=S["inner_big"])
        rate = 2 * n ** 3 / t["median_s"]
        print(f"  {name:22s} {ms(t)}  measured; {rate / 1e12:.3g} TFLOP/s derived"
              + (f" ({rate / peak:.0%} of the {peak / 1e12:.0f} TFLOP/s datasheet bf16 peak, reference)" if peak else ""))
    eager, comp = out["time"]["eager"]["median_s"], out["time"]["torch_compile"]["median_s"]
    out["gain_torch_compile"] = eager / comp - 1
    out["gain_jax_jit"] = out["time"]["jax_eager"]["median_s"] / out["time"]["jax_jit"]["median_s"] - 1
    print(f"  derived gain from compiling: torch {out['gain_torch_compile']:+.1%}, jax {out['gain_jax_jit']:+.1%}"
          " - one GEMM kernel either way; nothing to fuse, no launches worth saving;"
          " a slowdown is noise or a different kernel choice, not fusion")
    if device == "cuda":
        res["targets"]["matmul_gain_below_10pct"] = abs(out["gain_torch_compile"]) < 0.10
    res["matmul"] = out


# ---------------------------------------------------------------------------------------
# 4. How capture works, and where it breaks

def clean(x):
    return torch.sin(x) * 2 + 1


def dirty(x):
    y = torch.sin(x)
    print("    (print inside dirty() ran)")  # Dynamo cannot put a print in a graph: break
    scale = y.abs().max().item()               # a Python float leaves the graph: break
    return y / scale * 2 + 1


def exp_capture_torch(S, device, sync, jsync, res):
    # PREDICTION: explain() finds 0 breaks in clean() and 2 in dirty() (print, .item()).
    # New shapes: dynamic=False compiles once per shape (8, 16, 32: 3 graphs); the default
    # compiles 8 statically, then on 16 recompiles with a symbolic size that 32 reuses (2);
    # dynamic=True compiles one symbolic graph (1). A repeated shape never recompiles.
    print("\n4a. torch.compile captures bytecode: graph breaks and recompiles")
    torch._logging.set_logs(dynamo=logging.ERROR)  # we print the break reasons ourselves
    x = torch.randn(8, device=device)
    out = {}
    for fn in (clean, dirty):
        ex = torch._dynamo.explain(fn)(x)
        reasons = [str(r.reason).splitlines()[0][:90] for r in ex.break_reasons]
        out[fn.__name__] = {"graph_count": ex.graph_count, "graph_break_count": ex.graph_break_count,
                            "break_reasons": reasons}
        print(f"  {fn.__name__}(): {ex.graph_count} graph(s), {ex.graph_break_count} graph break(s) (measured) {reasons}")
    res["checks"]["graph_breaks_found_in_dirty"] = out["dirty"]["graph_break_count"] > 0
    res["checks"]["no_graph_breaks_in_clean"] = out["clean"]["graph_break_count"] == 0
    shapes = (8, 16, 8, 32)
    out["compiles_for_shapes"] = {"shapes": list(shapes)}
    for dynamic in (False, None, True):
        torch._dynamo.reset()
        graphs = []

        def counting_backend(gm, example_inputs):  # called once per (re)compile
            graphs.append(1)
            return gm.forward
        f = torch.compile(clean, backend=counting_backend, dynamic=dynamic)
        after = []
        for n in shapes:
            f(torch.randn(n, device=device))
            after.append(len(graphs))
        out["compiles_for_shapes"][f"dynamic={dynamic}"] = after
        print(f"  dynamic={str(dynamic):5s}: compiles after shapes {shapes}: {after} (measured)")
    res["checks"]["repeated_shape_does_not_recompile"] = all(
        v[2] == v[1] for k, v in out["compiles_for_shapes"].items() if k != "shapes")
    res["checks"]["dynamic_true_compiles_once"] = out["compiles_for_shapes"]["dynamic=True"][-1] == 1
    if "overhead" in res:  # compile time, measured in 1. as the first call
        first, warm = res["overhead"]["compile_first_call_s"]["torch_compile"], \
            res["overhead"]["time_per_call"]["torch_compile"]["median_s"]
        print(f"  compile time is paid once: first call {first:.2f} s vs warm {warm * 1e6:.1f} us "
              f"= {first / warm:.0f} warm calls (derived; a cache hit from an earlier run makes it shorter)")
    res["capture_torch"] = out


def exp_capture_jax(S, device, sync, jsync, res):
    # PREDICTION: jax.jit runs the Python function once per new input shape/dtype, with
    # abstract tracers; the Python counter inside therefore counts traces: 1, 2, 2, 3 for
    # shapes 8, 16, 8, 32. A static argument is part of the cache key: n=2, 3, 2 -> 2 traces.
    print("\n4b. jax.jit traces: jaxpr, trace-time side effects, retraces, AOT compile")
    out = {}
    big, vec = jnp.ones((2, 4)), jnp.ones(4)
    print("  jaxpr of the bandwidth chain (what tracing recorded):")
    print("    " + str(jax.make_jaxpr(unfused_jax)(big, vec, vec, vec, big)).replace("\n", "\n    "))
    traces = []

    def counted(x):
        traces.append(x.shape)  # a Python side effect: runs while tracing, never when the compiled code runs
        return jnp.sin(x) * 2 + 1
    f = jax.jit(counted)
    after = [(jsync(f(jnp.ones(n))), len(traces))[1] for n in (8, 16, 8, 32)]
    out["traces_for_shapes"] = {"shapes": [8, 16, 8, 32], "traces_after_each": after}
    print(f"  traces after shapes (8, 16, 8, 32): {after} (measured)")
    res["checks"]["jax_one_trace_per_new_shape"] = after == [1, 2, 2, 3]

    def power(x, k):  # a Python loop over k: k must be a concrete Python int
        traces.append(k)
        for _ in range(k):
            x = x * x
        return x
    p, before = jax.jit(power, static_argnums=1), len(traces)
    after = [(jsync(p(jnp.ones(4), k)), len(traces) - before)[1] for k in (2, 3, 2)]
    out["traces_for_static_args"] = {"k": [2, 3, 2], "traces_after_each": after}
    try:
        jax.jit(power)(jnp.ones(4), 2)
        out["nonstatic_loop_bound_error"] = None
    except Exception as e:  # range() over a tracer
        out["nonstatic_loop_bound_error"] = type(e).__name__
    print(f"  static_argnums=1, k = (2, 3, 2): traces {after} (measured); "
          f"without static_argnums: {out['nonstatic_loop_bound_error']}")
    res["checks"]["jax_retrace_per_new_static_arg"] = after == [1, 2, 2]
    # ahead-of-time: lower (trace to StableHLO) and compile (XLA) by hand, then ask XLA's cost model
    rows, d = S["rows"], S["d"]
    big, vec = jax.ShapeDtypeStruct((rows, d), jnp.float32), jax.ShapeDtypeStruct((d,), jnp.float32)
    fresh = jax.jit(lambda *xs: unfused_jax(*xs))  # a new function: jit's cache has not seen it
    t0 = time.perf_counter()
    lowered = fresh.lower(big, vec, vec, vec, big)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # a list of per-module dicts in some versions
        cost = cost[0] if cost else None
    flops, nbytes = (cost.get("flops"), cost.get("bytes accessed")) if cost else (None, None)
    floor = 3 * rows * d * 4
    out["aot"] = {"lower_s": t1 - t0, "compile_s": t2 - t1, "flops": flops, "bytes_accessed": nbytes, "bytes_floor": floor}
    print(f"  lower {t1 - t0:.3f} s, compile {t2 - t1:.3f} s (measured); XLA cost_analysis: flops {flops}, "
          f"bytes accessed {nbytes} vs floor {floor} = 3 N x 4 B"
          + (f" ({nbytes / floor:.2f}x: one fused pass)" if nbytes else " (not reported by this backend)"))
    if "overhead" in res:  # first call (trace + compile + run) of 1.'s chain vs its warm call
        first, warm = res["overhead"]["compile_first_call_s"]["jax_jit"], \
            res["overhead"]["time_per_call"]["jax_jit"]["median_s"]
        print(f"  compile time is paid once: first call {first:.2f} s vs warm {warm * 1e6:.1f} us "
              f"= {first / warm:.0f} warm calls (derived); every timing above excludes it")
    res["capture_jax"] = out


# ---------------------------------------------------------------------------------------

def figure(res, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: figure skipped")
        return
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.6))
    for ax, key, title in zip(axes, ["overhead", "bandwidth", "matmul"], ["overhead regime: 48 tiny ops",
                              "bandwidth regime: the chain", "compute regime: matmul"]):
        times = res.get(key, {}).get("time_per_call") or res.get(key, {}).get("time") or {}
        ax.bar(list(times), [v["median_s"] * 1e3 for v in times.values()], color="tab:blue")
        if key == "bandwidth" and times:
            ax.axhline(res[key]["floor_s"] * 1e3, color="tab:red", ls="--", label="one-read-one-write floor")
            ax.legend(fontsize=8)
        ax.set(title=title, ylabel="ms per call (measured)", yscale="log" if key == "overhead" else "linear")
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "03_compile.png"), dpi=120)
    print(f"figure: {os.path.join(out_dir, '03_compile.png')}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", help="write every measured number here")
    parser.add_argument("--out", default="out", help="directory for the figure")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA GPU; run with --device cpu")
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    if device == "cpu":
        jax.config.update("jax_platforms", "cpu")
        try:  # keep freed memory, as GPU caching allocators do, so big tensors skip page faults
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-4, 0), libc.mallopt(-1, 2**30)  # M_MMAP_MAX = 0, M_TRIM_THRESHOLD = 1 GB
        except OSError:
            pass
    os.makedirs(args.out, exist_ok=True)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, mem = props.name, props.total_memory
    else:
        name, mem = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)", None
    print(f"device: {name}" + (f", {mem / 2**30:.0f} GiB" if mem else ""))
    print(f"torch {torch.__version__}, jax {jax.__version__} on {jax.devices()[0]}; quick={args.quick}")
    if device == "cuda" and jax.default_backend() == "cpu":
        print("warning: JAX sees no GPU here; its numbers below are CPU numbers")
    S = {"cuda": dict(tiny=1024, rows=65536, d=4096, mm=8192, mm_dtype=torch.bfloat16, reps=10, inner_tiny=200, inner_big=5),
         "cpu": dict(tiny=1024, rows=2048, d=4096, mm=1024, mm_dtype=torch.float32, reps=7, inner_tiny=100, inner_big=2)}[device]
    if args.quick:
        S.update(rows=256, d=1024, mm=256, reps=3, inner_tiny=20, inner_big=2)
    print(f"sizes: tiny chain {S['tiny']} values; bandwidth {S['rows']}x{S['d']} fp32; matmul {S['mm']}^3")
    sync = (lambda out: torch.cuda.synchronize()) if device == "cuda" else (lambda out: None)
    jsync = jax.block_until_ready
    res = {"lesson": "03_compile", "quick": args.quick, "checks": {}, "targets": {}, "errors": {},
           "device": {"type": device, "name": name, "memory_bytes": mem, "torch": torch.__version__,
                      "jax": jax.__version__, "jax_device": str(jax.devices()[0])}}
    experiments = {"overhead": exp_overhead, "bandwidth": exp_bandwidth, "matmul": exp_matmul,
                   "capture_torch": exp_capture_torch, "capture_jax": exp_capture_jax}
    with torch.no_grad():
        for key, experiment in experiments.items():
            try:
                experiment(S, device, sync, jsync, res)
            except Exception as e:  # keep going: the other experiments and the JSON still count
                traceback.print_exc()
                res["errors"][key] = repr(e)
                res["checks"][f"{key}_ran"] = False
            torch.cuda.empty_cache()  # a no-op without a GPU
    try:
        figure(res, args.out)
    except Exception as e:
        print(f"figure skipped: {e!r}")
    print("\nchecks:", ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in res["checks"].items()))
    if res["targets"]:
        print("targets (H200):", ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in res["targets"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if not all(res["checks"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
