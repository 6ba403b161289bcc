"""
01_roofline.py - Section 13.1: the roofline, the two ceilings, the three regimes.

An op waits on arithmetic, on memory, or - when it is small - on the fixed cost of asking
for it. This lesson measures which, on this machine:
1. the two ceilings: peak matmul FLOP/s (bf16 on a GPU, fp32 on a CPU) and a large copy's
   bytes/s; their ratio is the ridge point;
2. a dozen ops on the roofline, each classified compute-, bandwidth- or overhead-bound
   from its measurement, beside what the roofline predicts for it;
3. the overhead floor: the time of a vector add from 64 elements up;
4. measurement discipline, run: no synchronize, the first call, mean against median, and
   JAX with and without block_until_ready;
5. the figure: out/01_roofline.png.
Run (this file alone; jax and matplotlib are optional):
  python 01_roofline.py                 # CUDA if present (cuda:0), else the CPU
  python 01_roofline.py --device cpu    # under a minute on 2 cores
  python 01_roofline.py --quick         # seconds: what the tests run
One GPU is all it uses. Expect on a datacenter GPU hundreds of TFLOP/s in bf16, a few TB/s,
a ridge near 200 FLOP/byte; on a small CPU ~100 GFLOP/s, tens of GB/s, a ridge of a few.
Every number printed is labelled measured, derived or reference (datasheet).
"""

import os
import signal
import sys

def interrupted(signum, frame):
    """Ctrl-C at any moment, even while torch is still importing: one line, exit 130.
    os._exit: an exception raised in a callback of Python's import machinery is printed
    and swallowed there."""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)

if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted)

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # else JAX takes 75% of a GPU

import argparse
import ctypes
import importlib.metadata
import itertools
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Reference numbers, never measurements: dense bf16 tensor-core FLOP/s and memory bytes/s
# (NVIDIA H200, H100 SXM and A100 80GB datasheets; NVIDIA's Ada whitepaper for the RTX 4090).
DATASHEET = {
    "H200": dict(bf16_flops=989e12, bandwidth=4.8e12),
    "H100": dict(bf16_flops=989e12, bandwidth=3.35e12),
    "A100": dict(bf16_flops=312e12, bandwidth=2.0e12),
    "RTX 4090": dict(bf16_flops=165e12, bandwidth=1.01e12),
}

FLAT = 2             # overhead-bound: time under 2x the same call on toy inputs (dims <= 8)
NEAR_ROOF = 0.5      # an op at >= 50% of its roof is "near" it; under that, "far below"
BUSY = "unreliable (machine busy)"
MAX_INNER = 1000     # at most this many calls in one timed sample
GPU_WARMUP_S = 0.05  # a GPU raises its clocks under load: keep it busy this long first
BURST_GAP_S = 0.1    # GPU: idle this long before each roof sample, so each is a burst

@dataclass
class Sizes:
    """The CPU's sizes (under a minute on 2 cores); the GPU and --quick rows change a few."""
    dtype: torch.dtype = torch.float32  # the matmuls': fp32 on a CPU, bf16 on a GPU
    peak_n: int = 2048          # the compute roof's matmul; the other matmuls scale with it
    vector: int = 2**24         # elements of the elementwise ops, norms, sums; the copy: 2x
    tiny: int = 16              # a matmul small enough to be all overhead
    decode_tokens: int = 1      # a few tokens against a (2 peak_n)^2 weight
    sweep: range = range(6, 25, 2)  # the overhead sweep's vector adds: 2**p elements
    reps: int = 7               # timed samples per measurement
    target_s: float = 2e-2      # a sample repeats the call until it lasts this long
    cache_bytes: int = 2**25    # last-level cache: rotated inputs exceed it 3x

# Well past a GPU's L2, and enough work to fill the chip.
GPU_SIZES = dict(dtype=torch.bfloat16, peak_n=8192, vector=2**28, tiny=64,
                 decode_tokens=16, sweep=range(6, 29, 2), reps=20, target_s=5e-3)
QUICK_CPU_SIZES = dict(peak_n=512, vector=2**21, sweep=range(6, 19, 3), reps=3,
                       target_s=5e-4)

def sizes_for(device, quick, cache_bytes):
    if device.type == "cuda":
        sizes = Sizes(**GPU_SIZES, cache_bytes=cache_bytes)
        if quick:
            sizes.reps = 5
        return sizes
    if quick:
        return Sizes(**QUICK_CPU_SIZES, cache_bytes=min(cache_bytes, 2**22))
    return Sizes(cache_bytes=cache_bytes)

PREFIXES = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""), (1e-3, "m")]

def si(x, unit=""):
    """812.3e12 -> '812 T' + unit; 7.81e-6 -> '7.81 u' + unit."""
    for power, prefix in PREFIXES:
        if abs(x) >= power:
            return f"{x / power:.3g} {prefix}{unit}".rstrip()
    return f"{x * 1e6:.3g} u{unit}"

def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")

# Honest timing: warm up, wait for the device before reading a clock, repeat, take the
# median. Every number in this lesson passes through time_once and per_call.

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def time_once(fn, device):
    """Seconds for one call of fn. GPU work is asynchronous: fn returns once its kernels
    are queued, so the clock is read only after the device has finished."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start

def calls_per_sample(one_call_s, target_s):
    """A microsecond op timed alone would time the clock and the synchronize: repeat it
    back to back until a sample lasts target_s (1 to MAX_INNER calls)."""
    inner = round(target_s / one_call_s)
    return max(1, min(MAX_INNER, inner))

def summary(samples):
    return dict(median_s=statistics.median(samples), min_s=min(samples),
                max_s=max(samples))

def per_call(fn, device, sizes, burst=False):
    """Seconds per call of fn: the median, min and max of sizes.reps timed samples, and
    the cold first call (kept apart: part 4 shows what it costs)."""
    # The first call pays one-off costs (kernel loading, library handles, fresh pages).
    first_s = time_once(fn, device)
    # The second is warm: its time says how many calls make one sample.
    warm_s = time_once(fn, device)
    inner = calls_per_sample(warm_s, sizes.target_s)

    def sample():
        for _ in range(inner):
            fn()

    # A GPU raises its clocks only under load: keep it busy before the first sample.
    if device.type == "cuda":
        warmup_samples = round(GPU_WARMUP_S / sizes.target_s)
        for _ in range(warmup_samples):
            sample()
    samples = []
    for _ in range(sizes.reps):
        # Burst mode (the roofs, on a GPU): idle, then one untimed sample to wake the
        # clocks, then the timed one - the short burst in which the ops below run.
        if burst and device.type == "cuda":
            sync(device)
            time.sleep(BURST_GAP_S)
            sample()
        samples.append(time_once(sample, device) / inner)
    return dict(summary(samples), first_s=first_s, inner=inner, samples_s=samples)

def rotating(fn, shapes, sizes, device, dtype):
    """fn on random inputs of these shapes, a different copy each call: enough copies to
    exceed the last-level cache 3x, so no call finds its inputs in a cache."""
    nbytes = sum(math.prod(shape) for shape in shapes) * dtype.itemsize
    copies = math.ceil(3 * sizes.cache_bytes / nbytes)
    copies = max(2, min(64, copies))  # 2 to 64 copies
    inputs = []
    for _ in range(copies):
        tensors = [torch.empty(shape, device=device, dtype=dtype) for shape in shapes]
        inputs.append([tensor.uniform_(-1, 1) for tensor in tensors])
    cycle = itertools.cycle(inputs)

    def call():
        return fn(*next(cycle))

    return call

def unreliable(timing, rate=0.0, ceiling=None):
    """The one rule for every number: samples spread wider than their median, or a rate
    more than 10% above a ceiling it cannot exceed. Either way the machine was busy."""
    spread = timing["max_s"] - timing["min_s"]
    if spread > timing["median_s"]:
        return True
    if ceiling is not None and rate > 1.1 * ceiling:
        return True
    return False

def mark(is_unreliable):
    """Printed after an unreliable number, and after every number derived from one."""
    if is_unreliable:
        return "   " + BUSY
    return ""

# 1. The two ceilings

def compute_roof(device, sizes):
    # PREDICTION: a big square matmul does ~n/3 FLOPs per byte, far right of any ridge:
    # the compute roof (a datacenter GPU: ~80% of its datasheet bf16 peak). The roof is
    # what a GPU does in bursts, as the ops below run (held for seconds at its power limit,
    # it lowers its clocks: see 02_hardware.py). One shape can tile the chip unevenly:
    # three shapes are tried, the fastest kept.
    n = sizes.peak_n
    shapes = [(n, n, n), (n // 2, n // 2, n // 2), (n, n // 2, 2 * n)]
    tried = {}
    for m, k, n_out in shapes:
        run = rotating(torch.matmul, [(m, k), (k, n_out)], sizes, device, sizes.dtype)
        timing = per_call(run, device, sizes, burst=True)
        timing["flops"] = 2 * m * k * n_out
        tried[f"{m}x{k}x{n_out}"] = timing
    rates = {shape: t["flops"] / t["median_s"] for shape, t in tried.items()}
    fastest = max(rates, key=rates.get)
    matmul = dict(tried[fastest], shape=fastest, dtype=dtype_name(sizes.dtype))
    return matmul, rates

def memory_roof(device, sizes):
    # PREDICTION: a copy does no arithmetic, only bytes: the memory roof (a datacenter GPU:
    # ~90% of its datasheet bytes/s; a CPU: tens of GB/s).
    src = torch.randn(2 * sizes.vector, device=device, dtype=sizes.dtype)
    dst = torch.empty_like(src)
    copy = per_call(lambda: dst.copy_(src), device, sizes)
    copy["bytes_moved"] = 2 * src.numel() * src.element_size()  # read once, written once
    copy_is_exact = torch.equal(dst, src)
    return copy, copy_is_exact

def measure_ceilings(device, sizes, reference):
    matmul, rates = compute_roof(device, sizes)
    copy, copy_is_exact = memory_roof(device, sizes)
    peak = matmul["flops"] / matmul["median_s"]
    bandwidth = copy["bytes_moved"] / copy["median_s"]
    # A roof more than 10% above the datasheet's: the clock read was wrong.
    matmul["unreliable"] = unreliable(matmul, peak, reference.get("bf16_flops"))
    copy["unreliable"] = unreliable(copy, bandwidth, reference.get("bandwidth"))
    return dict(peak_flops=peak, bandwidth_bytes_per_s=bandwidth,
                ridge_flop_per_byte=peak / bandwidth, copy_is_exact=copy_is_exact,
                matmul=matmul, matmul_shapes_tried=rates, copy=copy,
                unreliable=any([matmul["unreliable"], copy["unreliable"]]))

def report_ceilings(ceilings, reference):
    matmul = ceilings["matmul"]
    copy = ceilings["copy"]
    peak = ceilings["peak_flops"]
    bandwidth = ceilings["bandwidth_bytes_per_s"]
    slowest_flops = si(matmul["flops"] / matmul["max_s"])
    fastest_flops = si(matmul["flops"] / matmul["min_s"])
    print(f"  compute roof {si(peak, 'FLOP/s'):>14}   {matmul['dtype']} matmul"
          f" {matmul['shape']}, fastest of 3 shapes"
          f" (min-max {slowest_flops}-{fastest_flops})" + mark(matmul["unreliable"]))
    slowest_bytes = si(copy["bytes_moved"] / copy["max_s"])
    fastest_bytes = si(copy["bytes_moved"] / copy["min_s"])
    copied = si(copy["bytes_moved"] / 2, "B")
    print(f"  memory roof  {si(bandwidth, 'B/s'):>14}   copy of {copied}, read + written"
          f" (min-max {slowest_bytes}-{fastest_bytes})" + mark(copy["unreliable"]))
    print(f"  ridge point  {ceilings['ridge_flop_per_byte']:>8.1f} FLOP/B   (derived:"
          " compute roof / memory roof): an op doing fewer FLOPs per byte waits on memory"
          + mark(ceilings["unreliable"]))
    if reference:
        ref_flops = reference["bf16_flops"]
        ref_bandwidth = reference["bandwidth"]
        print(f"  reference    datasheet {si(ref_flops, 'FLOP/s')} dense bf16,"
              f" {si(ref_bandwidth, 'B/s')}: the roofs are {peak / ref_flops:.0%}"
              f" and {bandwidth / ref_bandwidth:.0%} of them (derived)"
              + mark(ceilings["unreliable"]))

# 2. A dozen ops on the roofline

@dataclass
class Op:
    label: str
    fn: object
    shapes: list        # of its inputs
    flops: int          # counted on paper
    bytes: int          # the minimum: each input read once, each output written once
    dtype: torch.dtype

def make_ops(sizes):
    """Each op's FLOPs and minimum bytes, counted on paper. Elementwise ops, norms and
    sums in fp32 (activations, optimizer math); matmuls in the compute roof's dtype.
    Bytes are bytes: both meet the same memory roof."""
    f32 = torch.float32
    v = 4                           # bytes per fp32 element
    n = sizes.vector
    rows = n // 1024                # softmax and layernorm: rows of 1024
    mm = sizes.dtype
    e = sizes.dtype.itemsize        # bytes per matmul element
    t = sizes.tiny
    tokens = sizes.decode_tokens
    d = 2 * sizes.peak_n            # the decode matmul's square weight
    batch = n // 4096               # bmm: this many 64x64 products
    m = sizes.peak_n // 2           # the medium square matmul
    p = sizes.peak_n
    ops = {}
    ops["vector_add_tiny"] = Op("vector add 1k", torch.add, [(1024,), (1024,)],
                                flops=1024, bytes=3 * 1024 * v, dtype=f32)
    ops["vector_add"] = Op(f"vector add {si(n)}", torch.add, [(n,), (n,)],
                           flops=n, bytes=3 * n * v, dtype=f32)
    ops["scale"] = Op(f"scale x*2 {si(n)}", lambda x: x * 2.0, [(n,)],
                      flops=n, bytes=2 * n * v, dtype=f32)
    # GELU: ~8 FLOPs per element by convention (the erf counted as one)
    ops["gelu"] = Op(f"GELU {si(n)}", F.gelu, [(n,)],
                     flops=8 * n, bytes=2 * n * v, dtype=f32)
    # softmax, per element: max, subtract, exp, sum, divide
    ops["softmax"] = Op(f"softmax {si(rows)} x 1024", lambda x: torch.softmax(x, dim=-1),
                        [(rows, 1024)], flops=5 * n, bytes=2 * n * v, dtype=f32)
    # layernorm, per element: mean, subtract, square, sum, normalise, gain, bias (+1)
    ops["layernorm"] = Op(f"layernorm {si(rows)} x 1024",
                          lambda x, w, b: F.layer_norm(x, w.shape, w, b),
                          [(rows, 1024), (1024,), (1024,)],
                          flops=8 * n, bytes=(2 * n + 2 * 1024) * v, dtype=f32)
    ops["sum"] = Op(f"sum {si(n)}", torch.sum, [(n,)],
                    flops=n, bytes=(n + 1) * v, dtype=f32)
    ops["matmul_tiny"] = Op(f"matmul {t}^3", torch.matmul, [(t, t), (t, t)],
                            flops=2 * t**3, bytes=3 * t * t * e, dtype=mm)
    ops["matmul_decode"] = Op(f"matmul {tokens} tok x {d}^2", torch.matmul,
                              [(tokens, d), (d, d)], flops=2 * tokens * d * d,
                              bytes=(2 * tokens * d + d * d) * e, dtype=mm)
    ops["bmm_small"] = Op(f"bmm {si(batch)} x 64^3", torch.bmm,
                          [(batch, 64, 64), (batch, 64, 64)], flops=2 * batch * 64**3,
                          bytes=3 * batch * 64 * 64 * e, dtype=mm)
    ops["matmul_medium"] = Op(f"matmul {m}^3", torch.matmul, [(m, m), (m, m)],
                              flops=2 * m**3, bytes=3 * m * m * e, dtype=mm)
    ops["matmul_large"] = Op(f"matmul {p}x{m}x{d}", torch.matmul, [(p, m), (m, d)],
                             flops=2 * p * m * d, bytes=(p * m + m * d + p * d) * e,
                             dtype=mm)
    return ops

def toy_shapes(shapes):
    """The same inputs cut to at most 8 per dimension: the call is there, the work is not."""
    return [tuple(min(dim, 8) for dim in shape) for shape in shapes]

def place_ops(device, sizes, ceilings):
    # PREDICTION: elementwise ops, norms, sums do 1-8 FLOPs per element moved: a few
    # FLOP/byte, left of the ridge, under the memory roof. A matmul's intensity grows with
    # its smallest dimension: a few tokens against a big weight, or 64x64 blocks, stay left
    # of a GPU's ridge; square matmuls of thousands cross it. Some land a few % above 100%:
    # ops that mostly read (a sum, a matmul streaming its weights) beat a copy, half of
    # whose bytes are writes; on a CPU a copy's write-allocate reads its destination first
    # (3 bytes moved per 2 counted), so an add or a scale can beat the copy by up to 1.5x.
    bytes_ceiling = ceilings["bandwidth_bytes_per_s"]
    if device.type == "cpu":
        bytes_ceiling = 1.5 * bytes_ceiling
    placed = {}
    for key, op in make_ops(sizes).items():
        run = rotating(op.fn, op.shapes, sizes, device, op.dtype)
        timing = per_call(run, device, sizes)
        toy_run = rotating(op.fn, toy_shapes(op.shapes), sizes, device, op.dtype)
        toy = per_call(toy_run, device, sizes)
        placed[key] = on_roofline(op, timing, toy, ceilings, bytes_ceiling)
    return placed

def on_roofline(op, timing, toy, ceilings, bytes_ceiling):
    """An op's row: counted on paper, measured, derived; its regime predicted by the
    roofline and classified from the measurement."""
    peak = ceilings["peak_flops"]
    bandwidth = ceilings["bandwidth_bytes_per_s"]
    time_s = timing["median_s"]
    intensity = op.flops / op.bytes
    bound = min(peak, intensity * bandwidth)  # the roofline: the FLOP/s it can attain
    achieved_flops = op.flops / time_s
    achieved_bytes = op.bytes / time_s
    row = dict(label=op.label, flops=op.flops, bytes=op.bytes, intensity=intensity,
               bound_flops=bound, time_s=time_s, toy_time_s=toy["median_s"],
               achieved_flops=achieved_flops, achieved_bytes_per_s=achieved_bytes,
               fraction_of_bound=achieved_flops / bound, min_s=timing["min_s"],
               max_s=timing["max_s"], first_s=timing["first_s"], inner=timing["inner"])
    row["predicted"] = "bandwidth"
    if intensity >= peak / bandwidth:
        row["predicted"] = "compute"
    row["measured"], row["near_roof"] = classify(row, peak, bandwidth)
    doubts = [unreliable(timing, achieved_flops, peak),
              unreliable(timing, achieved_bytes, bytes_ceiling),
              unreliable(toy),             # the "x toy" column and the overhead test
              ceilings["unreliable"]]      # the bound and both fractions
    row["unreliable"] = any(doubts)
    return row

def classify(op, peak, bandwidth):
    """(regime, near its roof?) from the measurement. Overhead first: time flat in size
    (under FLAT x its time on toy inputs). Else the roof it comes nearer to, as a
    fraction of each."""
    if op["time_s"] < FLAT * op["toy_time_s"]:
        return "overhead", None
    near = op["fraction_of_bound"] >= NEAR_ROOF
    if op["achieved_flops"] / peak >= op["achieved_bytes_per_s"] / bandwidth:
        return "compute", near
    return "bandwidth", near

def op_row(op):
    columns = [f"{op['label']:<24}",
               f"{si(op['flops']):>7}",
               f"{si(op['bytes']):>7}",
               f"{op['intensity']:>8.3g}",
               f"{si(op['time_s'], 's'):>9}",
               f"{si(op['achieved_flops'], 'FLOP/s'):>12}",
               f"{si(op['achieved_bytes_per_s'], 'B/s'):>10}",
               f"{op['fraction_of_bound']:>6.0%}",
               f"{op['time_s'] / op['toy_time_s']:>8.1f}"]
    regime = f"{op['predicted']} -> {op['measured']}"
    if op["near_roof"] is True:
        regime += " (near)"
    if op["near_roof"] is False:
        regime += " (far below)"
    if op["measured"] != op["predicted"]:
        regime += "   <- the roofline cannot see this"
    return "  " + " ".join(columns) + "  " + regime + mark(op["unreliable"])

def report_ops(ops):
    header = [f"{'op':<24}", f"{'FLOPs':>7}", f"{'bytes':>7}", f"{'FLOP/B':>8}",
              f"{'time':>9}", f"{'achieved':>12}", f"{'bytes/s':>10}", f"{'%bound':>6}",
              f"{'x toy':>8}"]
    print("  " + " ".join(header) + "  intensity predicts -> measured")
    for op in ops.values():
        print(op_row(op))

# 3. The overhead floor

def overhead_sweep(device, sizes, bandwidth):
    # PREDICTION: a vector add of 64 elements costs what one of 64 thousand does: the fixed
    # cost of a call (Python, PyTorch's dispatcher, a kernel launch), a few microseconds.
    # Time grows with size only once the bytes take longer than that: it doubles at
    # floor x bandwidth bytes per call, where moving them takes as long as the call.
    sweep = []
    for p in sizes.sweep:
        elements = 2**p
        run = rotating(torch.add, [(elements,), (elements,)], sizes, device, torch.float32)
        timing = per_call(run, device, sizes)
        sweep.append(dict(elements=elements, bytes=3 * elements * 4,
                          time_s=timing["median_s"], unreliable=unreliable(timing)))
    smallest = sweep[:3]
    floor = statistics.median(point["time_s"] for point in smallest)
    doubled = crossing(sweep, 2 * floor)
    return dict(floor_s=floor, sweep=sweep, crossover_bytes=doubled,
                predicted_crossover_bytes=floor * bandwidth,
                floor_unreliable=any(point["unreliable"] for point in smallest),
                unreliable=any(point["unreliable"] for point in sweep))

def crossing(sweep, time_s):
    """Bytes per call where the sweep's time first exceeds time_s, interpolated log-log
    between the two sizes around it; None if the sweep never gets there."""
    above = [i for i, point in enumerate(sweep) if point["time_s"] > time_s]
    if not above or above[0] == 0:
        return None
    before = sweep[above[0] - 1]
    after = sweep[above[0]]
    # where time_s lies between the two times, on a log scale: 0 at before, 1 at after
    rise = math.log(after["time_s"] / before["time_s"])
    fraction = math.log(time_s / before["time_s"]) / rise
    return before["bytes"] * (after["bytes"] / before["bytes"]) ** fraction

def report_overhead(overhead, roofs_unreliable):
    print("  vector add, time per call against size (measured):")
    for point in overhead["sweep"]:
        print(f"  {si(point['elements']):>10} elements {si(point['time_s'], 's'):>9}"
              + mark(point["unreliable"]))
    print(f"  overhead floor {si(overhead['floor_s'], 's')} per call (measured: the 3"
          " smallest sizes)" + mark(overhead["floor_unreliable"]))
    if overhead["crossover_bytes"] is None:
        print("  time doubles: not within this sweep")
    else:
        print(f"  time doubles at {si(overhead['crossover_bytes'], 'B')} per call (derived)"
              + mark(overhead["unreliable"]))
    predicted = si(overhead["predicted_crossover_bytes"], "B")
    doubtful = any([overhead["floor_unreliable"], roofs_unreliable])
    print(f"  predicted: floor x memory roof = {predicted} (derived)" + mark(doubtful))

# 4. Measurement discipline, shown by running it

def loop_stats(times):
    """A timing loop with no warm-up: its first (cold) call, the warm median, the loop's
    mean and median."""
    return dict(first_s=times[0], warm_median_s=statistics.median(times[1:]),
                loop_mean_s=statistics.fmean(times), loop_median_s=statistics.median(times))

def two_clocks(call, wait, reps):
    """Each call timed twice: when it returns, and when its result is ready (after wait).
    The first call is kept: a loop with no warm-up starts with it."""
    returned = []
    ready = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        result = call()
        returned.append(time.perf_counter() - start)
        wait(result)
        ready.append(time.perf_counter() - start)
    clocks = loop_stats(ready)
    clocks["returned_s"] = statistics.median(returned[1:])
    ready_doubtful = unreliable(summary(ready[1:]))
    returned_doubtful = unreliable(summary(returned[1:]))
    clocks["unreliable"] = any([ready_doubtful, returned_doubtful])
    return clocks

def torch_clocks(device, sizes):
    # PREDICTION (a): on a GPU torch.matmul returns once the kernel is queued: a clock read
    # then times the launch (~10 us), not the work (~1 ms), and claims ~100x the compute
    # roof. A CPU has no queue: ~1x.
    n = sizes.peak_n
    a = torch.randn(n, n, device=device, dtype=sizes.dtype)
    clocks = two_clocks(lambda: a @ a, lambda _: sync(device), sizes.reps)
    clocks["n"] = n
    return clocks

def first_calls(ceilings):
    # PREDICTION (b, c): the first call pays one-off costs (library handles, kernel loading;
    # fresh pages from the OS), dragging a loop's mean up, not its median. Shown on the
    # ceilings' own timings: the first call of the roof's matmul shape and of the copy,
    # then their samples, as a loop timed from its start would see them.
    first = {}
    for name in ("matmul", "copy"):
        timing = ceilings[name]
        first[name] = loop_stats([timing["first_s"]] + timing["samples_s"])
        first[name]["unreliable"] = timing["unreliable"]
    return first

def jax_clocks(device, sizes):
    # PREDICTION (d): JAX dispatches asynchronously on every backend, the CPU included:
    # without block_until_ready the clock stops at dispatch. Its first call also traces
    # and compiles.
    if device.type == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # JAX on the same device as torch
    try:
        import jax
    except ImportError:
        return dict(skipped="jax is not installed")
    platform = jax.devices()[0].platform
    n = sizes.peak_n
    dtype = dtype_name(sizes.dtype)
    expected = {"cuda": "gpu", "cpu": "cpu"}[device.type]
    if platform != expected:  # e.g. no jax CUDA plugin: a CPU-sized matmul
        n = 1024
        dtype = "float32"
    x = jax.random.normal(jax.random.key(0), (n, n), dtype)
    matmul = jax.jit(lambda x: x @ x)
    clocks = two_clocks(lambda: matmul(x), lambda y: y.block_until_ready(), sizes.reps)
    return dict(clocks, platform=platform, n=n, version=jax.__version__)

def report_discipline(discipline, peak, roofs_unreliable):
    clocks = discipline["torch"]
    n = clocks["n"]
    claimed = 2 * n**3 / clocks["returned_s"] / peak
    claimed_doubtful = any([clocks["unreliable"], roofs_unreliable])
    print(f"  (a) {n}^3 matmul: the call returns after {si(clocks['returned_s'], 's')}, its"
          f" result is ready after {si(clocks['warm_median_s'], 's')} (measured)"
          + mark(clocks["unreliable"]))
    print(f"      a clock read at return claims {claimed:.3g}x the compute roof (derived)"
          + mark(claimed_doubtful))
    for name, first in discipline["first"].items():
        ratio = first["first_s"] / first["warm_median_s"]
        print(f"  (b) {name:<6} first call {si(first['first_s'], 's'):>9} (measured)"
              f" = {ratio:.1f}x a warm one (derived)" + mark(first["unreliable"]))
        print(f"  (c) {name:<6} a loop timed from it: mean {si(first['loop_mean_s'], 's')},"
              f" median {si(first['loop_median_s'], 's')} (measured)"
              + mark(first["unreliable"]))
    jax_result = discipline["jax"]
    if "skipped" in jax_result:
        print(f"  (d) JAX: skipped - {jax_result['skipped']}")
        return
    returned = si(jax_result["returned_s"], "s")
    ready = si(jax_result["warm_median_s"], "s")
    first = si(jax_result["first_s"], "s")
    ratio = jax_result["first_s"] / jax_result["warm_median_s"]
    mean = si(jax_result["loop_mean_s"], "s")
    median = si(jax_result["loop_median_s"], "s")
    doubtful = mark(jax_result["unreliable"])
    print(f"  (d) JAX on {jax_result['platform']}, {jax_result['n']}^3 matmul: without"
          f" block_until_ready {returned}, with it {ready} (measured)" + doubtful)
    print(f"      first call (trace + compile) {first} (measured) = {ratio:.0f}x a warm"
          f" one (derived); a loop from it: mean {mean}, median {median} (measured)"
          + doubtful)

# 5. The figure

COLORS = {"compute": "tab:red", "bandwidth": "tab:blue", "overhead": "tab:gray"}

def figure(path, ops, ceilings, machine):
    """The two roofs and every op at its measured FLOP/s, numbered; the numbers are
    listed beside the plot, so neighbouring labels never overprint."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return "figure skipped: matplotlib is not installed"
    plt.switch_backend("Agg")
    peak = ceilings["peak_flops"]
    bandwidth = ceilings["bandwidth_bytes_per_s"]
    ridge = peak / bandwidth
    by_intensity = sorted(ops.values(), key=lambda op: op["intensity"])
    left = min(by_intensity[0]["intensity"], ridge) / 2
    right = max(by_intensity[-1]["intensity"], ridge) * 2
    fig, (ax, legend) = plt.subplots(1, 2, figsize=(12, 6),
                                     gridspec_kw=dict(width_ratios=[2.2, 1]))
    ax.loglog([left, ridge, right], [left * bandwidth, peak, peak], "k-", lw=2)
    ax.axvline(ridge, color="k", ls=":", lw=1)
    lines = []
    for number, op in enumerate(by_intensity, start=1):
        point = (op["intensity"], op["achieved_flops"])
        color = COLORS[op["measured"]]
        ax.scatter(*point, color=color, zorder=3)
        offset = (5, 5)  # neighbours alternate above-right and below-right
        if number % 2 == 0:
            offset = (5, -11)
        ax.annotate(str(number), point, fontsize=8, color=color, xytext=offset,
                    textcoords="offset points")
        text = f"{number:>2}  {op['label']}: {op['measured']}-bound"
        if op["unreliable"]:
            text += f", {BUSY}"
        lines.append((text, color))
    ax.set_xlabel("arithmetic intensity (FLOP / byte, counted)")
    ax.set_ylabel("achieved FLOP/s (measured)")
    fig.suptitle(f"The roofline of {machine}: roofs {si(peak, 'FLOP/s')},"
                 f" {si(bandwidth, 'B/s')}, ridge {ridge:.3g} FLOP/B (measured)")
    legend.axis("off")
    legend.set_title("the ops, in order of intensity: regime measured", fontsize=9, loc="left")
    for row, (text, color) in enumerate(lines):
        legend.text(0, 1 - row / 14, text, color=color, fontsize=8, family="monospace",
                    va="top", transform=legend.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)

# The machine, the flags, the run

def describe_gpu(device):
    props = torch.cuda.get_device_properties(device)
    cache_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    reference = {}
    for gpu, numbers in DATASHEET.items():
        if gpu in props.name:
            reference = numbers
    return dict(type="cuda", name=props.name, memory_bytes=props.total_memory,
                cache_bytes=cache_bytes, reference=reference)

def describe_cpu():
    cpuinfo = Path("/proc/cpuinfo")
    llc = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")  # e.g. "32768K"
    name = "CPU"
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":")[1].strip()
                break
    cache_bytes = 2**25
    if llc.exists():
        cache_bytes = int(llc.read_text().strip("K\n")) * 1024
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return dict(type="cpu", name=name, threads=torch.get_num_threads(),
                memory_bytes=memory_bytes, cache_bytes=cache_bytes, reference={},
                keeps_freed_memory=keep_freed_memory())

def keep_freed_memory():
    """glibc hands a big tensor fresh pages from the OS on every call, and touching them
    costs more than a vector add: ask it to keep freed memory, as a GPU allocator does."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        no_mmap = libc.mallopt(-4, 0)           # M_MMAP_MAX = 0: no big blocks via mmap
        no_trim = libc.mallopt(-1, 2**30)       # M_TRIM_THRESHOLD: keep 1 GB when freed
    except (OSError, AttributeError):           # not glibc (macOS, musl)
        return False
    return no_mmap == 1 and no_trim == 1

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
    parser = argparse.ArgumentParser(description="Section 13.1: the roofline and the regimes")
    parser.add_argument("--quick", action="store_true", help="a few seconds (the tests' run)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=output_path, help="write every measured number here")
    parser.add_argument("--out", type=output_path, default=Path("out"),
                        help="folder for the figure")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: PyTorch sees no CUDA GPU here; run with --device cpu")
    if args.json is not None:
        if args.json.is_dir():
            sys.exit(f"error: --json {args.json}: is a folder, not a file")
        check_writable("--json", args.json.parent)
    check_writable("--out", args.out)
    use_gpu = args.device != "cpu" and torch.cuda.is_available()
    args.device = torch.device("cpu")
    if use_gpu:
        args.device = torch.device("cuda", 0)
    return args

def main():
    args = parse_args()
    device = args.device
    if device.type == "cuda":
        machine = describe_gpu(device)
    else:
        machine = describe_cpu()
    jax_version = "not installed"
    for dist in importlib.metadata.distributions(name="jax"):
        jax_version = dist.version
    sizes = sizes_for(device, args.quick, machine["cache_bytes"])
    run_kind = "full"
    if args.quick:
        run_kind = "--quick"
    print(f"device: {machine['name']} ({device.type}), memory"
          f" {si(machine['memory_bytes'], 'B')}, last-level cache"
          f" {si(machine['cache_bytes'], 'B')}, keeps freed memory"
          f" {machine.get('keeps_freed_memory', True)}")
    print(f"torch {torch.__version__}, jax {jax_version}; {run_kind}"
          f" sizes, matmuls in {dtype_name(sizes.dtype)}, other ops in float32,"
          f" {sizes.reps} samples per measurement, inputs rotated past the cache")

    print(f"\n1. The two ceilings (measured: median of {sizes.reps} samples, min-max; on a"
          f" GPU each roof sample is a burst after {BURST_GAP_S} s idle)")
    ceilings = measure_ceilings(device, sizes, machine["reference"])
    report_ceilings(ceilings, machine["reference"])
    peak = ceilings["peak_flops"]
    bandwidth = ceilings["bandwidth_bytes_per_s"]

    print("\n2. A dozen ops on the roofline, each classified from its measurement (FLOPs"
          " and bytes counted, time measured, the rest derived)")
    ops = place_ops(device, sizes, ceilings)
    report_ops(ops)

    print("\n3. The overhead floor: the fixed cost of a call")
    overhead = overhead_sweep(device, sizes, bandwidth)
    report_overhead(overhead, ceilings["unreliable"])

    print("\n4. Measurement discipline, shown by running it")
    discipline = dict(torch=torch_clocks(device, sizes), first=first_calls(ceilings),
                      jax=jax_clocks(device, sizes))
    report_discipline(discipline, peak, ceilings["unreliable"])

    title_machine = f"{machine['name']} ({dtype_name(sizes.dtype)} matmuls)"
    figure_path = figure(args.out / "01_roofline.png", ops, ceilings, title_machine)
    print(f"\n5. Figure: {figure_path}")

    # Self-checks, correctness only: timing is reported above and never decides the exit.
    checks = dict(ceilings_positive=peak > 0 and bandwidth > 0,
                  copy_is_exact=ceilings["copy_is_exact"])
    if args.json is not None:
        device_info = dict(machine, torch=torch.__version__, jax=jax_version)
        sizes_info = {name: str(value) for name, value in vars(sizes).items()}
        result = dict(lesson="01_roofline", device=device_info, quick=args.quick,
                      sizes=sizes_info, ceilings=ceilings, ops=ops, overhead=overhead,
                      discipline=discipline, figure=figure_path, checks=checks)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"JSON: {args.json}")
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        sys.exit(f"error: self-check failed: {', '.join(failed)}")

if __name__ == "__main__":
    main()
