"""
Section 13.6: production data parallelism, two philosophies.

05_ddp_scratch.py averaged gradients by hand: backward, then one all-reduce per tensor.
Here the production version in each framework, and where the two differ:

  PyTorch, one process per device, explicit collectives: torchrun starts N processes and
    DistributedDataParallel (DDP) all-reduces gradients in buckets (~25 MB) while backward
    is still running. [1] same parameters as the hand-rolled version after k steps
    (checked); [2] step time against it; [3] a bucket_cap_mb sweep; [4] no_sync under
    gradient accumulation (all-reduce calls counted, gradients checked); [5] the bridge to
    sharded training, FSDP2 fully_shard: bytes of params + grads + AdamW state per rank.
  JAX, one process over all devices, implied collectives: a Mesh with a 'data' axis, the
    batch sharded, parameters replicated, the step a plain jax.jit; the compiler inserts
    the all-reduce (found and printed from the compiled program). Same loss as one device
    (checked). The bridge: parameters and AdamW state sharded over 'data' too.

Run (the launcher picks the half; --framework torch|jax says it explicitly):
  torchrun --nproc_per_node=4 06_ddp_prod.py    # PyTorch half; on a CPU: 4 gloo ranks, tiny GPT
  torchrun --nproc_per_node=8 06_ddp_prod.py    # 8 GPUs: NCCL, one GPU per rank, GPT-2 124M
  python 06_ddp_prod.py                         # JAX half: one process, all GPUs, or on a CPU
                                                # 4 simulated devices (--cpu-devices N)
NCCL when every rank has its own GPU, else gloo on the CPU. One GPU runs too (1 rank, a
1-device mesh), but collectives have work to do only with 2 or more. A wrong launch (torch
half without torchrun, JAX half under it) exits with the command to use instead. Output:
the numbers above, each labelled; --json keeps them all, --out gets the bucket-sweep figure.
"""

import argparse
import copy
import datetime
import json
import os
import re
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from model_torch import GPT, GPTConfig

LR = 6e-4
# The checks run in fp32 (on a GPU with manual attention: no atomics, no bf16 rounding), so
# two runs of the same math differ only by summation order. A wrong or missing all-reduce
# moves parameters by ~LR per AdamW step; rounding (amplified by Adam's division for
# gradients near zero) stays far below LR / 6.
PARAM_TOL = LR / 6


def stats_ms(seconds):
    ms = [s * 1e3 for s in seconds]
    return dict(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), n=len(ms))


def sizes(quick, gpu):
    """(config, batch per rank or device, sequence length)."""
    if gpu:
        return GPTConfig.preset("gpt2"), 8, 1024
    if quick:  # 1 layer, a small vocabulary: a smoke run, not a measurement
        return GPTConfig.preset("tiny", n_layer=1, block_size=64, vocab_size=4096), 2, 64
    return GPTConfig.preset("tiny"), 2, 128


def finish(result, args):
    ok = all(result["checks"].values())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print("checks:", "ALL PASSED" if ok else f"FAILED {[k for k, v in result['checks'].items() if not v]}")
    return ok


# =======================================================================================
# PyTorch: one process per device, explicit collectives

def setup_torch(args):
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this node: its GPUs serve them
    n_gpus = torch.cuda.device_count()
    if args.device == "cuda" and n_gpus < local_world:
        sys.exit(f"--device cuda: {local_world} ranks on this node but {n_gpus} GPU(s); NCCL needs one GPU per "
                 f"rank (torchrun --nproc_per_node={max(n_gpus, 1)}, or --device cpu)")
    cuda = args.device != "cpu" and n_gpus >= local_world
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    # a timeout: if one rank dies, the others fail after 2 minutes instead of hanging
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    except Exception as e:  # rendezvous timeout, port in use, ...: one sentence, not a traceback
        sys.exit(f"could not start the process group ({backend}, rank {rank} of {world}): "
                 f"{(str(e) or type(e).__name__).splitlines()[0]}")
    if rank == 0:
        why = "each rank has its own GPU" if cuda else f"{n_gpus} GPU(s) for {local_world} ranks on this node"
        name = torch.cuda.get_device_name(device) if cuda else "CPU"
        mem = (torch.cuda.get_device_properties(device).total_memory if cuda
               else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        print(f"device: {name}, {mem / 2**30:.0f} GiB | torch {torch.__version__} | "
              f"{world} ranks, backend {backend} ({why})")
    return rank, world, device, backend


def make_batches(cfg, n, B, T, rank, world, device):
    """Every rank draws the same global batch of B * world rows and keeps its own B rows."""
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (B * world, T + 1), generator=g)[rank * B:(rank + 1) * B]
            for _ in range(n)]
    return [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]


def handrolled_step(model, opt, x, y, world, amp=nullcontext()):
    """05's data parallelism: the whole backward first, then one all-reduce per tensor."""
    with amp:
        _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    for p in model.parameters():  # serial, after backward: nothing overlaps
        dist.all_reduce(p.grad.div_(world))
    opt.step()


def ddp_step(ddp, opt, x, y, amp=nullcontext()):
    with amp:
        _, loss = ddp(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DDP's hooks all-reduce each bucket as soon as its grads are ready
    opt.step()


def counting_allreduce(counter, bucket):
    """A DDP comm hook: count the bucket, then do exactly what DDP does by default."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    counter["calls"] += 1
    return allreduce_hook(None, bucket)


def wrap_ddp(model, device, count=False, **kw):
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None, **kw)
    counter = dict(calls=0)
    if count:
        ddp.register_comm_hook(counter, counting_allreduce)
    return ddp, counter


def max_diff(tensors_a, tensors_b):
    """The largest |a - b| over all tensors and all ranks."""
    local = max((a.detach().float() - b.detach().float()).abs().max().item() for a, b in zip(tensors_a, tensors_b))
    t = torch.tensor([local], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def exp_ddp_equals_handrolled(base, batches, world, device, log):
    # PREDICTION: the same math (the average of per-rank gradients, the same AdamW): after k
    # steps the parameters agree to rounding: exactly with 2 ranks (a + b = b + a), ~1e-6 with 4
    hand, model = copy.deepcopy(base), copy.deepcopy(base)
    ddp, _ = wrap_ddp(model, device)
    opt_h, opt_d = hand.configure_optimizer(lr=LR), model.configure_optimizer(lr=LR)
    for x, y in batches:
        handrolled_step(hand, opt_h, x, y, world)
        ddp_step(ddp, opt_d, x, y)
    err = max_diff(hand.parameters(), model.parameters())
    log(f"[1] DDP vs hand-rolled after {len(batches)} AdamW steps (fp32): max |param diff| {err:.2e} "
        f"(measured; tolerance {PARAM_TOL:.0e}; one step moves a parameter ~{LR:.0e})"
        + (" (trivial with one rank)" if world == 1 else ""))  # one rank: the all-reduce is a no-op
    return dict(steps=len(batches), max_abs_param_diff=err, trivial_at_one_rank=world == 1), err < PARAM_TOL


def time_steps(step_fns, steps, warmup, device):
    """Interleave the candidates step by step, so machine noise hits them alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {name: [] for name in step_fns}
    for i in range(warmup + steps):
        for name, fn in step_fns.items():
            dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)  # start together
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: stats_ms(t) for name, t in times.items()}


def exp_step_time(base, batches, world, device, amp, steps, log):
    # PREDICTION: hand-rolled pays one all-reduce per tensor (a latency each) after the whole
    # backward; DDP sends a few big buckets and overlaps them with backward, so it is faster by
    # up to the all-reduce time. On a busy CPU the overlap finds no idle core: there most of
    # the gain is bucketing (fewer calls).
    hand, model = copy.deepcopy(base), copy.deepcopy(base)
    ddp, _ = wrap_ddp(model, device)
    opt_h, opt_d = hand.configure_optimizer(lr=LR), model.configure_optimizer(lr=LR)
    x, y = batches[0]
    res = time_steps({"handrolled": lambda: handrolled_step(hand, opt_h, x, y, world, amp),
                      "ddp": lambda: ddp_step(ddp, opt_d, x, y, amp)}, steps, 2, device)
    res["handrolled"]["allreduce_calls_per_step"] = n_tensors = len(list(base.parameters()))
    res["grad_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
    res["ddp_speedup"] = res["handrolled"]["median_ms"] / res["ddp"]["median_ms"]
    res["ddp_not_slower"] = res["ddp"]["median_ms"] <= 1.02 * res["handrolled"]["median_ms"]
    for name, r in (("handrolled", res["handrolled"]), ("ddp", res["ddp"])):
        log(f"[2] {name:10s} {r['median_ms']:8.1f} ms/step (median, min {r['min_ms']:.1f} max {r['max_ms']:.1f}, rank 0, measured)")
    log(f"    hand-rolled: {n_tensors} all-reduce calls per step; DDP speedup {res['ddp_speedup']:.2f}x "
        f"(derived){'' if res['ddp_not_slower'] else ' <- DDP is SLOWER on this run'}")
    return res


def exp_bucket_sweep(base, batches, device, amp, caps, steps, log):
    # PREDICTION: tiny buckets -> many calls, latency-bound; one huge bucket -> no overlap (it
    # waits for the whole backward). The best sits in between, near the 25 MB default. A
    # tensor larger than the cap (the 50304 x d embedding) is a bucket of its own.
    rows = []
    x, y = batches[0]
    for cap in caps:
        model = copy.deepcopy(base)
        ddp, counter = wrap_ddp(model, device, count=True, bucket_cap_mb=cap)
        opt = model.configure_optimizer(lr=LR)
        for _ in range(2):  # warm-up; after step 1 DDP rebuilds its buckets in gradient-ready order
            ddp_step(ddp, opt, x, y, amp)
        counter["calls"] = 0
        t = time_steps({"ddp": lambda: ddp_step(ddp, opt, x, y, amp)}, steps, 0, device)["ddp"]
        rows.append(dict(bucket_cap_mb=cap, allreduce_calls_per_step=counter["calls"] / steps, **t))
        log(f"[3] bucket_cap_mb {cap:7.2f}: {counter['calls'] / steps:4.0f} buckets/step, {t['median_ms']:8.1f} "
            f"ms/step (median, min {t['min_ms']:.1f} max {t['max_ms']:.1f}, measured)")
    return rows


def exp_no_sync(base, batches, device, k, log):
    # PREDICTION: accumulating k micro-batches, only the last backward needs the all-reduce:
    # no_sync cuts the calls k-fold, same gradients (average of sums = sum of averages). The
    # forward must be inside no_sync too: DDP decides at forward time whether the coming
    # backward syncs, so no_sync around backward alone saves nothing.
    ddp, counter = wrap_ddp(copy.deepcopy(base), device, count=True)

    def accumulate(variant):
        ddp.zero_grad(set_to_none=True)
        counter["calls"] = 0
        for i, (x, y) in enumerate(batches[:k]):
            skip = lambda: ddp.no_sync() if variant != "sync_every" and i < k - 1 else nullcontext()
            with skip() if variant == "no_sync" else nullcontext():
                loss = ddp(x, y)[1] / k  # equal micro-batches: dividing by k makes the sum the mean
            with skip():
                loss.backward()
        return counter["calls"], [p.grad.clone() for p in ddp.module.parameters()]

    accumulate("sync_every")  # warm-up: DDP rebuilds its buckets after the first iteration
    res, grads = dict(k=k), {}
    for variant in ("sync_every", "no_sync", "backward_only_in_no_sync"):
        calls, grads[variant] = accumulate(variant)
        res[variant] = dict(allreduce_calls=calls)
        log(f"[4] {variant:24s}: {calls:3d} all-reduce calls (buckets) for {k} micro-batches (measured)")
    err, scale = max_diff(grads["sync_every"], grads["no_sync"]), max(g.abs().max().item() for g in grads["no_sync"])
    res.update(max_abs_grad_diff=err, max_abs_grad=scale,
               call_ratio=res["sync_every"]["allreduce_calls"] / max(res["no_sync"]["allreduce_calls"], 1))
    log(f"    no_sync cuts the calls {res['call_ratio']:.1f}x (target {k}x); gradients: max |diff| {err:.2e} "
        f"of max |grad| {scale:.2e} (measured)")
    return res, err <= 1e-5 * scale, res["call_ratio"] == k


def state_bytes_per_rank(model, opt):
    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard only
        return t.numel() * t.element_size()
    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return dict(params=params, grads=grads, optimizer=optim, total=params + grads + optim)


def exp_fsdp(base, batches, world, device, log):
    # PREDICTION: DDP keeps a full replica of params, grads and both AdamW moments on every rank
    # (16 bytes/param); FSDP2 keeps 1/N of each, all-gathers a block's params just in time for
    # its forward and backward, and reduce-scatters the grads: ~1/N of the bytes, same math.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard  # FSDP2: public since torch 2.6, gloo works
    ddp, _ = wrap_ddp(copy.deepcopy(base), device)
    opt_d = ddp.module.configure_optimizer(lr=LR)
    sharded, mesh = copy.deepcopy(base), init_device_mesh(device.type, (world,))  # a 1-D mesh of ranks
    for block in sharded.transformer.h:
        fully_shard(block, mesh=mesh)  # one all-gather unit per block
    fully_shard(sharded, mesh=mesh)  # the rest (embeddings = tied head, ln_f) at the root
    opt_s = sharded.configure_optimizer(lr=LR)
    for x, y in batches:
        ddp_step(ddp, opt_d, x, y)
        ddp_step(sharded, opt_s, x, y)  # the same step: the collectives live in the module
    err = max_diff(ddp.module.parameters(), (p.full_tensor() for p in sharded.parameters()))
    full, shard = state_bytes_per_rank(ddp.module, opt_d), state_bytes_per_rank(sharded, opt_s)
    trivial = " (trivial with one rank)" if world == 1 else ""  # one rank: nothing sharded, 1/N = 1
    log(f"[5] FSDP2 vs DDP after {len(batches)} steps (fp32): max |param diff| {err:.2e} (measured){trivial}")
    for name in ("params", "grads", "optimizer", "total"):
        log(f"    {name:9s} bytes per rank: replicated {full[name] / 2**20:8.2f} MiB, sharded "
            f"{shard[name] / 2**20:8.2f} MiB ({shard[name] / full[name]:.3f}; 1/N = {1 / world:.3f}, "
            f"measured){trivial}")
    ratio = shard["total"] / full["total"]
    res = dict(max_abs_param_diff=err, replicated_bytes=full, sharded_bytes=shard, sharded_over_replicated=ratio,
               trivial_at_one_rank=world == 1)
    return res, err < PARAM_TOL, abs(ratio * world - 1) < 0.05


def plot_sweep(rows, hand_ms, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("figure skipped (matplotlib missing)")
    fig, ax = plt.subplots(figsize=(6, 4))
    med = [r["median_ms"] for r in rows]
    ax.errorbar([r["bucket_cap_mb"] for r in rows], med, marker="o", label="DDP", capsize=3,
                yerr=[[m - r["min_ms"] for m, r in zip(med, rows)], [r["max_ms"] - m for m, r in zip(med, rows)]])
    ax.axhline(hand_ms, color="gray", ls="--", label="hand-rolled (all-reduce after backward)")
    ax.set(xscale="log", xlabel="bucket_cap_mb", ylabel="ms / step (median, min-max)", title="DDP: bucket size", ylim=(0, None))
    ax.legend()
    Path(out).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(out) / "06_bucket_sweep.png", dpi=120, bbox_inches="tight")
    print(f"figure: {Path(out) / '06_bucket_sweep.png'}")


def run_torch(args):
    rank, world, device, backend = setup_torch(args)
    log = print if rank == 0 else (lambda *a: None)
    cuda = device.type == "cuda"
    cfg, B, T = sizes(args.quick, cuda)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    torch.manual_seed(0)  # the same seed on every rank (DDP would broadcast rank 0's weights anyway)
    base = GPT(cfg).to(device)
    torch.manual_seed(0)  # the same weights, with deterministic attention, for the fp32 checks
    check_base = GPT(replace(cfg, attn="manual")).to(device) if cuda else base
    n_params = sum(p.numel() for p in base.parameters())
    log(f"model: n_layer={cfg.n_layer} d={cfg.n_embd} vocab={cfg.vocab_size}, {n_params / 1e6:.1f}M params, "
        f"batch {B} x {T} tokens per rank; timings {'bf16 autocast' if cuda else 'fp32'}, checks fp32")
    k, steps = 4, 3 if args.quick else (15 if cuda else 5)
    caps = [0.25, 25] if args.quick else ([1, 5, 25, 100, 1000] if cuda else [0.25, 1, 4, 25])
    batches = make_batches(cfg, k, B, T, rank, world, device)
    result = dict(lesson="06_ddp_prod", framework="torch", quick=args.quick, world_size=world, backend=backend,
                  device=dict(type=device.type, name=torch.cuda.get_device_name(device) if cuda else "CPU",
                              torch=torch.__version__), checks={},
                  model=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size, params=n_params,
                             batch_per_rank=B, seq_len=T))
    experiments = [  # (JSON key, run, names of the checks it returns after its result)
        ("equivalence", lambda: exp_ddp_equals_handrolled(check_base, batches[:3], world, device, log),
         ["ddp_equals_handrolled"]),
        ("step_time", lambda: (exp_step_time(base, batches, world, device, amp, steps, log),), []),
        ("bucket_sweep", lambda: (exp_bucket_sweep(base, batches, device, amp, caps, steps, log),), []),
        ("no_sync", lambda: exp_no_sync(check_base, batches, device, k, log),
         ["no_sync_grads_equal", "no_sync_cuts_allreduces_by_k"]),
        ("fsdp", lambda: exp_fsdp(check_base, batches[:3], world, device, log),
         ["fsdp_matches_ddp", "fsdp_bytes_about_1_over_n"]),
    ]
    for name, run, check_names in experiments:
        try:  # a failing experiment must not take the others, or the JSON, with it
            out = run()
            result[name] = out[0]
            result["checks"].update(zip(check_names, out[1:]))
        except Exception as e:  # reported, and its checks fail
            log(f"[{name}] FAILED: {type(e).__name__}: {e}")
            result[name] = dict(error=f"{type(e).__name__}: {e}")
            result["checks"].update({c: False for c in check_names} or {f"{name}_ran": False})
    ok = all(result["checks"].values())
    if rank == 0:
        if "error" not in result["bucket_sweep"] and "error" not in result["step_time"]:
            plot_sweep(result["bucket_sweep"], result["step_time"]["handrolled"]["median_ms"], args.out)
        ok = finish(result, args)
    dist.destroy_process_group()
    return ok


# =======================================================================================
# JAX: one process over all devices; the compiler inserts the collectives

def collectives_in(compiled):
    """Count the collective ops in a compiled XLA program, and return its first all-reduce line."""
    text = compiled.as_text()
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    counts = {k: len(re.findall(rf"\s{k}(?:-start)?\(", text)) for k in kinds}
    return counts, next((ln.strip() for ln in text.splitlines() if re.search(r"\sall-reduce(?:-start)?\(", ln)), "")


def exp_jax_placement(jax, step, state, data, state_sh, batch_sh, reps):
    # PREDICTION: one device -> no collective. Data parallel (batch sharded, params replicated)
    # -> the gradient of a replicated parameter over a sharded batch is a sum over the shards:
    # XLA must insert an all-reduce, and the losses equal one device's. Sharded params ->
    # all-gathers to use them, reduce-scatters (or all-reduce + slice) for their gradients,
    # 1/N of the bytes per device, and still the same losses.
    st = jax.device_put(state, state_sh)
    batches = [(jax.device_put(d[:, :-1], batch_sh), jax.device_put(d[:, 1:], batch_sh)) for d in data]
    t0 = time.perf_counter()
    compiled = step.lower(st, *batches[0]).compile()  # the same jitted step, compiled for this placement
    compile_s = time.perf_counter() - t0
    counts, example = collectives_in(compiled)
    losses, s = [], st
    for x, y in batches:  # two steps: the second loss shows the gradients were right
        loss, s = compiled(s, x, y)
        losses.append(float(loss))
        s = jax.device_put(s, state_sh)  # back to the placement the program was compiled for
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(st, *batches[0]))
        times.append(time.perf_counter() - t0)
    per_device = {}
    for a in jax.tree.leaves(st):
        for shard in a.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return dict(collectives=counts, allreduce_example=example, losses=losses, compile_s=compile_s,
                state_bytes_per_device=max(per_device.values()), step=stats_ms(times))


def run_jax(args):
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # must be set before jax is imported
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    import flax
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from model_jax import GPT as JaxGPT, adamw, make_train_step

    devices = jax.devices()
    n, gpu = len(devices), devices[0].platform == "gpu"
    if args.device == "cuda" and not gpu:
        sys.exit("--device cuda: JAX sees no GPU (install jax[cuda12] or jax[cuda13], or use --device cpu)")
    mem = ((devices[0].memory_stats() or {}).get("bytes_limit", 0) if gpu
           else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    print(f"device: {n} x {devices[0].device_kind} ({'GPUs' if gpu else 'simulated CPU devices'}), "
          f"{mem / 2**30:.0f} GiB {'each: JAX memory-pool limit (bytes_limit), not the card' if gpu else 'host'} "
          f"| jax {jax.__version__}, flax {flax.__version__} | one process drives all {n}")
    cfg, B, T = sizes(args.quick, gpu)
    B = 4 if gpu else B  # per device; the one-device reference runs all n * B rows on one GPU
    model = JaxGPT(cfg, rngs=nnx.Rngs(0))  # fp32 on both sides of the check
    graphdef, state = nnx.split((model, nnx.Optimizer(model, adamw(LR), wrt=nnx.Param)))
    step = make_train_step(graphdef)  # ONE jitted function: where its inputs live decides the program
    rng = np.random.default_rng(1)
    data = [rng.integers(0, cfg.vocab_size, (n * B, T + 1), dtype=np.int32) for _ in range(2)]
    print(f"model: n_layer={cfg.n_layer} d={cfg.n_embd} vocab={cfg.vocab_size}, batch {B} x {T} per device, "
          f"{'fp32 params; matmuls at JAX default precision: TF32 on a GPU' if gpu else 'fp32'}")

    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))  # Auto: XLA propagates shardings
    one = jax.sharding.SingleDeviceSharding(devices[0])
    replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def largest_divisible_dim(a):  # the bridge: split each array along its largest dim divisible by n
        for d in sorted(range(a.ndim), key=lambda d: -a.shape[d]):
            if a.shape[d] % n == 0:
                return NamedSharding(mesh, P(*["data" if i == d else None for i in range(a.ndim)]))
        return replicated

    placements = {  # name: (sharding of every state array, sharding of the batch)
        "single_device": (jax.tree.map(lambda a: one, state), one),
        "data_parallel": (jax.tree.map(lambda a: replicated, state), by_batch),
        "sharded_params": (jax.tree.map(largest_divisible_dim, state), by_batch),
    }
    result = dict(lesson="06_ddp_prod", framework="jax", quick=args.quick, n_devices=n, checks={},
                  device=dict(type="gpu" if gpu else "cpu", name=devices[0].device_kind, jax=jax.__version__),
                  model=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                             batch_per_device=B, seq_len=T))
    for name, (state_sh, batch_sh) in placements.items():
        try:
            r = result[name] = exp_jax_placement(jax, step, state, data, state_sh, batch_sh, 2 if args.quick else 5)
        except Exception as e:  # e.g. the one-device reference does not fit: say so, go on
            print(f"[{name}] FAILED: {type(e).__name__}: {str(e)[:300]}")
            result[name] = dict(error=f"{type(e).__name__}: {e}", losses=[float("nan")] * 2)
            continue
        found = ", ".join(f"{k} x{v}" for k, v in r["collectives"].items() if v) or "none"
        print(f"[{name}] compiled in {r['compile_s']:.1f} s; collectives in the compiled HLO: {found}")
        if r["allreduce_example"] and name == "data_parallel":
            print(f"    {r['allreduce_example'][:200]} ...\n    -> jit put it there; XLA merged the gradients' "
                  f"all-reduces into {r['collectives']['all-reduce']} op(s), the compiler's version of DDP's buckets")
        print(f"    losses {r['losses'][0]:.6f}, {r['losses'][1]:.6f}; {r['step']['median_ms']:.1f} ms/step (median, "
              f"measured); params + AdamW state {r['state_bytes_per_device'] / 2**20:.2f} MiB per device (measured)")

    for name in ("data_parallel", "sharded_params"):
        err = max(abs(a - b) / abs(b) for a, b in zip(result[name]["losses"], result["single_device"]["losses"]))
        result[name]["max_rel_loss_diff"] = err
        result["checks"][f"{name}_loss_equals_single_device"] = err < 1e-4  # False for nan
        print(f"{name}: loss against one device, max relative diff {err:.1e} over 2 steps (measured)"
              + (" (trivial with one device)" if n == 1 else ""))
    if n > 1:  # one device has nothing to all-reduce: XLA emits no collective
        result["checks"]["allreduce_in_compiled_text"] = result["data_parallel"].get("collectives", {}).get("all-reduce", 0) > 0
    sharded, full = (result[k].get("state_bytes_per_device", float("nan")) for k in ("sharded_params", "data_parallel"))
    result["sharded_over_replicated"] = ratio = sharded / full
    result["checks"]["sharded_bytes_about_1_over_n"] = abs(ratio * n - 1) < 0.05
    result["trivial_at_one_device"] = n == 1  # one device: these checks hold by construction
    print(f"params + AdamW state per device, sharded / replicated = {ratio:.3f} (1/N = {1 / n:.3f}, measured)"
          + (" (trivial with one device)" if n == 1 else "")
          + ("" if gpu else "; simulated devices share the CPU's cores: no speedup to expect"))
    return finish(result, args)


def main():
    p = argparse.ArgumentParser(description="Section 13.6: production data parallelism (see the docstring)")
    p.add_argument("--framework", choices=["auto", "torch", "jax"], default="auto",
                   help="auto: torch under torchrun, jax otherwise")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--cpu-devices", type=int, default=4, help="simulated JAX CPU devices, unless XLA_FLAGS says")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--out", type=str, default="out")
    args = p.parse_args()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    framework = args.framework if args.framework != "auto" else ("torch" if under_torchrun else "jax")
    if framework == "torch" and not under_torchrun:
        sys.stderr.write("The PyTorch half runs one process per device; launch it with\n"
                         "  torchrun --nproc_per_node=N 06_ddp_prod.py   (N = your GPUs, or e.g. 4 on a CPU)\n")
        sys.exit(2)
    if framework == "jax" and under_torchrun:
        if os.environ["RANK"] == "0":
            sys.stderr.write("The JAX half is ONE process driving every device; run it without torchrun:\n"
                             "  python 06_ddp_prod.py --framework jax\n")
        sys.exit(2)
    if framework == "jax" and args.framework == "auto":
        print("not under torchrun: the JAX half (one process, all devices). "
              "The PyTorch half: torchrun --nproc_per_node=N 06_ddp_prod.py")
    sys.exit(0 if (run_torch(args) if framework == "torch" else run_jax(args)) else 1)


if __name__ == "__main__":
    main()
