"""
Section 13.6: production data parallelism, two philosophies.

PyTorch (one process per device, explicit collectives): [1] DistributedDataParallel (DDP) ends
where 05's hand-rolled data parallelism ends (checked); [2] its step time against hand-rolled
and a bucket_cap_mb sweep, timed in turns (A B C, A B C, ...) so that each difference is
resolved or called noise; [3] the share of communication hidden under backward, from a
torch.profiler trace; [4] no_sync under gradient accumulation: the right loop and the trap;
[5] FSDP2's bytes per rank. JAX (one process drives every device, implied collectives): a Mesh
with a 'data' axis, a plain jax.jit whose compiled program holds the all-reduce, loss and step
time against one device; then the parameters sharded over 'data' too.

  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 06_ddp_prod.py  # CPU: 4 gloo ranks
  torchrun --standalone --nproc_per_node=2 06_ddp_prod.py [--interconnect staged]  # 2 GPUs
  python 06_ddp_prod.py         # JAX: one process, every GPU (a CPU: --cpu-devices simulated)
(One GPU: --nproc_per_node=1 runs, with nothing to all-reduce.) Expect a labelled line per number
and "checks: ALL PASSED".

staged: NCCL without peer-to-peer, every GPU-to-GPU byte through host memory, as on the
chapter's PCIe machine. Past one machine: torchrun --nnodes=2 --nproc_per_node=8
--rdzv-backend=c10d --rdzv-endpoint=HOST:29500 on each; JAX: one process per machine, each
calling jax.distributed.initialize("HOST:1234", num_processes=2, process_id=i) first (not done
here). --out gets 06_bucket_sweep_<interconnect>.png and the trace 06_ddp_trace_<interconnect>
.json (ui.perfetto.dev). --quick on a CPU: ~10 s. Copy with model_torch.py and model_jax.py.
"""

import argparse, copy, dataclasses, datetime, gc, json, os, re, statistics, sys, tempfile, time
import warnings
from collections import namedtuple
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from model_torch import GPT, GPTConfig

LR = 6e-4
# The checks run in fp32 (a GPU: manual attention, no atomics): two runs of the same math differ
# by summation order only, far below LR / 6; a wrong all-reduce moves parameters by ~LR a step.
PARAM_TOL = LR / 6
MICRO_STEPS = 4     # gradient accumulation: k micro-batches per optimizer step
PROFILED_STEPS = 2  # steps under torch.profiler per variant: a small trace
TIMEOUT_S = 60      # a rank left waiting this long in a collective gives up, never hangs
# rows per rank (JAX: per device); `passes` turns of every variant, a sample the median of
# `reps` steps; `caps`: the bucket_cap_mb swept (None: DDP's default)
Plan = namedtuple("Plan", "config batch seq_len passes reps caps")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")

def make_plan(quick, gpu):
    if gpu:
        return Plan(GPTConfig.preset("gpt2"), 8, 1024, 7, 5, (1, 5, 25, None, 100, 1000))
    if quick:  # 1 layer, a small vocabulary: a smoke run, not a measurement
        tiny = GPTConfig.preset("tiny", n_layer=1, block_size=64, vocab_size=4096)
        return Plan(tiny, 2, 64, 2, 1, (0.25, None))
    return Plan(GPTConfig.preset("tiny"), 2, 128, 3, 1, (0.25, 1, None, 25))

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
    if device.type == "cuda":  # JAX's timed functions block on their own results
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

def interleaved(variants, against, device, passes, reps, warmup=1):
    """Time the variants in turns (A B C, A B C, ...): drift and noise hit them alike. A sample
    is bench's median of reps steps (ms), the slowest rank's. What name saves against[name]: the
    median of the differences within each pass, resolved when their IQR excludes zero."""
    samples = {name: [] for name in variants}
    for _ in range(passes):
        for name, fn in variants.items():
            ms = torch.tensor(bench(fn, device, reps, warmup)[0] * 1e3, device=device)
            if dist.is_initialized():  # a data-parallel step is as slow as its slowest rank
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            samples[name].append(ms.item())
    result = {}
    for name, mine in samples.items():
        q1, median, q3 = statistics.quantiles(mine, n=4, method="inclusive")
        result[name] = dict(median_ms=median, q1_ms=q1, q3_ms=q3,
                            unreliable=max(mine) - min(mine) > median)
        if name in against:
            diffs = [b - a for a, b in zip(mine, samples[against[name]])]
            d1, saved, d3 = statistics.quantiles(diffs, n=4, method="inclusive")
            result[name].update(against=against[name], saves_ms=saved, saves_iqr_ms=(d1, d3),
                                resolved=d1 > 0 or d3 < 0)
    return result

def said(t):  # an interleaved() result, as text
    text = f"{t['median_ms']:6.1f} ms (median; IQR {t['q1_ms']:.1f}-{t['q3_ms']:.1f}; measured)"
    if t["unreliable"]:  # the samples spread wider than their median
        text += " unreliable (machine busy)"
    if "against" in t:
        (d1, d3), verdict = t["saves_iqr_ms"], {True: "resolved", False: "within noise"}
        text += f", saves {t['saves_ms']:+.1f} ms vs {t['against']} (IQR {d1:+.1f}..{d3:+.1f}: "
        text += f"{verdict[t['resolved']]})"
    return text

def header(args, plan, device_name, memory, versions, transport, per):  # first lines, JSON head
    c = plan.config
    print(f"device: {device_name}, {memory / 2**30:.0f} GiB | {versions}")
    print(f"interconnect: {args.interconnect}; NCCL reports: {transport}")
    print(f"model: {c.n_layer} layers, d {c.n_embd}, vocab {c.vocab_size}, {plan.batch} x "
          f"{plan.seq_len} tokens per {per}")
    return dict(lesson="06_ddp_prod", framework=args.framework, quick=args.quick,
                device=dict(name=device_name, versions=versions),
                interconnect=dict(name=args.interconnect, transport=transport),
                model=dict(dataclasses.asdict(c), batch=plan.batch, seq_len=plan.seq_len))

def finish(result, args, speaks):
    failed = [name for name, ok in result["checks"].items() if not ok]
    print("checks:", f"FAILED {failed}" if failed else "ALL PASSED")
    if args.json and speaks:
        write_json(args.json, result)
    return not failed

# =======================================================================================
# PyTorch: one process per device, explicit collectives

def setup_torch(args):  # NCCL on GPU LOCAL_RANK if every rank on this node has one, else gloo
    world, gpus = int(os.environ["WORLD_SIZE"]), torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if args.device == "cuda" and gpus < local_world:
        sys.exit(f"error: --device cuda: {local_world} ranks on this node but {gpus} GPU(s); "
                 f"run torchrun --nproc_per_node={max(gpus, 1)} ..., or use --device cpu")
    device, backend = torch.device("cpu"), "gloo"
    if args.device != "cpu" and 0 < local_world <= gpus:
        device, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
        torch.cuda.set_device(device)
    use_interconnect(args.interconnect)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dist.all_reduce(torch.ones(1, device=device))  # the first collective: NCCL connects now
    sync(device)
    return dist.get_rank(), world, device

def make_batches(plan, rank, world, device):  # the same global batches; each rank its rows
    generator, shape = torch.Generator().manual_seed(1), (plan.batch * world, plan.seq_len + 1)
    rows = slice(rank * plan.batch, (rank + 1) * plan.batch)
    batches = [torch.randint(0, plan.config.vocab_size, shape, generator=generator)[rows]
               for _ in range(MICRO_STEPS)]
    return [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in batches]

def loss_of(model, x, y, amp, micro_steps=1):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        return model(x, y)[1] / micro_steps  # equal micro-batches: sum of k losses / k = mean

def train_step(model, opt, x, y, amp, handrolled=False):
    loss = loss_of(model, x, y, amp)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DDP (and FSDP2): the module's hooks run the collectives inside backward
    if handrolled:  # 05's way: the whole backward first, then every gradient: nothing overlaps
        for p in model.parameters():
            dist.all_reduce(p.grad.div_(dist.get_world_size()))
    opt.step()

def counting_allreduce(counter, bucket):  # a DDP comm hook: count, then DDP's own all-reduce
    counter["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)

def wrap_ddp(model, device, cap=None, counter=None):  # DDP around a copy of model, its AdamW
    options = {}
    if cap is not None:  # None: DDP's default buckets
        options["bucket_cap_mb"] = cap
    if device.type == "cuda":
        options["device_ids"] = [device.index]
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), **options)
    if counter is not None:
        ddp.register_comm_hook(counter, counting_allreduce)
    return ddp, ddp.module.configure_optimizer(lr=LR)

def max_diff(tensors_a, tensors_b, device):  # the largest |a - b| over all tensors and ranks
    local = max((a.detach().float() - b.detach().float()).abs().max().item()
                for a, b in zip(tensors_a, tensors_b))
    value = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()

def exp_equivalence(base, batches, device):
    # PREDICTION: the same math (the mean of the ranks' gradients, the same AdamW): after 3
    # steps the parameters agree to rounding, bit for bit with 2 ranks (a + b = b + a).
    hand, (ddp, opt_ddp) = copy.deepcopy(base), wrap_ddp(base, device)
    opt_hand = hand.configure_optimizer(lr=LR)
    for x, y in batches:
        train_step(hand, opt_hand, x, y, amp=False, handrolled=True)
        train_step(ddp, opt_ddp, x, y, amp=False)
    diff = max_diff(hand.parameters(), ddp.module.parameters(), device)
    return dict(steps=len(batches), max_abs_param_diff=diff)

def exp_ddp_speed(base, x, y, device, plan, amp, trace):
    # PREDICTION, GPT-2 on two GPUs: 498 MB of fp32 gradients per rank and step against 6 x 124M
    # x 8192 = 6 TFLOP of compute, tens of ms in eager bf16 (H200: 989 TFLOP/s bf16, datasheet).
    # NVLink 4 (450 GB/s each way, datasheet): the all-reduce takes 1-2 ms, a few % of a step:
    #   DDP wins about that (148 calls become ~15, partly under backward), the bucket size
    #   barely matters, and one huge bucket may even win: little to hide, and each extra
    #   bucket's copy, launch and NCCL kernel (taking SMs from backward) costs more than it hides.
    # Staged through host memory (PCIe 5.0 x16: 64 GB/s each way, spec, plus a host copy): >= 8
    #   ms, 10-20 in practice, like the compute. Hand-rolled pays it all after backward, DDP hides
    #   most of it and wins clearly. Tiny buckets pay a latency each, one huge bucket waits for
    #   the whole backward: the best cap in between, near the 25 MiB default.
    # CPU (gloo): the ranks share the cores, overlap finds no idle one: DDP gains by fewer calls.
    hand = copy.deepcopy(base)
    variants = {"hand-rolled": partial(train_step, hand, hand.configure_optimizer(lr=LR), x, y,
                                       amp, handrolled=True)}
    caps = {"default" if cap is None else f"{cap:g} MiB": cap for cap in plan.caps}
    for name, cap in caps.items():
        variants[name] = partial(train_step, *wrap_ddp(base, device, cap), x, y, amp)
    against = {name: "default" for name in caps} | {"default": "hand-rolled"}
    rows = interleaved(variants, against, device, plan.passes, plan.reps)
    for name, row in rows.items():
        counter = dict(calls=len(list(base.parameters())))  # hand-rolled: one per tensor
        if name in caps:  # a counting twin (the timed models carry no hook)
            ddp, _ = wrap_ddp(base, device, caps[name], counter)
            for _ in range(2):  # the second backward: DDP rebuilds its buckets after the first
                counter["calls"] = 0
                loss_of(ddp, x, y, amp).backward()
        row.update(name=name, bucket_cap_mb=caps.get(name), allreduce_calls_per_step=
                   counter["calls"], **exp_overlap(variants[name], device, {"default": trace}.get(name)))
    return rows

def exp_overlap(step, device, trace):
    # PREDICTION: hand-rolled hides nothing; DDP runs all buckets but the last under backward.
    # GPU: NCCL kernels against all others; CPU: gloo's all-reduce (own threads) against
    # autograd's ops. A collective's time includes waiting for the slower rank.
    activity = torch.profiler.ProfilerActivity.CPU  # a GPU: its kernels only (a small trace)
    if device.type == "cuda":
        activity = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        sync(device)
    comm, compute = [], []
    for e in prof.events():
        kernel = e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
        if (kernel and "nccl" in e.name.lower()) or e.name == "gloo:all_reduce":
            comm.append((e.time_range.start, e.time_range.end))
        elif kernel or e.name.startswith("autograd::engine::evaluate_function"):
            compute.append((e.time_range.start, e.time_range.end))
    comm, busy = union(comm), union(compute)
    comm_us = sum(end - start for start, end in comm)
    hidden_us = sum(max(0, min(end, b_end) - max(start, b_start))
                    for start, end in comm for b_start, b_end in busy)
    if trace is not None:  # Chrome/Perfetto JSON
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(f"{trace}.tmp{os.getpid()}")
        os.replace(f"{trace}.tmp{os.getpid()}", trace)
    return dict(comm_ms_per_step=comm_us / 1e3 / PROFILED_STEPS,
                overlap_fraction=hidden_us / comm_us if comm_us else float("nan"))

def union(spans):  # time spans merged where they overlap, in order
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged

def accumulate_no_sync(ddp, micro, amp):
    # the right way: forward AND backward inside no_sync for all but the last micro-batch,
    # whose backward all-reduces the sum of all k gradients, once
    ddp.zero_grad(set_to_none=True)
    for x, y in micro[:-1]:
        with ddp.no_sync():
            loss = loss_of(ddp, x, y, amp, len(micro))
            loss.backward()
    x, y = micro[-1]
    loss_of(ddp, x, y, amp, len(micro)).backward()

def accumulate_trap(ddp, micro, amp):
    # the trap: forward outside no_sync. DDP decides during forward whether the coming backward
    # syncs, so every backward still all-reduces, as if no_sync were not there
    ddp.zero_grad(set_to_none=True)
    for x, y in micro[:-1]:
        loss = loss_of(ddp, x, y, amp, len(micro))
        with ddp.no_sync():
            loss.backward()
    x, y = micro[-1]
    loss_of(ddp, x, y, amp, len(micro)).backward()

def exp_no_sync(check_base, base, micro, device, plan, amp):
    # PREDICTION: k = 4 micro-batches. The trap all-reduces every backward, k times one step's
    # buckets; the right way only the last: k-fold fewer calls, the same gradients (the mean of
    # sums is the sum of means). Time saved: 3 all-reduces of every gradient, 3-6 ms over
    # NVLink (perhaps within noise), tens of ms staged through host memory (see [2]).
    loops = dict(no_sync=accumulate_no_sync, backward_only_in_no_sync=accumulate_trap)
    counter = dict(calls=0)
    ddp, _ = wrap_ddp(check_base, device, counter=counter)  # fp32: the gradient check
    accumulate_trap(ddp, micro, False)  # DDP rebuilds its buckets after the first backward
    result, grads = dict(k=len(micro)), {}
    for name, loop in loops.items():
        counter["calls"] = 0
        loop(ddp, micro, False)
        grads[name] = [p.grad.clone() for p in ddp.module.parameters()]
        result[name] = dict(allreduce_calls=counter["calls"])
    result["max_abs_grad_diff"] = max_diff(*grads.values(), device)
    result["max_abs_grad"] = max(g.abs().max().item() for g in grads["no_sync"])
    timed, _ = wrap_ddp(base, device)  # the timed model: no hook, autocast on a GPU
    accumulate_trap(timed, micro, amp)  # its first backward, where DDP rebuilds its buckets
    variants = {name: partial(loop, timed, micro, amp) for name, loop in loops.items()}
    against = dict(no_sync="backward_only_in_no_sync")
    for name, row in interleaved(variants, against, device, plan.passes, 1, 0).items():
        result[name].update(row)
    return result

def state_bytes(model, opt):  # params, grads and AdamW state on this rank (a DTensor: its shard)
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()),
               *(v for state in opt.state.values() for v in state.values() if torch.is_tensor(v))]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)

def exp_fsdp(base, batches, world, device):
    # PREDICTION: DDP keeps a full replica of params, grads and both AdamW moments on every rank
    # (16 bytes/param); FSDP2 keeps 1/N of each, all-gathers a block's params just in time for
    # its forward and backward, and reduce-scatters the grads: ~1/N, same math.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard  # FSDP2: public since torch 2.6; gloo works
    (ddp, opt_ddp), sharded = wrap_ddp(base, device), copy.deepcopy(base)
    mesh = init_device_mesh(device.type, (world,))
    for block in sharded.transformer.h:
        fully_shard(block, mesh=mesh)  # one all-gather unit per block
    fully_shard(sharded, mesh=mesh)  # the rest (embeddings = tied head, ln_f) at the root
    opt_sharded = sharded.configure_optimizer(lr=LR)
    for x, y in batches:
        train_step(ddp, opt_ddp, x, y, amp=False)
        train_step(sharded, opt_sharded, x, y, amp=False)
    gathered = (p.full_tensor() for p in sharded.parameters())  # all-gathered from the shards
    full, shard = state_bytes(ddp.module, opt_ddp), state_bytes(sharded, opt_sharded)
    return dict(steps=len(batches), max_abs_param_diff=max_diff(ddp.module.parameters(),
                gathered, device), replicated_bytes=full, sharded_bytes=shard,
                sharded_over_replicated=shard / full)

def plot_sweep(hand, rows, path):  # step time against bucket size, labelled with the overlap
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("figure skipped (matplotlib missing)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    swept = [row for row in rows if row["name"] != "default"]
    default = next(row for row in rows if row["name"] == "default")
    ax.axhline(hand["median_ms"], color="gray", ls="--", label="hand-rolled (nothing hidden)")
    ax.plot([row["bucket_cap_mb"] for row in swept], [row["median_ms"] for row in swept], "o-",
            label="DDP, bucket_cap_mb (%: communication hidden under backward)")
    ax.plot(25, default["median_ms"], "*", markersize=12,
            label=f"DDP default (25 MiB buckets): {default['overlap_fraction']:.0%} hidden")
    for row in swept:
        ax.annotate(f"{row['overlap_fraction']:.0%} hidden", (row["bucket_cap_mb"], row["median_ms"]),
                    textcoords="offset points", xytext=(5, 6), fontsize=8)
    ax.set(xscale="log", xlabel="bucket_cap_mb (MiB)", ylabel="ms / step (median of the passes)",
           ylim=(0, 1.2 * max(row["median_ms"] for row in rows + [hand])),
           title="DDP step time against bucket size")
    ax.legend(loc="lower right", fontsize=8)
    tmp = path.with_suffix(f".tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
    print(f"figure: {path}")

def report_torch(r, world):
    eq, ns, fsdp = r["equivalence"], r["no_sync"], r["fsdp"]
    print(f"[1] DDP vs hand-rolled after {eq['steps']} AdamW steps (fp32): max |param diff| "
          f"{eq['max_abs_param_diff']:.2e} (measured; tolerance {PARAM_TOL:.0e})")
    for row in [r["step_time"]["handrolled"]] + r["bucket_sweep"]:
        print(f"[2] {row['name']:>11}: {row['allreduce_calls_per_step']:3d} all-reduces/step "
              f"(counted), {said(row)}")
        print(f"[3] {row['name']:>11}: communication {row['comm_ms_per_step']:.1f} ms/step, "
              f"{row['overlap_fraction']:.0%} of it under backward (measured, profiler)")
    for name in ("no_sync", "backward_only_in_no_sync"):
        print(f"[4] {name:24s}: {ns[name]['allreduce_calls']:3d} all-reduces for {ns['k']} "
              f"micro-batches (counted), {said(ns[name])}")
    print(f"[4] gradients, no_sync vs the trap (which syncs every micro-batch): max |diff| "
          f"{ns['max_abs_grad_diff']:.2e} of max |grad| {ns['max_abs_grad']:.2e} (measured)")
    print(f"[5] FSDP2 vs DDP after {fsdp['steps']} steps (fp32): max |param diff| "
          f"{fsdp['max_abs_param_diff']:.2e} (measured)")
    print(f"[5] params + grads + AdamW state per rank: replicated {fsdp['replicated_bytes'] / 2**20:.2f}"
          f" MiB, sharded {fsdp['sharded_bytes'] / 2**20:.2f} MiB ({fsdp['sharded_over_replicated']:.3f};"
          f" 1/N = {1 / world:.3f}; measured)")

def torch_lesson(args, rank, world, device):
    cuda, out = device.type == "cuda", Path(args.out)
    plan = make_plan(args.quick, cuda)
    trace = out / f"06_ddp_trace_{args.interconnect}.json"
    if rank != 0:
        sys.stdout, trace = open(os.devnull, "w"), None  # one rank speaks and writes
    torch.manual_seed(0)  # the same weights on every rank (DDP would broadcast rank 0's anyway)
    base = check_base = GPT(plan.config).to(device)
    name, memory = "CPU", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    transport = "no NCCL here: the flag changes nothing"
    if cuda:  # the fp32 checks: the same weights, deterministic attention
        torch.manual_seed(0)
        check_base = GPT(dataclasses.replace(plan.config, attn="manual")).to(device)
        name, transport = torch.cuda.get_device_name(device), nccl_transport()
        memory = torch.cuda.get_device_properties(device).total_memory
    batches = make_batches(plan, rank, world, device)
    r = header(args, plan, name, memory, f"torch {torch.__version__} | {world} ranks, backend "
               f"{dist.get_backend()}", transport, "rank")
    r.update(world_size=world, backend=dist.get_backend())
    print(f"timing {len(plan.caps) + 1} variants in {plan.passes} turns, in {'bf16' if cuda else 'fp32'}"
          f", and profiling them; then no_sync and FSDP2 (GPT-2 on GPUs: about a minute)")
    r["equivalence"] = exp_equivalence(check_base, batches[:3], device)
    rows = exp_ddp_speed(base, *batches[0], device, plan, cuda, trace)
    r["step_time"] = dict(handrolled=rows.pop("hand-rolled"), ddp=rows["default"])
    r["bucket_sweep"] = list(rows.values())
    r["no_sync"] = ns = exp_no_sync(check_base, base, batches, device, plan, cuda)
    r["fsdp"] = exp_fsdp(check_base, batches[:3], world, device)
    report_torch(r, world)
    calls = ns["no_sync"]["allreduce_calls"]
    r["checks"] = dict(
        ddp_equals_handrolled=r["equivalence"]["max_abs_param_diff"] < PARAM_TOL,
        no_sync_grads_equal=ns["max_abs_grad_diff"] <= 1e-5 * ns["max_abs_grad"],
        no_sync_allreduces_once=calls == rows["default"]["allreduce_calls_per_step"],  # as in [2]
        trap_allreduces_every_backward=ns["backward_only_in_no_sync"]["allreduce_calls"] == ns["k"] * calls,
        fsdp_matches_ddp=r["fsdp"]["max_abs_param_diff"] < PARAM_TOL,
        fsdp_bytes_about_1_over_n=abs(r["fsdp"]["sharded_over_replicated"] * world - 1) < 0.05)
    if trace is not None:
        print(f"trace of the default buckets, {PROFILED_STEPS} steps (ui.perfetto.dev): {trace}")
        plot_sweep(r["step_time"]["handrolled"], r["bucket_sweep"],
                   out / f"06_bucket_sweep_{args.interconnect}.png")
    return finish(r, args, rank == 0)

def run_torch(args):
    rank, world, device = setup_torch(args)
    try:
        return torch_lesson(args, rank, world, device)
    finally:  # on every path: free the models (and the work objects DDP keeps) while the
        gc.collect()  # process group lives, then end it, so that no rank aborts at exit
        dist.destroy_process_group()

# =======================================================================================
# JAX: one process drives every device; the compiler inserts the collectives

def placements(jax, n):  # name -> (sharding of a state array, sharding of the batch)
    from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))  # XLA propagates
    one, replicated = SingleDeviceSharding(jax.devices()[0]), NamedSharding(mesh, PartitionSpec())
    by_rows = NamedSharding(mesh, PartitionSpec("data"))  # the batch's rows split over devices

    def split(array):  # the bridge: along the largest dimension that N divides, else replicated
        for dim in sorted(range(array.ndim), key=lambda d: -array.shape[d]):
            if array.shape[dim] % n == 0:
                return NamedSharding(mesh, PartitionSpec(*[None] * dim, "data"))
        return replicated
    return dict(single_device=(lambda a: one, one), data_parallel=(lambda a: replicated, by_rows),
                sharded_params=(split, by_rows))

def described(compiled, leaves, n, device):
    """The collectives in a compiled program; the state's bytes on one device, measured from its
    shards and expected from the shardings (an array split N ways: 1/N of it)."""
    text = compiled.as_text()
    found = [ln.strip() for ln in text.splitlines() if re.search(r"\sall-reduce(?:-start)?\(", ln)]
    total = sum(a.nbytes for a in leaves)
    split = sum(a.nbytes for a in leaves if not a.sharding.is_fully_replicated)
    mine = sum(s.data.nbytes for a in leaves for s in a.addressable_shards if s.device == device)
    return dict(collectives={k: len(re.findall(rf"\s{k}(?:-start)?\(", text)) for k in COLLECTIVES},
                allreduce_example=(found + [""])[0][:150], state_bytes_per_device=mine,
                expected_bytes_per_device=total - split + split // n, sharded_share=split / total)

def exp_jax(jax, step, state, data, layout, plan):
    # PREDICTION: one device: no collective. Data parallel (batch sharded, params replicated):
    # the gradient of a replicated parameter over a sharded batch is a sum over the shards, so
    # XLA must insert an all-reduce; the losses equal one device's. Sharded params: all-gathers
    # to use them, reduce-scatters for their gradients, 1/N of the bytes, the same losses.
    # Speed on the same global batch: one device computes the rows of two, 2 T(B) against T(B)
    # + the all-reduce not hidden: close to 2x over NVLink (1-2 ms of all-reduce), far less
    # staged (10-20 ms, see the torch half's [2]); none on simulated CPU devices (same cores).
    n, result, variants = jax.device_count(), {}, {}
    for name, (place, by_rows) in layout.items():
        shardings = jax.tree.map(place, state)
        placed = jax.device_put(state, shardings)
        batches = [[jax.device_put(d[:, i:i + plan.seq_len], by_rows) for i in (0, 1)] for d in data]
        compiled = step.lower(placed, *batches[0]).compile()
        result[name] = described(compiled, jax.tree.leaves(placed), n, jax.devices()[0])
        variants[name] = partial(lambda c, args: jax.block_until_ready(c(*args)), compiled,
                                 (placed, *batches[0]))
        losses, now = [], placed
        for x, y in batches:  # two steps: the second loss shows the gradients were right
            loss, now = compiled(jax.device_put(now, shardings), x, y)  # in the compiled-for layout
            losses.append(float(loss))
        result[name]["losses"] = losses
    against = dict(data_parallel="single_device", sharded_params="single_device")
    timed = interleaved(variants, against, torch.device("cpu"), plan.passes, plan.reps)
    for name, row in timed.items():
        one_device = result["single_device"]["losses"]
        result[name].update(step=row, max_rel_loss_diff=max(
            abs(a - b) / abs(b) for a, b in zip(result[name]["losses"], one_device)))
    return result

def report_jax(r, n):
    for name in ("single_device", "data_parallel", "sharded_params"):
        p = r[name]
        found = ", ".join(f"{k} x{v}" for k, v in p["collectives"].items() if v) or "none"
        print(f"[{name}] collectives in the compiled program: {found}")
        if name == "data_parallel" and p["allreduce_example"]:
            print(f"    {p['allreduce_example']} ...")
            print(f"    -> jit put it there; XLA merged the gradients' all-reduces into "
                  f"{p['collectives']['all-reduce']} op(s), the compiler's buckets")
        print(f"    losses {p['losses'][0]:.6f}, {p['losses'][1]:.6f} (measured); against one "
              f"device: max relative diff {p['max_rel_loss_diff']:.1e} (derived)")
        print(f"    step {said(p['step'])}")
        print(f"    params + AdamW state {p['state_bytes_per_device'] / 2**20:.2f} MiB per device "
              f"(measured; {p['expected_bytes_per_device'] / 2**20:.2f} from the shardings)")
    print(f"sharded / replicated bytes per device: {r['sharded_over_replicated']:.3f} (derived; "
          f"1/N = {1 / n:.3f}: {r['sharded_params']['sharded_share']:.1%} of the bytes are in "
          f"arrays with a dimension that {n} divides, the rest replicated)")

def run_jax(args):
    flags = os.environ.get("XLA_FLAGS", "")  # what JAX reads at start-up: set before the import
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}"
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    use_interconnect(args.interconnect)  # XLA's GPU collectives go through NCCL too
    import flax, jax, numpy as np
    from flax import nnx
    from model_jax import GPT as JaxGPT, adamw, make_train_step
    devices, n = jax.devices(), jax.device_count()
    gpu = devices[0].platform == "gpu"
    if args.device == "cuda" and not gpu:
        sys.exit("error: --device cuda: JAX sees no GPU (install jax[cuda13], or use --device cpu)")
    plan = make_plan(args.quick, gpu)
    if gpu:  # per device; the one-device reference runs n * 4 rows
        plan = plan._replace(batch=4, reps=3)
    layout = placements(jax, n)
    warm = jax.device_put(np.ones(n, np.float32), layout["data_parallel"][1])
    jax.block_until_ready(jax.jit(lambda a: a.sum())(warm))  # the first collective
    transport = "no NCCL here: the flag changes nothing"
    if gpu:
        transport = nccl_transport()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # a GPU: JAX's pool limit
    memory = (devices[0].memory_stats() or {}).get("bytes_limit", memory)
    r = header(args, plan, f"{n} x {devices[0].device_kind}", memory, f"jax {jax.__version__}, "
               f"flax {flax.__version__}", transport, "device; fp32 (a GPU: JAX's TF32 matmuls)")
    model = JaxGPT(plan.config, rngs=nnx.Rngs(0))  # fp32 on both sides of the check
    graphdef, state = nnx.split((model, nnx.Optimizer(model, adamw(LR), wrt=nnx.Param)))
    rng = np.random.default_rng(1)
    data = [rng.integers(0, plan.config.vocab_size, (n * plan.batch, plan.seq_len + 1),
                         dtype=np.int32) for _ in range(2)]
    print("compiling the step for 3 placements (GPT-2: tens of seconds)")
    r.update(exp_jax(jax, make_train_step(graphdef), jax.device_get(state), data, layout, plan))
    r.update(n_devices=n, sharded_over_replicated=r["sharded_params"]["state_bytes_per_device"] /
             r["data_parallel"]["state_bytes_per_device"])
    report_jax(r, n)
    r["checks"] = {f"{name}_loss_equals_single_device": r[name]["max_rel_loss_diff"] < 1e-4
                   for name in ("data_parallel", "sharded_params")}
    r["checks"]["sharded_bytes_match_shardings"] = all(
        r[name]["state_bytes_per_device"] == r[name]["expected_bytes_per_device"] for name in layout)
    if n > 1:  # one device has nothing to all-reduce: XLA emits no collective
        r["checks"]["allreduce_in_compiled_text"] = "all-reduce" in r["data_parallel"]["allreduce_example"]
    return finish(r, args, True)

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Section 13.6: production data parallelism")
    p.add_argument("--framework", choices=["torch", "jax"], help="default: torch under torchrun")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--interconnect", choices=["default", "staged"], default="default",
                   help="staged: NCCL without peer-to-peer, every GPU-to-GPU byte via host memory")
    p.add_argument("--cpu-devices", type=positive_int, default=4, help="simulated JAX CPU devices")
    p.add_argument("--quick", action="store_true", help="a smoke run of about ten seconds")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--out", default="out", help="folder for the figure and the trace")
    args = p.parse_args(argv)
    check_outputs(args)
    under_torchrun = "RANK" in os.environ
    if args.framework is None:  # the launcher says which half
        args.framework = "torch" if under_torchrun else "jax"
    if args.framework == "torch" and not under_torchrun:
        p.exit(2, "The PyTorch half runs one process per device; launch it with\n  torchrun "
               "--nproc_per_node=N --standalone 06_ddp_prod.py   (N = your GPUs, or 4 on a CPU)\n")
    if args.framework == "jax" and under_torchrun:
        p.exit(2, "The JAX half is ONE process driving every device; run it without torchrun:\n"
               "  python 06_ddp_prod.py --framework jax\n")
    return args

def main():
    args = parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler start/stop lines on stderr
    warnings.filterwarnings("ignore", message=".*Profiler clears events")  # we read each cycle
    own_log = "NCCL_DEBUG_FILE" not in os.environ  # use_interconnect names it: ours to remove
    try:
        ok = dict(torch=run_torch, jax=run_jax)[args.framework](args)
    except RuntimeError as error:  # e.g. no rendezvous, or a peer stopped during a collective
        sys.exit(f"error: rank {os.environ.get('RANK', 0)}: {type(error).__name__}: "
                 f"{str(error)[:300]}")
    finally:
        if own_log and "NCCL_DEBUG_FILE" in os.environ:
            Path(os.environ["NCCL_DEBUG_FILE"]).unlink(missing_ok=True)
    if not ok:
        sys.exit(1)

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
