"""01_roofline.py - Section 13.1: the roofline map, the three regimes, and how to measure.

An op waits on arithmetic, on memory, or - when it is small - on the fixed cost of asking
for it. This lesson predicts which for each op, then measures it on this machine:
1. the two ceilings: peak matmul FLOP/s (bf16 tensor cores on a GPU, fp32 on a CPU) and a
   large copy's bytes/s; their ratio is the ridge point;
2. a dozen ops from a vector add to a large matmul: FLOPs and bytes counted on paper, the
   regime the roofline predicts, then the measured time and the regime it shows;
3. the overhead floor: a vector add from 64 elements up, and the size at which moving its
   bytes starts to cost more than asking for it;
4. measurement discipline, run: no synchronize, the first call, mean against median, JAX
   with and without block_until_ready, and what a fresh output's pages cost;
5. the figure: out/01_roofline.png, every op on the roofline.

Copy model_torch.py beside it (its table of GPU datasheets gives the reference row); jax
and matplotlib are optional.
  python 01_roofline.py                 # CUDA if present (cuda:0), else the CPU
  python 01_roofline.py --device cpu    # about half a minute on 2 idle cores
  python 01_roofline.py --quick         # seconds: what the tests run
One GPU is all it uses. Expect on a datacenter GPU hundreds of TFLOP/s in bf16, a few
TB/s, a ridge near 200 FLOP/byte; on a small CPU ~100 GFLOP/s, tens of GB/s, a ridge of a
few.
Every number is labelled measured, derived (arithmetic on measured numbers) or reference
(a datasheet). A timing is the median of its samples with their [min-max]; what it is
compared with is timed in turn with it (A, B, A, B, ...). On a busy machine the run says
so and marks what it measured then.
"""

import argparse
import importlib.metadata
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from model_torch import datasheet


@dataclass
class Sizes:
    """The CPU's sizes (about half a minute on 2 cores); the GPU and --quick rows change
    a few. The matmuls' dtype and the cache to rotate past are this machine's."""
    peak_n: int = 2048          # the compute roof's matmul is n^3; the rest scale with it
    copy: int = 2**25           # fp32 elements of the memory roof's copy: 128 MiB a side
    vector: int = 2**22         # elements of the elementwise ops, norms and sums: 16 MiB
                                # in fp32, under the 32 MiB above which glibc gives each
                                # new output fresh pages from the OS (4e: what that costs)
    tiny: int = 16              # a matmul small enough to be all overhead
    decode_tokens: int = 1      # tokens against the decode matmul's (2 peak_n)^2 weight
    sweep: range = range(6, 23, 2)  # the overhead sweep's vector adds: 2**p elements
    fresh: int = 2**24          # part 4e's vector add: 64 MiB outputs
    reps: int = 7               # timed samples of each measurement
    target_s: float = 2e-2      # a sample repeats its call until it lasts about this long
    warmup_s: float = 0.0       # untimed load first (a GPU raises its clocks under load)
    dtype: torch.dtype = torch.float32  # the matmuls' (a GPU: bf16, or fp16 before sm80)
    cache_bytes: int = 2**25    # last-level cache: each op's inputs rotate past 3x it


# Well past a GPU's L2, and enough work to fill the chip (its vector: gpu_vector).
GPU = dict(peak_n=8192, tiny=64, decode_tokens=16, fresh=2**26, reps=20, target_s=5e-3,
           warmup_s=0.05)
QUICK = dict(peak_n=512, copy=2**22, vector=2**20, sweep=range(6, 19, 3), reps=3,
             target_s=5e-4)


def gpu_vector(memory_bytes):
    """The GPU's vector length: 2**28 elements (1 GiB in fp32), halved until 32 bytes an
    element fit the card: an add's two inputs, a second copy of them to rotate to, its
    output, and room for the allocator's cached blocks."""
    elements = 2**28
    while 32 * elements > memory_bytes:
        elements = elements // 2
    return elements


def has_bf16_tensor_cores(device):
    """bf16 tensor cores came with compute capability 8.0 (A100, RTX 30xx); a T4 (7.5)
    or a V100 (7.0) has fp16 tensor cores only."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def matmul_dtype(device):
    """The compute roof's format: bf16, as training uses, on a GPU with bf16 tensor
    cores; fp16 on one without; fp32 on a CPU, which has no tensor cores."""
    if device.type == "cpu":
        return torch.float32
    if has_bf16_tensor_cores(device):
        return torch.bfloat16
    return torch.float16


def sizes_for(device, quick, machine):
    """The CPU's defaults, or the GPU's row with its vector fitted to the card; --quick
    smaller (on a GPU: fewer samples only)."""
    if device.type == "cpu":
        sizes = Sizes(cache_bytes=machine["cache_bytes"])
        if quick:  # a smoke run: rotating past 4 MiB at most makes its inputs quickly
            sizes = replace(sizes, **QUICK, cache_bytes=min(sizes.cache_bytes, 2**22))
        return sizes
    vector = gpu_vector(machine["memory_bytes"])
    sweep = range(6, vector.bit_length(), 2)  # 64 elements up to the vector
    sizes = Sizes(**GPU, vector=vector, copy=vector, sweep=sweep,
                  dtype=matmul_dtype(device), cache_bytes=machine["cache_bytes"])
    if quick:
        sizes.reps = 5
    return sizes


# 1. The two ceilings

RIDGE_RANGE = {"cuda": (50, 500), "cpu": (1, 50)}  # FLOP/byte, as the prediction says


def measure_roofs(device, sizes, reference):
    """Prediction: a big square matmul does ~n/3 FLOPs per byte, far right of any ridge,
    so it runs at the compute roof; a copy does no arithmetic, so it runs at the memory
    roof. A GPU (tensor cores): 60-100% of its datasheet's dense bf16 peak and 70-100%
    of its bandwidth (a datasheet multiplies clocks and units; no kernel keeps all of
    them busy), a ridge of 50-500 FLOP/byte (~200 on a datacenter card). A CPU (fp32, no
    tensor cores): tens of GFLOP/s to a few TFLOP/s, 5-200 GB/s, a ridge of 1-50
    FLOP/byte: a CPU has few FLOPs for each byte its memory bus brings. One matmul shape
    can tile the chip unevenly: three are tried, and the fastest is the roof."""
    low, high = RIDGE_RANGE[device.type]
    kind = "GPU"
    if device.type == "cpu":
        kind = "CPU"
    print(f"  predicted: a ridge of {low}-{high} FLOP/byte on a {kind}; with a datasheet,"
          " roofs at 60-100% (compute) and 70-100% (memory) of it")
    n = sizes.peak_n
    shapes = [(n, n, n), (n // 2, n // 2, n // 2), (n, n // 2, 2 * n)]
    calls = []
    for m, k, n_out in shapes:
        shapes_in = [(m, k), (k, n_out)]
        call = rotating(torch.matmul, shapes_in, sizes.dtype, device, sizes.cache_bytes)
        calls.append(call)
    matmuls = {}
    for (m, k, n_out), timing in zip(shapes, per_call(calls, device, sizes)):
        timing["flops"] = 2 * m * k * n_out
        timing["flop_per_s"] = timing["flops"] / timing["median_s"]
        matmuls[f"{m}x{k}x{n_out}"] = timing
    fastest = max(matmuls, key=lambda shape: matmuls[shape]["flop_per_s"])
    src = torch.randn(sizes.copy, device=device)
    dst = torch.empty_like(src)
    copy = per_call([lambda: dst.copy_(src)], device, sizes)[0]
    copy["bytes_moved"] = 2 * src.numel() * src.element_size()  # read once, written once
    peak = matmuls[fastest]["flop_per_s"]
    bandwidth = copy["bytes_moved"] / copy["median_s"]
    ridge = peak / bandwidth
    of_datasheet = None
    if reference is not None:
        of_datasheet = dict(compute=peak / reference["bf16_flops"],
                            bandwidth=bandwidth / reference["bandwidth"])
    return dict(peak_flops=peak, bandwidth_bytes_per_s=bandwidth,
                ridge_flop_per_byte=ridge, dtype=str(sizes.dtype).removeprefix("torch."),
                matmul_shape=fastest, matmul=matmuls[fastest], matmuls=matmuls, copy=copy,
                first_matmul=matmuls[f"{n}x{n}x{n}"],  # the first this process ran
                copy_is_exact=torch.equal(dst, src), of_datasheet=of_datasheet,
                prediction_held=roofs_held(device.type, ridge, of_datasheet))


def roofs_held(device_type, ridge, of_datasheet):
    """The ridge in its range for this kind of device; with a datasheet, each roof in
    its share of the datasheet's number."""
    low, high = RIDGE_RANGE[device_type]
    held = [low <= ridge <= high]
    if of_datasheet is not None:
        held.append(0.6 <= of_datasheet["compute"] <= 1.0)
        held.append(0.7 <= of_datasheet["bandwidth"] <= 1.0)
    return all(held)


def report_roofs(roofs, machine, busy):
    matmul = roofs["matmul"]
    copy = roofs["copy"]
    slowest = matmul["flops"] / matmul["max_s"]
    fastest = matmul["flops"] / matmul["min_s"]
    rates = si_spread(roofs["peak_flops"], slowest, fastest, "FLOP/s")
    print(f"  measured: compute roof {rates}, {roofs['dtype']} matmul"
          f" {roofs['matmul_shape']}, the fastest of 3 shapes" + mark(busy))
    slowest = copy["bytes_moved"] / copy["max_s"]
    fastest = copy["bytes_moved"] / copy["min_s"]
    rates = si_spread(roofs["bandwidth_bytes_per_s"], slowest, fastest, "B/s")
    copied = si(copy["bytes_moved"] / 2, "B")
    print(f"  measured: memory roof {rates}, a copy of {copied}, each byte read once and"
          " written once" + mark(busy))
    ridge = num(roofs["ridge_flop_per_byte"])
    print(f"  derived: ridge point {ridge} FLOP/byte = compute roof / memory roof: an op"
          " doing fewer FLOPs per byte it moves waits on memory" + mark(busy))
    reference = machine["reference"]
    what = f"ridge {ridge} FLOP/byte"
    if machine["type"] == "cuda" and reference is None:
        print(f"  reference: no datasheet row for {machine['name']}: roofs measured only")
    if reference is not None:
        # model_torch.DATASHEETS: NVIDIA's datasheets and whitepapers, by exact product
        flops = si(reference["bf16_flops"], "FLOP/s")
        print(f"  reference: {machine['name']} datasheet: {flops} dense bf16,"
              f" {si(reference['bandwidth'], 'B/s')}")
        compute = roofs["of_datasheet"]["compute"]
        memory = roofs["of_datasheet"]["bandwidth"]
        shares = f"roofs {compute:.0%} and {memory:.0%} of the datasheet"
        print(f"  derived: the measured {shares}" + mark(busy))
        what += f", {shares}"
    say_held(roofs["prediction_held"], what, busy)


# 2. A dozen ops on the roofline: counted and predicted on paper, then measured

@dataclass
class Op:
    label: str
    fn: object
    shapes: list        # of its inputs
    dtype: torch.dtype
    flops: int          # counted on paper
    reads: int          # bytes: each input read once
    writes: int         # bytes: each output written once


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
    ops["vector_add_tiny"] = Op("vector add 1k", torch.add, [(1024,), (1024,)], f32,
                                flops=1024, reads=2 * 1024 * v, writes=1024 * v)
    ops["vector_add"] = Op(f"vector add {si(n)}", torch.add, [(n,), (n,)], f32,
                           flops=n, reads=2 * n * v, writes=n * v)
    ops["scale"] = Op(f"scale x*2 {si(n)}", lambda x: x * 2.0, [(n,)], f32,
                      flops=n, reads=n * v, writes=n * v)
    # GELU: ~8 FLOPs per element by convention (the erf counted as one)
    ops["gelu"] = Op(f"GELU {si(n)}", F.gelu, [(n,)], f32,
                     flops=8 * n, reads=n * v, writes=n * v)
    # softmax, per element: max, subtract, exp, sum, divide
    ops["softmax"] = Op(f"softmax {si(rows)} x 1024", lambda x: torch.softmax(x, dim=-1),
                        [(rows, 1024)], f32, flops=5 * n, reads=n * v, writes=n * v)
    # layernorm, per element: mean, subtract, square, sum, normalise, gain, bias (+1)
    ops["layernorm"] = Op(f"layernorm {si(rows)} x 1024",
                          lambda x, w, b: F.layer_norm(x, w.shape, w, b),
                          [(rows, 1024), (1024,), (1024,)], f32,
                          flops=8 * n, reads=(n + 2 * 1024) * v, writes=n * v)
    ops["sum"] = Op(f"sum {si(n)}", torch.sum, [(n,)], f32,
                    flops=n, reads=n * v, writes=v)
    ops["matmul_tiny"] = Op(f"matmul {t}^3", torch.matmul, [(t, t), (t, t)], mm,
                            flops=2 * t**3, reads=2 * t * t * e, writes=t * t * e)
    ops["matmul_decode"] = Op(f"matmul {tokens} tok x {d}^2", torch.matmul,
                              [(tokens, d), (d, d)], mm, flops=2 * tokens * d * d,
                              reads=(tokens * d + d * d) * e, writes=tokens * d * e)
    ops["bmm_small"] = Op(f"bmm {si(batch)} x 64^3", torch.bmm,
                          [(batch, 64, 64), (batch, 64, 64)], mm, flops=2 * batch * 64**3,
                          reads=2 * batch * 64 * 64 * e, writes=batch * 64 * 64 * e)
    ops["matmul_medium"] = Op(f"matmul {m}^3", torch.matmul, [(m, m), (m, m)], mm,
                              flops=2 * m**3, reads=2 * m * m * e, writes=m * m * e)
    ops["matmul_large"] = Op(f"matmul {p}x{m}x{d}", torch.matmul, [(p, m), (m, d)], mm,
                             flops=2 * p * m * d, reads=(p * m + m * d) * e,
                             writes=p * d * e)
    return ops


# Eager PyTorch spends a few microseconds of CPU on an op before its work starts
# (pytorch/pytorch#41383); an op whose roofline time is shorter waits on that instead.
CALL_S = 5e-6


def on_paper(op, peak, bandwidth):
    """An op's row before it runs: counted, and placed on the roofline. Its predicted
    regime is the roofline's (intensity against the ridge), unless the roofline's time
    is under one call's cost: then it is overhead-bound, which intensity cannot show."""
    op_bytes = op.reads + op.writes
    intensity = op.flops / op_bytes
    roofline_s = max(op.flops / peak, op_bytes / bandwidth)
    by_intensity = "bandwidth-bound"
    if intensity >= peak / bandwidth:
        by_intensity = "compute-bound"
    predicted = by_intensity
    if roofline_s < CALL_S:
        predicted = "overhead-bound"
    return dict(label=op.label, flops=op.flops, bytes=op_bytes, reads=op.reads,
                writes=op.writes, intensity=intensity, roofline_s=roofline_s,
                bound_flops=min(peak, intensity * bandwidth), by_intensity=by_intensity,
                predicted=predicted)


def report_on_paper(rows, ridge):
    print("  predicted (FLOPs and bytes counted; roofline time and regime derived from"
          " the roofs):")
    header = [f"{'op':<24}", f"{'FLOPs':>7}", f"{'bytes':>7}", f"{'FLOP/byte':>9}",
              f"{'roofline time':>13}", " predicted regime"]
    print("  " + " ".join(header))
    for row in rows.values():
        columns = [f"{row['label']:<24}",
                   f"{si(row['flops']):>7}",
                   f"{si(row['bytes']):>7}",
                   f"{num(row['intensity']):>9}",
                   f"{si(row['roofline_s'], 's'):>13}",
                   f" {row['predicted']}"]
        if row["predicted"] != row["by_intensity"]:
            columns.append(f"(by FLOP/byte: {row['by_intensity']})")
        print("  " + " ".join(columns))
    print("  legend: roofline time = the larger of FLOPs / compute roof and bytes /"
          " memory roof; the")
    print(f"  regime by FLOP/byte against the ridge ({num(ridge)}), but overhead-bound"
          " where that time is")
    print(f"  under one call's ~{si(CALL_S, 's')}, eager PyTorch's cost per op: a regime"
          " the roofline cannot see")


FLAT = 2         # overhead-bound: time under 2x the same call's on tiny inputs
NEAR_ROOF = 0.5  # an op at >= 50% of its roofline bound is near its roof


def measure_ops(ops, rows, device, sizes, peak, bandwidth):
    """Prediction: each op lands in the regime on_paper gave it. Elementwise ops, norms
    and sums do 1-8 FLOPs per element: a fraction of a FLOP per byte, left of any ridge,
    so bandwidth-bound at 50-100% of the memory roof. A matmul's intensity grows with
    its smallest dimension: a few tokens against a big weight, or 64x64 blocks, stay
    left of a GPU's ridge (~200) and may cross a CPU's (a few); square matmuls of
    thousands are compute-bound everywhere. The 1k vector add and the tiny matmul are
    overhead-bound: their time does not shrink with their inputs. So each op is timed in
    turn with the same call on inputs cut to at most 8 per dimension: time flat in size
    is overhead."""
    print("  predicted: every op measures in its predicted regime (the table above)")
    placed = {}
    for key, op in ops.items():
        full = rotating(op.fn, op.shapes, op.dtype, device, sizes.cache_bytes)
        small = tiny_shapes(op.shapes)
        tiny = rotating(op.fn, small, op.dtype, device, sizes.cache_bytes)
        timing, tiny_timing = per_call([full, tiny], device, sizes)
        placed[key] = measured(rows[key], timing, tiny_timing, peak, bandwidth)
    return dict(rows=placed, prediction_held=ops_held(placed))


def ops_held(rows):
    """Every op measured in its predicted regime, beyond the noise: a regime read from a
    ratio within noise confirms nothing."""
    held = []
    for row in rows.values():
        held.append(row["measured"] == row["predicted"])
        held.append(row["clear"])
    return all(held)


def tiny_shapes(shapes):
    """The same inputs cut to at most 8 per dimension: the call is there, the work is
    not."""
    return [tuple(min(dim, 8) for dim in shape) for shape in shapes]


def measured(row, timing, tiny_timing, peak, bandwidth):
    """An op's row completed by its measurement, and its regime classified from it."""
    time_s = timing["median_s"]
    row = dict(row, time_s=time_s, min_s=timing["min_s"], max_s=timing["max_s"],
               samples_s=timing["samples_s"], tiny_samples_s=tiny_timing["samples_s"],
               tiny_time_s=tiny_timing["median_s"])
    row["achieved_flops"] = row["flops"] / time_s
    row["achieved_bytes_per_s"] = row["bytes"] / time_s
    row["fraction_of_bound"] = row["achieved_flops"] / row["bound_flops"]
    row["size_ratio"] = ratio(timing["samples_s"], tiny_timing["samples_s"])
    compute = row["achieved_flops"] / peak  # its share of each roof
    memory = row["achieved_bytes_per_s"] / bandwidth
    row["measured"] = classify(row["size_ratio"]["median"], compute, memory)
    row["clear"] = beyond_noise(row["size_ratio"], FLAT)  # the overhead test, past noise
    row["near_roof"] = None
    if row["measured"] != "overhead-bound":
        row["near_roof"] = row["fraction_of_bound"] >= NEAR_ROOF
    return row


def classify(size_ratio, compute_share, bandwidth_share):
    """The regime from the measurement. Overhead first: time flat in size (under FLAT x
    the same call's on tiny inputs). Else the roof the op comes nearer to, each as a
    share of its roof."""
    if size_ratio < FLAT:
        return "overhead-bound"
    if compute_share >= bandwidth_share:
        return "compute-bound"
    return "bandwidth-bound"


def report_ops(result, device_type, reps, busy):
    print(f"  measured: median [min-max] of {reps} samples, each op's timed in turn with"
          " its tiny-input call's; the rest derived" + mark(busy))
    header = [f"{'op':<24}", f"{'time':>21}", f"{'FLOP/s':>7}", f"{'bytes/s':>7}",
              f"{'% of roof':>9}", f"{'time / tiny-input time':>22}", "held",
              " measured regime"]
    print("  " + " ".join(header))
    misses = []
    for key, row in result["rows"].items():
        held = "yes"
        if row["measured"] != row["predicted"] or not row["clear"]:
            held = "no"
            misses.append(row["label"])
        regime = row["measured"]
        if row["near_roof"] is False:
            regime += ", far below its roof"
        if not row["clear"]:
            regime += " (within noise)"
        columns = [f"{row['label']:<24}",
                   f"{si_spread(row['time_s'], row['min_s'], row['max_s'], 's'):>21}",
                   f"{si(row['achieved_flops']):>7}",
                   f"{si(row['achieved_bytes_per_s']):>7}",
                   f"{percent_of_roof(row):>9}",
                   f"{ratio_text(row['size_ratio']):>22}",
                   f"{held:>4}",
                   f" {regime}"]
        print("  " + " ".join(columns))
    print("  legend: % of roof = FLOP/s over the roofline's bound at this FLOP/byte"
          f" (near its roof from {NEAR_ROOF:.0%});")
    print("  time / tiny-input time = over the same call's on inputs cut to at most 8 per"
          f" dimension; under {FLAT}:")
    print("  time flat in size, overhead-bound; else the regime of the roof it comes"
          " nearer to")
    report_over_the_roof(result["rows"], device_type, busy)
    what = f"{len(result['rows']) - len(misses)} of {len(result['rows'])} ops as predicted"
    if misses:
        what += f"; not (or within noise): {', '.join(misses)}"
    say_held(result["prediction_held"], what, busy)


def percent_of_roof(row):
    """'87%', or '115%*' above the roof: a footnote says why it can be."""
    text = f"{row['fraction_of_bound']:.0%}"
    if row["fraction_of_bound"] > 1:
        text += "*"
    return text


def write_allocate_limit(reads, writes):
    """How far above the copy's memory roof an op can run on a CPU. A CPU reads a line
    before it writes it (write-allocate), so a written byte moves twice: the copy moves
    3 bytes for the 2 it counts, an op reads + 2 x writes for its reads + writes. Over
    the copy's rate: an add 1.125x, a scale 1x, an op that only reads 1.5x."""
    return 1.5 * (reads + writes) / (reads + 2 * writes)


def report_over_the_roof(rows, device_type, busy):
    """A footnote for each op printed above 100% of its roof, and on a CPU what
    write-allocate is."""
    write_allocated = False
    for key, row in rows.items():
        if row["fraction_of_bound"] > 1:
            print("  * " + over_the_roof(key, row, device_type, busy))
            if row["by_intensity"] == "bandwidth-bound":
                write_allocated = device_type == "cpu"
    if write_allocated:
        print("  write-allocate: a CPU reads a line before it writes it, so the copy that"
              " sets the memory roof moves")
        print("  3 bytes for the 2 it counts, an op reads + 2 x writes for its reads +"
              " writes: an add can reach 112.5%,")
        print("  a scale 100%, an op that only reads 150%:"
              " 1.5 x (reads + writes) / (reads + 2 x writes)")


def over_the_roof(key, row, device_type, busy):
    """The footnote of an op above 100% of its roof: why it can be."""
    text = f"{row['label']} at {row['fraction_of_bound']:.0%}: "
    if key in ["matmul_medium", "matmul_large"]:  # two of the shapes measure_roofs tries
        return text + "a shape the compute roof tried, timed again: the run-to-run spread"
    if row["by_intensity"] == "compute-bound":
        return text + "faster than every shape the compute roof tried"
    if device_type == "cuda" and row["writes"] < row["reads"]:
        return text + ("it writes fewer bytes than it reads; half a copy's bytes are"
                       " writes, and memory loses time turning its bus around between"
                       " the two")
    if device_type == "cuda":
        return text + "as many bytes written as read, like the copy: the run-to-run spread"
    limit = write_allocate_limit(row["reads"], row["writes"])
    text += f"write-allocate (below) allows up to {limit:.1%}"
    if row["fraction_of_bound"] <= limit:
        return text
    if busy:
        return text + "; beyond that: not a finding (machine busy)"
    return text + "; beyond that, a cache served some of its bytes"


# 3. The overhead floor

def overhead_sweep(device, sizes, bandwidth):
    """Prediction: a vector add of 64 elements costs what one of thousands does - the
    fixed cost of a call (Python, PyTorch's dispatcher, on a GPU the kernel launch):
    1-20 us on either device. Time grows with size once moving the bytes takes longer
    than that. On a CPU the same thread dispatches and then adds: time ~ floor + bytes /
    bandwidth, doubling at floor x memory roof bytes per call. On a GPU the next call is
    dispatched while this kernel runs: time ~ max(floor, kernel), doubling near twice
    that. Either way within 0.5-4x of floor x memory roof (on a CPU, inputs small enough
    to sit in its caches move faster than the memory roof). The sizes are timed in turn:
    a slow spell slows them all."""
    print(f"  predicted: a floor of 1-20 us per call; time doubles at 0.5-4x floor x"
          f" memory roof ({si(bandwidth, 'B/s')})")
    calls = []
    for p in sizes.sweep:
        shapes_in = [(2**p,), (2**p,)]
        call = rotating(torch.add, shapes_in, torch.float32, device, sizes.cache_bytes)
        calls.append(call)
    sweep = []
    for p, timing in zip(sizes.sweep, per_call(calls, device, sizes)):
        sweep.append(dict(elements=2**p, bytes=3 * 4 * 2**p, time_s=timing["median_s"],
                          min_s=timing["min_s"], max_s=timing["max_s"]))
    floor = statistics.median(point["time_s"] for point in sweep[:3])
    doubled = crossing(sweep, 2 * floor)
    predicted = floor * bandwidth
    held = [1e-6 <= floor <= 20e-6, doubled["bytes"] is not None]
    if doubled["clear"]:  # a doubling point within noise is not judged
        held.append(0.5 <= doubled["bytes"] / predicted <= 4)
    return dict(floor_s=floor, sweep=sweep, crossover_bytes=doubled["bytes"],
                crossover_clear=doubled["clear"], predicted_crossover_bytes=predicted,
                prediction_held=all(held))


def crossing(sweep, time_s):
    """Bytes per call where the sweep's median time first exceeds time_s, interpolated
    log-log between the two sizes around it; clear when beyond the noise: every sample
    of the size before it under time_s, every sample of the size after it over. No bytes
    if the sweep never gets there, or starts above it."""
    if sweep[0]["time_s"] > time_s:
        return dict(bytes=None, clear=False)
    for before, after in zip(sweep, sweep[1:]):
        if after["time_s"] > time_s:
            # where time_s lies between the two times, on a log scale: 0 before, 1 after
            rise = math.log(after["time_s"] / before["time_s"])
            fraction = math.log(time_s / before["time_s"]) / rise
            crossed = before["bytes"] * (after["bytes"] / before["bytes"]) ** fraction
            clear = before["max_s"] < time_s < after["min_s"]
            return dict(bytes=crossed, clear=clear)
    return dict(bytes=None, clear=False)


def report_overhead(overhead, busy):
    print("  measured: vector add, time per call against size (median [min-max])"
          + mark(busy))
    for point in overhead["sweep"]:
        elements = si(point["elements"])
        per_call_bytes = si(point["bytes"], "B")
        time_text = si_spread(point["time_s"], point["min_s"], point["max_s"], "s")
        print(f"  {elements:>10} elements {per_call_bytes:>9} per call {time_text:>22}")
    floor = si(overhead["floor_s"], "s")
    predicted = si(overhead["predicted_crossover_bytes"], "B")
    print(f"  derived: overhead floor {floor} per call, the median of the 3 smallest"
          f" sizes; x memory roof = {predicted}" + mark(busy))
    what = f"floor {floor}"
    doubled = overhead["crossover_bytes"]
    if doubled is None:
        print("  derived: time does not double within this sweep" + mark(busy))
        what += "; time never doubled"
    elif not overhead["crossover_clear"]:
        print(f"  derived: time doubles near {si(doubled, 'B')} per call" + mark(busy)
              + "  (within noise)")
        what += "; the doubling point within noise, not judged"
    else:
        times = num(doubled / overhead["predicted_crossover_bytes"])
        text = (f"  derived: time doubles at {si(doubled, 'B')} per call, {times}x floor"
                " x memory roof")
        if busy:
            print(text + mark(busy))
        else:
            print(text + ": below it a call costs its overhead, above it its bytes")
        what += f", doubling at {times}x floor x memory roof"
    say_held(overhead["prediction_held"], what, busy)


# 4. Measurement discipline, shown by running it

def two_clocks(call, wait, reps):
    """Each call timed twice: when it returns, and when its result is ready (after
    wait). The first call is kept: a loop with no warm-up starts with it."""
    returned = []
    ready = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        result = call()
        returned.append(time.perf_counter() - start)
        wait(result)
        ready.append(time.perf_counter() - start)
    return clocks_summary(returned, ready)


def clocks_summary(returned, ready):
    """A loop's two clocks: its first call, the warm calls' medians at return and when
    ready, the loop's mean and median, and per call ready / returned and first / warm.
    """
    warm_ready = ready[1:]
    first = [ready[0] for _ in warm_ready]
    return dict(first_s=ready[0], returned_s=statistics.median(returned[1:]),
                warm_median_s=statistics.median(warm_ready),
                loop_mean_s=statistics.fmean(ready),
                loop_median_s=statistics.median(ready),
                ready_over_returned=ratio(warm_ready, returned[1:]),
                first_over_warm=ratio(first, warm_ready),
                returned_samples_s=returned, ready_samples_s=ready)


def no_sync(device, sizes, peak):
    """Prediction (a): on a GPU torch.matmul returns once its kernel is queued: a clock
    read then times the launch (tens of us), not the work (~1.5 ms for 8192^3 in bf16),
    and claims more than the compute roof; the result is ready >5x later than the call
    returns. A CPU has no queue: the call returns with its result, ~1.0x."""
    if device.type == "cuda":
        print("  predicted (a): the matmul's result ready >5x later than its call"
              " returns")
    else:
        print("  predicted (a): the matmul's result ready as its call returns (~1.0x)")
    n = sizes.peak_n
    a = torch.randn(n, n, device=device, dtype=sizes.dtype)
    clocks = two_clocks(lambda: a @ a, lambda result: sync(device), sizes.reps)
    clocks["n"] = n
    clocks["claimed_over_roof"] = 2 * n**3 / clocks["returned_s"] / peak
    later = clocks["ready_over_returned"]["median"]
    clocks["prediction_held"] = later < 1.1
    if device.type == "cuda":
        clocks["prediction_held"] = later > 5
    return clocks


def report_no_sync(clocks, busy):
    print(f"  measured (a): {clocks['n']}^3 matmul, the call returns after"
          f" {si(clocks['returned_s'], 's')}, its result is ready after"
          f" {si(clocks['warm_median_s'], 's')} (medians)" + mark(busy))
    later = ratio_text(clocks["ready_over_returned"])
    print(f"  derived: ready / returned = {later}; a clock read at return claims"
          f" {num(clocks['claimed_over_roof'])}x the compute roof" + mark(busy))
    say_held(clocks["prediction_held"], f"ready / returned = {later}", busy)


def first_calls(roofs):
    """Prediction (b, c): the first call pays one-off costs - on a GPU the math
    library's handle and kernels (a first matmul 10-100x a warm one), on a CPU its
    threads and fresh pages (1.5-5x) - and it drags a loop's mean up, not its median.
    Shown on the roofs' own timings: the first matmul this process ran, and the first
    copy (into a destination never touched before), then their warm samples, as a loop
    timed from its start sees them."""
    print("  predicted (b, c): the first matmul slower than a warm one beyond the spread"
          " (a GPU 10-100x, a CPU 1.5-5x); a loop's mean above its median")
    first = {}
    for name, timing in [("matmul", roofs["first_matmul"]), ("copy", roofs["copy"])]:
        warm = timing["samples_s"]
        loop = [timing["first_s"]] + warm
        first[name] = dict(first_s=timing["first_s"], warm_median_s=timing["median_s"],
                           first_over_warm=ratio([timing["first_s"] for _ in warm], warm),
                           loop_mean_s=statistics.fmean(loop),
                           loop_median_s=statistics.median(loop))
    matmul = first["matmul"]
    held = [matmul["first_over_warm"]["min"] > 1,
            matmul["loop_mean_s"] > matmul["loop_median_s"]]
    first["prediction_held"] = all(held)
    return first


def report_first_calls(first, busy):
    for name in ["matmul", "copy"]:
        calls = first[name]
        costs = ratio_text(calls["first_over_warm"])
        print(f"  measured (b): {name:<6} first call {si(calls['first_s'], 's'):>9}, warm"
              f" {si(calls['warm_median_s'], 's'):>9}; derived: the first costs {costs}"
              " a warm one" + mark(busy, calls["first_over_warm"]))
        mean = si(calls["loop_mean_s"], "s")
        median = si(calls["loop_median_s"], "s")
        print(f"  derived (c):  {name:<6} a loop timed from that first call: mean {mean},"
              f" median {median}" + mark(busy))
    matmul = first["matmul"]
    what = (f"the first matmul costs {ratio_text(matmul['first_over_warm'])} a warm one;"
            f" loop mean {si(matmul['loop_mean_s'], 's')}, median"
            f" {si(matmul['loop_median_s'], 's')}")
    say_held(first["prediction_held"], what, busy)


JAX_PLATFORM = {"cuda": "gpu", "cpu": "cpu"}  # what jax calls the device torch calls this


def jax_clocks(device, sizes):
    """Prediction (d): JAX dispatches asynchronously on every backend, the CPU included:
    a jitted matmul's call returns once its work is queued, >5x before the result is
    ready, and only block_until_ready waits for it. The first call also traces and
    compiles: it is slower than a warm call beyond the spread."""
    print("  predicted (d): JAX's result ready >5x later than its call returns, on either"
          " device; its first call (trace + compile) slower than a warm one")
    if device.type == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # JAX on the device torch uses
    # JAX takes 75% of a GPU's memory when it starts unless told not to: leave it to torch
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
    except ImportError:
        print("  skipped (d): jax is not installed")
        return None
    platform = jax.devices()[0].platform
    n = sizes.peak_n
    dtype = str(sizes.dtype).removeprefix("torch.")
    if platform != JAX_PLATFORM[device.type]:  # e.g. jax without its CUDA plugin
        n = min(n, 1024)
        dtype = "float32"
        print(f"  JAX runs on {platform}, not beside torch: a {n}^3 {dtype} matmul there")
    x = jax.random.normal(jax.random.key(0), (n, n), dtype)
    matmul = jax.jit(lambda x: x @ x)
    clocks = two_clocks(lambda: matmul(x), lambda y: y.block_until_ready(), sizes.reps)
    clocks.update(platform=platform, n=n, dtype=dtype, version=jax.__version__)
    held = [clocks["ready_over_returned"]["median"] > 5,
            clocks["first_over_warm"]["min"] > 1]
    clocks["prediction_held"] = all(held)
    return clocks


def report_jax(clocks, busy):
    if clocks is None:
        return
    matmul = f"{clocks['n']}^3 {clocks['dtype']} matmul"
    returned = si(clocks["returned_s"], "s")
    ready = si(clocks["warm_median_s"], "s")
    print(f"  measured (d): JAX on {clocks['platform']}, {matmul}: without"
          f" block_until_ready {returned}, with it {ready}" + mark(busy))
    later = ratio_text(clocks["ready_over_returned"])
    first = ratio_text(clocks["first_over_warm"])
    print(f"  measured (d): first call (trace + compile) {si(clocks['first_s'], 's')};"
          f" derived: {first} a warm one" + mark(busy, clocks["first_over_warm"]))
    print(f"  derived: ready / returned = {later}" + mark(busy))
    what = f"ready / returned = {later}, the first call {first} a warm one"
    say_held(clocks["prediction_held"], what, busy)


def fresh_output(device, sizes):
    """Prediction (e): an op's output is new memory on every call. On a CPU with glibc
    (Linux), a block over 32 MiB comes from the OS and goes back to it when freed, and
    each of its 4 KiB pages faults the first time it is written: a 64 MiB vector add
    into a fresh output costs 1.5-6x the same add into an output allocated once (out=).
    On a GPU, torch's caching allocator hands back the block it freed: ~1.0x. (b)'s
    first copy paid for fresh pages once; here every call pays. (Part 2 keeps a CPU's
    tensors under 32 MiB, where glibc keeps freed memory for the next call.)"""
    if device.type == "cuda":
        print("  predicted (e): a fresh output costs ~1.0x a reused one (a caching"
              " allocator)")
    else:
        print("  predicted (e): a fresh 64 MiB output costs 1.5-6x a reused one (new"
              " pages)")
    a = torch.rand(sizes.fresh, device=device)
    b = torch.rand(sizes.fresh, device=device)
    out = torch.empty(sizes.fresh, device=device)
    calls = [lambda: torch.add(a, b), lambda: torch.add(a, b, out=out)]
    fresh, reused = per_call(calls, device, sizes)
    cost = ratio(fresh["samples_s"], reused["samples_s"])
    held = 0.9 <= cost["median"] <= 1.1
    if device.type == "cpu":
        held = all([cost["median"] >= 1.5, beyond_noise(cost)])
    return dict(bytes=4 * sizes.fresh, fresh=fresh, reused=reused, cost=cost,
                equal=torch.equal(torch.add(a, b), out), prediction_held=held)


def report_fresh_output(fresh, busy):
    fresh_s = si_spread(fresh["fresh"]["median_s"], fresh["fresh"]["min_s"],
                        fresh["fresh"]["max_s"], "s")
    reused_s = si_spread(fresh["reused"]["median_s"], fresh["reused"]["min_s"],
                         fresh["reused"]["max_s"], "s")
    print(f"  measured (e): vector add, {si(fresh['bytes'], 'B')} out: into a fresh"
          f" output {fresh_s}, into one allocated once {reused_s}" + mark(busy))
    cost = ratio_text(fresh["cost"])
    print(f"  derived: a fresh output costs {cost} a reused one"
          + mark(busy, fresh["cost"]))
    say_held(fresh["prediction_held"], f"a fresh output costs {cost}", busy)


# 5. The figure

COLORS = {"compute-bound": "tab:red", "bandwidth-bound": "tab:blue",
          "overhead-bound": "tab:gray"}


def figure(path, ops, roofs, machine_name):
    """The two roofs and every op at its measured FLOP/s, numbered; the numbers are
    listed beside the plot, so neighbouring labels never overprint."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    plt.switch_backend("Agg")
    peak = roofs["peak_flops"]
    bandwidth = roofs["bandwidth_bytes_per_s"]
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
        lines.append((f"{number:>2}  {op['label']}: {op['measured']}", color))
    ax.set_xlabel("arithmetic intensity (FLOP / byte, counted)")
    ax.set_ylabel("achieved FLOP/s (measured)")
    fig.suptitle(f"The roofline of {machine_name} ({roofs['dtype']} matmuls): roofs"
                 f" {si(peak, 'FLOP/s')}, {si(bandwidth, 'B/s')}, ridge {num(ridge)}"
                 " FLOP/B (measured)")
    legend.axis("off")
    legend.set_title("the ops by intensity: regime measured", fontsize=9, loc="left")
    for row, (text, color) in enumerate(lines):
        legend.text(0, 1 - row / 14, text, color=color, fontsize=8, family="monospace",
                    va="top", transform=legend.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# The tools every experiment above uses: how numbers are printed, and honest timing on
# a machine that may be busy (interleaved samples, medians with their spread).

# How numbers are printed: with an SI prefix, a timing with its range, and a mark on every
# number measured while other programs took the CPU.

PREFIXES = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""), (1e-3, "m"),
            (1e-6, "u"), (1e-9, "n")]


def prefix_for(x):
    for power, prefix in PREFIXES:
        if abs(x) >= power:
            return power, prefix
    return PREFIXES[-1]


def num(x):
    """Three significant digits and never an exponent: 0.949, 1.20, 12.3, 64, 2530."""
    if abs(x) >= 100 or x == round(x):
        return f"{x:.0f}"
    return f"{x:#.3g}"


def si(x, unit=""):
    """812.3e12 -> '812 T' + unit; 7.81e-6 -> '7.81 u' + unit."""
    power, prefix = prefix_for(x)
    return f"{num(x / power)} {prefix}{unit}".rstrip()


def si_spread(median, low, high, unit=""):
    """A median and its range, in the median's prefix: '13.3 ms [12.9-14.1]'."""
    power, prefix = prefix_for(median)
    low_high = f"[{num(low / power)}-{num(high / power)}]"
    return f"{num(median / power)} {prefix}{unit} {low_high}"


def ratio_text(ratio):
    """A ratio of timings taken in turn: '1.82x [1.24-4.44]', its median and its range.
    """
    return f"{num(ratio['median'])}x [{num(ratio['min'])}-{num(ratio['max'])}]"


def mark(busy, ratio=None):
    """What follows a printed number: '(machine busy)' if it was measured while other
    programs took the CPU; for a ratio, '(within noise)' if its range spans 1."""
    if busy:
        return "  (machine busy)"
    if ratio is not None and not beyond_noise(ratio):
        return "  (within noise)"
    return ""


def say_held(held, what, busy):
    """The line that closes each experiment: did its prediction hold, on what number."""
    verdict = "missed"
    if held:
        verdict = "held"
    print(f"  prediction {verdict}: {what}" + mark(busy))


# Honest timing: warm up, wait for the device before reading a clock, repeat, take the
# median with its range, time in turn what is compared. Every timing goes through here.

BUSY_SHARE = 0.9  # below this share of a core, other programs were taking the CPU
MAX_INNER = 1000  # at most this many calls in one timed sample


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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(call, device):
    """Seconds for one call. GPU work is asynchronous: a call returns once its kernels
    are queued, so the clock is read only after the device has finished."""
    sync(device)
    start = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - start


def calls_per_sample(one_call_s, target_s):
    """A microsecond op timed alone would time the clock and the synchronize: a sample
    repeats it back to back until it lasts about target_s (1 to MAX_INNER calls)."""
    inner = round(target_s / one_call_s)
    return max(1, min(MAX_INNER, inner))


def repeated(call, inner, device):
    """One sample: `inner` calls back to back, then wait for the device."""
    def sample():
        for _ in range(inner):
            call()
        sync(device)
    return sample


def per_call(calls, device, sizes):
    """Seconds per call of each of `calls`: sizes.reps samples each, taken interleaved,
    and the first call of each kept apart (it pays one-off costs: part 4 shows them)."""
    firsts = []
    inners = []
    samples = []
    for call in calls:
        firsts.append(time_once(call, device))
        inner = calls_per_sample(time_once(call, device), sizes.target_s)
        inners.append(inner)
        samples.append(repeated(call, inner, device))
    start = time.perf_counter()
    while time.perf_counter() - start < sizes.warmup_s:  # a GPU's clocks rise under load
        for sample in samples:
            sample()
    seconds = interleaved(samples, sizes.reps)
    timings = []
    for first_s, inner, sample_seconds in zip(firsts, inners, seconds):
        each = [s / inner for s in sample_seconds]
        timings.append(dict(median_s=statistics.median(each), min_s=min(each),
                            max_s=max(each), first_s=first_s, inner=inner,
                            samples_s=each))
    return timings


def ratio(a_seconds, b_seconds):
    """a's time over b's, from samples taken in turn: the median of the per-pair ratios
    a_i / b_i, with their min and max."""
    ratios = []
    for a_s, b_s in zip(a_seconds, b_seconds):
        ratios.append(a_s / b_s)
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))


def beyond_noise(ratio, threshold=1.0):
    """A ratio is a finding only when its whole range lies on one side of the threshold.
    """
    return ratio["min"] > threshold or ratio["max"] < threshold


def rotating(fn, shapes, dtype, device, cache_bytes):
    """fn on random inputs of these shapes, another copy each call: enough copies to
    exceed the last-level cache 3x, so no call finds its inputs in a cache."""
    nbytes = sum(math.prod(shape) for shape in shapes) * dtype.itemsize
    copies = math.ceil(3 * cache_bytes / nbytes)
    copies = max(2, min(64, copies))  # 2 to 64 copies
    inputs = []
    for _ in range(copies):
        tensors = [torch.empty(shape, device=device, dtype=dtype) for shape in shapes]
        inputs.append([tensor.uniform_(-1, 1) for tensor in tensors])
    cycle = itertools.cycle(inputs)

    def call():
        return fn(*next(cycle))

    return call


# The machine, the flags, the run

def describe_gpu(device):
    props = torch.cuda.get_device_properties(device)
    name = torch.cuda.get_device_name(device)
    row = datasheet(name)  # model_torch: this exact product's row; None if not in it
    reference = None
    if row is not None:
        reference = asdict(row)
    major, minor = torch.cuda.get_device_capability(device)
    return dict(type="cuda", name=name, memory_bytes=props.total_memory,
                cache_bytes=props.L2_cache_size, capability=f"{major}.{minor}",
                reference=reference)


def describe_cpu():
    name = "CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":")[1].strip()
                break
    cache_bytes = 2**25
    llc = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")  # e.g. "32768K"
    if llc.exists():
        cache_bytes = int(llc.read_text().strip("K\n")) * 1024
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return dict(type="cpu", name=name, memory_bytes=memory_bytes, cache_bytes=cache_bytes,
                reference=None)


def print_machine(machine, sizes, quick, jax_version):
    memory = si(machine["memory_bytes"], "B")
    cache = si(machine["cache_bytes"], "B")
    print(f"device: {machine['name']} ({machine['type']}), {memory} memory, {cache}"
          " last-level cache")
    run = "full"
    if quick:
        run = "--quick"
    print(f"torch {torch.__version__}, jax {jax_version}; {run} sizes, matmuls in"
          f" {str(sizes.dtype).removeprefix('torch.')}, the other ops in float32")
    if sizes.dtype == torch.float16:
        print(f"{machine['name']}: compute capability {machine['capability']}, no bf16"
              " tensor cores: the matmuls run in float16, the 16-bit format they have")


def watched(experiment, *args):
    """Run one experiment between two samples of cpu_share(): its result, and the
    samples (other programs took the CPU if either is below BUSY_SHARE)."""
    before = cpu_share()
    result = experiment(*args)
    after = cpu_share()
    return result, [before, after]


def was_busy(shares):
    return min(shares) < BUSY_SHARE


def report_verdicts(results, checks, shares):
    """The run's last lines - the checks, and whether other programs took the CPU - and
    the JSON's verdicts: every prediction held or missed, the checks, the busy samples."""
    predictions = {}
    for name, result in results.items():
        if result is not None:  # JAX's: None when jax is not installed
            predictions[name] = result["prediction_held"]
    print()
    for name, ok in checks.items():
        verdict = "FAILED"
        if ok:
            verdict = "ok"
        print(f"check {name}: {verdict}")
    busy_during = [name for name, samples in shares.items() if was_busy(samples)]
    if busy_during:
        during = ", ".join(busy_during)
        print(f"machine busy: other programs took the CPU during {during}; the marked"
              " numbers are not findings")
    cpu_shares = []
    for samples in shares.values():
        cpu_shares.extend(samples)
    return dict(predictions=predictions, checks=checks, machine_busy=len(busy_during) > 0,
                busy_experiments=busy_during, cpu_shares=cpu_shares)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--out", type=Path, default=Path("out"), help="figure folder")
    return parser.parse_args()


def main():
    args = parse_args()
    json_file = None
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        json_file = open(args.json, "w")  # a path that cannot be written fails here, first
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu")
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", 0)
    machine = describe_cpu()
    if device.type == "cuda":
        machine = describe_gpu(device)
    sizes = sizes_for(device, args.quick, machine)
    jax_version = "not installed"
    for dist in importlib.metadata.distributions(name="jax"):
        jax_version = dist.version
    print_machine(machine, sizes, args.quick, jax_version)
    shares = {}  # cpu_share() before and after each experiment

    print("\n1. The two ceilings: peak matmul FLOP/s and a copy's bytes/s")
    roofs, shares["roofs"] = watched(measure_roofs, device, sizes, machine["reference"])
    report_roofs(roofs, machine, was_busy(shares["roofs"]))
    peak = roofs["peak_flops"]
    bandwidth = roofs["bandwidth_bytes_per_s"]

    print("\n2. A dozen ops on the roofline: predicted on paper, then measured")
    ops = make_ops(sizes)
    rows = {}
    for key, op in ops.items():
        rows[key] = on_paper(op, peak, bandwidth)
    report_on_paper(rows, roofs["ridge_flop_per_byte"])
    placed, shares["ops"] = watched(measure_ops, ops, rows, device, sizes, peak,
                                    bandwidth)
    # the shares of the roofs are as reliable as the roofs
    report_ops(placed, device.type, sizes.reps, was_busy(shares["roofs"] + shares["ops"]))

    print("\n3. The overhead floor: the fixed cost of a call")
    overhead, shares["overhead"] = watched(overhead_sweep, device, sizes, bandwidth)
    report_overhead(overhead, was_busy(shares["overhead"]))

    print("\n4. Measurement discipline, shown by running it")
    clocks, shares["no_sync"] = watched(no_sync, device, sizes, peak)
    report_no_sync(clocks, was_busy(shares["no_sync"]))
    first = first_calls(roofs)
    report_first_calls(first, was_busy(shares["roofs"]))
    jax_result, shares["jax"] = watched(jax_clocks, device, sizes)
    report_jax(jax_result, was_busy(shares["jax"]))
    fresh, shares["fresh_output"] = watched(fresh_output, device, sizes)
    report_fresh_output(fresh, was_busy(shares["fresh_output"]))

    print("\n5. The figure")
    path = args.out / "01_roofline.png"
    figure_path = figure(path, placed["rows"], roofs, machine["name"])
    print(f"  {figure_path}")

    results = dict(roofs=roofs, ops=placed, overhead=overhead, no_sync=clocks,
                   first_calls=first, jax=jax_result, fresh_output=fresh)
    # Self-checks, correctness only: timing is reported above and never decides the exit.
    checks = dict(roofs_positive=all([peak > 0, bandwidth > 0]),
                  copy_is_exact=roofs["copy_is_exact"], fresh_output_equal=fresh["equal"])
    verdicts = report_verdicts(results, checks, shares)
    if json_file is not None:
        sizes_info = dict(asdict(sizes), dtype=str(sizes.dtype), sweep=list(sizes.sweep))
        device_info = dict(machine, torch=torch.__version__, jax=jax_version)
        json.dump(dict(lesson="01_roofline", device=device_info, quick=args.quick,
                       sizes=sizes_info, **results, figure=figure_path, **verdicts),
                  json_file, indent=1)
        json_file.close()
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        sys.exit(f"check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
