"""
Section 13.5: data parallelism from scratch, the ring all-reduce, and the communication bill.

Every rank holds a full replica of the GPT, takes its shard of the global batch, and the ranks
average their gradients before each (identical) optimizer step. That average is an all-reduce,
and this file builds one from point-to-point messages - naive (everyone sends to rank 0, rank 0
sends the sum back) and ring (reduce-scatter then all-gather, N-1 steps each) - checks both
against `dist.all_reduce`, then measures what it costs: time vs message size, algbw / busbw
(nccl-tests definitions), a fitted alpha-beta model T = 2(N-1)a + 2(N-1)/N S b, the bytes each
rank really sends, and the bill for this GPT's gradients against one step of compute.

    torchrun --nproc_per_node=4 05_ddp_scratch.py   # N ranks: NCCL if each has a GPU, else gloo on CPU
    python 05_ddp_scratch.py                        # one rank (CPU or one GPU): the bill is zero
    torchrun --nproc_per_node=3 05_ddp_scratch.py --device cpu --quick   # any N, odd ones too

Expect: replicas bit-identical and equal to one process training on the whole batch (<= 1e-5),
ring and naive equal to dist.all_reduce (<= 1e-6), ring bytes sent = 2(N-1)/N S, the ring close
to the library at large sizes while naive falls behind by ~N, and a figure
out/05_ddp_scratch_allreduce.png (time vs size with the fit). On CPU the GPT is the `tiny`
preset (gloo, about a minute); on GPUs it is GPT-2 124M (fp32) and the sweep goes to 1 GiB.
"""

import argparse, json, os, platform, statistics, sys, time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from model_torch import GPT, GPTConfig

SENT = [0]  # bytes this rank handed to send/isend: the instrument behind the byte count of 3.


def say(*a):  # rank 0 speaks for all
    print(*a, flush=True) if dist.get_rank() == 0 else None


def sync(dev):  # CUDA is asynchronous: wait for the GPU before reading a clock
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None


def time_op(fn, dev, reps, warmup=1, inner=1):
    """`reps` samples of seconds per call of fn; each sample is the slowest rank's time for
    `inner` back-to-back calls (as nccl-tests times its iterations), divided by inner."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier(); sync(dev)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(dev)
        times.append((time.perf_counter() - t0) / inner)
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective is done when its slowest rank is
    return t.tolist()


# ---------------------------------------------------------------------------------------
# 1. Hand-rolled data parallelism. PREDICTION: the mean of N shard-gradients is the gradient
# of the whole batch (equal shards), so N replicas fed the same averaged gradient take the
# same AdamW step: bit-identical to each other, and equal to one process on the whole batch
# up to fp32 rounding (another summation order: ~1e-7 relative in the gradients; on a GPU,
# non-deterministic CUDA kernels give ~1e-6 even with one rank). AdamW's g / (sqrt(v) + eps)
# magnifies that rounding in the few entries with |g| ~ eps = 1e-8, so the largest parameter
# difference is a fair fraction of a step (lr): 3% of lr measured on CPU with 4 ranks, 20% on
# one H200 rank; but the two runs travel the same path: their difference is ~1e-5 of the
# distance the parameters moved.

def data_parallel_training(cfg, micro_batch, seq_len, steps, dev, grad_tol=1e-5, path_tol=1e-3):
    rank, N = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same seed on every rank: the replicas start equal
    model = GPT(cfg).to(dev)
    opt = model.configure_optimizer(lr=1e-3)
    if rank == 0:  # the reference: one process, the whole global batch
        torch.manual_seed(0)
        ref = GPT(cfg).to(dev); ref_opt = ref.configure_optimizer(lr=1e-3)
        start = torch.cat([q.detach().view(-1) for q in ref.parameters()])
    params = list(model.parameters())  # the tied wte/lm_head matrix appears once
    compute, losses, ref_losses, grad_err = [], [], [], 0.0
    for step in range(steps):
        data = torch.randint(0, cfg.vocab_size, (micro_batch * N, seq_len + 1),
                             generator=torch.Generator().manual_seed(step)).to(dev)
        x, y = data[:, :-1], data[:, 1:]
        mine = slice(rank * micro_batch, (rank + 1) * micro_batch)  # this rank's shard
        sync(dev); t0 = time.perf_counter()
        _, loss = model(x[mine], y[mine])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync(dev); compute.append(time.perf_counter() - t0)
        for p in params:  # the whole of data parallelism: average the gradients
            dist.all_reduce(p.grad)
            p.grad.div_(N)
        mean_loss = loss.detach().clone(); dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / N)
        if rank == 0:
            _, ref_loss = ref(x, y)
            ref_opt.zero_grad(set_to_none=True); ref_loss.backward()
            ref_losses.append(ref_loss.item())
            if step == 0:  # same parameters, so the gradients must agree (later steps start apart)
                grad_err = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                               for p, q in zip(params, ref.parameters()))
            ref_opt.step()
        opt.step()
    flat = torch.cat([p.detach().view(-1) for p in params])
    rank0 = flat.clone(); dist.broadcast(rank0, 0)
    same = torch.tensor([float(torch.equal(flat, rank0))], device=dev)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    diff = torch.zeros(3, dtype=torch.float64, device=dev)  # grad err, max |dp|, ||dp|| / ||path||
    if rank == 0:
        ref_flat = torch.cat([q.detach().view(-1) for q in ref.parameters()])
        diff[0], diff[1] = grad_err, (flat - ref_flat).abs().max()
        diff[2] = (flat - ref_flat).double().norm() / (ref_flat - start).double().norm()
        del ref, ref_opt, ref_flat, start
    dist.broadcast(diff, 0)
    t = torch.tensor(compute[1:] or compute, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    lr = opt.param_groups[0]["lr"]
    r = dict(micro_batch=micro_batch, seq_len=seq_len, global_batch=micro_batch * N, steps=steps, lr=lr,
             losses=losses, single_process_losses=ref_losses if rank == 0 else None,
             replicas_identical=bool(same.item()), grad_max_rel_err_vs_single=diff[0].item(),
             max_abs_param_diff_vs_single=diff[1].item(), param_diff_over_distance_moved=diff[2].item(),
             grad_tolerance=grad_tol, path_tolerance=path_tol, compute_s=float(t.median()),
             grad_tensors=len(params), grad_bytes=sum(p.numel() * p.element_size() for p in params))
    say(f"  measured: losses, mean of {N} shards {[round(l, 4) for l in losses]} vs one process on the whole "
        f"batch {[round(l, 4) for l in ref_losses]}; replicas bit-identical: {r['replicas_identical']}")
    say(f"  measured: step 0, averaged vs whole-batch gradient: max rel err {diff[0].item():.1e} (tol {grad_tol:g})")
    say(f"  measured: after {steps} AdamW steps, ||p - p_single|| / ||p_single - p_start|| = {diff[2].item():.1e} "
        f"(tol {path_tol:g}); max |p - p_single| = {diff[1].item():.1e} = {diff[1].item() / lr:.1%} of lr")
    return r, model


# ---------------------------------------------------------------------------------------
# 2. All-reduce from point-to-point messages only.

def exchange(send_buf, dst, recv_buf, src):
    """Send one buffer to dst while receiving another from src. isend + irecv issued together
    (batched, so NCCL groups them), so N ranks all sending at once cannot deadlock."""
    ops = []
    if send_buf.numel():  # empty chunks (length < N) are skipped on both sides
        ops.append(dist.P2POp(dist.isend, send_buf, dst))
        SENT[0] += send_buf.numel() * send_buf.element_size()
    if recv_buf.numel():
        ops.append(dist.P2POp(dist.irecv, recv_buf, src))
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()


def naive_all_reduce(t):
    """Everyone sends to rank 0, rank 0 adds and sends the sum back. Rank 0 moves 2(N-1) S bytes."""
    rank, N = dist.get_rank(), dist.get_world_size()
    if N == 1 or t.numel() == 0:
        return t
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, N):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(1, N):
            dist.send(t, dst); SENT[0] += t.numel() * t.element_size()
    else:
        dist.send(t, 0); SENT[0] += t.numel() * t.element_size()
        dist.recv(t, 0)
    return t


def ring_all_reduce(t):
    """Reduce-scatter then all-gather around the ring rank -> rank+1, N-1 steps each, on N
    chunks of uneven size when N does not divide the length. Each rank sends 2(N-1)/N S bytes."""
    rank, N = dist.get_rank(), dist.get_world_size()
    if N == 1:
        return t
    chunks = t.view(-1).tensor_split(N)
    incoming = torch.empty(max(c.numel() for c in chunks), dtype=t.dtype, device=t.device)
    right, left = (rank + 1) % N, (rank - 1) % N
    for s in range(N - 1):  # reduce-scatter: add the left neighbour's partial sum into ours
        send, recv = chunks[(rank - s) % N], chunks[(rank - s - 1) % N]
        exchange(send, right, incoming[:recv.numel()], left)
        recv += incoming[:recv.numel()]
    # now rank r holds the full sum of chunk (r+1) % N; pass the finished chunks around
    for s in range(N - 1):  # all-gather
        exchange(chunks[(rank + 1 - s) % N], right, chunks[(rank - s) % N], left)
    return t


# PREDICTION: both equal dist.all_reduce up to summation order (~1e-7 relative), for any N
# and any length, including lengths smaller than N (empty chunks) and not divisible by N.
def check_all_reduce(dev, quick, tol=1e-6):
    rank, N = dist.get_rank(), dist.get_world_size()
    lengths = sorted({1, max(N - 1, 1), N + 1, 2 * N + 1, 997, 10_007 if quick else 1_000_003})
    errors = {"ring": 0.0, "naive": 0.0}
    for n in lengths:
        x = torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank)).to(dev)
        want = x.clone(); dist.all_reduce(want)
        for name, fn in (("ring", ring_all_reduce), ("naive", naive_all_reduce)):
            got = fn(x.clone())
            err = ((got - want).abs().max() / want.abs().max()).item()
            errors[name] = max(errors[name], err)
    e = torch.tensor([errors["ring"], errors["naive"]], device=dev)
    dist.all_reduce(e, op=dist.ReduceOp.MAX)  # every rank's worst error: all ranks agree on the check
    errors = dict(ring=e[0].item(), naive=e[1].item())
    say(f"  lengths {lengths} on {N} ranks (uneven chunks)")
    say(f"  measured: max |ours - dist.all_reduce| / max |dist.all_reduce|: "
        f"ring {errors['ring']:.1e}, naive {errors['naive']:.1e} (tol {tol:g})")
    return dict(lengths=lengths, ring_max_rel_err=errors["ring"],
                naive_max_rel_err=errors["naive"], tolerance=tol)


# ---------------------------------------------------------------------------------------
# 3. The communication bill.
# PREDICTION: small messages pay the latency alpha, 2(N-1) times for the ring; large ones pay
# bandwidth: the ring sends 2(N-1)/N S per rank (about 2S for any N), naive makes rank 0 move
# 2(N-1) S, so at large S naive is ~N times slower than the ring when each rank has its own
# link (GPUs); the ring is near the library (which is a ring, or better, itself).

def fit_alpha_beta(S, T, N, per_rank_factor):
    """Least squares on RELATIVE error of T = 2(N-1) alpha + per_rank_factor * S * beta."""
    A = np.stack([np.full_like(S, 2 * (N - 1)), per_rank_factor * S], 1)
    alpha, beta = np.linalg.lstsq(A / T[:, None], np.ones_like(T), rcond=None)[0]
    alpha, beta = max(alpha, 0.0), max(beta, 0.0)  # noise can push a term below zero
    pred = A @ np.array([alpha, beta])
    return dict(alpha_s=float(alpha), beta_s_per_byte=float(beta),
                bandwidth_GBps=float(1 / beta / 1e9) if beta > 0 else None, predicted_s=pred.tolist(),
                rel_err=(np.abs(pred - T) / T).tolist(), max_rel_err=float(np.max(np.abs(pred - T) / T)))


def communication_sweep(sizes, dev, reps, passes):
    N = dist.get_world_size()
    library = lambda t: dist.all_reduce(t)
    algos = {"naive": naive_all_reduce, "ring": ring_all_reduce, "library": library}
    res = {k: dict(median_s=[], min_s=[], max_s=[], algbw_GBps=[], busbw_GBps=[], bytes_sent_max_rank=[])
           for k in algos}
    xs, samples = {}, {}
    for S in sizes:
        for name, fn in algos.items():
            x = xs[S, name] = torch.randn(S // 4, device=dev)  # one per algorithm: repeated sums grow by N each call
            SENT[0] = 0; fn(x)
            sent = torch.tensor([SENT[0]], dtype=torch.float64, device=dev)
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            res[name]["bytes_sent_max_rank"].append(sent.item() if name != "library" else None)
    # Small messages take ~ms, and one late-scheduled rank stalls a whole call: average several
    # calls per sample; and sweep the sizes in several passes, so that a slow drift of the machine
    # spreads over every size instead of biasing one of them.
    for _ in range(passes):
        for S in sizes:
            for name, fn in algos.items():
                samples.setdefault((S, name), []).extend(time_op(lambda: fn(xs[S, name]), dev, *reps(S)))
    for S in sizes:
        for name in algos:
            t, r = samples[S, name], res[name]
            med = statistics.median(t)
            r["median_s"].append(med); r["min_s"].append(min(t)); r["max_s"].append(max(t))
            r["algbw_GBps"].append(S / med / 1e9)                  # nccl-tests: algbw = S / t
            r["busbw_GBps"].append(S / med / 1e9 * 2 * (N - 1) / N)  # busbw = algbw 2(N-1)/N
        say(f"  {S / 2**20:9.3f} MiB  " + "  ".join(
            f"{k} {res[k]['median_s'][-1] * 1e3:8.3f} ms ({res[k]['busbw_GBps'][-1]:6.2f} GB/s bus)"
            for k in algos))
    del xs
    S, ring_formula = np.array(sizes, float), [2 * (N - 1) / N * s for s in sizes]
    res["sizes_bytes"], res["ring_bytes_formula"] = list(sizes), ring_formula
    res["fit"] = {k: fit_alpha_beta(S, np.array(res[k]["median_s"]), N, 2 * (N - 1) if k == "naive"
                                    else 2 * (N - 1) / N) for k in algos}
    for k, f in res["fit"].items():
        say(f"  derived: {k:7s} fit alpha = {f['alpha_s'] * 1e6:8.2f} us, 1/beta = "
            f"{(f['bandwidth_GBps'] or float('nan')):7.2f} GB/s, max error per point {f['max_rel_err']:.0%}")
    sent = res["ring"]["bytes_sent_max_rank"]
    res["ring_bytes_ok"] = all(abs(b - f) <= 2 * (N - 1) * 4 for b, f in zip(sent, ring_formula))
    say(f"  measured: ring bytes sent by the busiest rank at {sizes[-1] / 2**20:.1f} MiB: {sent[-1]:.0f}"
        f" vs 2(N-1)/N S = {ring_formula[-1]:.0f} (derived); naive rank 0: "
        f"{res['naive']['bytes_sent_max_rank'][-1]:.0f} = (N-1) S")
    return res


# PREDICTION: per-parameter all-reduces pay alpha once per tensor (~150 for GPT-2);
# 25 MiB buckets pay it a handful of times and reach the bandwidth regime, so they are faster.
def gradient_bill(model, ddp, sweep, dev, reps, bucket_mb=25):
    N = dist.get_world_size()
    grads = [p.grad for p in model.parameters()]
    S, t_compute = ddp["grad_bytes"], ddp["compute_s"]
    out = dict(grad_bytes=S, grad_tensors=len(grads), compute_s=t_compute, bucket_mb=bucket_mb)
    if sweep:  # the fit predicts the gradient all-reduce; extrapolated if S is past the sweep
        for k in ("ring", "library"):
            f = sweep["fit"][k]
            t = 2 * (N - 1) * f["alpha_s"] + 2 * (N - 1) / N * S * f["beta_s_per_byte"]
            out[f"predicted_comm_s_{k}"] = t
            out[f"predicted_efficiency_{k}_no_overlap"] = t_compute / (t_compute + t)
            out[f"predicted_efficiency_{k}_full_overlap"] = t_compute / max(t_compute, t)
        say(f"  derived: {S / 1e6:.1f} MB of fp32 gradients, library fit predicts "
            f"{out['predicted_comm_s_library'] * 1e3:.1f} ms vs measured compute {t_compute * 1e3:.1f} ms"
            f" -> scaling efficiency {out['predicted_efficiency_library_no_overlap']:.0%} without overlap, "
            f"{out['predicted_efficiency_library_full_overlap']:.0%} with perfect overlap")
    buckets, cur, size = [], [], 0
    for g in grads:  # greedy buckets of <= bucket_mb (a bigger tensor gets its own)
        if cur and size + g.numel() * 4 > bucket_mb * 2**20:
            buckets.append(cur); cur, size = [], 0
        cur.append(g); size += g.numel() * 4
    buckets.append(cur)

    def per_param(gs):
        for g in gs:
            dist.all_reduce(g)

    def bucketed(gs):  # flatten a bucket, one all-reduce, copy the sums back
        it = iter(gs)
        for mine in ([next(it) for _ in b] for b in buckets):
            flat = torch.cat([g.view(-1) for g in mine])
            dist.all_reduce(flat)
            for g, part in zip(mine, flat.split([g.numel() for g in mine])):
                g.copy_(part.view_as(g))

    a, b = [g.clone() for g in grads], [g.clone() for g in grads]
    per_param(a); bucketed(b)
    err = max(((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))
    out["n_buckets"], out["bucketed_vs_per_param_max_rel_err"] = len(buckets), err
    if N == 1:  # one rank: every all-reduce is a no-op; timing them measures launch overhead, not the bill
        out["per_param_s"] = out["bucketed_s"] = None
        say(f"  {len(grads)} tensors in {len(buckets)} buckets of <= {bucket_mb} MiB (same sums: err {err:.1e}, "
            f"measured); timing skipped: with one rank the all-reduces are no-ops (run under torchrun)")
        return out
    out["per_param_s"] = statistics.median(time_op(lambda: per_param(a), dev, reps))
    out["bucketed_s"] = statistics.median(time_op(lambda: bucketed(b), dev, reps))
    say(f"  measured: {len(grads)} all-reduces (one per tensor) {out['per_param_s'] * 1e3:.2f} ms vs "
        f"{len(buckets)} buckets of <= {bucket_mb} MiB {out['bucketed_s'] * 1e3:.2f} ms (same sums: err {err:.1e})")
    return out


# ---------------------------------------------------------------------------------------
# 4. Figure: time vs message size, measured points and the fitted alpha-beta lines.

def figure(sweep, N, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("  figure skipped (matplotlib missing)")
    S = np.array(sweep["sizes_bytes"], float)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for k, c in (("naive", "tab:red"), ("ring", "tab:blue"), ("library", "tab:green")):
        ax.loglog(S, sweep[k]["median_s"], "o", color=c, label=f"{k} (measured)")
        ax.loglog(S, sweep["fit"][k]["predicted_s"], "--", color=c, label=f"{k} alpha-beta fit")
    ax.set(xlabel="message size S (bytes)", ylabel="all-reduce time (s)",
           title=f"all-reduce on {N} ranks: T = 2(N-1)alpha + 2(N-1)/N S beta")
    ax.legend(fontsize=8); ax.grid(True, which="both", alpha=0.3)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "05_ddp_scratch_allreduce.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"  figure: {path}")


# ---------------------------------------------------------------------------------------
# Launch: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; plain python
# sets none and runs as one rank. NCCL needs one GPU per rank (and GPU tensors), else gloo on CPU.

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def fail(msg, code=1):
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def init_distributed(want):
    have = [v for v in LAUNCH_VARS if v in os.environ]
    if have and len(have) < len(LAUNCH_VARS):
        fail(f"the distributed environment is half-set ({', '.join(have)} but not "
             f"{', '.join(v for v in LAUNCH_VARS if v not in have)}); launch with "
             f"`torchrun --nproc_per_node=N 05_ddp_scratch.py`, or plain `python 05_ddp_scratch.py` for one rank.", 2)
    launched = bool(have)
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if launched else (0, 1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and gpus < local_world:
        fail(f"--device cuda needs one GPU per rank (NCCL refuses two ranks on one GPU), but this "
             f"node runs {local_world} rank(s) and sees {gpus} GPU(s); use --nproc_per_node<={gpus} "
             f"or --device cpu (gloo)." if rank == 0 else "see rank 0", 1)
    if want != "cpu" and gpus >= local_world:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)  # before init: NCCL binds each rank to its GPU
        backend, why = "nccl", f"one GPU per rank ({gpus} visible)"
    else:
        dev, backend = torch.device("cpu"), "gloo"
        why = "--device cpu" if want == "cpu" else (f"{local_world} ranks but {gpus} GPU(s)" if gpus else "no GPU")
    kw = dict(backend=backend, timeout=timedelta(seconds=60))
    kw.update(device_id=dev) if backend == "nccl" else None  # eager NCCL init on this rank's GPU
    if not launched:  # one rank, no rendezvous: an in-process store
        kw.update(store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.init_process_group(**kw)
    except Exception as e:  # rendezvous timeout, port in use, ...
        fail(f"could not start the process group ({backend}, rank {rank} of {world}): "
             f"{(str(e) or type(e).__name__).splitlines()[0]}", 1)
    return dev, backend, why, launched


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (tests)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--json", help="write every measured number here (rank 0)")
    ap.add_argument("--out", default="out", help="figure directory")
    ap.add_argument("--max-mb", type=float, help="largest message of the sweep (default 1024 GPU, 64 CPU)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no CUDA GPU is visible; run with --device cpu (gloo).", 1)
    dev, backend, why, launched = init_distributed(args.device)
    rank, N = dist.get_rank(), dist.get_world_size()
    gpu = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if gpu else (platform.processor() or platform.machine())
    mem = torch.cuda.get_device_properties(dev).total_memory if gpu else \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    say(f"device: {name} ({mem / 2**30:.0f} GiB) | torch {torch.__version__} | python {platform.python_version()}")
    say(f"backend: {backend} on {'GPU' if gpu else 'CPU'} with {N} rank(s) ({why})" +
        ("" if launched else " - one rank: `python` was used; launch with torchrun --nproc_per_node=N for more"))
    torch.set_float32_matmul_precision("highest")  # true fp32 for the equality check of 1.

    q = args.quick
    if gpu:
        cfg, micro, T, steps = GPTConfig.preset("gpt2"), 2, 1024, 4
        max_mb = args.max_mb or 1024
    else:
        cfg = GPTConfig.preset("tiny", **(dict(n_layer=2, vocab_size=4096) if q else {}))
        micro, T, steps = (2, 32, 2) if q else (2, 128, 3)
        max_mb = args.max_mb or (1 if q else 64)
    sizes = [s for s in (2**12 * (16 if q else 4)**i for i in range(12)) if s <= max_mb * 2**20]
    passes = 1 if q else 3  # sweeps over all sizes; per pass and size: (samples, calls each)
    reps = (lambda S: (3, 1)) if q else (lambda S: (12, 10) if S <= 2**20 else (2, 1))
    result = dict(lesson="05_ddp_scratch", quick=q, world_size=N, backend=backend,
                  device=dict(name=name, memory_bytes=mem, type=dev.type, torch=torch.__version__),
                  model=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size))
    checks = {}

    def run(title, key, fn, alone=False):  # one experiment; alone: rank 0 only, no collectives
        say(f"\n== {title}")
        out, failed = None, 0.0
        try:
            out = fn()
        except Exception as e:
            print(f"  [rank {rank}] {key} failed: {type(e).__name__}: {(str(e) or ' ').splitlines()[0]}", flush=True)
            result[key] = dict(error=repr(e)); checks[f"{key}_ran"] = False; failed = 1.0
        if N > 1 and not alone:  # a rank that goes on alone would enter the next collectives out of step
            flag = torch.tensor([failed], device=dev)
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            except Exception:  # the process group itself is broken: stop too
                flag.fill_(1.0)
            if flag.item():
                dist.destroy_process_group()
                if rank == 0:
                    fail(f"{key} failed on at least one rank (see above); stopping every rank.", 1)
                sys.exit(1)
        return out

    out = run("1. hand-rolled data parallelism: replica per rank, shard of the batch, averaged gradients",
              "ddp", lambda: data_parallel_training(cfg, micro, T, steps, dev))
    ddp, model = out if out else (None, None)
    if ddp:
        result["ddp"] = ddp
        checks["replicas_identical"] = ddp["replicas_identical"]
        checks["ddp_gradients_match_single_process"] = ddp["grad_max_rel_err_vs_single"] <= ddp["grad_tolerance"]
        checks["ddp_matches_single_process"] = ddp["param_diff_over_distance_moved"] <= ddp["path_tolerance"]
    ar = run("2. all-reduce from send/recv: naive and ring vs dist.all_reduce", "allreduce_correctness",
             lambda: check_all_reduce(dev, q))
    if ar:
        result["allreduce_correctness"] = ar
        checks["ring_equals_all_reduce"] = ar["ring_max_rel_err"] <= ar["tolerance"]
        checks["naive_equals_all_reduce"] = ar["naive_max_rel_err"] <= ar["tolerance"]
    sweep = None
    if N > 1:
        sweep = run(f"3. the communication bill: time vs message size on {N} ranks ({backend})", "bill",
                    lambda: communication_sweep(sizes, dev, reps, passes))
    else:
        say("\n== 3. the communication bill: one rank sends nothing (2(N-1)/N S = 0); "
            "run under torchrun --nproc_per_node=N to measure it")
    if sweep:  # targets, not checks: timings on a shared machine are noisy
        result["bill"], checks["ring_bytes_match_formula"] = sweep, sweep["ring_bytes_ok"]
        big = [i for i, s in enumerate(sizes) if s >= 16 * 2**20] or [len(sizes) - 1]
        ratios = {sizes[i]: sweep["ring"]["algbw_GBps"][i] / sweep["library"]["algbw_GBps"][i] for i in big}
        ratio = min(ratios.values())
        slow = sweep["naive"]["median_s"][-1] / sweep["ring"]["median_s"][-1]
        result["targets"] = dict(ring_vs_library_algbw_large=ratio, naive_over_ring_time_largest=slow,
                                 alpha_beta_fit_max_rel_err_ring=sweep["fit"]["ring"]["max_rel_err"])
        say("  derived: ring algbw / library algbw: " + ", ".join(f"{S / 2**20:g} MiB {r:.0%}" for S, r in ratios.items())
            + " (target on 4 gloo CPU ranks: >= 70% from 16 MiB up)")
        if ratio < 0.7:
            fit = sweep["fit"]
            say(f"  derived, why lower at the small end: the ring's fixed cost, 2(N-1) alpha = {2 * (N - 1) * fit['ring']['alpha_s'] * 1e6:.0f} us"
                f" (each step a send/recv driven from Python), against the library's {2 * (N - 1) * fit['library']['alpha_s'] * 1e6:.0f} us;"
                f" the faster the link, the larger a message must be before bandwidth, not that cost, sets the time")
        say(f"  derived: naive / ring time at {sizes[-1] / 2**20:g} MiB: {slow:.2f}x; the model says {N}x when every"
            f" rank has its own link (rank 0 moves N times the ring's bytes), ~1x when all ranks share one memory"
            f" bus (a CPU: both move 2(N-1) S in total)")
    if ddp:
        g = run("3b. this GPT's gradient bill: predicted efficiency, per-tensor vs bucketed all-reduce",
                "gradients", lambda: gradient_bill(model, ddp, sweep, dev, 2 if q else 5))
        if g:
            result["gradients"] = g
            checks["bucketed_equals_per_param"] = g["bucketed_vs_per_param_max_rel_err"] <= 1e-6
    if sweep and rank == 0:
        run("4. figure: time vs message size with the alpha-beta fit", "figure", lambda: figure(sweep, N, args.out),
            alone=True)

    result["checks"] = checks
    ok = all(checks.values())
    say(f"\nchecks: {checks} -> {'all passed' if ok else 'FAILED'}")
    if rank == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    try:
        dist.barrier()  # nobody exits (and makes torchrun stop the others) before rank 0 has written
    finally:
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
