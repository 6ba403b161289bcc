"""Section 13.6: production data parallelism, two philosophies. PyTorch, a process per device:
DDP against 05's hand-rolled version, its buckets, overlap with backward, no_sync, FSDP2. JAX,
one process for every device: a 'data' Mesh, the collectives jit inserts, sharded parameters.
Copy with model_torch.py and model_jax.py. Expect a line per number and "checks: ALL PASSED"
(--quick on a CPU: ~10 s); in --out, a profiler trace to open at ui.perfetto.dev.
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 06_ddp_prod.py  # 4 gloo ranks
    torchrun --standalone --nproc_per_node=2 06_ddp_prod.py --interconnect staged  # 2 GPUs, no P2P
    python 06_ddp_prod.py  # JAX: all GPUs, else 4 CPU devices (XLA_FLAGS sets N)
Past one machine: torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 ... on each;
JAX: jax.distributed.initialize("HOST:1234", num_processes=2, process_id=i) first in each."""

import argparse, copy, dataclasses, datetime, gc, json, os, re, statistics, sys, tempfile, time
import warnings
from collections import namedtuple
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model_torch import GPT, GPTConfig

LR = 6e-4
PARAM_TOL = LR / 6  # fp32, manual attention: rounding only; a wrong all-reduce moves ~LR a step
MICRO_STEPS = 4     # gradient accumulation: k micro-batches per optimizer step
PROFILED_STEPS = 2  # steps under torch.profiler per variant: a small trace
TIMEOUT_S = 60      # a rank left waiting this long in a collective gives up, never hangs
HOST_MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
NO_NCCL = "no NCCL here: the flag changes nothing"
# rows per rank (JAX: device); `passes` turns, each a median of `reps` steps; bucket_cap_mb swept
Plan = namedtuple("Plan", "config batch seq_len passes reps caps")

def make_plan(quick, gpu, gpu_batch=8):
    if gpu:
        return Plan(GPTConfig.preset("gpt2"), gpu_batch, 1024, 7, 5, (1, 5, 25, None, 100, 1000))
    if quick:  # 1 layer, a small vocabulary: a smoke run, not a measurement
        tiny = GPTConfig.preset("tiny", n_layer=1, block_size=64, vocab_size=4096)
        return Plan(tiny, 2, 64, 2, 1, (0.25, None))
    return Plan(GPTConfig.preset("tiny"), 2, 128, 3, 1, (0.25, 1, None, 25))

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

def interleaved(variants, against, device, passes, reps):
    """Time the variants in turns (A B C, A B C, ...), the slowest rank's median of reps steps;
    saves: the median per-turn difference to against[name], resolved if its IQR excludes 0."""
    samples = {name: [] for name in variants}
    for _ in range(passes):
        for name, fn in variants.items():
            ms = torch.tensor(bench(fn, device, reps, warmup=1)[0] * 1e3, device=device)
            if dist.is_initialized():  # a data-parallel step is as slow as its slowest rank
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            samples[name].append(ms.item())
    result = {}
    for name, ms in samples.items():
        q1, mid, q3 = statistics.quantiles(ms, n=4, method="inclusive")
        result[name] = dict(median_ms=mid, q1_ms=q1, q3_ms=q3, unreliable=max(ms) - min(ms) > mid)
        if name in against:
            diffs = [b - a for a, b in zip(ms, samples[against[name]])]
            d1, saved, d3 = statistics.quantiles(diffs, n=4, method="inclusive")
            result[name].update(against=against[name], saves_ms=saved,
                                saves_iqr_ms=(d1, d3), resolved=d1 > 0 or d3 < 0)
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

def header(args, plan, name, memory, versions, transport, per):
    print(f"device: {name}, {memory / 2**30:.0f} GiB | {versions}")
    print(f"interconnect: {args.interconnect}; NCCL reports: {transport}")
    print(f"model: {plan.config.n_layer} layers, d {plan.config.n_embd}, vocab "
          f"{plan.config.vocab_size}, {plan.batch} x {plan.seq_len} tokens per {per}")
    return dict(lesson="06_ddp_prod", framework=args.framework, quick=args.quick,
                device=dict(name=name, versions=versions),
                interconnect=dict(name=args.interconnect, transport=transport),
                model=dict(vars(plan.config), batch=plan.batch, seq_len=plan.seq_len))

def loss_of(model, x, y, amp, micro_steps=1):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        return model(x, y)[1] / micro_steps  # equal micro-batches: sum of k losses / k = mean

def train_step(model, opt, x, y, amp, handrolled=False):
    opt.zero_grad(set_to_none=True)
    loss_of(model, x, y, amp).backward()  # DDP, FSDP2: the module's hooks run the collectives
    if handrolled:  # 05's way: the whole backward first, then every gradient: nothing overlaps
        for p in model.parameters():
            dist.all_reduce(p.grad.div_(dist.get_world_size()))
    opt.step()

def with_adamw(model):
    return model, getattr(model, "module", model).configure_optimizer(lr=LR)

def max_diff(xs, ys):  # the largest |x - y| of all tensors and ranks
    value = max((x.detach() - y.detach()).abs().max() for x, y in zip(xs, ys)).double()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()

def state_bytes(model, opt):  # params, grads and AdamW state on this rank (a DTensor: its shard)
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()),
               *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)

def exp_same_math(base, batches, device):
    # PREDICTION [1]: hand-rolled and DDP do the same math (the mean of the ranks' gradients,
    # the same AdamW): after 3 steps they agree to rounding, bit for bit with 2 ranks. [5]: DDP
    # keeps params, grads and both AdamW moments on every rank (16 bytes/param), FSDP2 1/N:
    # it all-gathers a block's params just in time and reduce-scatters its grads.
    from torch.distributed.fsdp import fully_shard  # FSDP2: public since torch 2.6; gloo works
    sharded = copy.deepcopy(base)
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in [*sharded.transformer.h, sharded]:  # an all-gather unit per block, then the rest
        fully_shard(unit, mesh=mesh)  # (embeddings = the tied head, ln_f) at the root
    hand, ddp, fsdp = map(with_adamw, (copy.deepcopy(base), DDP(copy.deepcopy(base)), sharded))
    for x, y in batches:
        for model, opt in (hand, ddp, fsdp):
            train_step(model, opt, x, y, amp=False, handrolled=model is hand[0])
    full, shard = state_bytes(ddp[0].module, ddp[1]), state_bytes(*fsdp)
    ddp_params, gathered = [*ddp[0].parameters()], [p.full_tensor() for p in sharded.parameters()]
    return (dict(steps=len(batches), max_abs_param_diff=max_diff(hand[0].parameters(), ddp_params)),
            dict(max_abs_param_diff=max_diff(ddp_params, gathered), replicated_bytes=full,
                 sharded_bytes=shard, sharded_over_replicated=shard / full))

def exp_ddp_speed(base, x, y, device, plan, amp, trace):
    # PREDICTION, GPT-2 on two GPUs: 498 MB of fp32 gradients per rank and step against 6 x 124M x
    # 8192 = 6 TFLOP, tens of ms in eager bf16 (H200: 989 TFLOP/s, datasheet). NVLink 4 (450 GB/s
    # each way, datasheet): 1-2 ms of all-reduce, DDP wins about that (148 calls become ~15); the
    # bucket size moves a ms either way: a small bucket pays a copy and launch each, one huge one
    # cannot start before backward ends. Staged through host memory (PCIe 5.0 x16: 64 GB/s each
    # way, spec, plus a host copy): 10-20 ms, like the compute: DDP hides much of it and wins
    # clearly; tiny buckets pay a latency each, one huge bucket waits for the whole backward.
    # CPU (gloo): ranks share the cores, DDP gains by fewer calls only.
    caps = {"default" if cap is None else f"{cap:g} MiB": cap for cap in plan.caps}
    steps = {"hand-rolled": partial(train_step, *with_adamw(copy.deepcopy(base)), x, y, amp, handrolled=True)} | {
        name: partial(train_step, *with_adamw(DDP(copy.deepcopy(base), bucket_cap_mb=cap)), x, y, amp)
        for name, cap in caps.items()}  # cap None: DDP's default buckets
    against = {name: "default" for name in caps} | {"default": "hand-rolled"}
    rows = interleaved(steps, against, device, plan.passes, plan.reps)
    for name, row in rows.items():
        row.update(exp_overlap(steps[name], device, {"default": trace}.get(name)), name=name)
    return rows

def exp_overlap(step, device, trace):
    # PREDICTION: hand-rolled hides nothing; DDP all buckets but the last. GPU: NCCL kernels
    # against the others; CPU: gloo's all-reduce (own threads) against autograd's ops.
    activity = getattr(torch.profiler.ProfilerActivity, device.type.upper())  # GPU: kernels only
    after_one = torch.profiler.schedule(wait=0, warmup=1, active=PROFILED_STEPS, repeat=1)
    with torch.profiler.profile(activities=[activity], schedule=after_one) as prof:
        for _ in range(1 + PROFILED_STEPS):  # a first step unrecorded: the ranks' profilers
            step()  # start apart, and a collective would count the wait for the later one
            sync(device)
            prof.step()
    comm, compute = [], []
    for e in prof.events():
        kernel = e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
        span = (round(e.time_range.start * 1e3), round(e.time_range.end * 1e3))  # ns: exact sums
        if (kernel and "nccl" in e.name.lower()) or e.name == "gloo:all_reduce":
            comm.append(span)
        elif kernel or e.name.startswith("autograd::engine::evaluate_function"):
            compute.append(span)
    if trace is not None:  # Chrome/Perfetto JSON, written whole or not at all
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(tmp := f"{trace}.tmp{os.getpid()}")
        os.replace(tmp, trace)
    comm_ns = covered(comm)  # under backward: |comm| + |compute| - |comm or compute|
    hidden = (comm_ns + covered(compute) - covered(comm + compute)) / max(comm_ns, 1)
    return dict(allreduce_calls_per_step=len(comm) // PROFILED_STEPS,
                comm_ms_per_step=comm_ns / 1e6 / PROFILED_STEPS, overlap_fraction=hidden)

def covered(spans):  # the time that (start, end) spans cover, overlaps counted once
    total, reached = 0, float("-inf")
    for start, end in sorted(spans):
        total += max(0, end - max(start, reached))
        reached = max(reached, end)
    return total

def accumulate_no_sync(ddp, micro, amp):
    # the right way: forward AND backward inside no_sync for all but the last micro-batch,
    # whose backward all-reduces the sum of all k gradients, once
    ddp.zero_grad(set_to_none=True)
    for x, y in micro[:-1]:
        with ddp.no_sync():
            loss_of(ddp, x, y, amp, len(micro)).backward()
    loss_of(ddp, *micro[-1], amp, len(micro)).backward()

def accumulate_trap(ddp, micro, amp):
    # the trap: forward outside no_sync. DDP decides during forward whether the coming
    # backward syncs, so every backward still all-reduces, as if no_sync were not there
    ddp.zero_grad(set_to_none=True)
    for x, y in micro[:-1]:
        loss = loss_of(ddp, x, y, amp, len(micro))
        with ddp.no_sync():
            loss.backward()
    loss_of(ddp, *micro[-1], amp, len(micro)).backward()

def exp_no_sync(base, micro, device, plan, amp):
    # PREDICTION: k = 4: the trap all-reduces every backward, the right way the last only: the
    # same gradients, 3 all-reduces of every gradient saved: 3-6 ms NVLink, tens of ms staged.
    loops = dict(no_sync=accumulate_no_sync, backward_only_in_no_sync=accumulate_trap)
    ddp, grads = DDP(copy.deepcopy(base)), []
    for loop in loops.values():  # the gradients in fp32
        loop(ddp, micro, False)
        grads.append([p.grad.clone() for p in ddp.parameters()])
    result = dict(k=len(micro), max_abs_grad_diff=max_diff(*grads),
                  max_abs_grad=max(g.abs().max().item() for g in grads[0]))
    variants = {name: partial(loop, ddp, micro, amp) for name, loop in loops.items()}
    trap_first = dict(no_sync="backward_only_in_no_sync")
    for name, row in interleaved(variants, trap_first, device, plan.passes, 1).items():
        counted = exp_overlap(variants[name], device, None)  # after the timing: buckets settled
        result[name] = dict(row, allreduce_calls=counted["allreduce_calls_per_step"])
    return result

def run_torch(args):  # NCCL on GPU LOCAL_RANK if every rank on this machine has one, else gloo
    device, backend, machine = torch.device("cpu"), "gloo", ("CPU", HOST_MEMORY)
    if args.device != "cpu" and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        device, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
        torch.cuda.set_device(device)
        machine = (torch.cuda.get_device_name(device), torch.cuda.mem_get_info(device)[1])
    elif args.device == "cuda":
        sys.exit("error: --device cuda: fewer GPUs than ranks on this machine; use --device cpu")
    use_interconnect(args.interconnect)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))  # main ends it
    dist.all_reduce(torch.ones(1, device=device))  # the first collective: NCCL connects now
    sync(device)
    rank, world, cuda = dist.get_rank(), dist.get_world_size(), backend == "nccl"
    plan, trace = make_plan(args.quick, cuda), Path(args.out, f"06_ddp_trace_{args.interconnect}.json")
    if rank != 0:
        sys.stdout, trace = open(os.devnull, "w"), None  # one rank speaks and writes
    torch.manual_seed(0)  # the same weights on every rank (DDP would broadcast rank 0's anyway)
    base = GPT(plan.config).to(device)
    check_base = GPT(dataclasses.replace(plan.config, attn="manual")).to(device)  # deterministic
    shape = (MICRO_STEPS, plan.batch * world, plan.seq_len + 1)  # the same on every rank
    tokens = torch.randint(plan.config.vocab_size, shape, generator=torch.Generator().manual_seed(1))
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens[:, rank::world].to(device)]
    versions = f"torch {torch.__version__} | {world} ranks, backend {backend}"
    r = header(args, plan, *machine, versions, nccl_transport() if cuda else NO_NCCL, "rank")
    eq, fsdp = exp_same_math(check_base, micro[:3], device)
    rows = exp_ddp_speed(base, *micro[0], device, plan, cuda, trace)
    hand, ns = rows.pop("hand-rolled"), exp_no_sync(base, micro, device, plan, cuda)
    print(f"[1][5] max |param diff| after {eq['steps']} AdamW steps (fp32, measured): DDP vs hand-"
          f"rolled {eq['max_abs_param_diff']:.2e}, FSDP2 vs DDP {fsdp['max_abs_param_diff']:.2e}")
    for row in [hand, *rows.values()]:
        print(f"[2] {row['name']:>11}: {row['allreduce_calls_per_step']:3d} all-reduces/step "
              f"(counted), {said(row)}")
        print(f"[3] {row['name']:>11}: communication {row['comm_ms_per_step']:.1f} ms/step, "
              f"{row['overlap_fraction']:.0%} of it under backward (measured, profiler)")
    for name in ("no_sync", "backward_only_in_no_sync"):
        print(f"[4] {name:24s}: {ns[name]['allreduce_calls']:3d} all-reduces for {ns['k']} "
              f"micro-batches (counted), {said(ns[name])}")
    print(f"[4] gradients, no_sync vs the trap (which syncs every micro-batch): max |diff| "
          f"{ns['max_abs_grad_diff']:.2e} of max |grad| {ns['max_abs_grad']:.2e} (measured)")
    print(f"[5] params + grads + AdamW state per rank: replicated {fsdp['replicated_bytes'] / 2**20:.2f} "
          f"MiB, FSDP2 {fsdp['sharded_bytes'] / 2**20:.2f} MiB (1/N = {1 / world:.3f}; measured)")
    print(f"trace of the default buckets, {PROFILED_STEPS} steps (ui.perfetto.dev): {trace}")
    calls, trap = ns["no_sync"]["allreduce_calls"], ns["backward_only_in_no_sync"]["allreduce_calls"]
    r.update(world_size=world, backend=backend, equivalence=eq, no_sync=ns, fsdp=fsdp,
             step_time=dict(handrolled=hand, ddp=rows["default"]), bucket_sweep=list(rows.values()))
    r["checks"] = dict(
        ddp_equals_handrolled=eq["max_abs_param_diff"] < PARAM_TOL,
        no_sync_grads_equal=ns["max_abs_grad_diff"] <= 1e-5 * ns["max_abs_grad"],
        no_sync_allreduces_once=calls == rows["default"]["allreduce_calls_per_step"],
        trap_allreduces_every_backward=trap == ns["k"] * calls,
        fsdp_matches_ddp=fsdp["max_abs_param_diff"] < PARAM_TOL,
        fsdp_bytes_about_1_over_n=abs(fsdp["sharded_over_replicated"] * world - 1) < 0.05)
    return r, rank == 0

def exp_jax(jax, step, state, data, plan):
    # PREDICTION: data parallel: a replicated parameter's gradient over a sharded batch is a
    # sum over the shards: XLA inserts an all-reduce, the losses equal one device's. Sharded
    # params: all-gathers, reduce-scatters, 1/N of the bytes. One device does the rows of N:
    # ~2x over NVLink (1-2 ms of all-reduce), less staged (10-20 ms), none simulated on a CPU.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, SingleDeviceSharding
    first, n = jax.devices()[0], jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def split(array):  # the bridge: along the largest dimension that N divides, else replicated
        for dim in sorted(range(array.ndim), key=lambda d: -array.shape[d]):
            if array.shape[dim] % n == 0:
                return NamedSharding(mesh, P(*[None] * dim, "data"))
        return replicated
    one = SingleDeviceSharding(first)  # per placement: (a state array's sharding, the batch's)
    layout = dict(single_device=(lambda a: one, one), data_parallel=(lambda a: replicated, by_rows),
                  sharded_params=(split, by_rows))
    result, variants = {}, {}
    for name, (place, rows) in layout.items():
        shardings = jax.tree.map(place, state)
        placed = jax.device_put(state, shardings)
        (x, y), second = [[jax.device_put(a, rows) for a in (d[:, :-1], d[:, 1:])] for d in data]
        compiled = step.lower(placed, x, y).compile()
        variants[name] = partial(lambda c, *a: jax.block_until_ready(c(*a)), compiled, placed, x, y)
        loss, after = compiled(placed, x, y)  # a second step checks the gradients
        losses = [float(loss), float(compiled(jax.device_put(after, shardings), *second)[0])]
        # what jit made of it: its collectives; the state's bytes here, measured and expected
        text, leaves = compiled.as_text(), jax.tree.leaves(placed)
        total = sum(a.nbytes for a in leaves)
        split_bytes = sum(a.nbytes for a in leaves if not a.sharding.is_fully_replicated)
        mine = sum(s.data.nbytes for a in leaves for s in a.addressable_shards if s.device == first)
        calls = {k: len(re.findall(rf"\s{k}(?:-start)?\(", text))
                 for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}
        example = re.findall(r"\S.*\sall-reduce(?:-start)?\(.*", text) + [""]
        result[name] = dict(losses=losses, collectives=calls, allreduce_example=example[0][:150],
                            state_bytes_per_device=mine, sharded_share=split_bytes / total,
                            expected_bytes_per_device=total - split_bytes + split_bytes // n)
    against = dict(data_parallel="single_device", sharded_params="single_device")
    for name, row in interleaved(variants, against, torch.device("cpu"), plan.passes, plan.reps).items():
        pairs = zip(result[name]["losses"], result["single_device"]["losses"])
        result[name].update(step=row, max_rel_loss_diff=max(abs(a - b) / abs(b) for a, b in pairs))
    return result

def run_jax(args):
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # 4 CPU devices
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    use_interconnect(args.interconnect)  # XLA's GPU collectives go through NCCL too
    import flax, jax, numpy as np
    from flax import nnx
    from model_jax import GPT as JaxGPT, adamw, make_train_step
    device, n, gpu = jax.devices()[0], jax.device_count(), jax.default_backend() == "gpu"
    if args.device == "cuda" and not gpu:
        sys.exit("error: --device cuda: JAX sees no GPU (install jax[cuda13], or use --device cpu)")
    plan = make_plan(args.quick, gpu, gpu_batch=4)  # per device: one device runs n x 4 rows
    memory = (device.memory_stats() or {}).get("bytes_limit", HOST_MEMORY)  # GPU: JAX's pool
    versions, transport = f"jax {jax.__version__}, flax {flax.__version__}", nccl_transport()
    r = header(args, plan, f"{n} x {device.device_kind}", memory, versions,
               transport if gpu else NO_NCCL, "device; fp32 (a GPU: JAX's TF32 matmuls)")
    model = JaxGPT(plan.config, rngs=nnx.Rngs(0))  # fp32 on both sides of the check
    graphdef, state = nnx.split((model, nnx.Optimizer(model, adamw(LR), wrt=nnx.Param)))
    rng, shape = np.random.default_rng(1), (n * plan.batch, plan.seq_len + 1)
    data = [rng.integers(0, plan.config.vocab_size, shape, dtype=np.int32) for _ in range(2)]
    print("compiling the step for 3 placements (GPT-2: tens of seconds)")
    placements = exp_jax(jax, make_train_step(graphdef), jax.device_get(state), data, plan)
    for name, p in placements.items():
        found = ", ".join(f"{k} x{v}" for k, v in p["collectives"].items() if v) or "none"
        print(f"[{name}] collectives in the compiled program: {found}")
        if p["allreduce_example"] and name == "data_parallel":
            print(f"    {p['allreduce_example']} ...  (jit put it there; XLA's buckets)")
        print(f"    losses {p['losses'][0]:.6f}, {p['losses'][1]:.6f} (measured); against one "
              f"device: max relative diff {p['max_rel_loss_diff']:.1e} (derived)")
        print(f"    step {said(p['step'])}")
        print(f"    params + AdamW state {p['state_bytes_per_device'] / 2**20:.2f} MiB/device (measured)")
    dp, sharded = placements["data_parallel"], placements["sharded_params"]
    ratio = sharded["state_bytes_per_device"] / dp["state_bytes_per_device"]
    print(f"sharded / replicated bytes per device: {ratio:.3f} (derived; 1/N = {1 / n:.3f}; "
          f"{sharded['sharded_share']:.1%} of the bytes have a dimension that {n} divides)")
    r.update(placements, n_devices=n, sharded_over_replicated=ratio, checks=dict(
        data_parallel_loss_equals_single_device=dp["max_rel_loss_diff"] < 1e-4,
        sharded_params_loss_equals_single_device=sharded["max_rel_loss_diff"] < 1e-4,
        sharded_bytes_match_shardings=all(p["state_bytes_per_device"] == p[
            "expected_bytes_per_device"] for p in placements.values()),
        allreduce_in_compiled_text=n == 1 or "all-reduce" in dp["allreduce_example"]))
    return r, True

def parse_args(argv=None):
    launched = "torch" if "RANK" in os.environ else "jax"  # torchrun sets RANK
    p = argparse.ArgumentParser(description="Section 13.6: production data parallelism")
    p.add_argument("--framework", choices=["torch", "jax"], default=launched)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--interconnect", choices=["default", "staged"], default="default")
    p.add_argument("--quick", action="store_true", help="a smoke run of about ten seconds")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--out", default="out", help="folder for the profiler trace")
    args = p.parse_args(argv)
    check_outputs(args)
    if args.framework != launched:
        p.exit(2, "The PyTorch half: torchrun --nproc_per_node=N --standalone 06_ddp_prod.py\n"
               "The JAX half is ONE process: python 06_ddp_prod.py --framework jax\n")
    return args

def main():
    args = parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler start/stop lines on stderr
    warnings.filterwarnings("ignore", message=".*Profiler clears events")  # we read each cycle
    try:
        result, speaks = dict(torch=run_torch, jax=run_jax)[args.framework](args)
    except RuntimeError as error:  # e.g. no rendezvous, or a peer stopped during a collective
        reason = (str(error) or type(error).__name__).splitlines()[0][:300]
        sys.exit(f"error: rank {os.environ.get('RANK', 0)}: {type(error).__name__}: {reason}")
    finally:
        if dist.is_initialized():  # free the models (and the work objects DDP keeps) while the
            gc.collect()  # process group lives, then end it, so that no rank aborts at exit
            dist.destroy_process_group()
        if os.environ.get("NCCL_DEBUG_FILE", "").endswith(f"nccl-{os.getpid()}.log"):
            Path(os.environ["NCCL_DEBUG_FILE"]).unlink(missing_ok=True)
    failed = [name for name, ok in result["checks"].items() if not ok]
    print("checks:", f"FAILED {failed}" if failed else "ALL PASSED")
    if args.json and speaks:
        write_json(args.json, result)
    sys.exit(int(bool(failed)))

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
