"""
Section 13.7: the waterfall. GPT-2 124M down the chapter's method, one measured rung per
technique (RUNGS), each kept for the rungs after it, all from one init on the same batches:
the speed changes, the losses must not. torch.profiler says where each rung's step goes.

    python 07_capstone_torch.py               # one GPU: gpt2 (124M, T=1024), ~3 min
    python 07_capstone_torch.py --headline    # baseline vs final rung, 100 steps each, ~2 min
    OMP_NUM_THREADS=8 torchrun --standalone --nproc_per_node=2 07_capstone_torch.py
        [--interconnect staged]               # each GPU the final rung alone, then DDP
    python 07_capstone_torch.py --device cpu  # the tiny preset, ~70 s on 2 cores
    python 07_capstone_torch.py --quick       # a step or two per rung (the tests)

Per rung: ms/step, tokens/s, MFU (6N + 12LTd FLOPs per token over the datasheet bf16 peak and
a measured matmul peak), peak memory against a 24 GB card, tokens/J (NVML), the loss gap, what
binds. Figures in out/. --data FILE (UTF-8) or the stdlib's sources. Needs model_torch.py.
"""

import argparse, gc, hashlib, json, logging, math, os, platform, re, statistics, sys
import sysconfig, tempfile, time, warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch._inductor.config
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from model_torch import GPT, GPTConfig, activation_bytes, datasheet_bf16_peak, flops_per_token

BASELINE = dict(tf32=False, bf16=False, attn="manual", compile=False, fused=False, vocab=50257,
                accum=4, host_sync=True, checkpoint=False, ddp=False, bf16_grads=False)
WARMUP = 2  # untimed steps of every rung: the first compiles, the second settles
WINDOW = 5  # steps between host syncs once "no host sync per step" is on
RUNGS = [  # (name, what it changes, the regime it targets and the prediction: printed first)
    ("fp32 eager", {}, "baseline: full fp32 matmuls leave the tensor cores idle: ~67 TFLOP/s "
     "fp32 on an H100/H200 against 989 bf16 (datasheet): < 7% MFU"),
    ("+ TF32", dict(tf32=True), "compute-bound on the wrong units: TF32 runs fp32 matmuls on "
     "tensor cores (495 TFLOP/s): 2-3x (build-nanogpt, A100: 1000 -> 333 ms)"),
    ("+ bf16 autocast", dict(bf16=True), "tensor-core peak x2, activations /2, but eager adds "
     "casts and manual attention stays fp32: 1.1-1.5x (build-nanogpt: 333 -> 300 ms)"),
    ("+ flash attention (SDPA)", dict(attn="sdpa"), "bandwidth-bound: manual attention writes and "
     "re-reads B*H*T*T scores per layer; SDPA's fused kernel (flash, or cuDNN's) does not: 1.2-2x"),
    ("+ torch.compile", dict(compile=True), "bandwidth- and overhead-bound chains (LayerNorm, "
     "GELU, residuals, casts, the loss) fuse into few kernels: 1.3-2x, plus compile time once"),
    ("+ fused AdamW", dict(fused=True), "overhead: foreach AdamW launches several kernels per "
     "parameter group, fused is one pass over params, grads, moments: a few %"),
    ("+ vocab 50304, 1 micro-step", dict(vocab=50304, accum=1), "50304 = 128 x 393 leaves the "
     "largest matmul no ragged tiles (nanoGPT: up to ~25%); one 4x micro-batch amortises fixed "
     "costs: 1.05-1.3x, more activation memory"),
    ("+ no host sync per step", dict(host_sync=False), f"overhead: reading the loss every "
     f"step makes the CPU wait for the GPU to drain; every {WINDOW} steps it runs ahead. A ~100 ms "
     "step hides a gap < 1 ms: expect < 1% here, 0 on a CPU; it pays for steps of a few ms"),
    ("+ activation checkpointing", dict(checkpoint=True), "a memory fix where memory does NOT "
     "bind: recomputing each block's forward adds ~1/3 of its FLOPs: 20-30% SLOWER, dropped"),
    ("+ DDP", dict(ddp=True), "the batch split among N GPUs, the gradient all-reduce overlapped "
     "with backward: over NVLink close to N x one GPU (scaling > 90%)"),
    ("+ bf16 gradient all-reduce", dict(ddp=True, bf16_grads=True), "communication-bound on a "
     "slow link: a hook all-reduces bf16 gradients, half the bytes: ~0 on NVLink, a few % staged"),
]
CLASSES = {  # class: (the regime it means, substrings of a kernel's (CPU: op's) name; first wins)
    "communication": ("communication-bound", ("nccl", "gloo", "allreduce", "all_reduce", "c10d")),
    "loss": ("bandwidth-bound", ("nll_loss", "nllloss", "log_softmax", "logsoftmax")),
    "attention": ("attention-bound", ("flash", "fmha", "sdpa", "attention", "softmax")),
    "matmul": ("compute-bound", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "addmm", "bmm")),
    "optimizer": ("bandwidth-bound", ("adam", "multi_tensor_apply", "foreach")),
    "norm+elementwise": ("bandwidth-bound", ("norm", "gammabeta", "elementwise", "gelu", "triton",
                         "cpp_fused", "reduce", "copy", "memcpy", "memset", "fill", "add", "mul")),
    "other": ("unclassified", ("",)),  # every other kernel
    "idle": ("overhead-bound", ()),  # no kernel running: the device waits for the host
}
TOLERANCE = 0.005  # largest relative loss gap to the baseline over the waterfall's steps: bf16's
# 8 mantissa bits (~0.2% per value) average out in the loss's sums; a real bug moves it far more
HEADLINE_TOLERANCE = 0.03  # the same over 100 steps: rounding differences grow along a run
ACCUM_TOLERANCE = 1e-4  # accumulated vs full-batch gradient in fp32 (rounding: ~1e-6)
FITS = 23 * 2**30  # a 24 GB card (RTX 4090) less ~1 GiB for the CUDA context, libraries
SIZES = dict(  # batch: sequences per step; steps: timed steps of a compiled / eager rung
    cuda=dict(preset="gpt2", model={}, batch=64, steps=20, eager_steps=3,
              headline_steps=100, headline_batch=32),
    cpu=dict(preset="tiny", model=dict(block_size=128), batch=4, steps=2, eager_steps=2,
             headline_steps=30, headline_batch=4),
    quick=dict(preset="tiny", model=dict(n_layer=2, n_head=2, n_embd=32, block_size=16),
               batch=4, steps=1, eager_steps=1, headline_steps=5, headline_batch=4))
HEADER = (f"   {'rung':34s} {'ms/step':>8s} {'tokens/s':>10s} {'speed-up':>8s} {'MFU(ds)':>7s} "
          f"{'MFU(meas)':>9s} {'peak GiB':>8s} {'24 GB':>5s} {'tokens/J':>8s} {'compile':>7s} "
          f"{'d(loss)':>7s}  binds: share of a profiled step\n   (measured: ms, tokens/s, peak "
          "memory, tokens/J (NVML), compile, binds; derived: speed-up, MFU, d(loss) vs the base)")

# --- Data: real text, the same batches in both capstones (both files hold this block).

def read_corpus(data, max_bytes=20_000_000):
    """--data FILE, else the stdlib's *.py files (sorted, capped); a bad file: one line, exit 1."""
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages"}  # installed packages are not the stdlib
        files = sorted(p for p in root.rglob("*.py") if not skip & set(p.parts))
        return b"\n".join(p.read_bytes() for p in files)[:max_bytes]
    if not Path(data).is_file():
        sys.exit(f"error: --data {data}: not a file")
    raw = Path(data).read_bytes()[:max_bytes]
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(raw) - 3:  # not a multi-byte character cut by the cap
            sys.exit(f"error: --data {data}: not UTF-8 text (byte {e.start} is {raw[e.start]:#x})")
    return raw

def load_tokens(data, min_tokens, cache_dir=".cache"):
    """Token ids (uint16) and the tokenizer: GPT-2 BPE if tiktoken's files are cached (no network
    to fetch them), else UTF-8 bytes (ids < 256). Tokenized once, cached atomically."""
    raw = read_corpus(data)
    tk_cache = (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
                or os.path.join(tempfile.gettempdir(), "data-gym-cache"))
    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    bpe = all(os.path.exists(os.path.join(tk_cache, hashlib.sha1(f"{url}{f}".encode()).hexdigest()))
              for f in ("vocab.bpe", "encoder.json"))
    tokenizer = "gpt2-bpe" if bpe else "utf8-bytes"
    path = Path(cache_dir) / f"tokens-{tokenizer}-{hashlib.sha1(raw).hexdigest()[:16]}.npy"
    try:
        return np.load(path), tokenizer
    except (OSError, ValueError, EOFError):  # absent, or left unreadable: tokenize again
        pass
    if bpe:
        import tiktoken
        ids = tiktoken.get_encoding("gpt2").encode_ordinary(raw.decode("utf-8", errors="replace"))
    else:
        print("tokenizer: tiktoken's GPT-2 BPE files are not cached (no network): UTF-8 bytes")
        ids = np.frombuffer(raw, dtype=np.uint8)
    ids = np.asarray(ids, dtype=np.uint16)
    if len(ids) < min_tokens:
        sys.exit(f"error: --data {data}: {len(ids)} tokens, fewer than one batch's {min_tokens}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, ids)
    os.replace(tmp, path)  # a reader never sees a half-written cache, even after Ctrl-C
    return ids, tokenizer

def get_batch(tokens, step, batch_size, seq_len, seed=0):
    """Batch number `step`, drawn by a generator seeded by (seed, step): the same in every rung."""
    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - seq_len - 1, batch_size)
    windows = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)
    return windows[:, :-1], windows[:, 1:]

def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value

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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a step or two per rung (the tests)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--out", default="out", help="figure folder")
    p.add_argument("--data", help="a UTF-8 text file (default: the stdlib's sources)")
    p.add_argument("--batch", type=positive_int, help="sequences per step, a multiple of 4")
    p.add_argument("--headline", action="store_true", help="baseline vs final rung, loss curves")
    p.add_argument("--interconnect", choices=["default", "staged"], default="default",
                   help="staged: NCCL without peer-to-peer, GPU to GPU via host memory")
    args = p.parse_args(argv)
    if args.batch is not None and args.batch % 4:
        p.error("argument --batch: a multiple of 4 (the first rungs take 4 micro-batches)")
    if args.headline and "RANK" in os.environ:
        p.error("--headline runs on one device: start it with python, not torchrun")
    check_outputs(args)
    return args

def use_interconnect(name):
    """Before the process group starts. 'staged' turns NCCL's peer-to-peer off, so every
    GPU-to-GPU byte goes through host memory, as on a PCIe box without P2P. NCCL's own log
    (NCCL_DEBUG=INFO, into a file per process) then says which transport it chose."""
    if name == "staged":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_FILE", f"{tempfile.gettempdir()}/nccl-{os.getpid()}.log")

def nccl_transport():
    """The transports NCCL's log names once a collective has run (e.g. P2P/CUMEM/read, or
    SHM/direct/direct when staged through host memory)."""
    try:
        text = Path(os.environ["NCCL_DEBUG_FILE"]).read_text()
    except (KeyError, OSError):
        return "not reported"
    return ", ".join(sorted(set(re.findall(r" via (\S+)", text)))) or "not reported"

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

def burst_peak(device, dtype, n, samples):
    """The matmul ceiling as 01_roofline.py measures it: bursts >= 5 ms of n x n matmuls, each
    after 100 ms idle and one untimed call. FLOP/s = 2 n^3 / the median seconds per matmul."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    calls, seconds = math.ceil(0.005 / bench(lambda: a @ b, device, reps=1, warmup=1)[0]), []
    for _ in range(samples):
        time.sleep(0.1)
        seconds.append(bench(lambda: [a @ b for _ in range(calls)], device, 1, 1)[0] / calls)
    return 2 * n**3 / statistics.median(seconds)

def energy_meter(device):
    """A function reading this GPU's energy counter in joules (NVML), or None without NVML."""
    try:  # torch's NVML handle (the one torch.cuda.power_draw reads: CUDA_VISIBLE_DEVICES-aware)
        import pynvml
        handle = torch.cuda._get_pynvml_handler(device)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # mJ since the driver loaded
    except Exception:  # no nvidia-ml-py, no NVIDIA driver, or no counter on this GPU
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3

def profile_step(step, device):
    """Seconds of one step per kernel class (on a CPU: op class, own time) and its wall time.
    One stream runs a step's kernels in order (one thread its ops), so their sum is the busy
    time and the rest is idle. Only DDP's all-reduce runs beside them (its own stream; on a CPU,
    gloo's threads, left out): what sums past the step overlapped compute, and is taken off
    communication, leaving what the step waited for."""
    gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - start
    events = sorted(prof.profiler.kineto_results.events(),
                    key=lambda e: (e.start_ns(), -e.duration_ns()))  # outer CPU ops first
    split, outer, thread = dict.fromkeys(CLASSES, 0.0), [], events[0].start_thread_id()
    for e in events:  # a GPU's kernels; a CPU's ops on the step's thread (gloo's: left out)
        if (e.device_type().name != "CPU") != gpu or (gpu and e.is_user_annotation()) or (
                not gpu and e.start_thread_id() != thread):
            continue
        name, seconds = e.name().lower(), e.duration_ns() / 1e9
        cls = next(c for c, (_, keys) in CLASSES.items() if any(k in name for k in keys))
        split[cls] += seconds
        while outer and outer[-1][0] <= e.start_ns():
            outer.pop()
        if outer:  # CPU ops nest: the open outer op's own time excludes this one's
            split[outer[-1][1]] -= seconds
        if not gpu:
            outer.append((e.end_ns(), cls))
    split["communication"] += min(wall - sum(split.values()), 0.0)  # the overlapped part
    split["idle"] = wall - sum(split.values())
    return split, wall

def config(run, setup):
    return GPTConfig.preset(run.sizes["preset"], **run.sizes["model"], vocab_size=setup["vocab"],
                            attn=setup["attn"], checkpoint=setup["checkpoint"])

def build(setup, run):
    """The rung's model at the shared init (GPT-2's 50257 embedding rows: a prefix of 50304)."""
    gc.collect()  # the last rung's model first: compiled modules hold reference cycles
    with torch.device(run.device):
        raw = model = GPT(config(run, setup))
    tied = ("transformer.wte.weight", "lm_head.weight")
    raw.load_state_dict({k: v[:setup["vocab"]] if k in tied else v
                         for k, v in run.init_state.items()})
    if setup["ddp"]:  # gradient_as_bucket_view: the gradients live in DDP's buckets
        model = DDP(raw, device_ids=run.device_ids, gradient_as_bucket_view=True)
    if setup["bf16_grads"]:  # gloo's hooks have no bf16: on CPU ranks fp16, the same bytes
        hook = (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook)[run.gpu]
        model.register_comm_hook(None, hook)
    if setup["compile"] and setup["ddp"]:  # else dynamo reuses the graph compiled without DDP:
        torch._dynamo.reset()  # one backward, no split at the buckets, no all-reduce overlapped
    if setup["compile"]:  # DDP compiled whole: the graph splits at its buckets, comm overlaps
        print(f"   compiling (torch.compile, {run.backend}) in the first step: inductor: ~1 min")
        model = torch.compile(model, backend=run.backend)
    return raw, model

def accumulate(model, x, y, accum, bf16):
    """Gradients of the batch's mean loss from `accum` equal micro-batches: each micro-batch's
    mean loss is divided by accum, so their gradients add up to the full batch's."""
    total = torch.zeros((), device=x.device)
    for x_micro, y_micro in zip(x.chunk(accum), y.chunk(accum)):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x_micro, y_micro)
        (loss / accum).backward()
        total += loss.detach() / accum
    return total

def accumulation_error(run, rows=4):
    """The gradient accumulated over 4 micro-batches vs the full batch's, before any optimizer
    step (fp32 baseline): their relative difference."""
    # PREDICTION: fp32 rounding, ~1e-6 (the same sums in another order). A step that forgot to
    # divide by the micro-batch count would be off by 3x - and AdamW's update would hide it.
    torch.set_float32_matmul_precision("highest")
    raw, model = build(BASELINE, run)
    x, y = (t[:rows] for t in run.batches[0])
    grads = []
    for accum in (BASELINE["accum"], 1):
        accumulate(model, x, y, accum, bf16=False)
        grads.append(torch.cat([p.grad.flatten() for p in raw.parameters()]))
        raw.zero_grad(set_to_none=True)
    return ((grads[0] - grads[1]).norm() / grads[1].norm()).item()

def train(setup, run, steps):
    """A rung: WARMUP steps; `steps` timed in windows of one step (the host reads each loss)
    or WINDOW steps, NVML's energy around them; one profiled step. Under DDP each process
    trains its rows of every batch."""
    torch.set_float32_matmul_precision(("highest", "high")[setup["tf32"]])
    raw, model = build(setup, run)
    opt = raw.configure_optimizer(lr=6e-4, weight_decay=0.1, fused=setup["fused"])
    world, rows, window, losses = 1, slice(None), 1, []
    if setup["ddp"]:
        world, rows = run.world, run.rows
    if not setup["host_sync"]:
        window = min(WINDOW, steps)

    def optimizer_steps(count):
        for _ in range(count):
            x, y = (t[rows] for t in run.batches[len(losses) % len(run.batches)])
            loss = accumulate(model, x, y, setup["accum"], setup["bf16"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            if world > 1:  # the global batch's mean loss: the mean of the ranks' means
                dist.all_reduce(loss)
            losses.append(loss / world)
            if setup["host_sync"]:
                losses[-1] = losses[-1].item()  # the host waits for the device here

    if run.gpu:
        torch.cuda.reset_peak_memory_stats(run.device)
    first = bench(lambda: optimizer_steps(1), run.device, reps=WARMUP, warmup=0)[2]
    joules, reps = run.energy and -run.energy(), math.ceil(steps / window)
    median, fastest, slowest = (seconds / window for seconds in bench(
        lambda: optimizer_steps(window), run.device, reps, warmup=0))
    joules = run.energy and joules + run.energy()  # this GPU's, for its share of the tokens
    split, wall = profile_step(lambda: optimizer_steps(1), run.device)
    x, peak = run.batches[0][0][rows], None
    if run.gpu:
        peak = torch.cuda.max_memory_allocated(run.device)
    return dict(settings=setup, world_size=world, ms_per_step=median * 1e3, ms_min=fastest * 1e3,
                ms_max=slowest * 1e3, tokens_per_step=x.numel() * world, profile=split,
                tokens_per_s=x.numel() * world / median, losses=[float(v) for v in losses],
                loss=float(losses[-1]), profile_step_s=wall, compile_s=max(0.0, first - median),
                peak_mem_bytes=peak, tokens_per_joule=joules and x.numel() * reps * window / joules,
                activation_bytes=activation_bytes(config(run, setup), len(x) // setup["accum"],
                                                  bf16=setup["bf16"]))  # predicted (model_torch)

def keeps(change, run):
    """Measure -> fix -> re-measure: a fix for a regime this device is not in is measured, then
    not carried forward: checkpointing (memory does not bind here), and bf16 autocast on a CPU
    (no bf16 matmul units: its bf16 matmuls run 10-20x slower than fp32)."""
    return not change.get("checkpoint") and (run.gpu or not change.get("bf16"))

def final_setup(run):
    """The last single-device configuration: every rung this device keeps."""
    kept = [change for _, change, _ in RUNGS[:-2] if keeps(change, run)]
    return {key: value for change in [BASELINE] + kept for key, value in change.items()}

def measure(name, why, setup, run, base=None, steps=None):
    """Train one rung (or say why not), derive its numbers, print them in one line; base: the
    rung its speed-up and loss gap are measured against (default: itself)."""
    print(f"{name}: predicted {why}", flush=True)
    if setup["ddp"] and run.world == 1:
        hint = ("they need one process per GPU: torchrun --standalone --nproc_per_node=2 "
                "07_capstone_torch.py (CPU ranks: --device cpu)")
        print(f"   skipped: {hint}")
        return dict(name=name, skipped=hint, kept=False)
    if steps is None:
        steps = run.sizes["steps"] if setup["compile"] else run.sizes["eager_steps"]
    r = dict(name=name, **train(setup, run, steps))
    base, split, peak = base or r, r["profile"], r["peak_mem_bytes"]
    flops = run.flops_per_token * r["tokens_per_s"] / r["world_size"]  # per GPU
    binds = max(split, key=split.get)  # the class with the largest share of the step
    r.update(mfu_datasheet=run.datasheet and flops / run.datasheet, kept=keeps(setup, run),
             mfu_measured_peak=flops / run.peak, binds=binds, regime=CLASSES[binds][0],
             speedup=r["tokens_per_s"] / base["tokens_per_s"], fits_24gb=peak and peak < FITS,
             loss_rel_diff=max(abs(a - b) / b for a, b in zip(r["losses"], base["losses"])),
             unreliable=flops > min(1.1 * run.peak, run.datasheet or math.inf)
             or r["ms_max"] - r["ms_min"] > r["ms_per_step"])
    print(f"   {name + ' (dropped)' * (not r['kept']):34s} {r['ms_per_step']:8.1f} "
          f"{r['tokens_per_s']:10,.0f} {r['speedup']:7.2f}x {fmt(r['mfu_datasheet'], '.1%'):>7}"
          f" {r['mfu_measured_peak']:9.1%} {fmt(peak and peak / 2**30, '.1f'):>8} "
          f"{fmt(r['fits_24gb']):>5} {fmt(r['tokens_per_joule'], ',.0f'):>8} "
          f"{r['compile_s']:6.1f}s {r['loss_rel_diff']:7.2%}  {binds} "
          f"{split[binds] / r['profile_step_s']:.0%} ({r['regime']})"
          + "  unreliable (machine busy)" * r["unreliable"])
    return r

def fmt(value, spec=""):
    """A number, or n/a where this machine cannot measure it; yes/no for a verdict."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return ("no", "yes")[value]
    return format(value, spec)

def waterfall(run):
    """The accumulation check, then each rung's change on top of what the rungs before kept;
    under torchrun, the final single-device rung on each GPU alone, then the DDP rungs."""
    error = accumulation_error(run)
    print(f"measured: gradient accumulated over {BASELINE['accum']} micro-batches vs the full "
          f"batch: relative difference {error:.1e} (tolerance {ACCUM_TOLERANCE:.0e})\n{HEADER}")
    rungs, kept, todo = [], BASELINE, RUNGS
    if run.world > 1:
        # PREDICTION: alone, each GPU trains the whole batch in `world` micro-batches, each one
        # DDP rank's share: the same math as DDP (the same losses, to rounding), the same work
        # per GPU. DDP's tokens/s over world x this rate then leaves what DDP adds: all-reduce
        # not hidden under backward, and each rank's own optimizer step (alone: one a batch).
        kept, todo = final_setup(run), RUNGS[-2:]
        why = f"the batch in {run.world} micro-batches, one rank's share each: DDP's reference"
        rungs.append(measure("final rung, each GPU alone", why, dict(kept, accum=run.world), run))
    for name, change, why in todo:
        rungs.append(measure(name, why, {**kept, **change}, run, rungs and rungs[0]))
        if rungs[-1]["kept"]:
            kept = {**kept, **change}
    done = [r for r in rungs if "loss" in r]
    checks = dict(accumulated_gradient_equals_full_batch=error <= ACCUM_TOLERANCE,
                  losses_track_baseline=all(r["loss_rel_diff"] <= TOLERANCE for r in done),
                  time_split_adds_up=all(min(r["profile"].values()) >= 0 for r in done))
    if run.world == 1:  # checkpointing against the last kept rung: measured memory on a GPU,
        memory = ("activation_bytes", "peak_mem_bytes")[run.gpu]  # predicted on a CPU
        before = [r for r in rungs[:-3] if r["kept"]][-1]
        checks["checkpointing_lowers_memory"] = rungs[-3][memory] < before[memory]
    for rung in done[1:]:  # under torchrun: the DDP rungs against world x one GPU alone
        if rung["world_size"] > 1:
            rung["scaling"] = rung["tokens_per_s"] / (run.world * done[0]["tokens_per_s"])
            print(f"derived: {rung['name']}: scaling {rung['scaling']:.1%} of {run.world} x "
                  "one GPU alone")
    return dict(rungs=rungs, accumulation_rel_diff=error, loss_tolerance=TOLERANCE, checks=checks)

def headline(run):
    """The chapter's opening claim: the baseline and the final rung trained for the same steps
    from one init on the same batches: loss against step, and against wall-clock."""
    # PREDICTION: the curves lie on each other (rounding: within ~1% at every step) while the
    # final rung is ~10x faster per step on a GPU, ~1.5x on a CPU; its compile is paid once.
    steps = run.sizes["headline_steps"]
    print(HEADER)
    base = measure(*RUNGS[0][::2], BASELINE, run, steps=steps)
    last = measure("final rung (every rung kept)", "the same curve, ~10x sooner",
                   final_setup(run), run, base, steps)
    gap, ratio = last["loss_rel_diff"], base["ms_per_step"] / last["ms_per_step"]
    count = len(base["losses"])  # with the warm-up and the profiled steps
    print(f"measured: largest relative loss gap over {count} steps {gap:.2%} (tolerance "
          f"{HEADLINE_TOLERANCE:.0%})\nderived: the final rung is {ratio:.1f}x faster per step "
          f"(its compile, {last['compile_s']:.0f} s, is left off the wall-clock axis)")
    return dict(steps=count, rungs=[base, last], largest_loss_gap=gap, time_ratio=ratio,
                tolerance=HEADLINE_TOLERANCE,
                checks=dict(headline_losses_track=gap <= HEADLINE_TOLERANCE))

def plot(result, out, headline):
    """Two panels: the waterfall's tokens/s and where each step's time goes, or the headline's
    loss against step and against wall-clock; saved as out/07_capstone_torch[_headline].png."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("figure skipped (no matplotlib)")
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    done, name = [r for r in result["rungs"] if "loss" in r], "07_capstone_torch"
    if headline:
        name += "_headline"
        for r in done:
            steps = np.arange(1, len(r["losses"]) + 1)
            left.plot(steps, r["losses"], label=r["name"])
            right.plot(steps * r["ms_per_step"] / 1e3, r["losses"])
        left.set(xlabel="optimizer step", ylabel="training loss (measured)",
                 title=f"the same curve: largest gap {result['largest_loss_gap']:.2%}")
        right.set(xlabel="wall-clock s (steps x measured median step; compile left out)",
                  xscale="log", title=f"{result['time_ratio']:.1f}x apart")
        left.legend()
    else:
        names, stacked = [r["name"] for r in done], np.zeros(len(done))
        bars = left.barh(names, [r["tokens_per_s"] for r in done],
                         color=[("tab:red", "tab:blue")[r["kept"]] for r in done])
        left.bar_label(bars, [f"{r['speedup']:.1f}x" for r in done], fontsize=8)
        left.set(xlabel="tokens/s (measured)", title="speed-up over the first rung (red: dropped)")
        left.invert_yaxis()
        for cls in CLASSES:
            share = np.array([r["profile"][cls] / r["profile_step_s"] for r in done])
            right.barh(names, share, left=stacked, label=cls)
            stacked += share
        right.set(xlabel="share of a profiled step (measured)", title="where a step's time goes",
                  xlim=(0, 1.45))  # room for the legend
        right.legend(fontsize=8, loc="center right")
    path, tmp = Path(out) / f"{name}.png", Path(out) / f"{name}.tmp{os.getpid()}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    print(f"figure: {path}")

def prepare(args, device, rank=0, world=1):
    """What every rung shares: sizes, batches, one init, the peaks; the first lines printed."""
    gpu, sizes = device.type == "cuda", SIZES["quick" if args.quick else device.type]
    batch = sizes["headline_batch" if args.headline else "batch"]
    if args.batch is not None:
        batch = args.batch
    if batch % world:
        sys.exit(f"error: {batch} sequences per step do not split into {world} equal shares")
    run = SimpleNamespace(device=device, gpu=gpu, sizes=sizes, world=world, datasheet=None,
                          rows=slice(rank * batch // world, (rank + 1) * batch // world),
                          device_ids=None, energy=None, backend="inductor")
    name, memory, n, dtype = platform.machine(), f"{os.cpu_count()} cores", 1024, torch.float32
    if gpu:
        name, n, dtype = torch.cuda.get_device_name(device), 8192, torch.bfloat16
        memory = f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"
        run.datasheet, run.device_ids = datasheet_bf16_peak(name), [device.index]
        run.energy = energy_meter(device)
    if args.quick and not gpu:  # the tests: dynamo captures the graphs, runs them eagerly
        run.backend = "eager"  # (inductor's C++ build takes minutes)
    torch._dynamo.reset()  # every run compiles afresh: no graph kept from an earlier run
    print(f"device: {name}, {memory} | torch {torch.__version__} | python "
          f"{platform.python_version()} | compile backend {run.backend}")
    shipped = config(run, dict(BASELINE, vocab=50257))  # GPT-2 as shipped: the FLOPs that count
    tokens, tokenizer = load_tokens(args.data, shipped.block_size + 2)
    run.batches = [tuple(torch.from_numpy(a).to(device) for a in get_batch(tokens, i, batch,
                   shipped.block_size)) for i in range(WARMUP + 1 + sizes["headline_steps"])]
    torch.manual_seed(0)  # one init for every rung (vocab 50304; GPT-2's rows are its prefix)
    run.init_state = GPT(config(run, dict(BASELINE, vocab=50304))).state_dict()
    run.peak = burst_peak(device, dtype, n, (10, 3)[args.quick])
    run.flops_per_token = flops_per_token(shipped)
    print(f"data: {len(tokens):,} tokens ({tokenizer}), {batch} x {shipped.block_size} tokens "
          f"per step; model {sizes['preset']} ({shipped.n_layer} layers, d={shipped.n_embd})\n"
          f"derived: flops_per_token = 6N + 12LTd = {run.flops_per_token / 1e6:.1f} MFLOP\n"
          f"reference: datasheet dense bf16 peak {fmt(run.datasheet and run.datasheet / 1e12)} "
          f"TFLOP/s (NVIDIA)\nmeasured: {n} x {n} {dtype} matmul peak (burst) "
          f"{run.peak / 1e12:.3g} TFLOP/s")
    return run, dict(device=dict(name=name, type=device.type, memory=memory,
                                 torch=torch.__version__), tokenizer=tokenizer,
                     flops_per_token=run.flops_per_token,
                     peaks=dict(datasheet_bf16=run.datasheet, measured_matmul_burst=run.peak))

def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*dynamo_pgo force disabled")
    warnings.filterwarnings("ignore", message=".*Profiler clears events")  # one profile a rung
    for name in ("torch._dynamo.variables.torch", "torch._dynamo.variables.ctx_manager"):
        logging.getLogger(name).addFilter(lambda record: "will be ignored" not in str(record.msg))
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no "USDT" lines around each profile
    torch._inductor.config.force_disable_caches = True  # every compile cold: its time is true
    torch._inductor.config.cpp.enable_kernel_profile = True  # CPU kernels named in the profile
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # one each
    if args.device == "cuda" and not gpus:
        sys.exit("error: --device cuda: fewer CUDA GPUs here than processes (one GPU each)")
    start, device = time.perf_counter(), torch.device("cpu")
    own_log = "NCCL_DEBUG_FILE" not in os.environ  # this process's NCCL log: removed at the end
    if args.device != "cpu" and gpus:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        use_interconnect(args.interconnect)
    if rank:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports; errors still reach stderr
    if world > 1:  # torchrun started this process: a process group for the DDP rungs
        dist.init_process_group(("gloo", "nccl")[device.type == "cuda"],
                                timeout=timedelta(seconds=120))
    try:
        run, result = prepare(args, device, rank, world)
        if world > 1:
            dist.all_reduce(torch.ones(1, device=device))  # the first collective: NCCL's path
            sync(device)
            transport = "gloo on CPU ranks: the flag changes nothing"
            if device.type == "cuda":
                transport = f"NCCL reports {nccl_transport()}"
            print(f"interconnect: {args.interconnect} ({world} processes); {transport}")
            result.update(world_size=world, interconnect=args.interconnect, transport=transport)
        result.update((waterfall, headline)[args.headline](run))
    finally:
        if world > 1:
            dist.destroy_process_group()
        if own_log and "NCCL_DEBUG_FILE" in os.environ:
            Path(os.environ["NCCL_DEBUG_FILE"]).unlink(missing_ok=True)
    result.update(lesson="07_capstone_torch", quick=args.quick, wall_s=time.perf_counter() - start)
    for check, ok in result["checks"].items():
        print(f"check {check}: {('FAILED', 'ok')[ok]}")
    print(f"wall time: {result['wall_s']:.0f} s")
    if rank == 0:
        plot(result, args.out, args.headline)
    if args.json and rank == 0:
        write_json(args.json, result)
    failed = [check for check, ok in result["checks"].items() if not ok]
    if failed:
        sys.exit(f"error: check failed: {', '.join(failed)}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
