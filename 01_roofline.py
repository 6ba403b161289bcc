"""01_roofline.py - Section 13.1: the map (the roofline) and the method (measure, classify).
An op waits on arithmetic, on memory, or - when small - on the fixed cost of asking for it:
1. the two ceilings (peak matmul FLOP/s: bf16 on a GPU, fp32 on a CPU; a large copy's bytes/s)
and the ridge point; 2. a dozen ops on the roofline, each classified compute-, bandwidth- or
overhead-bound from its measurement; 3. the overhead floor; 4. measurement discipline, run (no
sync, first call, mean vs median, JAX's block_until_ready); 5. the figure, out/01_roofline.png.
Run: python 01_roofline.py (CUDA if present, else CPU: under a minute on 2 cores); --quick
(seconds: the tests' run), --device cpu, --json FILE. One GPU is enough (cuda:0). Copy it with
model_torch.py (datasheet peaks); jax is optional. Expect on a datacenter GPU hundreds of
TFLOP/s bf16, a few TB/s, a ridge near 200 FLOP/byte; on a small CPU ~100 GFLOP/s, tens of
GB/s, a ridge of a few. Numbers are labelled measured, derived or reference (datasheet)."""

import os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # else JAX takes 75% of the GPU

import argparse, ctypes, importlib.metadata, itertools, json, math, statistics, sys, time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from model_torch import datasheet_bf16_peak

# Reference memory bandwidths, bytes/s (NVIDIA H200, H100 SXM, A100 80GB datasheets; Ada
# whitepaper for the RTX 4090): printed beside ours, never used as a measurement.
DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "RTX 4090": 1.01e12}
FLAT = 2         # step 3: overhead-bound if time < 2x the same op on toy inputs (dims <= 8)
NEAR_ROOF = 0.5  # an op at >= 50% of its roof is "near" it; under that, "far below"
BUSY = "   unreliable (machine busy)"
GPU_WARMUP_S = 0.05  # a GPU raises its clocks under load: keep it busy this long first
BURST_GAP_S = 0.1    # GPU: idle this long before each roof sample, so every sample is a burst

@dataclass
class Sizes:
    dtype: torch.dtype     # the matmuls': bf16 on a GPU, fp32 on a CPU
    peak_n: int            # the compute roof's square matmul; the other matmuls scale with it
    vector: int            # elements of the elementwise ops, norms and reductions; copy: 2x
    tiny: int              # a matmul small enough to be all overhead
    decode_tokens: int     # a few tokens against a (2 peak_n)^2 weight
    sweep: range           # the overhead sweep's vector adds: 2**p elements
    reps: int              # timed samples per measurement
    target_s: float        # a sample runs enough back-to-back calls to last this long
    cache_bytes: int       # last-level cache: rotated inputs exceed it 3x

def sizes_for(device, quick, cache_bytes):
    """GPU: sizes well past its L2 that fill the chip. CPU: under a minute on 2 cores."""
    if device.type == "cuda":
        return Sizes(torch.bfloat16, 8192, 2**28, 64, 16, range(6, 29, 2), 5 if quick else 20,
                     5e-3, cache_bytes)
    if quick:
        return Sizes(torch.float32, 512, 2**21, 16, 1, range(6, 19, 3), 3, 5e-4,
                     min(cache_bytes, 2**22))
    return Sizes(torch.float32, 2048, 2**24, 16, 1, range(6, 25, 2), 7, 2e-2, cache_bytes)

def si(x, unit=""):
    """812.3e12 -> '812 T' + unit; 7.81e-6 -> '7.81 u' + unit."""
    for power, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""), (1e-3, "m")):
        if abs(x) >= power:
            return f"{x / power:.3g} {prefix}{unit}".rstrip()
    return f"{x * 1e6:.3g} u{unit}"

# Honest timing: warm up, wait for the device before reading a clock, repeat, take the median.

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

def per_call(fn, device, sizes, burst=False):
    """Seconds per call: the cold first call, then `reps` samples timed by bench, each `inner`
    calls lasting ~target_s (a microsecond op must outlast the clock and the synchronize).
    burst (GPU): idle, one untimed call to wake the clocks, then the sample."""
    first_s = bench(fn, device, reps=1, warmup=0)[0]
    inner = max(1, min(1000, round(sizes.target_s / bench(fn, device, reps=1, warmup=0)[0])))
    def calls():
        for _ in range(inner):
            fn()
    for _ in range(round(GPU_WARMUP_S / sizes.target_s) * (device.type == "cuda")):
        calls()  # a GPU raises its clocks under load
    samples = []
    for _ in range(sizes.reps):
        if burst and device.type == "cuda":
            sync(device)
            time.sleep(BURST_GAP_S)
        samples.append(bench(calls, device, reps=1, warmup=int(burst))[0] / inner)
    return dict(median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples),
                first_s=first_s, inner=inner, samples_s=samples)

def rotating(fn, shapes, sizes, device, dtype):
    """fn over random inputs, cycling through copies that exceed the last-level cache 3x."""
    nbytes = sum(math.prod(s) for s in shapes) * dtype.itemsize
    copies = max(2, min(64, math.ceil(3 * sizes.cache_bytes / nbytes)))
    cycle = itertools.cycle([[torch.empty(s, device=device, dtype=dtype).uniform_(-1, 1)
                              for s in shapes] for _ in range(copies)])
    return lambda: fn(*next(cycle))

def unreliable(timing, rate=0.0, ceiling=None):
    """Samples spread wider than their median, or a rate 10% above a ceiling: do not trust."""
    return (timing["max_s"] - timing["min_s"] > timing["median_s"]
            or rate > 1.1 * (ceiling or math.inf))

# 1. The two ceilings

def measure_ceilings(device, sizes):
    # PREDICTION: a big square matmul does ~n/3 FLOPs per byte, far right of any ridge: the
    # compute roof (a datacenter GPU: ~80% of its datasheet bf16 peak). A copy does no arithmetic:
    # the memory roof (~90% of the datasheet bytes/s). The roof is what a GPU does in bursts, as
    # the ops below run (held for seconds, at its power limit, it lowers its clocks: see
    # 02_hardware.py). One shape can tile the chip unevenly: keep the fastest of three.
    n, tried = sizes.peak_n, {}
    for m, k, n_out in [(n, n, n), (n // 2, n // 2, n // 2), (n, n // 2, 2 * n)]:
        run = rotating(torch.matmul, [(m, k), (k, n_out)], sizes, device, sizes.dtype)
        tried[f"{m}x{k}x{n_out}"] = dict(flops=2 * m * k * n_out,
                                         **per_call(run, device, sizes, burst=True))
    shape = max(tried, key=lambda s: tried[s]["flops"] / tried[s]["median_s"])
    src = torch.randn(2 * sizes.vector, device=device, dtype=sizes.dtype)
    dst = torch.empty_like(src)
    copy = per_call(lambda: dst.copy_(src), device, sizes)
    copy["bytes_moved"] = 2 * src.numel() * src.element_size()  # read once, written once
    peak, bandwidth = tried[shape]["flops"] / tried[shape]["median_s"], copy["bytes_moved"] / copy["median_s"]
    return dict(peak_flops=peak, bandwidth_bytes_per_s=bandwidth,
                ridge_flop_per_byte=peak / bandwidth, copy_is_exact=torch.equal(dst, src),
                matmul=dict(shape=shape, dtype=str(sizes.dtype).split(".")[-1], **tried[shape]),
                matmul_shapes_tried={s: t["flops"] / t["median_s"] for s, t in tried.items()},
                copy=copy)

def report_ceilings(c, ref_flops, ref_bw):
    mm, copy, peak, bw = c["matmul"], c["copy"], c["peak_flops"], c["bandwidth_bytes_per_s"]
    print(f"  compute roof {si(peak, 'FLOP/s'):>14}   {mm['dtype']} matmul {mm['shape']}, fastest of"
          f" 3 shapes (min-max {si(mm['flops'] / mm['max_s'])}-{si(mm['flops'] / mm['min_s'])})"
          + BUSY * unreliable(mm, peak, ref_flops))
    print(f"  memory roof  {si(bw, 'B/s'):>14}   copy of {si(copy['bytes_moved'] / 2, 'B')}, read"
          f" + written (min-max {si(copy['bytes_moved'] / copy['max_s'])}"
          f"-{si(copy['bytes_moved'] / copy['min_s'])})" + BUSY * unreliable(copy, bw, ref_bw))
    print(f"  ridge point  {c['ridge_flop_per_byte']:>8.1f} FLOP/B   (derived: compute roof /"
          " memory roof): an op doing fewer FLOPs per byte waits on memory")
    if ref_flops and ref_bw:
        print(f"  reference    datasheet {si(ref_flops, 'FLOP/s')} dense bf16, {si(ref_bw, 'B/s')}:"
              f" measured = {peak / ref_flops:.0%} and {bw / ref_bw:.0%} of them")

# 2. A dozen ops on the roofline

def make_ops(sizes):
    """key: (label, function, input shapes, FLOPs, minimum bytes, dtype), counted on paper.
    Minimum bytes: each input read once, each output written once - no kernel moves fewer.
    Elementwise ops, norms, reductions in fp32 (activations, optimizer math), matmuls in the
    compute roof's dtype: bytes are bytes, both meet the same memory roof."""
    e, v, n, t, m = sizes.dtype.itemsize, 4, sizes.vector, sizes.tiny, sizes.peak_n // 2
    rows, batch, tokens, d = n // 1024, n // 4096, sizes.decode_tokens, 2 * sizes.peak_n
    p, fp32, mm = sizes.peak_n, torch.float32, sizes.dtype
    return {
        "vector_add_tiny": ("vector add 1k", torch.add, [(1024,)] * 2, 1024, 3 * 1024 * v, fp32),
        "vector_add": (f"vector add {si(n)}", torch.add, [(n,)] * 2, n, 3 * n * v, fp32),
        "scale": (f"scale x*2 {si(n)}", lambda x: x * 2.0, [(n,)], n, 2 * n * v, fp32),
        # GELU: ~8 FLOPs per element by convention (the erf counted as one)
        "gelu": (f"GELU {si(n)}", F.gelu, [(n,)], 8 * n, 2 * n * v, fp32),
        # softmax, per element: max, subtract, exp, sum, divide
        "softmax": (f"softmax {si(rows)} x 1024", lambda x: torch.softmax(x, -1),
                    [(rows, 1024)], 5 * n, 2 * n * v, fp32),
        # layernorm, per element: mean, subtract, square, sum, normalise, gain, bias (+1)
        "layernorm": (f"layernorm {si(rows)} x 1024", lambda x, w, b: F.layer_norm(x, w.shape, w, b),
                      [(rows, 1024), (1024,), (1024,)], 8 * n, (2 * n + 2 * 1024) * v, fp32),
        "sum": (f"sum {si(n)}", torch.sum, [(n,)], n, (n + 1) * v, fp32),
        "matmul_tiny": (f"matmul {t}^3", torch.matmul, [(t, t)] * 2, 2 * t**3, 3 * t * t * e, mm),
        "matmul_decode": (f"matmul {tokens} tok x {d}^2", torch.matmul, [(tokens, d), (d, d)],
                          2 * tokens * d * d, (2 * tokens * d + d * d) * e, mm),
        "bmm_small": (f"bmm {si(batch)} x 64^3", torch.bmm, [(batch, 64, 64)] * 2,
                      2 * batch * 64**3, 3 * batch * 64 * 64 * e, mm),
        "matmul_medium": (f"matmul {m}^3", torch.matmul, [(m, m)] * 2, 2 * m**3, 3 * m * m * e, mm),
        "matmul_large": (f"matmul {p}x{m}x{d}", torch.matmul, [(p, m), (m, d)], 2 * p * m * d,
                         (p * m + m * d + p * d) * e, mm),
    }

def place_ops(device, sizes, peak, bandwidth):
    # PREDICTION: elementwise ops, norms, reductions do 1-8 FLOPs per element moved: a few
    # FLOP/byte, left of the ridge, under the memory roof. A matmul's intensity grows with its
    # smallest dimension: a few tokens against a big weight, or 64x64 blocks, stay left of a
    # GPU's ridge; square matmuls of thousands cross it. Some land a few % above 100%: ops that
    # mostly read (a sum, a matmul streaming its weights) beat a copy, half of whose bytes are
    # writes; on a CPU a copy's write-allocate reads its destination first (3 bytes moved per 2
    # counted), so an add or a scale can beat the copy by up to 1.5x.
    bytes_ceiling = bandwidth * {"cpu": 1.5, "cuda": 1.0}[device.type]
    ops = {}
    for key, (label, fn, shapes, flops, nbytes, dtype) in make_ops(sizes).items():
        timing = per_call(rotating(fn, shapes, sizes, device, dtype), device, sizes)
        toy = per_call(rotating(fn, [tuple(min(d, 8) for d in s) for s in shapes], sizes, device,
                                dtype), device, sizes)  # the same call on toy inputs: ~no work
        time_s, intensity = timing["median_s"], flops / nbytes
        bound = min(peak, intensity * bandwidth)  # the roofline: the FLOP/s this op can attain
        ops[key] = dict(label=label, flops=flops, bytes=nbytes, intensity=intensity,
                        bound_flops=bound, time_s=time_s, toy_time_s=toy["median_s"],
                        achieved_flops=flops / time_s, achieved_bytes_per_s=nbytes / time_s,
                        fraction_of_bound=flops / time_s / bound, predicted="bandwidth",
                        unreliable=(unreliable(timing, flops / time_s, peak)
                                    or nbytes / time_s > 1.1 * bytes_ceiling),
                        **{k: timing[k] for k in ("min_s", "max_s", "first_s", "inner")})
        if intensity >= peak / bandwidth:
            ops[key]["predicted"] = "compute"
        ops[key]["measured"], ops[key]["near_roof"] = classify(ops[key], peak, bandwidth)
    return ops

def classify(op, peak, bandwidth):
    """(regime, near its roof?) from the measurement. Overhead first: time flat in size (under
    FLAT x its time on toy inputs). Else the roof it comes nearer to, as a fraction of each."""
    if op["time_s"] < FLAT * op["toy_time_s"]:
        return "overhead", None
    if op["achieved_flops"] / peak >= op["achieved_bytes_per_s"] / bandwidth:
        return "compute", op["fraction_of_bound"] >= NEAR_ROOF
    return "bandwidth", op["fraction_of_bound"] >= NEAR_ROOF

def report_ops(ops):
    print(f"  {'op':<24} {'FLOPs':>7} {'bytes':>7} {'FLOP/B':>8} {'time':>9} {'achieved':>12}"
          f" {'bytes/s':>10} {'%bound':>6} {'x toy':>8}  intensity predicts -> measured")
    for op in ops.values():
        how = {True: " (near)", False: " (far below)", None: ""}[op["near_roof"]]
        note = "   <- the roofline cannot see this" * (op["measured"] != op["predicted"])
        print(f"  {op['label']:<24} {si(op['flops']):>7} {si(op['bytes']):>7}"
              f" {op['intensity']:>8.3g} {si(op['time_s'], 's'):>9}"
              f" {si(op['achieved_flops'], 'FLOP/s'):>12} {si(op['achieved_bytes_per_s'], 'B/s'):>10}"
              f" {op['fraction_of_bound']:>6.0%} {op['time_s'] / op['toy_time_s']:>8.1f}"
              f"  {op['predicted']} -> {op['measured']}{how}{note}" + BUSY * op["unreliable"])

# 3. The overhead floor

def overhead_sweep(device, sizes, bandwidth):
    # PREDICTION: a vector add of 64 elements costs what one of 64 thousand does: the fixed
    # cost of a call (Python, PyTorch's dispatcher, a kernel launch), a few microseconds. Time
    # grows with size only once the bytes take longer than that: past floor x bandwidth.
    sweep = []
    for p in sizes.sweep:
        run = rotating(torch.add, [(2**p,)] * 2, sizes, device, torch.float32)
        sweep.append(dict(elements=2**p, bytes=3 * 2**p * 4,
                          time_s=per_call(run, device, sizes)["median_s"]))
    floor, grown = statistics.median(s["time_s"] for s in sweep[:3]), None
    i = next((i for i, s in enumerate(sweep) if s["time_s"] > 2 * floor), None)
    if i:  # interpolate log-log between the two sizes that bracket 2x the floor
        (b0, t0), (b1, t1) = [(sweep[j]["bytes"], sweep[j]["time_s"]) for j in (i - 1, i)]
        grown = b0 * (b1 / b0) ** (math.log(2 * floor / t0) / math.log(t1 / t0))
    return dict(floor_s=floor, sweep=sweep, crossover_bytes=grown,
                predicted_crossover_bytes=floor * bandwidth)

# 4. Measurement discipline, shown by running it

def loop_stats(times):
    """A timing loop without warm-up: its first (cold) call, the warm median, its mean, median."""
    return dict(first_s=times[0], warm_median_s=statistics.median(times[1:]),
                loop_mean_s=statistics.fmean(times), loop_median_s=statistics.median(times))

def two_clocks(call, wait, reps):
    """Each call timed twice: when it returns, and when its result is ready (after wait)."""
    returned, ready = [], []
    for _ in range(reps + 1):
        start = time.perf_counter()
        result = call()
        returned.append(time.perf_counter() - start)
        wait(result)
        ready.append(time.perf_counter() - start)
    return dict(returned_s=statistics.median(returned[1:]), **loop_stats(ready))

def discipline(device, sizes, ceilings):
    # PREDICTION (a): on a GPU torch.matmul returns once the kernel is queued: a clock read then
    # times the launch (~10 us), not the work (~1 ms), ~100x the compute roof. A CPU has no
    # queue: ~1x. (b, c): the first call pays one-off costs (library handles, kernel loading;
    # fresh pages from the OS), dragging a loop's mean up, not its median. (d): JAX dispatches
    # asynchronously on every backend, the CPU included; its first call also compiles.
    n, a = sizes.peak_n, torch.randn(sizes.peak_n, sizes.peak_n, device=device, dtype=sizes.dtype)
    out = dict(n=n, torch=two_clocks(lambda: a @ a, lambda _: sync(device), sizes.reps))
    for name in ("matmul", "copy"):  # the ceilings' first calls were the process's first
        out[f"first_{name}"] = loop_stats([ceilings[name]["first_s"]] + ceilings[name]["samples_s"])
    if device.type == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # JAX on the same device as torch
    try:
        import jax
    except ImportError:
        return dict(out, jax=dict(skipped="jax is not installed"))
    platform, dtype = jax.devices()[0].platform, str(sizes.dtype).split(".")[-1]
    if platform != {"cuda": "gpu", "cpu": "cpu"}[device.type]:  # e.g. no jax CUDA plugin
        n, dtype = 1024, "float32"
    x, matmul = jax.random.normal(jax.random.key(0), (n, n), dtype), jax.jit(lambda x: x @ x)
    out["jax"] = dict(two_clocks(lambda: matmul(x), lambda y: y.block_until_ready(), sizes.reps),
                      platform=platform, n=n, version=jax.__version__)
    return out

def report_discipline(d, peak):
    clocks, jx = d["torch"], d["jax"]
    print(f"  (a) {d['n']}^3 matmul: the call returns after {si(clocks['returned_s'], 's')}, its"
          f" result is ready after {si(clocks['warm_median_s'], 's')} (measured): a clock read at"
          f" return claims {2 * d['n'] ** 3 / clocks['returned_s'] / peak:.3g}x the compute roof")
    for name in ("matmul", "copy"):
        w = d[f"first_{name}"]
        print(f"  (b) {name:<6} first call {si(w['first_s'], 's'):>9} ="
              f" {w['first_s'] / w['warm_median_s']:.1f}x a warm one (measured);  (c) a loop timed"
              f" from it: mean {si(w['loop_mean_s'], 's')}, median {si(w['loop_median_s'], 's')}")
    if "skipped" in jx:
        print(f"  (d) JAX: skipped - {jx['skipped']}")
        return
    print(f"  (d) JAX on {jx['platform']}, {jx['n']}^3 matmul: without block_until_ready"
          f" {si(jx['returned_s'], 's')}, with it {si(jx['warm_median_s'], 's')} (measured);"
          f" first call (trace + compile) {jx['first_s'] / jx['warm_median_s']:.0f}x a warm one;"
          f" a loop from it: mean {si(jx['loop_mean_s'], 's')}, median {si(jx['loop_median_s'], 's')}")

# 5. The figure

def figure(path, ops, ceilings):
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return "figure skipped: matplotlib is not installed"
    plt.switch_backend("Agg")
    peak, bandwidth = ceilings["peak_flops"], ceilings["bandwidth_bytes_per_s"]
    xs = sorted([op["intensity"] for op in ops.values()] + [peak / bandwidth])  # 2 lines, log-log
    colors = {"compute": "tab:red", "bandwidth": "tab:blue", "overhead": "tab:gray"}
    fig, ax = plt.subplots(figsize=(10, 6))
    ax.loglog(xs, [min(peak, x * bandwidth) for x in xs], "k-", lw=2)
    for op in ops.values():
        point = (op["intensity"], op["achieved_flops"])
        ax.scatter(*point, color=colors[op["measured"]], zorder=3)
        ax.annotate(op["label"] + BUSY * op["unreliable"], point, fontsize=7, xytext=(4, -3),
                    textcoords="offset points")
    ax.set(xlabel="arithmetic intensity (FLOP / byte)", ylabel="achieved FLOP/s (measured)",
           title=f"The roofline (measured; ridge {peak / bandwidth:.3g} FLOP/B): red compute-,"
                 " blue bandwidth-, grey overhead-bound")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)
    return str(path)

# The machine, the flags, the run

def describe(device):
    """Name, memory, last-level cache. On a CPU, glibc hands a big tensor fresh pages on every
    call (their first touch costs more than a vector add): ask it to keep freed memory."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return dict(type="cuda", name=props.name, memory_bytes=props.total_memory,
                    cache_bytes=getattr(props, "L2_cache_size", 50 * 2**20),  # and, reference:
                    datasheet_bf16_flops=datasheet_bf16_peak(props.name),
                    datasheet_bandwidth=next((bw for gpu, bw in DATASHEET_BANDWIDTH.items()
                                              if gpu in props.name), None))
    cpuinfo, llc = Path("/proc/cpuinfo"), Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    names = [ln.split(":")[1].strip() for ln in cpuinfo.read_text().splitlines()
             if ln.startswith("model name")] if cpuinfo.exists() else []
    info = dict(type="cpu", name=(names + ["CPU"])[0], threads=torch.get_num_threads(),
                memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                cache_bytes=int(llc.read_text().strip("K\n")) * 1024 if llc.exists() else 2**25)
    try:  # M_MMAP_MAX = 0: never hand big blocks back; M_TRIM_THRESHOLD = 1 GB
        libc = ctypes.CDLL("libc.so.6")
        info["keeps_freed_memory"] = libc.mallopt(-4, 0) == 1 and libc.mallopt(-1, 2**30) == 1
    except (OSError, AttributeError):
        info["keeps_freed_memory"] = False
    return info

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
    parser = argparse.ArgumentParser(description="Section 13.1: the roofline and the regimes")
    parser.add_argument("--quick", action="store_true", help="a few seconds (the tests' run)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", help="write every measured number here")
    parser.add_argument("--out", default="out", help="folder for the figure")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: PyTorch sees no CUDA GPU here; run with --device cpu")
    check_outputs(args)
    use_gpu = args.device != "cpu" and torch.cuda.is_available()
    args.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
    return args

def main():
    args = parse_args()
    device, dev = args.device, describe(args.device)
    jax_version = next((d.version for d in importlib.metadata.distributions(name="jax")), None)
    sizes = sizes_for(device, args.quick, dev["cache_bytes"])
    print(f"device: {dev['name']} ({device.type}), memory {si(dev['memory_bytes'], 'B')},"
          f" last-level cache {si(dev['cache_bytes'], 'B')}, keeps freed memory"
          f" {dev.get('keeps_freed_memory', True)}")
    print(f"torch {torch.__version__}, jax {jax_version or 'not installed'};"
          f" {'--quick' if args.quick else 'full'} sizes, matmuls in {str(sizes.dtype)[6:]}, other ops in"
          f" float32, {sizes.reps} samples per measurement, inputs rotated past the cache")
    print(f"\n1. The two ceilings (measured: median of {sizes.reps} samples, min-max; on a GPU each"
          f" roof sample is a burst after {BURST_GAP_S} s idle)")
    ceilings = measure_ceilings(device, sizes)
    report_ceilings(ceilings, dev.get("datasheet_bf16_flops"), dev.get("datasheet_bandwidth"))
    peak, bandwidth = ceilings["peak_flops"], ceilings["bandwidth_bytes_per_s"]
    print("\n2. A dozen ops on the roofline, each classified from its measurement (FLOPs and"
          " bytes counted, time measured, the rest derived)")
    ops = place_ops(device, sizes, peak, bandwidth)
    report_ops(ops)
    print("\n3. The overhead floor: the fixed cost of a call")
    overhead = overhead_sweep(device, sizes, bandwidth)
    print("  vector add, time per call against size (measured):\n   "
          + "  ".join(f"{si(s['elements'])}:{si(s['time_s'], 's')}" for s in overhead["sweep"]))
    print(f"  overhead floor {si(overhead['floor_s'], 's')} per call (measured: 3 smallest sizes);"
          f" time doubles at {si(overhead['crossover_bytes'] or math.nan, 'B')} per call (derived);"
          f"\n  predicted: floor x bandwidth = {si(overhead['predicted_crossover_bytes'], 'B')}")
    print("\n4. Measurement discipline, shown by running it")
    clocks = discipline(device, sizes, ceilings)
    report_discipline(clocks, peak)
    result = dict(lesson="01_roofline", device=dict(dev, torch=torch.__version__, jax=jax_version),
                  quick=args.quick, sizes={k: str(v) for k, v in vars(sizes).items()},
                  ceilings=ceilings, ops=ops, overhead=overhead, discipline=clocks)
    result["figure"] = figure(Path(args.out) / "01_roofline.png", ops, ceilings)
    print(f"\n5. Figure: {result['figure']}")
    # Self-checks, correctness only: timing is reported above and never decides the exit code.
    result["checks"] = dict(ceilings_positive=peak > 0 and bandwidth > 0,
                            copy_is_exact=ceilings["copy_is_exact"])
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
