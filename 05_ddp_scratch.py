"""
Section 13.5: data parallelism from scratch, the ring all-reduce, the communication bill.

1. Replicas on shards of the batch average their gradients: checked against one process
   on the whole batch.
2. All-reduce from send/recv, naive and ring: checked against dist.all_reduce.
3. Its bill: time against message size, algbw, busbw, an alpha-beta fit (4. a figure),
   the bytes each rank sends; then this GPT's gradients, per tensor and in buckets,
   against one training step: the scaling to expect.
5. `--interconnect staged` sends every GPU-to-GPU byte through host memory (a PCIe box).

NCCL when every rank has a GPU, else gloo. Copy it with model_torch.py. A CPU runs the
tiny GPT in a minute or two, GPUs GPT-2 124M; expect "all passed" and a figure in out/:
    python 05_ddp_scratch.py                   # one rank, CPU or one GPU: nothing to send
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 05_ddp_scratch.py
    torchrun --standalone --nproc_per_node=2 05_ddp_scratch.py --interconnect staged
    # past one machine, the same on each node:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:PORT 05_ddp_scratch.py
"""

import os
import signal
import sys


def interrupted(signum, frame):
    """Ctrl-C while the imports below run: one line, exit 130. (A KeyboardInterrupt raised
    there can land in a callback of Python's import machinery, which prints it and goes on.)"""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted)  # before the imports below, which take seconds

import argparse
import importlib
import json
import platform
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from model_torch import GPT, GPTConfig

if __name__ == "__main__":  # from here Ctrl-C is a KeyboardInterrupt: main() ends cleanly
    signal.signal(signal.SIGINT, signal.default_int_handler)

LEARNING_RATE = 1e-3
GRAD_TOL = 1e-5       # averaged vs whole-batch gradient, relative (fp32 summation order)
PATH_TOL = 1e-3       # gap to the single-process parameters / the distance they moved
ALLREDUCE_TOL = 1e-6  # ours vs dist.all_reduce, relative: a chunk lost or added twice: ~1
BUCKET_MB = 25        # DDP's default gradient bucket (Li et al., VLDB 2020)
TIMEOUT_S = 60        # a rank that stops answering fails the others after this
QUICK_TIMEOUT_S = 20  # --quick: a stuck ring fails in seconds
LOCAL_RANKS = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # here (torchrun sets it)

@dataclass
class Sizes:
    """What each experiment runs on: CPU values; GPU and --quick name what differs."""
    preset: str = "tiny"         # the GPT (model_torch presets)
    changes: dict = field(default_factory=dict)  # GPTConfig fields changed from it
    batch: int = 2               # 1.: rows per rank of each global batch
    seq_len: int = 128           # 1.: tokens per row
    steps: int = 3               # 1.: AdamW steps, compared with one process
    longest: int = 1_000_003     # 2.: the longest tensor checked (prime: uneven chunks)
    max_log2: int = 26           # 3.: messages of 2**k bytes, k = 12 (4 KiB) .. max_log2
    log2_step: int = 2           # 3.: k in steps of this
    passes: int = 3              # 3.: sweeps over every size, interleaved
    reps: int = 10               # 3.: timed calls per measurement
    warmup: int = 3              # 3.: untimed calls before them
    step_batch: int = 8          # 3b: the timed training step's global rows
    step_seq: int = 128          # 3b: its tokens per row

CPU = Sizes()
GPU = replace(CPU, preset="gpt2", seq_len=1024, steps=4, max_log2=30,
              step_batch=64, step_seq=1024)  # the step of 07's DDP rung
QUICK = replace(CPU, changes=dict(n_layer=2, vocab_size=4096), seq_len=32, steps=2,
                longest=10_007, max_log2=20, log2_step=4, passes=1, reps=2, warmup=1,
                step_batch=4, step_seq=32)

@dataclass
class Timing:
    """Seconds: the median of repeated calls, the fastest and the slowest call."""
    median: float
    low: float
    high: float

    @property
    def unreliable(self):  # the rule everywhere: samples spread wider than their median
        return self.high - self.low > self.median

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def bench(fn, device, reps, warmup):
    """Call fn warmup times, then time reps calls. GPU work is asynchronous, so the
    device is synchronised before every clock read."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times), min(times), max(times))

def worst(values, device):
    """Each value's largest over the ranks: every rank gets the same answer."""
    values = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()

def timed(fn, device, sizes):
    """bench() on every rank at once; a collective ends with its slowest rank's."""
    dist.barrier()
    mine = bench(fn, device, sizes.reps, sizes.warmup)
    median, low, high = worst([mine.median, mine.low, mine.high], device)
    return Timing(median, low, high)

def say(*parts):  # rank 0 speaks for every rank
    if dist.get_rank() == 0:
        print(*parts, flush=True)

def relative_error(got, want):
    scale = want.abs().max().clamp_min(1e-30)
    return ((got - want).abs().max() / scale).item()

# 1. PREDICTION: the mean of N shard gradients is the whole batch's gradient. The
# replicas take the same AdamW steps, bit-identical, equal to one process up to fp32
# rounding (~1e-7 relative; CUDA ~1e-6), which AdamW's g / (sqrt(v) + eps) magnifies
# where |g| ~ eps: ~1e-5 of the distance the parameters moved.
def get_batch(step, rows, seq_len, vocab, device):  # the same on every rank
    generator = torch.Generator().manual_seed(step)
    data = torch.randint(vocab, (rows, seq_len + 1), generator=generator)
    return data[:, :-1].to(device), data[:, 1:].to(device)

@dataclass
class TrainingRun:
    model: GPT
    start: torch.Tensor  # the parameters before the first step, as one vector
    end: torch.Tensor    # and after the last
    losses: list
    first_grads: list    # step 0's gradients, a tensor per parameter

def train(config, sizes, device, rows, average):  # a replica on `rows` of each batch
    world = dist.get_world_size()
    torch.manual_seed(0)  # the same seed everywhere: every replica starts equal
    model = GPT(config).to(device)
    optimizer = model.configure_optimizer(lr=LEARNING_RATE)
    start = parameters_to_vector(model.parameters()).detach()
    losses = []
    first_grads = None
    for step in range(sizes.steps):
        batch = sizes.batch * world
        x, y = get_batch(step, batch, sizes.seq_len, config.vocab_size, device)
        _, loss = model(x[rows], y[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if average:
            for p in model.parameters():  # the whole of data parallelism: average
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        if step == 0:
            first_grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        losses.append(loss.item())
    end = parameters_to_vector(model.parameters()).detach()
    return TrainingRun(model, start, end, losses, first_grads)

def data_parallel_training(sizes, device):
    rank = dist.get_rank()
    world = dist.get_world_size()
    config = GPTConfig.preset(sizes.preset, **sizes.changes)
    shard = slice(rank * sizes.batch, (rank + 1) * sizes.batch)
    replica = train(config, sizes, device, shard, average=True)
    # the reference, on every rank alike: one process trained on the whole batch
    single = train(config, sizes, device, slice(None), average=False)
    rank0_params = replica.end.clone()
    dist.broadcast(rank0_params, 0)
    differs = float(not torch.equal(replica.end, rank0_params))
    grad_errors = []
    for mine, reference in zip(replica.first_grads, single.first_grads):
        grad_errors.append(relative_error(mine, reference))
    gap = replica.end - single.end
    moved = single.end - single.start
    gap_ratio = (gap.norm() / moved.norm()).item()
    this_rank = [differs, max(grad_errors), gap.abs().max().item(), gap_ratio]
    differs, grad_error, max_gap, gap_ratio = worst(this_rank, device)
    losses = torch.tensor(replica.losses, dtype=torch.float64, device=device)
    dist.all_reduce(losses)  # the global batch's loss: the mean of the shards' losses
    result = dict(steps=sizes.steps, losses=(losses / world).tolist(),
                  single_process_losses=single.losses,
                  replicas_identical=differs == 0,
                  grad_max_rel_err_vs_single=grad_error,
                  max_abs_param_diff_vs_single=max_gap,
                  param_diff_over_distance_moved=gap_ratio)
    return replica.model, result

# 2. All-reduce from send/recv only: each returns the tensor, summed in place, and the
# bytes this rank sent.
def exchange(send_buf, dst, recv_buf, src):
    """Start sending send_buf to dst and receiving recv_buf from src, batched so that N
    ranks all sending at once cannot deadlock. An empty chunk (length < N) is skipped
    on both sides."""
    ops = []
    if send_buf.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send_buf, dst))
    if recv_buf.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv_buf, src))
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)

def naive_all_reduce(tensor):
    """Everyone sends to rank 0, which adds and sends the sum back: it moves 2(N-1) S."""
    if dist.get_rank() > 0:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
        return tensor, tensor.nbytes
    others = range(1, dist.get_world_size())
    incoming = torch.empty_like(tensor)
    for source in others:
        dist.recv(incoming, source)
        tensor += incoming
    for destination in others:
        dist.send(tensor, destination)
    return tensor, len(others) * tensor.nbytes

# The ring's schedule is plain arithmetic, checkable without any process: N chunks, as
# tensor_split cuts them; at each step rank r sends one chunk to r + 1 and receives the
# one r - 1 sends, which is always the chunk before it.
def chunk_lengths(length, world):
    """The first length % N chunks are one element longer: chunk 0 is the longest."""
    lengths = []
    for chunk in range(world):
        size = length // world
        if chunk < length % world:
            size += 1
        lengths.append(size)
    return lengths

def reduce_scatter_step(rank, step, world):
    """(chunk sent, chunk received and added to): after N-1 steps rank r holds the
    whole sum of chunk r + 1."""
    send = (rank - step) % world
    receive = (send - 1) % world
    return send, receive

def all_gather_step(rank, step, world):
    """(chunk sent, chunk received and kept): rank r passes on its finished chunk
    r + 1, then each finished chunk as it arrives."""
    send = (rank + 1 - step) % world
    receive = (send - 1) % world
    return send, receive

def ring_all_reduce(tensor):
    """Reduce-scatter then all-gather around the ring rank -> rank + 1, N-1 steps each,
    on N uneven chunks, each sent whole: pieces would let one piece's add overlap the
    next one's transfer, but each adds a send/recv's fixed cost, more than the add it
    hides (two H200s)."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    right = (rank + 1) % world
    left = (rank - 1) % world
    chunks = tensor.view(-1).split(chunk_lengths(tensor.numel(), world))
    incoming = torch.empty_like(chunks[0])  # chunk 0 is the longest
    sent = 0
    for step in range(world - 1):  # reduce-scatter: add the left's partial sums to ours
        send, receive = reduce_scatter_step(rank, step, world)
        part = incoming[:chunks[receive].numel()]
        for request in exchange(chunks[send], right, part, left):
            request.wait()
        chunks[receive].add_(part)
        sent += chunks[send].nbytes
    for step in range(world - 1):  # all-gather: pass the finished sums on
        send, receive = all_gather_step(rank, step, world)
        for request in exchange(chunks[send], right, chunks[receive], left):
            request.wait()
        sent += chunks[send].nbytes
    return tensor, sent

def library_all_reduce(tensor):  # NCCL's or gloo's own: its bytes are not ours to count
    dist.all_reduce(tensor)
    return tensor, None

ALGORITHMS = dict(naive=naive_all_reduce, ring=ring_all_reduce,
                  library=library_all_reduce)

# PREDICTION: ours equal dist.all_reduce up to summation order (~1e-7 relative) for any
# N and length: below N (empty chunks), not divisible by N (uneven chunks).
def check_all_reduce(device, sizes):
    rank = dist.get_rank()
    world = dist.get_world_size()
    awkward = {1, max(world - 1, 1), world + 1, 2 * world + 1, 997, 10_007, sizes.longest}
    lengths = sorted(awkward)
    ring_error = 0.0
    naive_error = 0.0
    for n in lengths:
        generator = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(n, generator=generator).to(device)
        want = x.clone()
        dist.all_reduce(want)
        ring, _ = ring_all_reduce(x.clone())
        naive, _ = naive_all_reduce(x.clone())
        ring_error = max(ring_error, relative_error(ring, want))
        naive_error = max(naive_error, relative_error(naive, want))
    ring_error, naive_error = worst([ring_error, naive_error], device)
    return dict(lengths=lengths, ring_max_rel_err=ring_error,
                naive_max_rel_err=naive_error)

# 3. PREDICTION: small messages pay latency alpha: 2(N-1) Python send/recv steps for the
# ring, ~1 for the library; large ones bandwidth: the ring sends 2(N-1)/N S per rank,
# naive's rank 0 2(N-1) S: ~N times slower with a link per rank (GPUs), ~1x on one
# memory bus (a CPU). Staged, each byte crosses two PCIe links, each busy both ways:
# busbw stays below the pinned host<->device copy rate that 02 measures.
def fit_alpha_beta(message_bytes, timings, world, moved):
    """T = 2(N-1) alpha + moved S beta, fitted in relative error: every size counts."""
    sizes = np.array(message_bytes, dtype=float)
    times = np.array([t.median for t in timings])
    latency = np.full_like(sizes, 2 * (world - 1))
    terms = np.stack([latency, moved * sizes], axis=1)
    solution = np.linalg.lstsq(terms / times[:, None], np.ones_like(times), rcond=None)[0]
    positive = solution[0] >= 0 and solution[1] > 0  # a negative cost: a busy machine
    noisy = any(t.unreliable for t in timings)
    alpha = max(solution[0], 0.0)
    beta = max(solution[1], 1e-30)
    predicted = terms @ np.array([alpha, beta])
    worst_error = max(abs(predicted - times) / times)
    return dict(alpha_s=alpha, beta_s_per_byte=beta, bandwidth_GBps=1 / beta / 1e9,
                reliable=bool(positive and not noisy), predicted_s=predicted.tolist(),
                max_rel_err=float(worst_error))

def bytes_sent(all_reduce, buffers, device):  # counted by our code; the busiest rank's
    counts = []
    for buffer in buffers:
        _, sent = all_reduce(buffer)
        counts.append(sent)
    return worst(counts, device)

def pooled(passes):  # one size's passes: the median of their medians, the extremes
    median = statistics.median(t.median for t in passes)
    low = min(t.low for t in passes)
    high = max(t.high for t in passes)
    return Timing(median, low, high)

def communication_sweep(device, sizes):
    world = dist.get_world_size()
    message_bytes = [2**k for k in range(12, sizes.max_log2 + 1, sizes.log2_step)]
    buffers = [torch.zeros(size // 4, device=device) for size in message_bytes]  # 0+0=0
    counted = {}
    for name in ("naive", "ring"):
        counted[name] = bytes_sent(ALGORITHMS[name], buffers, device)
    runs = {name: [[] for _ in buffers] for name in ALGORITHMS}  # per size, per pass
    for _ in range(sizes.passes):  # interleaved: a drifting machine touches all alike
        for j, buffer in enumerate(buffers):
            for name, all_reduce in ALGORITHMS.items():
                timing = timed(lambda: all_reduce(buffer), device, sizes)
                runs[name][j].append(timing)
    ring_factor = 2 * (world - 1) / world  # bytes a rank sends per byte of message
    bill = dict(sizes_bytes=message_bytes,
                ring_bytes_formula=[ring_factor * size for size in message_bytes])
    for name in ALGORITHMS:
        timings = [pooled(passes) for passes in runs[name]]
        algbw = []
        busbw = []
        for size, timing in zip(message_bytes, timings):
            algbw.append(size / timing.median / 1e9)  # nccl-tests: S / t
            busbw.append(algbw[-1] * ring_factor)     # nccl-tests: algbw 2(N-1)/N
        moved = ring_factor
        if name == "naive":
            moved = 2 * (world - 1)  # rank 0's share: N-1 messages in, N-1 out
        bill[name] = dict(median_s=[t.median for t in timings],
                          spread_s=[t.high - t.low for t in timings],
                          unreliable=[t.unreliable for t in timings],
                          algbw_GBps=algbw, busbw_GBps=busbw,
                          fit=fit_alpha_beta(message_bytes, timings, world, moved))
        if name in counted:
            bill[name]["bytes_sent_max_rank"] = counted[name]
    ratio = []
    for ring, library in zip(bill["ring"]["algbw_GBps"], bill["library"]["algbw_GBps"]):
        ratio.append(ring / library)
    bill["ring_over_library_algbw"] = ratio
    return bill

# 3b. PREDICTION: a step costs compute + comm when the all-reduce waits for backward,
# max(compute, comm) with perfect overlap (06 measures DDP's). Per tensor pays alpha ~150
# times for GPT-2, 25 MiB buckets ~20 times: they cost less.
def buckets_of(tensors, bucket_bytes):  # greedy, in parameter order; a big one alone
    buckets = [[]]
    filled = 0
    for tensor in tensors:
        if buckets[-1] and filled + tensor.nbytes > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(tensor)
        filled += tensor.nbytes
    return buckets

def all_reduce_each(tensors):  # one all-reduce, and its fixed cost, per tensor
    for tensor in tensors:
        dist.all_reduce(tensor)

def all_reduce_buckets(buckets):  # per bucket: flatten, sum, copy back (as DDP does)
    for bucket in buckets:
        flat = torch.cat([t.view(-1) for t in bucket])
        dist.all_reduce(flat)
        parts = flat.split([t.numel() for t in bucket])
        for tensor, part in zip(bucket, parts):
            tensor.copy_(part.view_as(tensor))

def time_one_step(model, device, sizes):
    """The compute that data parallelism divides: a step on this rank's share."""
    cuda = device.type == "cuda"
    rows = max(sizes.step_batch // dist.get_world_size(), 1)
    optimizer = model.configure_optimizer(lr=LEARNING_RATE, fused=cuda)
    x, y = get_batch(0, rows, sizes.step_seq, model.config.vocab_size, device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()

    return rows, timed(step, device, sizes)

def gradient_bill(model, device, sizes):
    grads = [p.grad for p in model.parameters()]
    per_tensor = [g.clone() for g in grads]
    buckets = buckets_of([g.clone() for g in grads], BUCKET_MB * 2**20)
    all_reduce_each(per_tensor)  # the same sums either way (checked), then timed
    all_reduce_buckets(buckets)
    errors = []
    bucketed = [t for bucket in buckets for t in bucket]
    for mine, reference in zip(bucketed, per_tensor):
        errors.append(relative_error(mine, reference))
    rows, step = time_one_step(model, device, sizes)
    result = dict(grad_bytes=sum(g.nbytes for g in grads), grad_tensors=len(grads),
                  buckets=len(buckets), max_rel_err=max(errors),
                  step_tokens=f"{rows} x {sizes.step_seq}",
                  step_s=step.median, step_unreliable=step.unreliable)
    ways = dict(per_tensor=lambda: all_reduce_each(per_tensor),
                bucketed=lambda: all_reduce_buckets(buckets))
    for name, all_reduce in ways.items():
        comm = timed(all_reduce, device, sizes)
        no_overlap = step.median / (step.median + comm.median)
        full_overlap = step.median / max(step.median, comm.median)
        result[name] = dict(measured_s=comm.median, unreliable=comm.unreliable,
                            efficiency_no_overlap=no_overlap,
                            efficiency_full_overlap=full_overlap)
    return result

def figure(bill, world, path):  # 4. time against message size: points, fitted lines
    try:
        from matplotlib.figure import Figure  # no pyplot: no display, no backend
    except ImportError:
        return "figure skipped (matplotlib missing)"
    fig = Figure()
    ax = fig.subplots()
    sizes = bill["sizes_bytes"]
    for name in ALGORITHMS:
        points = ax.loglog(sizes, bill[name]["median_s"], "o", label=f"{name} + fit")
        color = points[0].get_color()
        ax.loglog(sizes, bill[name]["fit"]["predicted_s"], "--", color=color)
    ax.set(xlabel="message size (bytes)", ylabel="time (s)")
    ax.set_title(f"all-reduce, {world} ranks")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return f"figure: {path}"

def own_nccl_log():
    return f"{tempfile.gettempdir()}/nccl-{os.getpid()}.log"

def use_interconnect(name):
    """Before the process group starts. 'staged' turns NCCL's peer-to-peer off, so every
    GPU-to-GPU byte goes through host memory, as on a PCIe box without P2P. NCCL's own
    log (NCCL_DEBUG=INFO, a file per process) then says which transport it chose."""
    if name == "staged":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_FILE", own_nccl_log())

def nccl_transport():
    """The transports NCCL's log names once a collective has run (e.g. P2P/CUMEM/read,
    or SHM/direct/direct when staged through host memory)."""
    try:
        text = Path(os.environ["NCCL_DEBUG_FILE"]).read_text()
    except (KeyError, OSError):
        return "not reported"
    transports = sorted(set(re.findall(r" via (\S+)", text)))
    if not transports:
        return "not reported"
    return ", ".join(transports)

def first_line(error):
    lines = str(error).splitlines()
    if not lines:
        return type(error).__name__
    return lines[0]

def start(args):
    """torchrun sets RANK and the rest (plain python: one rank). NCCL if every rank here
    has a GPU. Returns the device, its name and its memory in bytes."""
    use_interconnect(args.interconnect)
    timeout = TIMEOUT_S
    if args.quick:
        timeout = QUICK_TIMEOUT_S
    options = dict(backend="gloo", timeout=timedelta(seconds=timeout))
    device = torch.device("cpu")
    name = platform.machine()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.device != "cpu" and torch.cuda.device_count() >= LOCAL_RANKS:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))  # ranks may span nodes
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init: NCCL binds this rank to its GPU
        options.update(backend="nccl", device_id=device)
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.mem_get_info(device)[1]
        quiet = "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"
        os.environ.setdefault(quiet, "false")
    if "RANK" not in os.environ:
        options.update(store=dist.HashStore(), rank=0, world_size=1)
    # torch.optim imports torch._dynamo; imported after the group starts, it keeps the
    # group alive past destroy_process_group(), and gloo's threads then abort the exit
    importlib.import_module("torch._dynamo")
    try:
        dist.init_process_group(**options)
    except (ValueError, dist.DistError) as error:  # torchrun's variables half set, or
        rank = os.environ.get("RANK", 0)           # the rendezvous cannot be reached
        print(f"error: rank {rank}: the ranks cannot start: {first_line(error)}. Launch "
              "with torchrun (see the docstring), or with plain python for one rank",
              file=sys.stderr, flush=True)
        sys.exit(1)
    return device, name, memory

def report_training(d, world):
    mean = np.round(d["losses"], 4).tolist()
    single = np.round(d["single_process_losses"], 4).tolist()
    say(f"  measured: loss per step, mean of {world} shards {mean}")
    say(f"  measured: loss per step, one process on the whole batch {single}")
    say(f"  measured: replicas bit-identical after {d['steps']} steps: "
        f"{d['replicas_identical']}")
    say("  measured: step 0, mean vs whole-batch gradient: max relative error "
        f"{d['grad_max_rel_err_vs_single']:.1e}")
    say("  measured: gap to the single run / distance moved "
        f"{d['param_diff_over_distance_moved']:.1e}")

def report_bill(bill):
    say("  measured, slowest rank: MiB | naive, ring, library: ms, derived busbw GB/s")
    say("  derived: ring algbw / library's | counted: bytes sent / S by the busiest rank:"
        " ring (2(N-1)/N), naive (N-1)")
    for j, size in enumerate(bill["sizes_bytes"]):
        row = f"  {size / 2**20:10.3f}"
        noisy = []
        for name in ALGORITHMS:
            milliseconds = bill[name]["median_s"][j] * 1e3
            row += f" {milliseconds:10.3f} {bill[name]['busbw_GBps'][j]:7.2f}"
            if bill[name]["unreliable"][j]:
                noisy.append(name)
        row += f" {bill['ring_over_library_algbw'][j]:5.0%}"
        if "ring" in noisy or "library" in noisy:
            noisy.append("ring / library")
        for name in ("ring", "naive"):
            row += f" {bill[name]['bytes_sent_max_rank'][j] / size:5.2f}"
        if noisy:
            row += f"  {', '.join(noisy)}: unreliable (machine busy)"
        say(row)
    for name in ALGORITHMS:
        fit = bill[name]["fit"]
        line = (f"  derived: {name:7s} fit: alpha {fit['alpha_s'] * 1e6:9.2f} us, "
                f"1/beta {fit['bandwidth_GBps']:8.2f} GB/s, "
                f"worst point off by {fit['max_rel_err']:.0%}")
        if not fit["reliable"]:
            line += "  unreliable (machine busy)"
        say(line)

def report_gradients(g):
    step = f"{g['step_s'] * 1e3:.1f} ms"
    if g["step_unreliable"]:
        step += "  unreliable (machine busy)"
    say(f"  measured: one step of {g['step_tokens']} tokens per rank: {step}")
    mib = g["grad_bytes"] / 2**20
    for way, calls in (("per_tensor", g["grad_tensors"]), ("bucketed", g["buckets"])):
        bill = g[way]
        say(f"  measured: {mib:.1f} MiB {way}, {calls} all-reduce(s): "
            f"{bill['measured_s'] * 1e3:.2f} ms")
        line = (f"  derived: {way} efficiency {bill['efficiency_no_overlap']:.0%} "
                f"without overlap, {bill['efficiency_full_overlap']:.0%} with perfect "
                "overlap")
        if bill["unreliable"] or g["step_unreliable"]:
            line += "  unreliable (machine busy)"
        say(line)
    say("  measured: bucketed vs per tensor, max relative difference "
        f"{g['max_rel_err']:.1e}")

def run(args, device, name, memory):
    world = dist.get_world_size()
    nodes = world // LOCAL_RANKS
    backend = dist.get_backend()
    dist.all_reduce(torch.zeros(1, device=device))  # warm-up: the ranks connect
    transport = "gloo, the flag changes nothing"
    if device.type == "cuda":
        transport = nccl_transport()
    p2p = os.environ.get("NCCL_P2P_DISABLE", 0)
    say(f"device: {name} ({memory / 2**30:.0f} GiB) | torch {torch.__version__}")
    say(f"backend: {backend}; ranks: {world} on {nodes} node(s); --device {args.device}")
    say(f"interconnect: {args.interconnect} (NCCL_P2P_DISABLE={p2p}): {transport}")
    machine = dict(name=name, memory_bytes=memory, torch=torch.__version__)
    result = dict(lesson="05_ddp_scratch", quick=args.quick, world_size=world,
                  nodes=nodes, backend=backend, interconnect=args.interconnect,
                  transport=transport, device=machine)
    sizes = CPU
    if device.type == "cuda":
        sizes = GPU
    if args.quick:
        sizes = QUICK

    say("\n== 1. hand-rolled data parallelism: a replica per rank, a shard each, "
        "mean gradients")
    model, training = data_parallel_training(sizes, device)
    report_training(training, world)

    say("\n== 2. all-reduce from send/recv: naive and ring vs dist.all_reduce")
    correct = check_all_reduce(device, sizes)
    say(f"  measured: max |ours - library| / max |library| on lengths {correct['lengths']}")
    say(f"  measured: ring {correct['ring_max_rel_err']:.1e}, "
        f"naive {correct['naive_max_rel_err']:.1e}")
    grad_error = training["grad_max_rel_err_vs_single"]
    path_gap = training["param_diff_over_distance_moved"]
    checks = dict(
        replicas_identical=training["replicas_identical"],
        ddp_gradients_match_single_process=grad_error <= GRAD_TOL,
        ddp_matches_single_process=path_gap <= PATH_TOL,
        ring_equals_all_reduce=correct["ring_max_rel_err"] <= ALLREDUCE_TOL,
        naive_equals_all_reduce=correct["naive_max_rel_err"] <= ALLREDUCE_TOL)
    result.update(checks=checks, ddp=training, allreduce_correctness=correct)
    if world == 1:
        say("\n== 3. the communication bill: one rank sends nothing; "
            "launch with torchrun")
        return result

    say(f"\n== 3. the communication bill on {world} ranks: time against message size")
    bill = communication_sweep(device, sizes)
    report_bill(bill)
    say("\n== 3b. this GPT's gradients against one step of compute, "
        "per tensor and bucketed")
    gradients = gradient_bill(model, device, sizes)
    report_gradients(gradients)
    if dist.get_rank() == 0:
        say("  " + figure(bill, world, args.out / "05_ddp_scratch_allreduce.png"))
    counted = bill["ring"]["bytes_sent_max_rank"]
    ring_exact = True
    for sent, formula in zip(counted, bill["ring_bytes_formula"]):
        if abs(sent - formula) > 8 * (world - 1):  # uneven chunks: +-1 element a step
            ring_exact = False
    checks["ring_bytes_match_formula"] = ring_exact
    checks["bucketed_equals_per_tensor"] = gradients["max_rel_err"] <= ALLREDUCE_TOL
    result.update(bill=bill, gradients=gradients)
    return result

def writable(folder):
    """A path where no file can be made is refused now, not after the run."""
    existing = folder.absolute()
    while not existing.exists():  # missing folders are made at the end
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write in {existing}: {error.strerror}")
    return folder

def json_file(text):
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder")
    writable(Path(text).parent)
    return Path(text)

def out_folder(text):
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return writable(Path(text))

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=json_file, help="write every number here")
    parser.add_argument("--out", type=out_folder, default="out", help="figure folder")
    fabrics = ["default", "staged"]
    parser.add_argument("--interconnect", choices=fabrics, default="default")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < LOCAL_RANKS:
        parser.error("--device cuda needs a GPU per rank here; use --device cpu (gloo)")
    return args

def write_json(path, result):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)

def peer_failed(error):  # gloo's and NCCL's words for a rank that died or went silent
    return isinstance(error, dist.DistError) or "gloo" in str(error)

def main(argv=None):
    args = parse_args(argv)
    device, name, memory = start(args)
    try:
        result = run(args, device, name, memory)
        passed = all(result["checks"].values())
        verdict = "FAILED"
        if passed:
            verdict = "all passed"
        say(f"\nchecks: {result['checks']} -> {verdict}")
        if dist.get_rank() == 0 and args.json:
            write_json(args.json, result)
        dist.barrier()  # nobody leaves before rank 0 has written
    except RuntimeError as error:
        if not peer_failed(error):
            raise  # a bug: its traceback
        print(f"error: rank {dist.get_rank()}: another rank died or stopped answering: "
              f"{first_line(error)}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        dist.destroy_process_group()
        Path(own_nccl_log()).unlink(missing_ok=True)
    if not passed:
        sys.exit(1)
    sys.exit(0)

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun forwards Ctrl-C again
        print("interrupted", file=sys.stderr)
        sys.exit(130)
