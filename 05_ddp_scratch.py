"""
Section 13.5: data parallelism from scratch, the ring all-reduce, the communication bill.

Every rank holds a replica of the model, takes its shard of each batch, and averages its
gradients with the other ranks' before the optimizer steps: that is all of data
parallelism. This file builds it by hand and measures what the averaging costs.
1. Data parallelism by hand, checked against one process training on the whole batch.
2. All-reduce from send/recv: naive (everything through rank 0) and ring (reduce-scatter,
   then all-gather), for any number of ranks and any length; checked against the
   library's dist.all_reduce.
3. The communication bill: a. the bytes each rank sends, counted; b. time against message
   size, algbw and busbw (nccl-tests' definitions); c. an alpha-beta fit; d. this GPT's
   gradients, one all-reduce per parameter against 25 MiB buckets; e. a step's compute
   against its all-reduce: the scaling to expect, then measured.
4. A figure: time against message size, with the fits (out/05_ddp_scratch.png).
5. The book's box on yours: `--interconnect staged` sets NCCL_P2P_DISABLE=1, so NCCL
   stages every GPU-to-GPU byte through host memory, as on four RTX 4090s without
   peer-to-peer (out/05_ddp_scratch_staged.png).

One process per device, started by torchrun: NCCL when every rank on a machine has a GPU
of its own (cuda:LOCAL_RANK, so ranks may span machines), gloo on CPUs. Plain python runs
a group of one rank, which has nothing to send: 1. and 2. only. Copy it with model_torch.py.

    python 05_ddp_scratch.py                                     # one rank
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 05_ddp_scratch.py
    torchrun --standalone --nproc_per_node=2 05_ddp_scratch.py --interconnect staged
    # past one machine, the same command on every node:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 05_ddp_scratch.py

Expect every check ok. Four CPU ranks run the tiny GPT in one to two minutes on 2 cores;
GPUs run GPT-2 124M in under a minute.
"""

import argparse
import contextlib
import io
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from model_torch import GPT, GPTConfig, micro_batches, param_count, predicted_peak_bytes

LEARNING_RATE = 1e-3
GRAD_TOL = 1e-5       # shards' mean vs whole-batch gradient, relative (fp32 summation order)
PATH_TOL = 1e-3       # gap to one process's parameters / the distance they moved
ALLREDUCE_TOL = 1e-6  # ours vs dist.all_reduce, relative: a chunk lost or added twice: ~1
BUCKET_MB = 25        # DDP's default gradient bucket (Li et al., VLDB 2020)
TIMEOUT_S = 60        # a rank that stops answering fails the others after this


@dataclass
class Sizes:
    """CPU values; the GPU and --quick rows name only what differs."""
    preset: str = "tiny"       # the GPT (model_torch presets)
    n_layer: int = 4           # its blocks
    vocab_size: int = 50304    # its vocabulary (GPT-2's, padded)
    rows: int = 2              # 1.: rows per rank in each global batch
    seq_len: int = 128         # 1.: tokens per row
    steps: int = 3             # 1.: AdamW steps, compared with one process
    longest: int = 1_000_003   # 2.: the longest tensor checked (prime: uneven chunks)
    largest_log2: int = 26     # 3b.: messages of 2**k bytes, k = 12 (4 KiB) .. this
    log2_step: int = 2         # 3b.: k in steps of this
    reps: int = 10             # 3b., 3d.: interleaved samples of every timing
    calls: int = 1             # 3b.: all-reduces back to back in one sample, as nccl-tests
    step_rows: int = 8         # 3d., 3e.: the timed training step: rows of its global batch
    step_seq: int = 128        # 3d., 3e.: and tokens per row
    step_reps: int = 3         # 3e.: interleaved samples of the step


CPU = Sizes()
# GPUs: GPT-2 124M. 1. on short rows: one process holds the whole batch of every rank.
# The timed step is the torch capstone's: 64 x 1024 tokens, split over the ranks.
GPU = replace(CPU, preset="gpt2", n_layer=12, seq_len=256, steps=4, largest_log2=30,
              calls=5, step_rows=64, step_seq=1024, step_reps=5)
QUICK = replace(CPU, n_layer=2, vocab_size=4096, seq_len=32, steps=2, longest=10_007,
                largest_log2=20, log2_step=4, reps=3, step_rows=4, step_seq=32,
                step_reps=2)


# ---------------------------------------------------------------------------------------
# 1. Data parallelism by hand

def get_batch(step, rows, seq_len, vocab, device):
    """The same global batch on every rank: each takes its own rows of it."""
    generator = torch.Generator().manual_seed(step)
    data = torch.randint(vocab, (rows, seq_len + 1), generator=generator)
    return data[:, :-1].to(device), data[:, 1:].to(device)


@dataclass
class TrainingRun:
    start: torch.Tensor        # the parameters before the first step, as one vector
    end: torch.Tensor          # and after the last
    first_grads: torch.Tensor  # step 0's gradients, as one vector
    numels: list               # each parameter's length in those vectors
    losses: list               # this process's loss at each step


def train(config, sizes, device, rows, average):
    """AdamW steps of a replica on `rows` of each global batch; with `average`, the
    gradients are summed over the ranks and divided by their number before each step."""
    world = dist.get_world_size()
    torch.manual_seed(0)  # the same seed everywhere: every replica starts equal
    model = GPT(config).to(device)
    optimizer = model.configure_optimizer(lr=LEARNING_RATE)
    start = parameters_to_vector(model.parameters()).detach().clone()
    first_grads = None
    losses = []
    for step in range(sizes.steps):
        x, y = get_batch(step, sizes.rows * world, sizes.seq_len, config.vocab_size, device)
        _, loss = model(x[rows], y[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if average:
            for p in model.parameters():  # the whole of data parallelism: average
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        if step == 0:
            first_grads = torch.cat([p.grad.view(-1) for p in model.parameters()])
        optimizer.step()
        losses.append(loss.item())
    end = parameters_to_vector(model.parameters()).detach().clone()
    numels = [p.numel() for p in model.parameters()]
    return TrainingRun(start, end, first_grads, numels, losses)


def data_parallel_training(sizes, device):
    """predicted: the mean of N shards' gradients is the whole batch's gradient, so every
    replica takes the same AdamW steps: bit-identical across ranks, and equal to one
    process on the whole batch up to fp32 summation order (~1e-7 relative, CUDA ~1e-6;
    checked at 1e-5). AdamW's g / (sqrt(v) + eps) magnifies that rounding where |g| ~ eps:
    the parameters end within ~1e-5 of the distance they moved (checked at 1e-3). One
    rank on a CPU: exactly equal, the same operations in the same order."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    say("predicted: replicas bit-identical; the shards' mean gradient equal to the whole "
        f"batch's within {GRAD_TOL:.0e}; the parameters within {PATH_TOL:.0e} of the "
        "distance they moved")
    config = GPTConfig.preset(sizes.preset, n_layer=sizes.n_layer, vocab_size=sizes.vocab_size)
    shard = slice(rank * sizes.rows, (rank + 1) * sizes.rows)
    replica = train(config, sizes, device, shard, average=True)
    # the reference: one process on the whole batch (rank 0's), sent to every rank
    reference_end = torch.empty_like(replica.end)
    reference_grads = torch.empty_like(replica.first_grads)
    reference_losses = torch.zeros(sizes.steps, dtype=torch.float64, device=device)
    if rank == 0:
        single = train(config, sizes, device, slice(None), average=False)
        reference_end.copy_(single.end)
        reference_grads.copy_(single.first_grads)
        reference_losses.copy_(torch.tensor(single.losses, dtype=torch.float64))
    dist.broadcast(reference_end, 0)
    dist.broadcast(reference_grads, 0)
    dist.broadcast(reference_losses, 0)
    rank0_end = replica.end.clone()
    dist.broadcast(rank0_end, 0)
    differs = float(not torch.equal(replica.end, rank0_end))
    grad_errors = []
    mine = replica.first_grads.split(replica.numels)
    reference = reference_grads.split(replica.numels)
    for got, want in zip(mine, reference):  # per tensor: small gradients count too
        grad_errors.append(relative_error(got, want))
    gap = replica.end - reference_end
    moved = reference_end - replica.start
    gap_ratio = (gap.norm() / moved.norm()).item()
    worst = slowest_rank([differs, max(grad_errors), gap.abs().max().item(), gap_ratio], device)
    losses = torch.tensor(replica.losses, dtype=torch.float64, device=device)
    dist.all_reduce(losses)  # the global batch's loss: the mean of the shards' losses
    return dict(steps=sizes.steps, losses=(losses / world).tolist(),
                one_process_losses=reference_losses.tolist(),
                replicas_identical=worst[0] == 0,
                grad_max_rel_err=worst[1], max_abs_param_gap=worst[2],
                param_gap_over_distance_moved=worst[3])


def report_training(d, world, checks):
    say(f"  measured: loss per step, the mean of the {world} shards' losses "
        f"{np.round(d['losses'], 4).tolist()}")
    say(f"  measured: loss per step, one process on the whole batch "
        f"{np.round(d['one_process_losses'], 4).tolist()}")
    say(f"  measured: replicas bit-identical after {d['steps']} steps: "
        f"{d['replicas_identical']}")
    say("  measured: step 0's gradient, shards' mean vs whole batch: max relative error "
        f"{d['grad_max_rel_err']:.1e}")
    say("  measured: parameters' gap to one process / the distance they moved: "
        f"{d['param_gap_over_distance_moved']:.1e} (largest gap "
        f"{d['max_abs_param_gap']:.1e})")
    found = dict(replicas_identical=d["replicas_identical"],
                 gradients_match_one_process=d["grad_max_rel_err"] <= GRAD_TOL,
                 training_matches_one_process=d["param_gap_over_distance_moved"] <= PATH_TOL)
    held = all(found.values())
    say(f"  {held_or_missed(held)}: gradient error {d['grad_max_rel_err']:.1e}, "
        f"parameter gap {d['param_gap_over_distance_moved']:.1e} of the distance moved")
    say_checks(found, checks)
    return held


# ---------------------------------------------------------------------------------------
# 2. All-reduce from send/recv. Each sums `tensor` over the ranks, in place, and returns
# the bytes this rank sent.

def exchange(send_buf, dst, recv_buf, src):
    """Start sending send_buf to dst and receiving recv_buf from src, batched so that N
    ranks all sending at once cannot deadlock. An empty chunk (length < N) is skipped on
    both sides."""
    ops = []
    if send_buf.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send_buf, dst))
    if recv_buf.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv_buf, src))
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)


def naive_all_reduce(tensor):
    """Everyone sends to rank 0, which adds and sends the sum back: rank 0 receives
    (N-1) S, then sends (N-1) S."""
    if dist.get_rank() > 0:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
        return tensor.nbytes
    others = range(1, dist.get_world_size())
    incoming = torch.empty_like(tensor)
    for source in others:
        dist.recv(incoming, source)
        tensor += incoming
    for destination in others:
        dist.send(tensor, destination)
    return len(others) * tensor.nbytes


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
    """(chunk sent, chunk received and added to): after N-1 steps rank r holds the whole
    sum of chunk r + 1."""
    send = (rank - step) % world
    receive = (send - 1) % world
    return send, receive


def all_gather_step(rank, step, world):
    """(chunk sent, chunk received and kept): rank r passes on its finished chunk r + 1,
    then each finished chunk as it arrives."""
    send = (rank + 1 - step) % world
    receive = (send - 1) % world
    return send, receive


def ring_all_reduce(tensor):
    """Reduce-scatter then all-gather around the ring rank -> rank + 1, N-1 steps each, on
    N uneven chunks, each sent whole: a rank sends 2(N-1) chunks, 2(N-1)/N S, while it
    receives as much. (Cutting chunks into pieces would let one piece's add overlap the
    next one's transfer, but each piece adds a send/recv's fixed cost.)"""
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
    return sent


def library_all_reduce(tensor):
    """NCCL's or gloo's own: its bytes are not ours to count."""
    dist.all_reduce(tensor)
    return None


ALGORITHMS = dict(naive=naive_all_reduce, ring=ring_all_reduce, library=library_all_reduce)


def check_all_reduce(device, sizes):
    """predicted: ours equal dist.all_reduce up to summation order (~1e-7 relative; checked
    at 1e-6) for any N and any length: shorter than N (empty chunks), not divisible by N
    (uneven chunks), prime."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    say(f"predicted: naive and ring equal dist.all_reduce within {ALLREDUCE_TOL:.0e} "
        "relative, at every length")
    awkward = {1, max(world - 1, 1), world, world + 1, 2 * world + 1, 997, 10_007,
               sizes.longest}
    lengths = sorted(awkward)
    errors = dict(ring=0.0, naive=0.0)
    for n in lengths:
        generator = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(n, generator=generator).to(device)
        want = x.clone()
        dist.all_reduce(want)
        for name in errors:
            got = x.clone()
            ALGORITHMS[name](got)
            errors[name] = max(errors[name], relative_error(got, want))
    worst = slowest_rank([errors["ring"], errors["naive"]], device)
    return dict(lengths=lengths, ring_max_rel_err=worst[0], naive_max_rel_err=worst[1])


def report_all_reduce(c, checks):
    say(f"  measured: max |ours - library| / max |library| over lengths {c['lengths']}: "
        f"ring {c['ring_max_rel_err']:.1e}, naive {c['naive_max_rel_err']:.1e}")
    found = dict(ring_equals_library=c["ring_max_rel_err"] <= ALLREDUCE_TOL,
                 naive_equals_library=c["naive_max_rel_err"] <= ALLREDUCE_TOL)
    held = all(found.values())
    worst = max(c["ring_max_rel_err"], c["naive_max_rel_err"])
    say(f"  {held_or_missed(held)}: largest error {worst:.1e}")
    say_checks(found, checks)
    return held


# ---------------------------------------------------------------------------------------
# 3. The communication bill

def message_sizes(sizes):
    return [2**k for k in range(12, sizes.largest_log2 + 1, sizes.log2_step)]


def size_name(nbytes):
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:g} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:g} MiB"
    return f"{nbytes / 2**10:g} KiB"


def count_bytes_sent(device, sizes):
    """predicted: in the ring every rank sends 2(N-1) chunks of S/N: 2(N-1)/N S, under 2 S
    for any N (up to one element a step when N does not divide the length); in the naive
    all-reduce rank 0 sends (N-1) S, after receiving as much. Counted by our own code: no
    clock involved."""
    world = dist.get_world_size()
    say(f"predicted: each ring rank sends 2(N-1)/N S = {2 * (world - 1) / world:.2f} S; "
        f"naive's rank 0 (N-1) S = {world - 1} S (N = {world})")
    counted = dict(sizes_bytes=message_sizes(sizes), ring=[], naive=[])
    for size in counted["sizes_bytes"]:
        buffer = torch.zeros(size // 4, device=device)  # fp32 zeros: 0 + 0 = 0, forever
        counted["ring"].append(ring_all_reduce(buffer))
        counted["naive"].append(naive_all_reduce(buffer))
    counted["ring"] = slowest_rank(counted["ring"], device)  # the busiest rank's
    counted["naive"] = slowest_rank(counted["naive"], device)
    return counted


def report_bytes_sent(counted, world, checks):
    ring_gap = 0.0
    naive_gap = 0.0
    ring_ratios = []
    for size, ring, naive in zip(counted["sizes_bytes"], counted["ring"], counted["naive"]):
        ring_gap = max(ring_gap, abs(ring - 2 * (world - 1) / world * size))
        naive_gap = max(naive_gap, abs(naive - (world - 1) * size))
        ring_ratios.append(ring / size)
    naive_ratio = counted["naive"][0] / counted["sizes_bytes"][0]
    say(f"  measured (counted): bytes sent / S by the busiest rank, "
        f"{size_name(counted['sizes_bytes'][0])} to {size_name(counted['sizes_bytes'][-1])}: "
        f"ring {min(ring_ratios):.4f} to {max(ring_ratios):.4f}, naive {naive_ratio:.2f}")
    say(f"  measured (counted): largest gap to the formula: ring {ring_gap:.0f} bytes, "
        f"naive {naive_gap:.0f} bytes")
    found = dict(ring_bytes_match_formula=ring_gap <= 2 * (world - 1) * 4,  # an fp32 a step
                 naive_bytes_match_formula=naive_gap == 0)
    held = all(found.values())
    say(f"  {held_or_missed(held)}: ring {max(ring_ratios):.2f} S, naive {naive_ratio:.2f} S")
    say_checks(found, checks)
    return held


def back_to_back(all_reduce, buffer, calls):
    """One timed sample: `calls` all-reduces in a row, as a training loop issues them."""
    def sample():
        for _ in range(calls):
            all_reduce(buffer)
    return sample


def naive_over_ring_expected(device, world):
    """At large messages naive's rank 0 moves 2(N-1) S one direction at a time, a ring
    rank 2(N-1)/N S both ways at once: N times less, where each rank has a link of its
    own (GPUs). CPU ranks copy through the same cores: at most as many at once as there
    are cores."""
    if device.type == "cuda":
        return world
    return min(world, os.cpu_count())


def communication_sweep(device, sizes):
    """predicted: small messages are overhead-bound: the time stays flat, and our ring,
    2(N-1) send/recv steps issued from Python, is slower than the library's one call (a
    GPU runs NCCL's whole all-reduce as one kernel). Large messages are bandwidth-bound:
    the time grows with S, our ring within 1.25x of the library's (both send 2(N-1)/N S
    per rank), and naive N times slower than the ring on GPUs (min(N, cores) on a CPU,
    whose ranks share the cores). Staged through host memory (NCCL_P2P_DISABLE=1), both
    directions share it: expect less than N, and busbw below one PCIe direction's rate
    (Gen4 x16 31.5 GB/s, Gen5 63 GB/s by the PCIe specification)."""
    world = dist.get_world_size()
    expected = naive_over_ring_expected(device, world)
    why = f"N = {world}: a link per rank"
    if device.type == "cpu":
        why = f"min(N, cores) = min({world}, {os.cpu_count()}): CPU ranks share the cores"
    say("predicted: the smallest size overhead-bound, our ring slower than the library; "
        f"the largest bandwidth-bound, ring / library <= 1.25x, naive / ring ~ {expected}x "
        f"({why})")
    sweep = dict(sizes_bytes=message_sizes(sizes), busy=[], cpu_shares=[],
                 calls=sizes.calls, naive_over_ring_expected=expected,
                 ring_over_library=[], naive_over_ring=[])
    for name in ALGORITHMS:
        sweep[name] = dict(samples_s=[], median_s=[], algbw_GBps=[], busbw_GBps=[])
    share_before = share_now()
    sweep["cpu_shares"].append(share_before)
    for size in sweep["sizes_bytes"]:
        buffer = torch.zeros(size // 4, device=device)
        fns = [back_to_back(fn, buffer, sizes.calls) for fn in ALGORITHMS.values()]
        samples = interleaved(fns, sizes.reps, device)
        share_after = share_now()
        sweep["cpu_shares"].append(share_after)
        sweep["busy"].append(min(share_before, share_after) < BUSY_SHARE)
        share_before = share_after
        for name, seconds in zip(ALGORITHMS, samples):
            per_call = [s / sizes.calls for s in seconds]
            median = statistics.median(per_call)
            algbw = size / median / 1e9                                  # nccl-tests: S / t
            sweep[name]["samples_s"].append(per_call)
            sweep[name]["median_s"].append(median)
            sweep[name]["algbw_GBps"].append(algbw)
            sweep[name]["busbw_GBps"].append(algbw * 2 * (world - 1) / world)  # x 2(N-1)/N
        ring = sweep["ring"]["samples_s"][-1]
        library = sweep["library"]["samples_s"][-1]
        naive = sweep["naive"]["samples_s"][-1]
        sweep["ring_over_library"].append(pair_ratios(ring, library))
        sweep["naive_over_ring"].append(pair_ratios(naive, ring))
    return sweep


def report_sweep(sweep, world):
    calls = "one call"
    if sweep["calls"] > 1:
        calls = f"{sweep['calls']} calls back to back"
    say(f"  measured: ms per all-reduce, the slowest of {world} ranks: median [min, max] of "
        f"{len(sweep['ring']['samples_s'][0])} interleaved samples, {calls} in each")
    say(f"  {'size':>9}  {'naive':>20}  {'ring':>20}  {'library':>20}")
    for j, size in enumerate(sweep["sizes_bytes"]):
        row = f"  {size_name(size):>9}"
        for name in ALGORITHMS:
            row += f"  {spread(median_range(sweep[name]['samples_s'][j]), 1e3):>20}"
        say(row + busy_mark(sweep["busy"][j]))
    say(f"  derived: GB/s by nccl-tests' definitions: algbw = S / time; busbw = algbw x "
        f"2(N-1)/N = algbw x {2 * (world - 1) / world:.2f}, what each rank's link carries")
    say(f"  {'':>9}  {'algbw':^29}  {'busbw':^29}".rstrip())
    say(f"  {'size':>9}  {'naive':>9} {'ring':>9} {'library':>9}  {'naive':>9} {'ring':>9} "
        f"{'library':>9}")
    for j, size in enumerate(sweep["sizes_bytes"]):
        row = f"  {size_name(size):>9} "
        for name in ALGORITHMS:
            row += f" {num(sweep[name]['algbw_GBps'][j]):>9}"
        row += " "
        for name in ALGORITHMS:
            row += f" {num(sweep[name]['busbw_GBps'][j]):>9}"
        say(row + busy_mark(sweep["busy"][j]))
    say("  derived: time ratios, the median [min, max] of the per-sample ratios; a finding "
        "only when the range lies on one side of 1")
    say(f"  {'size':>9}  {'ring / library':<34}  {'naive / ring'}")
    for j, size in enumerate(sweep["sizes_bytes"]):
        ring = sweep["ring_over_library"][j]
        naive = sweep["naive_over_ring"][j]
        ring_text = spread(ring, unit="x") + noise_mark(ring)
        naive_text = spread(naive, unit="x") + noise_mark(naive)
        row = f"  {size_name(size):>9}  {ring_text:<34}  {naive_text:<34}"
        say(row.rstrip() + busy_mark(sweep["busy"][j]))
    largest = size_name(sweep["sizes_bytes"][-1])
    ring = sweep["ring_over_library"][-1]["median"]
    naive = sweep["naive_over_ring"][-1]["median"]
    expected = sweep["naive_over_ring_expected"]
    smallest = sweep["ring_over_library"][0]["median"]
    held = dict(sweep_ring_slower_when_small=smallest > 1,
                sweep_ring_near_library=ring <= 1.25,
                sweep_naive_over_ring=expected / 1.5 <= naive <= expected * 1.5)
    say(f"  {held_or_missed(held['sweep_ring_slower_when_small'])}: at "
        f"{size_name(sweep['sizes_bytes'][0])} ring / library {smallest:.2f}x"
        f"{busy_mark(sweep['busy'][0])}")
    mark = busy_mark(sweep["busy"][-1])
    say(f"  {held_or_missed(held['sweep_ring_near_library'])}: at {largest} ring / library "
        f"{ring:.2f}x{mark}")
    say(f"  {held_or_missed(held['sweep_naive_over_ring'])}: at {largest} naive / ring "
        f"{naive:.2f}x, expected ~{expected}x{mark}")
    return held


def bytes_moved_per_byte(name, world):
    """k: the bytes a rank moves one after another per byte of message. A ring (ours, the
    library's) sends 2(N-1)/N S while it receives as much at the same time; naive's rank 0
    receives (N-1) S, then sends (N-1) S: 2(N-1) S in turn."""
    if name == "naive":
        return 2 * (world - 1)
    return 2 * (world - 1) / world


def fit_alpha_beta(sizes_bytes, seconds, world, moved):
    """T = 2(N-1) alpha + k S beta, least squares in relative error (every size counts,
    not only the largest): alpha, the fixed cost of one message on one hop; beta, the
    seconds per byte of one link. A negative fitted cost (noise) is set to 0."""
    sizes = np.array(sizes_bytes, dtype=float)
    measured = np.array(seconds)
    hops = np.full_like(sizes, 2 * (world - 1))
    terms = np.stack([hops, moved * sizes], axis=1)
    weighted = terms / measured[:, None]
    solution = np.linalg.lstsq(weighted, np.ones_like(measured), rcond=None)[0]
    alpha = max(float(solution[0]), 0.0)
    beta = max(float(solution[1]), 1e-30)
    predicted = terms @ np.array([alpha, beta])
    worst = np.max(np.abs(predicted - measured) / measured)
    return dict(alpha_s=alpha, beta_s_per_byte=beta, link_GBps=1 / beta / 1e9,
                predicted_s=predicted.tolist(), worst_rel_err=float(worst),
                clamped=bool(solution[0] < 0 or solution[1] <= 0))


def fit_models(sweep, world):
    """predicted: one link, one bandwidth: the fitted 1/beta of our ring within 1.25x of
    the library's (naive's too, when rank 0's bytes are counted right); alpha larger for
    our ring on GPUs, whose steps Python issues one by one, than for NCCL's one kernel."""
    say("predicted: 1/beta of our ring within 1.25x of the library's (one link, one "
        "bandwidth); alpha larger for ours on GPUs (Python issues its steps)")
    fits = {}
    for name in ALGORITHMS:
        moved = bytes_moved_per_byte(name, world)
        fits[name] = fit_alpha_beta(sweep["sizes_bytes"], sweep[name]["median_s"], world, moved)
    return fits


def report_fit(fits, world, busy):
    hops = 2 * (world - 1)
    mark = busy_mark(busy)
    say("  derived: an alpha-beta fit per algorithm, T = 2(N-1) alpha + k S beta, least "
        "squares in relative error over every size, where")
    say(f"    alpha is the fixed cost of one message on one hop (an all-reduce takes "
        f"2(N-1) = {hops} hops in turn);")
    say(f"    k the bytes a rank moves in turn per byte of message: ring and library "
        f"2(N-1)/N = {2 * (world - 1) / world:.2f} (sending while receiving), naive's rank "
        f"0 2(N-1) = {hops} (receiving, then sending);")
    say("    1/beta the bandwidth of one link, as each algorithm sees it")
    say(f"  {'algorithm':>9}  {'alpha us/hop':>12}  {'2(N-1) alpha us':>15}  "
        f"{'1/beta GB/s':>11}  {'worst size off by':>17}")
    for name in ALGORITHMS:
        fit = fits[name]
        alpha_us = fit["alpha_s"] * 1e6
        row = (f"  {name:>9}  {num(alpha_us):>12}  {num(hops * alpha_us):>15}  "
               f"{num(fit['link_GBps']):>11}  {fit['worst_rel_err']:17.0%}")
        if fit["clamped"]:
            row += " (a negative cost fitted: set to 0)"
        say(row + mark)
    library = fits["library"]
    half_way = world * library["alpha_s"] / library["beta_s_per_byte"]  # 2(N-1)a = k S b
    say(f"  derived: the library is overhead-bound below S = N alpha / beta = "
        f"{num(half_way / 2**20)} MiB (its two terms equal), bandwidth-bound above{mark}")
    link_ratio = fits["ring"]["link_GBps"] / library["link_GBps"]
    alpha_ratio = "not compared (the library's fitted alpha is 0)"
    if library["alpha_s"] > 0:
        alpha_ratio = f"{num(fits['ring']['alpha_s'] / library['alpha_s'])}x the library's"
    held = 1 / 1.25 <= link_ratio <= 1.25
    say(f"  {held_or_missed(held)}: ring's 1/beta {link_ratio:.2f}x the library's; ring's "
        f"alpha {alpha_ratio}{mark}")
    return held


def buckets_of(tensors, bucket_bytes):
    """Greedy, in parameter order: a tensor larger than a bucket gets one of its own."""
    buckets = [[]]
    filled = 0
    for tensor in tensors:
        if buckets[-1] and filled + tensor.nbytes > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(tensor)
        filled += tensor.nbytes
    return buckets


def fewest_buckets(tensor_bytes, bucket_bytes):
    """A lower bound: a tensor larger than a bucket fills one alone; the others need at
    least their bytes / bucket_bytes."""
    alone = [nbytes for nbytes in tensor_bytes if nbytes > bucket_bytes]
    rest = sum(tensor_bytes) - sum(alone)
    return len(alone) + math.ceil(rest / bucket_bytes)


def all_reduce_each(tensors):
    """One all-reduce, and its fixed cost, per tensor. Returns the calls made."""
    calls = 0
    for tensor in tensors:
        dist.all_reduce(tensor)
        calls += 1
    return calls


def all_reduce_buckets(buckets):
    """Per bucket: flatten, sum, copy back (as DDP does). Returns the calls made."""
    calls = 0
    for bucket in buckets:
        flat = torch.cat([t.view(-1) for t in bucket])
        dist.all_reduce(flat)
        calls += 1
        parts = flat.split([t.numel() for t in bucket])
        for tensor, part in zip(bucket, parts):
            tensor.copy_(part.view_as(tensor))
    return calls


def gradient_bill(grads, library_fit, device, sizes):
    """predicted: one all-reduce per parameter pays the fixed cost 2(N-1) alpha once per
    tensor (GPT-2: 148 tensors); 25 MiB buckets pay it at least once per 25 MiB, a tensor
    larger than a bucket alone (GPT-2: >= 15 calls); both send the same bytes, k G beta.
    By the library's fit (3c), buckets cost less by the fixed costs they save, less the
    copies into and out of the buckets: bucketed faster than per parameter."""
    world = dist.get_world_size()
    bucket_bytes = BUCKET_MB * 2**20
    grad_bytes = sum(g.nbytes for g in grads)
    fewest = fewest_buckets([g.nbytes for g in grads], bucket_bytes)
    per_call_s = 2 * (world - 1) * library_fit["alpha_s"]
    bandwidth_s = bytes_moved_per_byte("ring", world) * grad_bytes * library_fit["beta_s_per_byte"]
    predicted_each = len(grads) * per_call_s + bandwidth_s
    predicted_buckets = fewest * per_call_s + bandwidth_s
    say(f"predicted: {len(grads)} calls per parameter, at least {fewest} in {BUCKET_MB} MiB "
        f"buckets; by 3c's library fit {num(predicted_each * 1e3)} ms against "
        f"{num(predicted_buckets * 1e3)} ms or a little more: buckets faster")
    per_tensor = [g.clone() for g in grads]
    buckets = buckets_of([g.clone() for g in grads], bucket_bytes)
    calls_each = all_reduce_each(per_tensor)  # the same sums either way (checked)
    calls_buckets = all_reduce_buckets(buckets)
    errors = []
    bucketed = [t for bucket in buckets for t in bucket]
    for got, want in zip(bucketed, per_tensor):
        errors.append(relative_error(got, want))
    samples = interleaved([lambda: all_reduce_each(per_tensor),
                           lambda: all_reduce_buckets(buckets)], sizes.reps, device)
    return dict(grad_bytes=grad_bytes, tensors=len(grads), fewest_buckets=fewest,
                calls_per_parameter=calls_each, calls_bucketed=calls_buckets,
                max_rel_err=max(errors), predicted_per_parameter_s=predicted_each,
                predicted_bucketed_s=predicted_buckets,
                per_parameter_s=samples[0], bucketed_s=samples[1],
                per_parameter_over_bucketed=pair_ratios(samples[0], samples[1]))


def report_gradient_bill(g, busy, checks):
    mark = busy_mark(busy)
    packing = ""
    if g["calls_bucketed"] > g["fewest_buckets"]:
        packing = ": greedy packing in parameter order leaves buckets part-empty"
    say(f"  measured (counted): {g['grad_bytes'] / 2**20:.1f} MiB of fp32 gradients in "
        f"{g['tensors']} tensors: {g['calls_per_parameter']} all-reduce calls per "
        f"parameter, {g['calls_bucketed']} in {BUCKET_MB} MiB buckets (predicted at least "
        f"{g['fewest_buckets']}{packing})")
    each = median_range(g["per_parameter_s"])
    buckets = median_range(g["bucketed_s"])
    say(f"  measured: one all-reduce per parameter {spread(each, 1e3, ' ms')}, predicted "
        f"{num(g['predicted_per_parameter_s'] * 1e3)} ms{mark}")
    say(f"  measured: {BUCKET_MB} MiB buckets {spread(buckets, 1e3, ' ms')}, predicted "
        f"{num(g['predicted_bucketed_s'] * 1e3)} ms{mark}")
    ratio = g["per_parameter_over_bucketed"]
    say(f"  derived: per parameter / bucketed {spread(ratio, unit='x')}"
        f"{noise_mark(ratio)}{mark}")
    say(f"  measured: bucketed vs per parameter sums, max relative difference "
        f"{g['max_rel_err']:.1e}")
    held = ratio["low"] > 1  # faster in every pair of samples: beyond the noise
    say(f"  {held_or_missed(held)}: buckets {ratio['median']:.2f}x faster"
        f"{noise_mark(ratio)}{mark}")
    say_checks(dict(buckets_equal_per_parameter=g["max_rel_err"] <= ALLREDUCE_TOL), checks)
    return held


def has_bf16_tensor_cores(device):
    """Compute capability 8.0 (A100) and later; a T4 (7.5) or V100 (7.0) has none."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def step_plan(config, sizes, world, memory_bytes, extra_bytes, bf16):
    """This rank's rows of the step's global batch, and in how many micro-batches they fit
    the card by model_torch's accounting, beside `extra_bytes` the bill keeps alive. None:
    one row does not fit."""
    rows = max(sizes.step_rows // world, 1)
    counted = replace(config, block_size=sizes.step_seq)
    micro = micro_batches(counted, rows, memory_bytes - extra_bytes, bf16)
    if micro is None:
        return None
    peak = predicted_peak_bytes(counted, rows // micro, bf16) + extra_bytes
    return dict(rows=rows, micro_batches=micro, predicted_peak_bytes=peak)


def training_step(step, buckets):
    """One step on this rank's rows, in micro-batches; with `buckets`, the gradients are
    averaged over the ranks between backward and the optimizer: hand-rolled data
    parallelism, the all-reduce after the whole backward (no overlap)."""
    micro = step["plan"]["micro_batches"]
    step["optimizer"].zero_grad(set_to_none=False)  # the buckets point at these gradients
    for x, y in zip(step["x"].chunk(micro), step["y"].chunk(micro)):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=step["bf16"]):
            _, loss = step["model"](x, y)
        (loss / micro).backward()
    if buckets is not None:
        all_reduce_buckets(buckets)
        for bucket in buckets:
            for grad in bucket:
                grad.div_(dist.get_world_size())
    step["optimizer"].step()


def prepare_step(sizes, device, world):
    """The timed step's model, optimizer and batch, sized to the card; one warm-up step,
    which leaves the gradients that 3d all-reduces. None when one row does not fit."""
    config = GPTConfig.preset(sizes.preset, n_layer=sizes.n_layer, vocab_size=sizes.vocab_size)
    bf16 = False
    memory = 2**62  # a CPU's: no card to fit
    if device.type == "cuda":
        bf16 = has_bf16_tensor_cores(device)
        memory = torch.cuda.get_device_properties(device).total_memory
        if not bf16:
            say("  no bf16 tensor cores (compute capability below 8.0): the step runs in fp32")
    two_copies = 2 * 4 * param_count(config)  # 3d's per-parameter and bucketed gradients
    plan = step_plan(config, sizes, world, memory, two_copies, bf16)
    if plan is None:
        say(f"  skipped: one row of {sizes.step_seq} tokens does not fit "
            f"{memory / 2**30:.0f} GiB by model_torch's accounting")
        return None
    if device.type == "cuda":
        say(f"  derived: {plan['micro_batches']} micro-batch(es) of "
            f"{plan['rows'] // plan['micro_batches']} rows: "
            f"{plan['predicted_peak_bytes'] / 2**30:.1f} of {memory / 2**30:.0f} GiB "
            "predicted (model_torch's accounting)")
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = model.configure_optimizer(lr=LEARNING_RATE, fused=device.type == "cuda")
    x, y = get_batch(0, plan["rows"], sizes.step_seq, config.vocab_size, device)
    step = dict(model=model, optimizer=optimizer, x=x, y=y, plan=plan, bf16=bf16)
    training_step(step, None)
    return step


def scaling(step, comm_s, sizes, device):
    """predicted: a rank computes its 1/N of the batch in t_step, then waits t_comm for
    the all-reduce: efficiency t_step / (t_step + t_comm) against N ranks that need not
    talk (with perfect overlap t_step / max(t_step, t_comm): 06's DDP overlaps the
    all-reduce with backward). Times add: the measured efficiency within 5 points."""
    say("predicted: efficiency = t_step / (t_step + t_comm), t_comm = 3d's bucketed "
        f"all-reduce ({num(statistics.median(comm_s) * 1e3)} ms); measured within 5 points")
    grads = [p.grad for p in step["model"].parameters()]
    buckets = buckets_of(grads, BUCKET_MB * 2**20)
    samples = interleaved([lambda: training_step(step, None),
                           lambda: training_step(step, buckets)], sizes.step_reps, device)
    compute = statistics.median(samples[0])
    comm = statistics.median(comm_s)
    return dict(step_s=samples[0], data_parallel_step_s=samples[1],
                predicted_efficiency=compute / (compute + comm),
                predicted_efficiency_full_overlap=compute / max(compute, comm),
                efficiency=pair_ratios(samples[0], samples[1]))


def report_scaling(s, rows, seq, world, busy):
    mark = busy_mark(busy)
    say(f"  measured: a step alone, {rows} rows x {seq} tokens per rank: "
        f"{spread(median_range(s['step_s']), 1e3, ' ms')}{mark}")
    say(f"  measured: the same step + the bucketed all-reduce before the optimizer: "
        f"{spread(median_range(s['data_parallel_step_s']), 1e3, ' ms')}{mark}")
    say(f"  derived: predicted efficiency {s['predicted_efficiency']:.0%} without overlap, "
        f"{s['predicted_efficiency_full_overlap']:.0%} with perfect overlap")
    efficiency = s["efficiency"]
    say(f"  derived: measured efficiency, step alone / data-parallel step "
        f"{spread(efficiency, 100, '%')}{mark}")
    say(f"  derived: {world} ranks do {world}x the tokens of one: "
        f"{world * efficiency['median']:.2f}x one rank's throughput{mark}")
    held = abs(efficiency["median"] - s["predicted_efficiency"]) <= 0.05
    say(f"  {held_or_missed(held)}: measured {efficiency['median']:.0%}, predicted "
        f"{s['predicted_efficiency']:.0%}{mark}")
    return held


def one_rank_bill(sizes):
    """One rank sends nothing; what a ring would make each rank send, by the counts."""
    config = GPTConfig.preset(sizes.preset, n_layer=sizes.n_layer, vocab_size=sizes.vocab_size)
    grad_mib = 4 * param_count(config) / 2**20
    say(f"  derived: this GPT's fp32 gradients are {grad_mib:.1f} MiB; a ring all-reduce "
        "makes each rank send 2(N-1)/N of them per step:")
    for world in (2, 4, 8):
        say(f"    N = {world}: {2 * (world - 1) / world * grad_mib:.1f} MiB")


def plot_sweep(sweep, fits, world, interconnect, path):
    """4. Time against message size: the measured medians, and each fit as a line."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no display, no backend
    except ImportError:
        return "figure skipped: matplotlib is not installed"
    fig = Figure()
    ax = fig.subplots()
    for name in ALGORITHMS:
        points = ax.loglog(sweep["sizes_bytes"], sweep[name]["median_s"], "o", label=name)
        color = points[0].get_color()
        ax.loglog(sweep["sizes_bytes"], fits[name]["predicted_s"], "--", color=color,
                  label=f"{name}: alpha-beta fit")
    ax.set(xlabel="message size S (bytes)", ylabel="time of one all-reduce (s)")
    ax.set_title(f"all-reduce on {world} ranks, interconnect {interconnect}")
    ax.legend()
    fig.savefig(path)
    return f"figure: {path}"


# ---------------------------------------------------------------------------------------
# The tools every experiment above uses: timing on a machine that may be busy (interleaved
# samples, the slowest rank's, medians with their spread), and printing.

def say(*parts):
    """Rank 0 speaks for every rank."""
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest_rank(values, device):
    """Each value's largest over the ranks; every rank gets the same list."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def relative_error(got, want):
    scale = want.abs().max().clamp_min(1e-30)
    return ((got - want).abs().max() / scale).item()


BUSY_SHARE = 0.9  # below this share of a core, other programs were taking the CPU


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


def share_now():
    """cpu_share() on rank 0 alone, once every rank has reached a barrier and while the
    others wait in a second one (asleep there, so four CPU ranks on two cores leave it its
    core): the lesson's own ranks are not other programs. The other ranks say 1.0 (the
    minimum over ranks is rank 0's)."""
    dist.barrier()  # no rank still at its last work
    share = 1.0
    if dist.get_rank() == 0:
        share = cpu_share()
    dist.barrier()
    return share


def interleaved(fns, reps, device):
    """Seconds of each call of each function, the functions called in turn (A, B, A, B,
    ...), so a machine slowed for a while slows every side alike; one untimed round
    first, the warm-up. The ranks start each call together (a barrier) and a call's time
    is its slowest rank's: a collective is done when its last rank is."""
    for fn in fns:
        fn()
    seconds = [[] for _ in fns]
    for _ in range(reps):
        for samples, fn in zip(seconds, fns):
            dist.barrier()
            start = time.perf_counter()
            fn()
            sync(device)
            samples.append(time.perf_counter() - start)
    slowest = []
    for samples in seconds:
        slowest.append(slowest_rank(samples, device))
    return slowest


def median_range(samples):
    return dict(median=statistics.median(samples), low=min(samples), high=max(samples))


def pair_ratios(a_samples, b_samples):
    """A / B from interleaved samples: the median of the per-pair ratios, with their range."""
    ratios = []
    for a, b in zip(a_samples, b_samples):
        ratios.append(a / b)
    return median_range(ratios)


def num(x):
    """Three significant digits, no exponent above 1."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def spread(summary, scale=1.0, unit=""):
    """'median [min, max]' of a summary from median_range()."""
    median = num(summary["median"] * scale)
    low = num(summary["low"] * scale)
    high = num(summary["high"] * scale)
    return f"{median}{unit} [{low}, {high}]"


def noise_mark(ratio):
    """A ratio is a finding only when its whole range lies on one side of 1."""
    if ratio["low"] > 1 or ratio["high"] < 1:
        return ""
    return " (within noise)"


def busy_mark(busy):
    if busy:
        return " (machine busy)"
    return ""


def held_or_missed(held):
    if held:
        return "prediction held"
    return "prediction missed"


def say_checks(found, checks):
    for name, ok in found.items():
        if ok:
            say(f"  check {name}: ok")
        else:
            say(f"  check {name}: FAILED")
    checks.update(found)


# ---------------------------------------------------------------------------------------
# 5. The interconnect, the ranks, the machine

def nccl_log_path():
    return Path(tempfile.gettempdir()) / f"05_ddp_scratch_nccl_{os.getpid()}.log"


def nccl_transports(log_text):
    """The transports NCCL's log names: P2P/... over NVLink or PCIe peer-to-peer,
    SHM/... through host memory when staged."""
    found = sorted(set(re.findall(r" via (\S+)", log_text)))
    if not found:
        return "not reported"
    return ", ".join(found)


def start_ranks(device_choice, interconnect):
    """torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and where to meet; plain python runs a
    group of one. NCCL when every rank on this machine has a GPU of its own, else gloo."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = torch.device("cpu")
    if device_choice == "cuda":
        device = torch.device("cuda", local_rank)
    if device_choice == "auto" and torch.cuda.device_count() >= local_ranks:
        device = torch.device("cuda", local_rank)
    if interconnect == "staged":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # before NCCL starts: GPU bytes via host memory
    options = dict(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_DEBUG", "INFO")  # its log says which transport it chose
        os.environ.setdefault("NCCL_DEBUG_FILE", str(nccl_log_path()))
        # naive's sends and recvs wait for the group's other work, as naive means them to:
        # quiet torch's warning about that
        os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
        options.update(backend="nccl", device_id=device)  # NCCL binds this rank to its GPU
    if "RANK" not in os.environ:  # plain python: a group of one
        options.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(**options)
    return device


def describe(device, interconnect):
    """The machine, in the first lines; the transport NCCL chose once the ranks have met."""
    world = dist.get_world_size()
    nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = os.cpu_count()
    dist.all_reduce(torch.zeros(1, device=device))  # the ranks connect
    sync(device)
    name = f"{platform.machine()} CPU, {cores} cores"
    transport = "gloo: --interconnect changes nothing"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
        transport = "not reported"
        if nccl_log_path().exists():
            transport = nccl_transports(nccl_log_path().read_text())
    say(f"device: {name} | torch {torch.__version__} | {dist.get_backend()}, {world} "
        f"rank(s) on {nodes} node(s)")
    p2p = os.environ.get("NCCL_P2P_DISABLE", "unset")
    say(f"interconnect: {interconnect} (NCCL_P2P_DISABLE={p2p}): {transport}")
    if device.type == "cpu" and world // nodes > cores:
        say(f"note: {world // nodes} ranks on {cores} cores take turns, so CPU times include "
            "waiting for a core")
    return dict(name=name, torch=torch.__version__, backend=dist.get_backend(),
                world_size=world, nodes=nodes, cores=cores, interconnect=interconnect,
                transport=transport)


def section(args, device):
    """Section 13.5, in order: each experiment, then its report."""
    machine = describe(device, args.interconnect)
    world = machine["world_size"]
    sizes = CPU
    if device.type == "cuda":
        sizes = GPU
    if args.quick:
        sizes = QUICK
    shares = []
    busy = {}
    checks = {}
    predictions = {}
    result = dict(lesson="05_ddp_scratch", quick=args.quick, device=machine, checks=checks,
                  predictions=predictions, cpu_shares=shares, busy=busy)

    say("\n== 1. data parallelism by hand: a replica per rank, a shard of the batch each, "
        "gradients averaged")
    result["training"] = data_parallel_training(sizes, device)
    predictions["training"] = report_training(result["training"], world, checks)

    say("\n== 2. all-reduce from send/recv: naive and ring, checked against dist.all_reduce")
    result["all_reduce"] = check_all_reduce(device, sizes)
    predictions["all_reduce"] = report_all_reduce(result["all_reduce"], checks)

    if world == 1:
        say("\n== 3. the communication bill: one rank sends nothing (launch with torchrun)")
        one_rank_bill(sizes)
        return result

    say(f"\n== 3a. the bytes each rank sends, counted, on {world} ranks")
    result["bytes_sent"] = count_bytes_sent(device, sizes)
    predictions["bytes_sent"] = report_bytes_sent(result["bytes_sent"], world, checks)

    say("\n== 3b. time against message size: naive, ring and the library, interleaved")
    sweep = communication_sweep(device, sizes)
    result["sweep"] = sweep
    shares += sweep["cpu_shares"]
    busy["3b. time against message size"] = any(sweep["busy"])
    predictions.update(report_sweep(sweep, world))

    say("\n== 3c. the alpha-beta model")
    fits = fit_models(sweep, world)
    result["fits"] = fits
    predictions["fit_one_link"] = report_fit(fits, world, any(sweep["busy"]))

    say(f"\n== 3d. this GPT's gradients: one all-reduce per parameter vs {BUCKET_MB} MiB "
        "buckets")
    step = prepare_step(sizes, device, world)
    if step is not None:
        result["step_plan"] = step["plan"]
        grads = [p.grad for p in step["model"].parameters()]
        before = share_now()
        result["gradients"] = gradient_bill(grads, fits["library"], device, sizes)
        after = share_now()
        shares += [before, after]
        busy["3d. gradients"] = min(before, after) < BUSY_SHARE
        predictions["buckets_faster"] = report_gradient_bill(
            result["gradients"], busy["3d. gradients"], checks)

        say(f"\n== 3e. a data-parallel step: its compute and its all-reduce, on {world} ranks")
        before = share_now()
        result["scaling"] = scaling(step, result["gradients"]["bucketed_s"], sizes, device)
        after = share_now()
        shares += [before, after]
        busy["3e. scaling"] = min(before, after) < BUSY_SHARE
        predictions["scaling"] = report_scaling(result["scaling"], step["plan"]["rows"],
                                                sizes.step_seq, world, busy["3e. scaling"])

    say("\n== 4. the figure: time against message size, with the alpha-beta fits")
    figure = args.out / "05_ddp_scratch.png"
    if args.interconnect == "staged":
        figure = args.out / "05_ddp_scratch_staged.png"
    if dist.get_rank() == 0:
        say("  " + plot_sweep(sweep, fits, world, args.interconnect, figure))
    return result


def main():
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    json_file = None
    if args.json is not None and rank == 0:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        json_file = open(args.json, "w")  # a path that cannot be written fails here, first
    args.out.mkdir(parents=True, exist_ok=True)
    device = start_ranks(args.device, args.interconnect)
    try:
        result = section(args, device)
    finally:
        dist.destroy_process_group()
        nccl_log_path().unlink(missing_ok=True)
    busy = [name for name, was_busy in result["busy"].items() if was_busy]
    result["machine_busy"] = len(busy) > 0
    if busy and rank == 0:
        print(f"\nmachine busy: other programs took the CPU during {', '.join(busy)}; the "
              "marked numbers are not findings")
    if json_file is not None:
        json.dump(result, json_file, indent=1)
        json_file.close()
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed and rank == 0:
        sys.exit(f"check failed: {', '.join(failed)}")
    if failed:
        sys.exit(1)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--out", type=Path, default=Path("out"), help="figure folder")
    parser.add_argument("--interconnect", choices=["default", "staged"], default="default",
                        help="staged: NCCL_P2P_DISABLE=1, GPU bytes through host memory")
    if int(os.environ.get("RANK", "0")) > 0:  # rank 0 prints a bad flag's message; the others exit 2 quietly
        with contextlib.redirect_stderr(io.StringIO()):
            return parser.parse_args()
    return parser.parse_args()


if __name__ == "__main__":
    main()
