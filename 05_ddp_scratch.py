"""
Section 13.5: data parallelism from scratch, the ring all-reduce, and the communication bill.

1. Replicas on shards of the batch average their gradients (checked against one process on the
whole batch). 2. All-reduce from send/recv, naive and ring (checked against dist.all_reduce).
3. Its bill: time against message size, algbw, busbw, an alpha-beta fit (4. figure), bytes sent;
this GPT's gradients, per tensor and bucketed, against one step: the scaling to expect. NCCL if
every rank has a GPU, else gloo; `staged` sends every GPU-to-GPU byte through host memory, as on
a PCIe box. Copy with model_torch.py. Expect all checks passed and a figure under out/; a CPU runs
the tiny GPT in about a minute, GPUs GPT-2 124M:
    python 05_ddp_scratch.py                                 # one rank: nothing to send
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 05_ddp_scratch.py
    torchrun --standalone --nproc_per_node=2 05_ddp_scratch.py --interconnect staged
    # past one machine, the same on each: --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT
"""

import argparse, importlib, json, os, platform, re, statistics, sys, tempfile, time
from collections import namedtuple
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from model_torch import GPT, GPTConfig

LEARNING_RATE = 1e-3
GRAD_TOL = 1e-5        # averaged vs whole-batch gradient, relative (fp32 summation order)
PATH_TOL = 1e-3        # gap to the single-process parameters / distance they moved
ALLREDUCE_TOL = 1e-6   # ours vs dist.all_reduce, relative
BUCKET_MB = 25         # DDP's default gradient bucket (Li et al., VLDB 2020)
TIMEOUT_S = 60         # seconds: a rank that stops answering fails the others after this
LOCAL_RANKS = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # on this machine (torchrun sets it)
# 1.: GPT, rows per rank, sequence, steps; 2.: longest length; 3b: the timed step's global rows and
# sequence (GPUs: as in 07's DDP rung); 3.: 2**k bytes, k = 12 (4 KiB) .. max_log2; repeats.
Sizes = namedtuple("Sizes", "preset changes batch seq_len steps longest step_batch step_seq "
                            "max_log2 log2_step passes reps warmup")
SIZES = dict(cuda=Sizes("gpt2", {}, 2, 1024, 4, 1_000_003, 64, 1024, 30, 2, 3, 10, 3),
             cpu=Sizes("tiny", {}, 2, 128, 3, 1_000_003, 8, 128, 26, 2, 3, 10, 3),
             quick=Sizes("tiny", dict(n_layer=2, vocab_size=4096), 2, 32, 2, 10_007, 4, 32, 20, 4, 1, 2, 1))

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

def worst(values, device):  # each value's largest over the ranks: every rank agrees on it
    values = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()

def timed(fn, device, sizes):  # bench() on every rank at once; a collective ends with its slowest
    dist.barrier()
    return worst(bench(fn, device, sizes.reps, sizes.warmup), device)

def say(*parts):  # rank 0 speaks for every rank
    if dist.get_rank() == 0:
        print(*parts, flush=True)

def nbytes(tensor):
    return tensor.numel() * tensor.element_size()

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

# 1. PREDICTION: the mean of N shard gradients is the whole batch's gradient: the replicas take one
# AdamW step, bit-identical, equal to one process up to fp32 rounding (~1e-7 relative; CUDA ~1e-6),
# which AdamW's g / (sqrt(v) + eps) magnifies where |g| ~ eps: ~1e-5 of the distance moved.
def get_batch(step, rows, seq_len, vocab, device):  # the same on every rank
    data = torch.randint(vocab, (rows, seq_len + 1), generator=torch.Generator().manual_seed(step))
    return data[:, :-1].to(device), data[:, 1:].to(device)

def relative_error(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()

def train(config, sizes, device, rows, average):  # a replica on `rows` of each global batch
    world = dist.get_world_size()
    torch.manual_seed(0)  # the same seed everywhere: every replica starts equal
    model = GPT(config).to(device)
    optimizer = model.configure_optimizer(lr=LEARNING_RATE)
    start = parameters_to_vector(model.parameters()).detach()
    losses, first_grads = [], None
    for step in range(sizes.steps):
        x, y = get_batch(step, sizes.batch * world, sizes.seq_len, config.vocab_size, device)
        _, loss = model(x[rows], y[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if average:
            for p in model.parameters():  # the whole of data parallelism: average the gradients
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        first_grads = first_grads or [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        losses.append(loss.item())
    return model, start, parameters_to_vector(model.parameters()).detach(), losses, first_grads

def data_parallel_training(sizes, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.preset(sizes.preset, **sizes.changes)
    mine = slice(rank * sizes.batch, (rank + 1) * sizes.batch)  # this rank's shard
    model, _, params, losses, grads = train(config, sizes, device, mine, average=True)
    # the reference, on every rank alike: one process trained on the whole global batch
    _, start, single, single_losses, single_grads = train(config, sizes, device, slice(None), False)
    rank0 = params.clone()
    dist.broadcast(rank0, 0)
    gap = params - single
    differs, grad_err, max_gap, gap_ratio = worst(
        [float(not torch.equal(params, rank0)), max(map(relative_error, grads, single_grads)),
         gap.abs().max().item(), (gap.norm() / (single - start).norm()).item()], device)
    mean_losses = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(mean_losses)  # the global batch's loss: the mean of the shards' losses
    return model, dict(steps=sizes.steps, losses=(mean_losses / world).tolist(),
                       single_process_losses=single_losses, replicas_identical=differs == 0,
                       grad_max_rel_err_vs_single=grad_err, max_abs_param_diff_vs_single=max_gap,
                       param_diff_over_distance_moved=gap_ratio)

# 2. All-reduce from send/recv only: each returns the tensor, summed in place, and the bytes sent.
def exchange(send_buf, dst, recv_buf, src):
    """Start sending send_buf to dst and receiving recv_buf from src, batched so that N ranks
    all sending at once cannot deadlock. An empty chunk (length < N) is skipped on both sides."""
    ops = [dist.P2POp(op, buf, peer) for op, buf, peer in
           ((dist.isend, send_buf, dst), (dist.irecv, recv_buf, src)) if buf.numel()]
    return dist.batch_isend_irecv(ops) if ops else []

def naive_all_reduce(tensor):
    """Everyone sends to rank 0, which adds and sends the sum back: rank 0 moves 2(N-1) S."""
    if dist.get_rank() > 0:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
        return tensor, nbytes(tensor)
    incoming, others = torch.empty_like(tensor), range(1, dist.get_world_size())
    for source in others:
        dist.recv(incoming, source)
        tensor += incoming
    for destination in others:
        dist.send(tensor, destination)
    return tensor, len(others) * nbytes(tensor)

def ring_all_reduce(tensor):
    """Reduce-scatter then all-gather around the ring rank -> rank + 1, N-1 steps each, on N
    uneven chunks, each sent whole: pieces would let one piece's add overlap the next one's
    transfer, but each adds a send/recv's fixed cost, more than the add it hides (two H200s)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(world)
    incoming = torch.empty_like(chunks[0])  # chunk 0 is the longest
    right, left, sent = (rank + 1) % world, (rank - 1) % world, 0
    for step in range(world - 1):  # reduce-scatter: add the left neighbour's partial sums to ours
        send, into = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        part = incoming[:into.numel()]
        for request in exchange(send, right, part, left):
            request.wait()
        into += part
        sent += nbytes(send)
    for step in range(world - 1):  # all-gather: rank r holds the sum of chunk r + 1; pass it on
        send = chunks[(rank + 1 - step) % world]
        for request in exchange(send, right, chunks[(rank - step) % world], left):
            request.wait()
        sent += nbytes(send)
    return tensor, sent

ALGORITHMS = dict(naive=naive_all_reduce, ring=ring_all_reduce, library=lambda t: (t, dist.all_reduce(t)))

# PREDICTION: ours equal dist.all_reduce up to summation order (~1e-7 relative) for any N and
# length: below N (empty chunks), not divisible by N (uneven chunks).
def check_all_reduce(device, sizes):
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = sorted({1, max(world - 1, 1), world + 1, 2 * world + 1, 997, 10_007, sizes.longest})
    ring_error = naive_error = 0.0
    for n in lengths:
        x = torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank)).to(device)
        want = ALGORITHMS["library"](x.clone())[0]
        ring_error = max(ring_error, relative_error(ring_all_reduce(x.clone())[0], want))
        naive_error = max(naive_error, relative_error(naive_all_reduce(x.clone())[0], want))
    ring_error, naive_error = worst([ring_error, naive_error], device)
    return dict(lengths=lengths, ring_max_rel_err=ring_error, naive_max_rel_err=naive_error)

# 3. PREDICTION: small messages pay latency alpha: 2(N-1) Python send/recv steps for the ring, ~1
# for the library; large ones bandwidth: ring 2(N-1)/N S per rank, naive's rank 0 2(N-1) S: ~N
# times slower with a link per rank (GPUs), ~1x on one memory bus (a CPU). Staged, each byte
# crosses two PCIe links, each busy both ways: busbw stays below the pinned host<->device rate.
def fit_alpha_beta(sizes, times, world, moved):  # T = 2(N-1) alpha + moved S beta, relative error
    sizes, times = np.array(sizes, float), np.array(times, float)
    terms = np.stack([np.full_like(sizes, 2 * (world - 1)), moved * sizes], 1)
    alpha, beta = np.linalg.lstsq(terms / times[:, None], np.ones_like(times), rcond=None)[0]
    reliable = bool(alpha >= 0 and beta > 0)  # a negative cost: the machine was busy
    alpha, beta = max(alpha, 0.0), max(beta, 1e-30)
    predicted = terms @ np.array([alpha, beta])
    return dict(alpha_s=alpha, beta_s_per_byte=beta, bandwidth_GBps=1 / beta / 1e9, reliable=reliable,
                predicted_s=predicted.tolist(), max_rel_err=max(abs(predicted - times) / times))

def communication_sweep(device, sizes):
    world = dist.get_world_size()
    sizes_bytes = [2**k for k in range(12, sizes.max_log2 + 1, sizes.log2_step)]
    buffers = [torch.zeros(size // 4, device=device) for size in sizes_bytes]  # zeros stay 0
    sent = [worst([fn(b)[1] or 0 for b in buffers], device) for fn in ALGORITHMS.values()]  # bytes
    runs = {name: [[] for _ in buffers] for name in ALGORITHMS}
    for _ in range(sizes.passes):  # interleaved: a drifting machine touches every size alike
        for j, buffer in enumerate(buffers):
            for name, fn in ALGORITHMS.items():
                runs[name][j].append(timed(lambda: fn(buffer), device, sizes))
    ring_moved = 2 * (world - 1) / world  # bytes a rank sends per byte of message (ring, library)
    bill = dict(sizes_bytes=sizes_bytes, ring_bytes_formula=[ring_moved * s for s in sizes_bytes])
    for i, name in enumerate(ALGORITHMS):  # per size: the median of the passes' medians
        median = [statistics.median(run[0] for run in per) for per in runs[name]]
        algbw = [size / t / 1e9 for size, t in zip(sizes_bytes, median)]  # nccl-tests: S / t
        moved = dict(naive=2 * (world - 1)).get(name, ring_moved)  # naive: rank 0's share
        bill[name] = dict(median_s=median, algbw_GBps=algbw, bytes_sent_max_rank=sent[i],
                          busbw_GBps=[a * ring_moved for a in algbw],  # nccl-tests: algbw 2(N-1)/N
                          spread_s=[max(r[2] for r in per) - min(r[1] for r in per) for per in runs[name]],
                          fit=fit_alpha_beta(sizes_bytes, median, world, moved))
    bill["ring_over_library_algbw"] = [r / lib for r, lib in zip(bill["ring"]["algbw_GBps"],
                                                                 bill["library"]["algbw_GBps"])]
    return bill

# 3b. PREDICTION: a step costs compute + comm when the all-reduce waits for backward, max(compute,
# comm) with perfect overlap (06 measures DDP's). Per tensor pays alpha ~150 times for GPT-2, 25 MiB
# buckets ~20 times: they cost less.
def buckets_of(tensors, bucket_bytes):  # greedy, in parameter order; a larger tensor alone
    buckets = [[]]
    for tensor in tensors:
        if buckets[-1] and sum(map(nbytes, buckets[-1])) + nbytes(tensor) > bucket_bytes:
            buckets.append([])
        buckets[-1].append(tensor)
    return buckets

def all_reduce_buckets(buckets):  # one all-reduce per bucket: flatten, sum, copy back (as DDP)
    for bucket in buckets:
        flat = torch.cat([t.view(-1) for t in bucket])
        dist.all_reduce(flat)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))

def gradient_bill(model, device, sizes):
    world, grads = dist.get_world_size(), [p.grad for p in model.parameters()]
    per_tensor = [g.clone() for g in grads]
    buckets = buckets_of([g.clone() for g in grads], BUCKET_MB * 2**20)
    ways = dict(per_tensor=lambda: [dist.all_reduce(t) for t in per_tensor],  # one call per tensor
                bucketed=lambda: all_reduce_buckets(buckets))
    for fn in ways.values():  # the same sums either way (checked), then timed
        fn()
    error = max(map(relative_error, [t for bucket in buckets for t in bucket], per_tensor))
    cuda, rows = device.type == "cuda", max(sizes.step_batch // world, 1)
    optimizer = model.configure_optimizer(lr=LEARNING_RATE, fused=cuda)
    x, y = get_batch(0, rows, sizes.step_seq, model.config.vocab_size, device)
    def step():  # the compute that data parallelism divides: this rank's share of the batch
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
    step_s = timed(step, device, sizes)[0]
    result = dict(grad_bytes=sum(map(nbytes, grads)), grad_tensors=len(grads), buckets=len(buckets),
                  step_s=step_s, step_tokens=f"{rows} x {sizes.step_seq}", max_rel_err=error)
    for name, fn in ways.items():
        comm = timed(fn, device, sizes)[0]
        result[name] = dict(measured_s=comm, efficiency_no_overlap=step_s / (step_s + comm),
                            efficiency_full_overlap=step_s / max(step_s, comm))
    return result

def figure(bill, world, path):  # 4. time against message size: measured points, fitted lines
    try:
        from matplotlib.figure import Figure  # no pyplot: no display, no backend to choose
    except ImportError:
        return "figure skipped (matplotlib missing)"
    fig = Figure()
    ax = fig.subplots()
    for name in ALGORITHMS:
        points = ax.loglog(bill["sizes_bytes"], bill[name]["median_s"], "o", label=name + " + fit")
        ax.loglog(bill["sizes_bytes"], bill[name]["fit"]["predicted_s"], "--",
                  color=points[0].get_color())
    ax.set(xlabel="message size (bytes)", ylabel="time (s)", title=f"all-reduce, {world} ranks")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp)
    os.replace(tmp, path)
    return f"figure: {path}"

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run (tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", help="write every measured number here (rank 0)")
    parser.add_argument("--out", default="out", help="folder for the figure")
    parser.add_argument("--interconnect", choices=["default", "staged"], default="default")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < LOCAL_RANKS:
        sys.exit("error: --device cuda needs a GPU per rank here; use --device cpu (gloo)")
    check_outputs(args)
    return args

def start(args):  # torchrun sets RANK etc. (plain python: one rank); NCCL if every rank has a GPU
    use_interconnect(args.interconnect)
    options = dict(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    device, name = torch.device("cpu"), platform.machine()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.device != "cpu" and torch.cuda.device_count() >= LOCAL_RANKS:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))  # ranks may span nodes
        torch.cuda.set_device(device)  # before init: NCCL binds this rank to its GPU
        options.update(backend="nccl", device_id=device)
        name, memory = torch.cuda.get_device_name(device), torch.cuda.mem_get_info(device)[1]
        os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
    if "RANK" not in os.environ:
        options.update(store=dist.HashStore(), rank=0, world_size=1)
    # torch.optim imports torch._dynamo; imported after the group starts, it keeps the group alive
    # past destroy_process_group(), and gloo's threads then abort the exit: import it first
    importlib.import_module("torch._dynamo")
    dist.init_process_group(**options)
    return device, name, memory

def report_bill(bill):
    say("  measured, slowest rank: MiB | naive, ring, library: ms, busbw GB/s | derived: ring algbw"
        " / library's | bytes sent / S by the busiest rank: ring (2(N-1)/N), naive (N-1)")
    for j, size in enumerate(bill["sizes_bytes"]):
        cells = [f"{bill[k]['median_s'][j] * 1e3:10.3f} {bill[k]['busbw_GBps'][j]:7.2f}" for k in ALGORITHMS]
        cells += [f"{bill['ring_over_library_algbw'][j]:5.0%}"]
        cells += [f"{bill[k]['bytes_sent_max_rank'][j] / size:5.2f}" for k in ("ring", "naive")]
        noisy = ", ".join(k for k in ALGORITHMS if bill[k]["spread_s"][j] > bill[k]["median_s"][j])
        flag = f"  {noisy}: unreliable (machine busy)" if noisy else ""  # spread wider than median
        say(f"  {size / 2**20:10.3f}" + " ".join(cells) + flag)
    for k, fit in ((k, bill[k]["fit"]) for k in ALGORITHMS):
        say(f"  derived: {k:7s} fit: alpha {fit['alpha_s'] * 1e6:9.2f} us, 1/beta "
            f"{fit['bandwidth_GBps']:8.2f} GB/s, worst point off by {fit['max_rel_err']:.0%}"
            + ("" if fit["reliable"] else "  unreliable (machine busy)"))

def run(args, device, name, memory):
    world, nodes = dist.get_world_size(), dist.get_world_size() // LOCAL_RANKS
    dist.all_reduce(torch.zeros(1, device=device))  # warm-up: the ranks connect
    transport = nccl_transport() if device.type == "cuda" else "gloo, the flag changes nothing"
    say(f"device: {name} ({memory / 2**30:.0f} GiB) | torch {torch.__version__}")
    say(f"backend: {dist.get_backend()}; ranks: {world} on {nodes} node(s); --device {args.device}")
    say(f"interconnect: {args.interconnect} (NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', 0)}): {transport}")
    result = dict(lesson="05_ddp_scratch", quick=args.quick, world_size=world, nodes=nodes,
                  backend=dist.get_backend(), interconnect=args.interconnect, transport=transport,
                  device=dict(name=name, memory_bytes=memory, torch=torch.__version__))
    sizes = SIZES["quick"] if args.quick else SIZES[device.type]
    say("\n== 1. hand-rolled data parallelism: a replica per rank, a shard each, mean gradients")
    model, d = data_parallel_training(sizes, device)
    say(f"  measured: loss per step, mean of {world} shards {np.round(d['losses'], 4).tolist()}; "
        f"one process, whole batch {np.round(d['single_process_losses'], 4).tolist()}")
    say(f"  measured: replicas bit-identical after {d['steps']} steps: {d['replicas_identical']}")
    say(f"  measured: step 0, mean vs whole-batch gradient: max relative error "
        f"{d['grad_max_rel_err_vs_single']:.1e}")
    say(f"  measured: gap to single run / distance moved {d['param_diff_over_distance_moved']:.1e}")
    say("\n== 2. all-reduce from send/recv: naive and ring vs dist.all_reduce")
    c = check_all_reduce(device, sizes)
    say(f"  measured: max |ours - library| / max |library| on lengths {c['lengths']}: ring "
        f"{c['ring_max_rel_err']:.1e}, naive {c['naive_max_rel_err']:.1e}")
    checks = result["checks"] = dict(
        replicas_identical=d["replicas_identical"],
        ddp_gradients_match_single_process=d["grad_max_rel_err_vs_single"] <= GRAD_TOL,
        ddp_matches_single_process=d["param_diff_over_distance_moved"] <= PATH_TOL,
        ring_equals_all_reduce=c["ring_max_rel_err"] <= ALLREDUCE_TOL,
        naive_equals_all_reduce=c["naive_max_rel_err"] <= ALLREDUCE_TOL)
    result.update(ddp=d, allreduce_correctness=c)
    if world == 1:
        say("\n== 3. the communication bill: one rank sends nothing; launch with torchrun")
        return result
    say(f"\n== 3. the communication bill on {world} ranks: time against message size")
    bill = result["bill"] = communication_sweep(device, sizes)
    report_bill(bill)
    say("\n== 3b. this GPT's gradients against one step of compute, per tensor and bucketed")
    g = result["gradients"] = gradient_bill(model, device, sizes)
    say(f"  measured: one step of {g['step_tokens']} tokens per rank: {g['step_s'] * 1e3:.1f} ms")
    for way, calls in (("per_tensor", g["grad_tensors"]), ("bucketed", g["buckets"])):
        say(f"  measured: {g['grad_bytes'] / 2**20:.1f} MiB {way}, {calls} all-reduce(s): "
            f"{g[way]['measured_s'] * 1e3:.2f} ms; derived: efficiency "
            f"{g[way]['efficiency_no_overlap']:.0%} without overlap, "
            f"{g[way]['efficiency_full_overlap']:.0%} with perfect overlap")
    say(f"  measured: bucketed vs per tensor, max relative difference {g['max_rel_err']:.1e}")
    if dist.get_rank() == 0:
        say("  " + figure(bill, world, Path(args.out) / "05_ddp_scratch_allreduce.png"))
    pairs = zip(bill["ring"]["bytes_sent_max_rank"], bill["ring_bytes_formula"])  # +-1 (uneven)
    checks.update(ring_bytes_match_formula=all(abs(b - f) <= 8 * (world - 1) for b, f in pairs),
                  bucketed_equals_per_tensor=g["max_rel_err"] <= ALLREDUCE_TOL)
    return result

def main(argv=None):
    args = parse_args(argv)
    passed = False
    try:
        result = run(args, *start(args))
        passed = all(result["checks"].values())
        say(f"\nchecks: {result['checks']} -> " + ("all passed" if passed else "FAILED"))
        if dist.get_rank() == 0 and args.json:
            write_json(args.json, result)
        dist.barrier()  # nobody leaves before rank 0 has written
    except Exception as error:  # this rank failed, a peer died or stopped answering, or no launch
        message = (str(error) or type(error).__name__).splitlines()[0]
        print(f"error: rank {os.environ.get('RANK', 0)}: {message}", file=sys.stderr, flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if os.environ["NCCL_DEBUG_FILE"].endswith(f"nccl-{os.getpid()}.log"):  # our own log
            Path(os.environ["NCCL_DEBUG_FILE"]).unlink(missing_ok=True)
    sys.exit(int(not passed))

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
