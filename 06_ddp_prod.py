"""
Section 13.6: production data parallelism, two philosophies.

05_ddp_scratch.py averaged gradients by hand: backward, then one all-reduce per tensor.
This file replaces that with what production code uses, in each framework, and shows
where the two differ:

  PyTorch: one process per device, collectives explicit. torchrun starts N processes,
    DistributedDataParallel (DDP) averages gradients in ~25 MB buckets, launched while
    backward is still running. Measured: same parameters as the hand-rolled version
    after k steps (checked); step time against it; a bucket_cap_mb sweep; no_sync under
    gradient accumulation (all-reduce calls counted, gradients checked); then the bridge
    to sharded training, FSDP2 fully_shard: bytes of params + grads + AdamW state per rank.
  JAX: one process drives every device, collectives implied. A Mesh with a 'data' axis,
    the batch sharded over it, parameters replicated, the training step a plain jax.jit:
    the compiler inserts the all-reduce (found and printed from the compiled program's
    text). Same loss as one device (checked). The bridge: a PartitionSpec over 'data' for
    the parameters and AdamW state too, bytes per device against replication.

How to run (the launcher picks the half; --framework says it explicitly):
  torchrun --nproc_per_node=4 06_ddp_prod.py          # PyTorch half. A CPU: 4 gloo ranks
  torchrun --nproc_per_node=8 06_ddp_prod.py          # 8 GPUs: NCCL, one GPU per rank, GPT-2 124M
  python 06_ddp_prod.py                               # JAX half (= --framework jax): one
                                                      # process; all GPUs, or 4 simulated CPU
                                                      # devices (--cpu-devices N) on a CPU
  python 06_ddp_prod.py --framework torch             # refused: the torch half needs torchrun
NCCL when every rank has its own GPU, else gloo on CPU. One GPU works (1 rank, 1 device),
but collectives only have something to do with 2 or more.

Output: which backend and devices; DDP-vs-hand-rolled parameter error and ms/step; a
table of bucket_cap_mb -> buckets (all-reduce calls per step) and ms/step; all-reduce
calls with and without no_sync; FSDP2's bytes per rank as a fraction of replication;
for JAX the all-reduce line from the compiled HLO, the loss error against one device,
and bytes per device replicated vs sharded. --json keeps every number; --out a figure.
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
from pathlib import Path

import torch
import torch.distributed as dist

from model_torch import GPT, GPTConfig

LR = 6e-4


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=["auto", "torch", "jax"], default="auto",
                   help="auto: torch under torchrun, jax otherwise")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--cpu-devices", type=int, default=4, help="simulated JAX CPU devices")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--out", type=str, default="out")
    return p.parse_args()


def stats_ms(seconds):
    ms = [s * 1e3 for s in seconds]
    return dict(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), n=len(ms))


def sizes(quick, cuda):
    """(config, batch per rank/device, sequence length)."""
    if cuda:
        return GPTConfig.preset("gpt2"), 8, 1024
    if quick:  # a smaller vocabulary and 2 layers: a smoke run, not a measurement
        return GPTConfig.preset("tiny", n_layer=2, block_size=64, vocab_size=4096), 2, 64
    return GPTConfig.preset("tiny"), 2, 128


def finish(result, args, ok):
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print("checks:", "ALL PASSED" if ok else "FAILED " + str([k for k, v in result["checks"].items() if not v]))


# =======================================================================================
# PyTorch: one process per device, explicit collectives

def setup_torch(args):
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    n_gpus = torch.cuda.device_count()
    if args.device == "cuda" and n_gpus < world:
        sys.exit(f"--device cuda: {world} ranks but {n_gpus} GPU(s); NCCL needs one GPU per rank "
                 f"(run torchrun --nproc_per_node={max(n_gpus, 1)}, or --device cpu)")
    cuda = args.device != "cpu" and n_gpus >= world
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    # a timeout: a rank that dies makes the others fail after 2 minutes instead of hanging
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    if rank == 0:
        why = "each rank has its own GPU" if cuda else (
            f"{n_gpus} GPU(s) for {world} ranks" if n_gpus else "no GPU")
        name = torch.cuda.get_device_name(device) if cuda else "CPU"
        mem = (torch.cuda.get_device_properties(device).total_memory if cuda
               else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        print(f"device: {name}, {mem / 2**30:.0f} GiB | torch {torch.__version__} | "
              f"{world} ranks, backend {backend} ({why})")
    return rank, world, device, backend


def make_batches(cfg, n, B, T, rank, world, device, seed):
    """Every rank draws the same global batch of B*world rows and keeps its own B rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(0, cfg.vocab_size, (B * world, T + 1), generator=g)[rank * B:(rank + 1) * B]
        out.append((data[:, :-1].to(device), data[:, 1:].to(device)))
    return out


def handrolled_step(model, opt, x, y, world, amp):
    """05's data parallelism: full backward first, then one all-reduce per tensor."""
    with amp:
        _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    for p in model.parameters():  # serial, after backward: nothing overlaps
        dist.all_reduce(p.grad.div_(world))
    opt.step()


def ddp_step(ddp, opt, x, y, amp):
    with amp:
        _, loss = ddp(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DDP's hooks all-reduce each bucket as soon as its grads are ready
    opt.step()


def counting_allreduce(counter, bucket):
    """A DDP comm hook: count the bucket, then do exactly what DDP does by default."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    counter["calls"] += 1
    counter["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


def wrap_ddp(model, device, count=False, **kw):
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None, **kw)
    counter = dict(calls=0, bytes=0)
    if count:
        ddp.register_comm_hook(counter, counting_allreduce)
    return ddp, counter


def global_max(x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def max_param_diff(a, b):
    return max((pa.detach().float() - pb.detach().float()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))


def exp_ddp_equals_handrolled(base, batches, world, device, amp, log):
    # PREDICTION: same math (average of per-rank gradients, same AdamW), so after k steps the
    # parameters agree to float rounding (~1e-7: only the summation order of the all-reduce differs)
    hand, model = copy.deepcopy(base), copy.deepcopy(base)
    ddp, _ = wrap_ddp(model, device)
    opt_h, opt_d = hand.configure_optimizer(lr=LR), model.configure_optimizer(lr=LR)
    for x, y in batches:
        handrolled_step(hand, opt_h, x, y, world, amp)
        ddp_step(ddp, opt_d, x, y, amp)
    err = global_max(max_param_diff(hand, model))
    log(f"[1] DDP vs hand-rolled after {len(batches)} AdamW steps: max |param diff| = {err:.2e} "
        f"(measured; parameters move ~{LR:.0e} per step)")
    return dict(steps=len(batches), max_abs_param_diff=err), err < 1e-5


def time_steps(step_fns, steps, warmup, device):
    """Interleave the candidates step by step, so machine noise hits them alike."""
    times = {name: [] for name in step_fns}
    for i in range(warmup + steps):
        for name, fn in step_fns.items():
            dist.barrier()  # start together: do not time waiting for a slow rank
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: stats_ms(t) for name, t in times.items()}


def exp_step_time(base, batches, world, device, amp, steps, log):
    # PREDICTION: hand-rolled pays one all-reduce per tensor (latency each time) after the
    # whole backward; DDP sends a few large buckets and overlaps them with backward, so its
    # step is faster, by up to the all-reduce time. On a busy CPU the overlap has no idle
    # core to use: there, bucketing (fewer calls) is most of the gain.
    hand, model = copy.deepcopy(base), copy.deepcopy(base)
    ddp, _ = wrap_ddp(model, device)
    opt_h, opt_d = hand.configure_optimizer(lr=LR), model.configure_optimizer(lr=LR)
    x, y = batches[0]
    res = time_steps({"handrolled": lambda: handrolled_step(hand, opt_h, x, y, world, amp),
                      "ddp": lambda: ddp_step(ddp, opt_d, x, y, amp)}, steps, 2, device)
    n_tensors = sum(1 for _ in base.parameters())
    res["handrolled"]["allreduce_calls_per_step"] = n_tensors
    res["grad_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
    res["ddp_speedup"] = res["handrolled"]["median_ms"] / res["ddp"]["median_ms"]
    res["ddp_not_slower"] = res["ddp"]["median_ms"] <= res["handrolled"]["median_ms"] * 1.02
    for name in ("handrolled", "ddp"):
        r = res[name]
        log(f"[2] {name:10s} {r['median_ms']:8.1f} ms/step (median, min {r['min_ms']:.1f} max "
            f"{r['max_ms']:.1f}, rank 0, measured)")
    log(f"    hand-rolled: {n_tensors} all-reduce calls per step; DDP / hand-rolled speedup "
        f"{res['ddp_speedup']:.2f}x (derived){'' if res['ddp_not_slower'] else '  <- DDP SLOWER here'}")
    return res


def exp_bucket_sweep(base, batches, device, amp, caps, steps, log):
    # PREDICTION: tiny buckets -> many calls, latency-bound; one huge bucket -> no overlap
    # (the all-reduce waits for the whole backward). The minimum sits in between, near 25 MB.
    rows = []
    x, y = batches[0]
    for cap in caps:
        model = copy.deepcopy(base)
        ddp, counter = wrap_ddp(model, device, count=True, bucket_cap_mb=cap)
        opt = model.configure_optimizer(lr=LR)
        for _ in range(2):  # warm-up; DDP rebuilds its buckets in gradient-ready order after step 1
            ddp_step(ddp, opt, x, y, amp)
        counter["calls"] = 0
        t = time_steps({"ddp": lambda: ddp_step(ddp, opt, x, y, amp)}, steps, 0, device)["ddp"]
        rows.append(dict(bucket_cap_mb=cap, allreduce_calls_per_step=counter["calls"] / steps, **t))
        log(f"[3] bucket_cap_mb {cap:7.2f}: {counter['calls'] / steps:5.0f} buckets/step, "
            f"{t['median_ms']:8.1f} ms/step (median, min {t['min_ms']:.1f} max {t['max_ms']:.1f}, measured)")
    return rows


def exp_no_sync(base, batches, device, amp, k, log):
    # PREDICTION: accumulating k micro-batches, only the last backward needs an all-reduce:
    # no_sync cuts the calls k-fold with the same gradients (sum then average = average then
    # sum). The forward must run inside no_sync too: DDP decides at forward time whether the
    # coming backward syncs, so no_sync around backward alone saves nothing.
    model = copy.deepcopy(base)
    ddp, counter = wrap_ddp(model, device, count=True)
    micro = batches[:k]

    def accumulate(variant):
        ddp.zero_grad(set_to_none=True)
        counter["calls"] = 0
        for i, (x, y) in enumerate(micro):
            last = i == k - 1
            skip = lambda: ddp.no_sync() if (variant != "sync_every" and not last) else nullcontext()
            if variant == "backward_only_in_no_sync":
                with amp:
                    loss = ddp(x, y)[1] / k
                with skip():
                    loss.backward()
            else:
                with skip(), amp:
                    loss = ddp(x, y)[1] / k
                with skip():
                    loss.backward()
        return counter["calls"], [p.grad.detach().clone() for p in ddp.module.parameters()]

    accumulate("sync_every")  # warm-up: DDP rebuilds its buckets after the first iteration
    res = {}
    grads = {}
    for variant in ("sync_every", "no_sync", "backward_only_in_no_sync"):
        calls, grads[variant] = accumulate(variant)
        res[variant] = dict(allreduce_calls=calls)
        log(f"[4] {variant:26s}: {calls:4d} all-reduce calls for {k} micro-batches (measured)")
    err = global_max(max((a - b).abs().max().item() for a, b in zip(grads["sync_every"], grads["no_sync"])))
    scale = max(g.abs().max().item() for g in grads["sync_every"])
    res.update(k=k, max_abs_grad_diff=err, max_abs_grad=scale,
               call_ratio=res["sync_every"]["allreduce_calls"] / max(res["no_sync"]["allreduce_calls"], 1))
    log(f"    no_sync cuts calls {res['call_ratio']:.1f}x (target {k}x); grads: max |diff| {err:.2e} "
        f"vs max |grad| {scale:.2e} (measured)")
    return res, err <= 1e-5 * scale + 1e-8, res["call_ratio"] == k


def tensor_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard only
    return t.numel() * t.element_size()


def state_bytes_per_rank(model, opt):
    params = sum(tensor_bytes(p) for p in model.parameters())
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = sum(tensor_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return dict(params=params, grads=grads, optimizer=optim, total=params + grads + optim)


def exp_fsdp(base, batches, world, device, amp, log):
    # PREDICTION: DDP keeps a full replica of params, grads and both AdamW moments on every
    # rank (16 bytes/param); FSDP2 keeps 1/N of each, gathering a block's params just in time
    # for its forward and backward, and reduce-scattering grads: bytes per rank ~ 1/N, same math.
    try:
        from torch.distributed.fsdp import fully_shard  # FSDP2, public since torch 2.6
    except ImportError as e:
        log(f"[5] FSDP2 fully_shard unavailable in torch {torch.__version__} ({e}); skipped")
        return dict(error=str(e)), False, False
    model = copy.deepcopy(base)
    ddp, _ = wrap_ddp(model, device)
    opt_d = model.configure_optimizer(lr=LR)
    sharded = copy.deepcopy(base)
    for block in sharded.transformer.h:
        fully_shard(block)  # one all-gather unit per block
    fully_shard(sharded)  # the rest (embeddings, tied head, ln_f) at the root
    opt_s = sharded.configure_optimizer(lr=LR)
    for x, y in batches:
        ddp_step(ddp, opt_d, x, y, amp)
        with amp:
            _, loss = sharded(x, y)
        opt_s.zero_grad(set_to_none=False)
        loss.backward()
        opt_s.step()
    err = global_max(max((pd.detach() - ps.full_tensor().detach()).abs().max().item()
                         for pd, ps in zip(model.parameters(), sharded.parameters())))
    replicated, shard = state_bytes_per_rank(model, opt_d), state_bytes_per_rank(sharded, opt_s)
    ratio = shard["total"] / replicated["total"]
    log(f"[5] FSDP2 vs DDP after {len(batches)} steps: max |param diff| {err:.2e} (measured)")
    for name in ("params", "grads", "optimizer", "total"):
        log(f"    {name:9s} bytes per rank: replicated {replicated[name] / 2**20:8.2f} MiB, "
            f"sharded {shard[name] / 2**20:8.2f} MiB ({shard[name] / replicated[name]:.3f}; 1/N = {1 / world:.3f})")
    res = dict(max_abs_param_diff=err, replicated_bytes=replicated, sharded_bytes=shard,
               sharded_over_replicated=ratio)
    return res, err < 1e-5, abs(ratio * world - 1) < 0.05


def plot_sweep(rows, hand_ms, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("figure skipped (matplotlib missing)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    caps = [r["bucket_cap_mb"] for r in rows]
    ax.errorbar(caps, [r["median_ms"] for r in rows], marker="o", label="DDP",
                yerr=[[r["median_ms"] - r["min_ms"] for r in rows], [r["max_ms"] - r["median_ms"] for r in rows]])
    ax.axhline(hand_ms, color="gray", ls="--", label="hand-rolled (all-reduce after backward)")
    ax.set(xscale="log", xlabel="bucket_cap_mb", ylabel="ms / step (median, min-max)",
           title="DDP step time vs bucket size")
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
    torch.manual_seed(0)
    base = GPT(cfg).to(device)  # the same seed on every rank; DDP would broadcast rank 0's anyway
    n_params = sum(p.numel() for p in base.parameters())
    log(f"model: n_layer={cfg.n_layer} d={cfg.n_embd} vocab={cfg.vocab_size}, {n_params / 1e6:.1f}M params, "
        f"batch {B} x {T} tokens per rank{', bf16 autocast' if cuda else ', fp32'}")
    k = 4
    batches = make_batches(cfg, max(k, 3), B, T, rank, world, device, seed=1)
    steps = 4 if args.quick else (15 if cuda else 8)
    caps = [0.25, 1, 25] if args.quick else ([1, 5, 25, 100, 1000] if cuda else [0.5, 2, 8, 25, 100])
    result = dict(lesson="06_ddp_prod", framework="torch", quick=args.quick, world_size=world,
                  backend=backend, device=dict(type=device.type, name=torch.cuda.get_device_name(device)
                                               if cuda else "CPU", torch=torch.__version__),
                  model=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                             params=n_params, batch_per_rank=B, seq_len=T), checks={})
    checks = result["checks"]
    experiments = [
        ("equivalence", lambda: exp_ddp_equals_handrolled(base, batches[:3], world, device, amp, log),
         ["ddp_equals_handrolled"]),
        ("step_time", lambda: (exp_step_time(base, batches, world, device, amp, steps, log),), []),
        ("bucket_sweep", lambda: (exp_bucket_sweep(base, batches, device, amp, caps, steps, log),), []),
        ("no_sync", lambda: exp_no_sync(base, batches, device, amp, k, log),
         ["no_sync_grads_equal", "no_sync_cuts_allreduces_by_k"]),
        ("fsdp", lambda: exp_fsdp(base, batches[:3], world, device, amp, log),
         ["fsdp_matches_ddp", "fsdp_bytes_about_1_over_n"]),
    ]
    for name, fn, check_names in experiments:
        try:  # one failing experiment must not take the others (or the JSON) with it
            out = fn()
            result[name] = out[0]
            checks.update(zip(check_names, out[1:]))
        except Exception as e:  # noqa: BLE001 -- reported, and its checks fail
            log(f"[{name}] FAILED: {type(e).__name__}: {e}")
            result[name] = dict(error=f"{type(e).__name__}: {e}")
            checks.update({c: False for c in check_names} or {name + "_ran": False})
    if rank == 0 and "median_ms" in str(result.get("bucket_sweep")):
        plot_sweep(result["bucket_sweep"], result["step_time"]["handrolled"]["median_ms"], args.out)
    ok = all(checks.values())
    if rank == 0:
        finish(result, args, ok)
    dist.destroy_process_group()
    return ok


# =======================================================================================
# JAX: one process over all devices, the compiler inserts the collectives

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
    gpu = devices[0].platform == "gpu"
    if args.device == "cuda" and not gpu:
        sys.exit("--device cuda: JAX sees no GPU (install jax[cuda12]/jax[cuda13], or use --device cpu)")
    n = len(devices)
    stats = devices[0].memory_stats() if gpu else None
    mem = stats["bytes_limit"] if stats else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"device: {n} x {devices[0].device_kind} ({'GPU' if gpu else 'simulated CPU devices'}), "
          f"{mem / 2**30:.0f} GiB {'each' if gpu else 'host'} | jax {jax.__version__}, flax {flax.__version__} "
          f"| one process, {n} devices")
    cfg, B, T = sizes(args.quick, gpu)
    B = 4 if gpu else B  # per device; the single-device reference runs all n*B rows on one GPU
    model = JaxGPT(cfg, rngs=nnx.Rngs(0))  # fp32 params and compute on both sides of the check
    graphdef, state = nnx.split((model, nnx.Optimizer(model, adamw(LR), wrt=nnx.Param)))
    step = make_train_step(graphdef)  # ONE jitted function; its placement decides the program
    rng = np.random.default_rng(1)
    data = [rng.integers(0, cfg.vocab_size, (n * B, T + 1), dtype=np.int32) for _ in range(2)]
    print(f"model: n_layer={cfg.n_layer} d={cfg.n_embd} vocab={cfg.vocab_size}, batch {B} x {T} per device")

    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))  # Auto: XLA propagates shardings
    one = jax.sharding.SingleDeviceSharding(devices[0])
    replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def largest_divisible_dim(a):  # the bridge: shard each array along its largest dim divisible by n
        for d in sorted(range(a.ndim), key=lambda d: -a.shape[d]):
            if a.shape[d] % n == 0:
                return NamedSharding(mesh, P(*[("data" if i == d else None) for i in range(a.ndim)]))
        return replicated

    placements = {  # name: (sharding of every state array, sharding of the batch)
        "single_device": (jax.tree.map(lambda a: one, state), one),
        "data_parallel": (jax.tree.map(lambda a: replicated, state), by_batch),
        "sharded_params": (jax.tree.map(largest_divisible_dim, state), by_batch),
    }
    result = dict(lesson="06_ddp_prod", framework="jax", quick=args.quick, n_devices=n,
                  device=dict(type="gpu" if gpu else "cpu", name=devices[0].device_kind, jax=jax.__version__),
                  model=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                             batch_per_device=B, seq_len=T), checks={})
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    for name, (state_sh, batch_sh) in placements.items():
        # PREDICTION: single device -> no collective. Data parallel -> the gradient of a
        # replicated parameter w.r.t. a sharded batch is a sum over shards: an all-reduce.
        # Sharded params -> all-gathers to use them, reduce-scatters (or all-reduce + slice) for grads.
        st = jax.device_put(state, state_sh)
        batches = [(jax.device_put(d[:, :-1], batch_sh), jax.device_put(d[:, 1:], batch_sh)) for d in data]
        t0 = time.perf_counter()
        compiled = step.lower(st, *batches[0]).compile()
        compile_s = time.perf_counter() - t0
        text = compiled.as_text()
        counts = {k: len(re.findall(rf"\s{k}(?:-start)?\(", text)) for k in kinds}
        example = next((ln.strip() for ln in text.splitlines() if re.search(r"\sall-reduce(?:-start)?\(", ln)), None)
        losses, s = [], st
        for x, y in batches:  # two steps: the second loss shows the gradients were right
            loss, s = compiled(s, x, y)
            losses.append(float(loss))
            s = jax.device_put(s, state_sh)  # back to the input placement the program expects
        times = []
        for _ in range(2 if args.quick else 5):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(st, *batches[0]))
            times.append(time.perf_counter() - t0)
        per_device = {}
        for a in jax.tree.leaves(st):
            for sh in a.addressable_shards:
                per_device[sh.device] = per_device.get(sh.device, 0) + sh.data.nbytes
        result[name] = dict(collectives=counts, allreduce_example=example, losses=losses,
                            compile_s=compile_s, state_bytes_per_device=max(per_device.values()),
                            step=stats_ms(times))
        found = ", ".join(f"{k} x{v}" for k, v in counts.items() if v) or "none"
        print(f"[{name}] compiled in {compile_s:.1f} s; collectives in the HLO: {found}")
        if example and name == "data_parallel":
            print(f"    {example[:220]}{' ...' if len(example) > 220 else ''}")
        print(f"    losses {losses[0]:.6f}, {losses[1]:.6f}; {stats_ms(times)['median_ms']:.1f} ms/step (median, "
              f"measured); state {max(per_device.values()) / 2**20:.2f} MiB per device (measured)")

    ref = result["single_device"]["losses"]
    for name in ("data_parallel", "sharded_params"):
        err = max(abs(a - b) / abs(b) for a, b in zip(result[name]["losses"], ref))
        result[name]["max_rel_loss_diff"] = err
        result["checks"][f"{name}_loss_equals_single_device"] = err < 1e-4
        print(f"{name}: loss vs one device, max relative diff {err:.1e} over 2 steps (measured)")
    if n > 1:  # one device has nothing to all-reduce: XLA emits no collective
        result["checks"]["allreduce_in_compiled_text"] = result["data_parallel"]["collectives"]["all-reduce"] > 0
    ratio = result["sharded_params"]["state_bytes_per_device"] / result["data_parallel"]["state_bytes_per_device"]
    result["sharded_over_replicated"] = ratio
    result["checks"]["sharded_bytes_about_1_over_n"] = abs(ratio * n - 1) < 0.05
    print(f"params + AdamW state per device: sharded / replicated = {ratio:.3f} (1/N = {1 / n:.3f}, measured)"
          + ("" if gpu else "; simulated devices share the CPU's cores: no speedup expected"))
    ok = all(result["checks"].values())
    finish(result, args, ok)
    return ok


def main():
    args = parse_args()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    framework = args.framework if args.framework != "auto" else ("torch" if under_torchrun else "jax")
    if framework == "torch" and not under_torchrun:
        print("The PyTorch half runs one process per device: launch it with\n"
              "  torchrun --nproc_per_node=N 06_ddp_prod.py   (N = GPUs, or e.g. 4 on a CPU)", file=sys.stderr)
        sys.exit(2)
    if framework == "jax" and under_torchrun:
        if os.environ.get("RANK") == "0":
            print("The JAX half is ONE process driving all devices: run it with plain\n"
                  "  python 06_ddp_prod.py --framework jax", file=sys.stderr)
        sys.exit(2)
    if framework == "jax" and args.framework == "auto":
        print("not under torchrun: running the JAX half (one process, all devices); "
              "for the PyTorch half: torchrun --nproc_per_node=N 06_ddp_prod.py")
    ok = run_torch(args) if framework == "torch" else run_jax(args)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
