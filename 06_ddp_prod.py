"""
Section 13.6: production data parallelism, two philosophies.

PyTorch runs one process per device, and its collectives are calls you can see:
  1. DistributedDataParallel (DDP) on the GPT ends where 05's hand-rolled data
     parallelism ends (checked).
  2. Its step time against hand-rolled's, and why: a few buckets instead of a call per
     tensor, summed while backward still computes (counted, and profiled).
  3. bucket_cap_mb, swept: the buckets as predicted, the overlap, the step time.
  4. no_sync under gradient accumulation: one all-reduce of the summed gradients, not
     one per micro-batch; the same gradients (checked).
  5. The bridge: FSDP2's fully_shard keeps 1/N of the parameters, gradients and AdamW
     state on each rank, and ends where DDP ends (checked).
JAX runs one process for all devices, and its collectives follow from shardings:
  1. A Mesh with a 'data' axis and the batch split over it: jit puts all-reduces into
     the compiled program, and the losses equal one device's (checked).
  2. The split batch's step time against one device running all of it.
  3. The bridge: the parameters and AdamW state split over 'data' too (a PartitionSpec):
     memory per device against replication, the same losses (checked).

Copy it with model_torch.py and model_jax.py. Run
    torchrun --standalone --nproc_per_node=2 06_ddp_prod.py  # PyTorch: a GPU per rank
    torchrun --standalone --nproc_per_node=2 06_ddp_prod.py --interconnect staged
        # GPU-to-GPU bytes through host memory, as on a PCIe box without P2P (the book's)
    torchrun --standalone --nproc_per_node=2 06_ddp_prod.py --device cpu
        # gloo ranks on the CPU, at most one per core
    python 06_ddp_prod.py  # JAX: every GPU, else 4 simulated CPU devices
One GPU has no partner: the PyTorch half needs 2 ranks or more (with fewer GPUs than
ranks here, the ranks run on the CPU) and the JAX half 2 devices or more (--device cpu
simulates them).
Past one machine, PyTorch: the same torchrun on each node, with --nnodes=2
--rdzv-backend=c10d --rdzv-endpoint=HOST:29500 for --standalone. JAX: one process per
machine, each calling jax.distributed.initialize("HOST:1234", num_processes=2,
process_id=i) before any other JAX call.

Expect each experiment's prediction, what it measured and whether the prediction held,
then "check ...: ok" lines; in --out, the profiler trace of DDP's step (ui.perfetto.dev).
On a CPU each half takes a minute or two; on two GPUs, about a minute each.
"""

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import io
import json
import os
import re
import statistics
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before torch: no profiler USDT lines

import flax
import jax
import numpy as np
import torch
import torch.distributed as dist
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard  # FSDP2, public since torch 2.6
from torch.nn.parallel import DistributedDataParallel as DDP

from model_jax import GPT as JaxGPT
from model_jax import adamw as jax_adamw
from model_jax import make_train_step
from model_torch import ALLOCATOR_HEADROOM, GPT, GPTConfig, param_count, predicted_peak_bytes

LR = 6e-4
PARAM_TOL = LR / 6   # fp32 rounding: ~1e-6; a gradient lost, or summed and not averaged: ~LR
LOSS_TOL = 1e-4      # relative: fp32 rounding ~1e-6; a gradient summed twice: ~1e-2
STEPS_CHECKED = 3    # AdamW steps before two ways of training are compared
MICRO_STEPS = 4      # gradient accumulation: k micro-batches per optimizer step
PROFILED_STEPS = 2   # steps under the profiler, after one unrecorded step
TIMEOUT = datetime.timedelta(seconds=120)  # a rank waiting this long in a collective fails
CPU_DEVICES = 4      # JAX on a CPU: simulated devices, unless the environment names a count
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
BUSY_SHARE = 0.9  # below this share of a core, other programs were taking the CPU


@dataclasses.dataclass
class Sizes:
    preset: str = "tiny"       # model_torch's preset: 4 heads, d 128
    n_layer: int = 4           # transformer blocks
    vocab_size: int = 50304    # GPT-2's tokens, padded: the embedding is most of the bytes
    rows: int = 2              # sequences per rank (JAX: per device); fewer if memory says
    seq_len: int = 128         # tokens per sequence
    reps: int = 5              # rounds of each interleaved comparison
    caps: tuple = (0.25, 1, 25)  # bucket_cap_mb values swept beside DDP's default

    def config(self, attn="sdpa"):
        return GPTConfig.preset(self.preset, n_layer=self.n_layer, block_size=self.seq_len,
                                vocab_size=self.vocab_size, attn=attn)


CPU = Sizes()
GPU = dataclasses.replace(CPU, preset="gpt2", n_layer=12, rows=8, seq_len=1024, reps=10,
                          caps=(1, 5, 25, 100, 1000))
QUICK = dataclasses.replace(CPU, n_layer=2, vocab_size=4096, seq_len=32, reps=2,
                            caps=(0.25,))  # a smoke run, not a measurement


# ---------------------------------------------------------------------------------------
# PyTorch: one process per device; DDP's hooks run the all-reduces during backward.

def loss_of(model, x, y, amp, micro_steps=1):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        _, loss = model(x, y)
    return loss / micro_steps  # equal micro-batches: the sum of k losses / k, their mean


def train_step(model, optimizer, x, y, amp):
    """One step of DDP or FSDP2: their hooks run the collectives inside backward. The
    named ranges show in the profiler's trace, on the CPU's timeline and the GPU's."""
    optimizer.zero_grad(set_to_none=True)
    with torch.profiler.record_function("forward"):
        loss = loss_of(model, x, y, amp)
    with torch.profiler.record_function("backward"):
        loss.backward()
    with torch.profiler.record_function("optimizer"):
        optimizer.step()


def handrolled_step(model, optimizer, x, y, amp):
    """05's way: the whole backward, then an all-reduce per gradient tensor (the sum over
    the ranks, then / N for the mean), then the step. Nothing overlaps."""
    optimizer.zero_grad(set_to_none=True)
    with torch.profiler.record_function("forward"):
        loss = loss_of(model, x, y, amp)
    with torch.profiler.record_function("backward"):
        loss.backward()
    with torch.profiler.record_function("all-reduce"):
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
    with torch.profiler.record_function("optimizer"):
        optimizer.step()


def adamw(model):
    plain = getattr(model, "module", model)  # DDP wraps the GPT as .module
    return plain.configure_optimizer(lr=LR)


def max_diff(xs, ys):
    """The largest |x - y| over all tensors and all ranks."""
    diffs = []
    for x, y in zip(xs, ys):
        diffs.append((x.detach() - y.detach()).abs().max())
    largest = torch.stack(diffs).max().double()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def torch_same_result(check_model, batches):
    """Predicted: hand-rolled and DDP do the same math (the mean of the ranks' gradients
    into the same AdamW), so after 3 steps their parameters agree: bit for bit with 2
    ranks (a + b = b + a), to fp32 rounding (under 1e-5) with more (a bucket's sum adds
    in another order than a lone tensor's). A gradient summed and not averaged would move
    them by ~LR (6e-4) a step. fp32 and manual attention, on a CPU or a GPU: no kernel
    rounds differently from one run to the next."""
    hand = copy.deepcopy(check_model)
    hand_optimizer = adamw(hand)
    ddp = DDP(copy.deepcopy(check_model))  # rank 0's weights broadcast to every rank
    ddp_optimizer = adamw(ddp)
    for x, y in batches:
        handrolled_step(hand, hand_optimizer, x, y, amp=False)
        train_step(ddp, ddp_optimizer, x, y, amp=False)
    diff = max_diff(hand.parameters(), ddp.parameters())
    return dict(steps=len(batches), max_abs_param_diff=diff)


def report_torch_same_result(same, checks, predictions):
    diff = same["max_abs_param_diff"]
    print(f"measured: max |parameter difference| after {same['steps']} AdamW steps, DDP "
          f"against hand-rolled: {diff:.2e}")
    held(predictions, "same_result", diff <= 1e-5, f"{diff:.2e}, predicted at most 1e-5")
    check(checks, "ddp_equals_handrolled", diff < PARAM_TOL)


def torch_step_time(model, x, y, amp, reps, device, trace):
    """Predicted: DDP is faster than hand-rolled (hand-rolled / DDP above 1, beyond the
    spread). Both move the same bytes, 4 a parameter (498 MB for GPT-2, 29 MB for the
    CPU's model), but hand-rolled makes one all-reduce per gradient tensor (148 for
    GPT-2, 52 for the CPU's) once backward has returned, none of it overlapping, while DDP
    makes one per bucket (predicted_buckets: 13 and 2) and sums every bucket but the last
    while backward still computes: over 10% of its all-reduce time overlaps backward.
    With peer-to-peer (NVLink: ~370 GB/s of all-reduce on H100s and H200s), GPT-2's
    all-reduce takes ~1-2 ms of a ~35 ms step: DDP gains a few percent. Staged through
    host memory (PCIe without P2P: ~27 GB/s) it takes ~18 ms, and DDP hides much of it:
    ~1.2x. On a CPU the ranks' cores do both backward and gloo's sums, so overlap buys
    little; the fewer calls save their fixed cost: 1.0-1.3x."""
    hand = copy.deepcopy(model)
    ddp = DDP(copy.deepcopy(model))
    steps = {"hand-rolled": partial(handrolled_step, hand, adamw(hand), x, y, amp),
             "DDP": partial(train_step, ddp, adamw(ddp), x, y, amp)}
    timing = timed(steps, reps, device)
    cuda = device.type == "cuda"
    profiles = {"hand-rolled": profiled(steps["hand-rolled"], cuda),
                "DDP": profiled(steps["DDP"], cuda, trace)}
    return dict(timing=timing, compared=compared(timing, "hand-rolled", "DDP"),
                profiles=profiles)


def report_torch_step_time(step_time, tensors, buckets, trace, predictions):
    print_time(step_time["timing"], "hand-rolled", "hand-rolled step")
    print_time(step_time["timing"], "DDP", "DDP step")
    c = step_time["compared"]
    print_comparison(c, "hand-rolled", "DDP")
    for name, row in step_time["profiles"].items():
        print(f"measured: {name}: all-reduces a step {row['calls_per_step']:.0f} (counted), "
              f"{row['comm_ms_per_step']:.1f} ms of them, {row['overlap']:.0%} while "
              f"backward computed (profiler)")
    if trace is not None:
        print(f"trace of DDP's steps (ui.perfetto.dev): {trace}")
    held(predictions, "ddp_faster", faster(c), f"hand-rolled / DDP {c['ratio']:.2f}x{mark(c)}")
    hand = step_time["profiles"]["hand-rolled"]
    ddp = step_time["profiles"]["DDP"]
    ok = hand["calls_per_step"] == tensors and ddp["calls_per_step"] == buckets
    if hand["overlap"] >= 0.01 or not overlap_as_predicted(ddp["overlap"], buckets):
        ok = False
    held(predictions, "ddp_buckets_overlap", ok,
         f"all-reduces {hand['calls_per_step']:.0f} and {ddp['calls_per_step']:.0f} "
         f"(predicted {tensors} and {buckets}), overlap {hand['overlap']:.0%} and "
         f"{ddp['overlap']:.0%}{busy_mark(c['busy'])}")


def overlap_as_predicted(overlap, buckets):
    """With 2 buckets or more, over 10% of the all-reduce time overlaps backward; a single
    bucket waits for the last gradient, so it overlaps almost nothing."""
    if buckets == 1:
        return overlap < 0.1
    return overlap > 0.1


def profiled(step, cuda, trace=None):
    """The step under torch.profiler, after one unrecorded step (the ranks' profilers
    start apart, and a collective would count the wait): its all-reduces (overlap_of)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=PROFILED_STEPS, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as profiler:
        for _ in range(1 + PROFILED_STEPS):
            step()
            if cuda:
                torch.cuda.synchronize()
            profiler.step()
    if trace is not None:  # Chrome/Perfetto JSON
        profiler.export_chrome_trace(str(trace))
    if cuda:
        comm, backward = gpu_spans(profiler.events())
    else:
        comm, backward = cpu_spans(profiler.events())
    return overlap_of(comm, backward, PROFILED_STEPS)


def span_ns(event):
    return (round(event.time_range.start * 1e3), round(event.time_range.end * 1e3))


def cpu_spans(events):
    """On a CPU: gloo's all-reduces, from the call to the end of the sum (in flight on
    gloo's threads), and backward's work (autograd's engine evaluating each function)."""
    comm = []
    backward = []
    for event in events:
        if event.name == "gloo:all_reduce":
            comm.append(span_ns(event))
        elif event.name.startswith("autograd::engine::evaluate_function"):
            backward.append(span_ns(event))
    return comm, backward


def gpu_spans(events):
    """On a GPU: NCCL's kernels, and backward's: the other kernels that ran between the
    end of a step's forward range and the start of its optimizer range, as the GPU ran
    them (DDP's bucket copies, and hand-rolled's divisions, among them)."""
    comm = []
    kernels = []
    forward_ends = []
    optimizer_starts = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if event.is_user_annotation and event.name == "forward":  # record_function's range
            forward_ends.append(span_ns(event)[1])
        elif event.is_user_annotation and event.name == "optimizer":
            optimizer_starts.append(span_ns(event)[0])
        elif "nccl" in event.name.lower():
            comm.append(span_ns(event))
        elif not event.is_user_annotation:
            kernels.append(span_ns(event))
    backward = []
    for first, last in zip(sorted(forward_ends), sorted(optimizer_starts)):
        for start, end in kernels:
            if first <= start and end <= last:
                backward.append((start, end))
    return comm, backward


def covered(spans):
    """The time that (start, end) spans cover, overlaps counted once."""
    total = 0
    reached = float("-inf")
    for start, end in sorted(spans):
        total += max(0, end - max(start, reached))
        reached = max(reached, end)
    return total


def overlap_of(comm, backward, steps):
    """All-reduce calls and milliseconds per step, and the share of that time during
    which backward computed: |comm and backward| / |comm|."""
    comm_ns = covered(comm)
    both = comm_ns + covered(backward) - covered(comm + backward)  # |A| + |B| - |A or B|
    return dict(calls_per_step=len(comm) / steps, comm_ms_per_step=comm_ns / 1e6 / steps,
                overlap=both / max(comm_ns, 1))


def predicted_buckets(model, bucket_cap_mb):
    """How many all-reduces DDP makes a step: its buckets, filled with the gradients in
    the order backward makes them (the parameters reversed), each closed once it holds
    bucket_cap_mb MiB; DDP's default (None): 25 MiB, but 1 MiB for the first bucket, so
    that communication starts early."""
    limits = [1 * 2**20, 25 * 2**20]
    if bucket_cap_mb is not None:
        limits = [bucket_cap_mb * 2**20]
    buckets = 0
    filled = 0
    for p in reversed(list(model.parameters())):
        filled += p.numel() * p.element_size()
        if filled >= limits[min(buckets, len(limits) - 1)]:
            buckets += 1
            filled = 0
    if filled > 0:
        buckets += 1
    return buckets


def torch_bucket_sweep(model, x, y, amp, caps, reps, device):
    """Predicted: bucket_cap_mb sets the all-reduces a step, as predicted_buckets counts
    them (GPT-2: 50, 37, 13, 4 and 1 for 1, 5, 25, 100 and 1000 MiB), and a cap that holds
    every gradient in one bucket overlaps almost nothing. The time trades a fixed cost
    per call against that overlap: on GPUs, caps of 1 to 100 MiB land within a ms or two
    of the default, while one bucket (1000 MiB) waits for the whole backward and is
    slower by about its all-reduce (NVLink: ~2 ms; staged: ~10 ms). On a CPU, where
    overlap buys little, the caps land within noise of each other. Each cap is timed
    interleaved with DDP's default."""
    ddp = DDP(copy.deepcopy(model))
    default = partial(train_step, ddp, adamw(ddp), x, y, amp)
    rows = []
    for cap in caps:
        swept = DDP(copy.deepcopy(model), bucket_cap_mb=cap)
        step = partial(train_step, swept, adamw(swept), x, y, amp)
        timing = timed({"default": default, "swept": step}, reps, device)
        row = profiled(step, device.type == "cuda")
        row.update(bucket_cap_mb=cap, predicted_calls=predicted_buckets(model, cap),
                   timing=timing, against_default=compared(timing, "default", "swept"))
        rows.append(row)
        del swept, step  # one swept replica alive at a time
    return rows


def report_torch_bucket_sweep(rows, predictions):
    print("bucket_cap_mb | all-reduces predicted | counted | overlap | step ms, median "
          "[min, max] | default / this cap")
    ok = True
    for row in rows:
        ms = row["timing"]["ms"]["swept"]
        c = row["against_default"]
        spread = f"{statistics.median(ms):.1f} [{min(ms):.1f}, {max(ms):.1f}]"
        print(f"{row['bucket_cap_mb']:>13g} | {row['predicted_calls']:>21d} | "
              f"{row['calls_per_step']:>7.0f} | {row['overlap']:>7.0%} | {spread:>26} | "
              f"{c['ratio']:.2f}x ({c['low']:.2f} to {c['high']:.2f}){mark(c)}")
        if row["calls_per_step"] != row["predicted_calls"]:
            ok = False
        if not overlap_as_predicted(row["overlap"], row["predicted_calls"]):
            ok = False
    print("(counted and overlap: the profiler's, with backward; default / this cap: "
          "derived, the median of the interleaved pairs (their range), above 1 when the "
          "cap is faster than DDP's default of [2])")
    held(predictions, "buckets_as_predicted", ok,
         "every bucket_cap_mb made the all-reduces predicted_buckets counts, one bucket "
         "overlapping almost nothing")


def accumulate_no_sync(ddp, micro, amp):
    # the right way: forward AND backward inside no_sync for all but the last
    # micro-batch, whose backward all-reduces the sum of all k gradients, once
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


def torch_no_sync(model, micro, amp, reps, device):
    """Predicted: with k = 4 micro-batches the right way all-reduces once, one backward's
    buckets (13 for GPT-2, 2 for the CPU's model); the trap all-reduces every backward, k
    times as many. The gradients are the same (fp32: rounding, ~1e-7 of the largest; a
    micro-batch lost or counted twice moves them by a quarter), and the right way is
    faster, by 3 all-reduces of every gradient: ~5 ms with NVLink, tens of ms staged or
    on a CPU."""
    ddp = DDP(copy.deepcopy(model))
    accumulate_no_sync(ddp, micro, amp=False)
    right = [p.grad.clone() for p in ddp.parameters()]
    accumulate_trap(ddp, micro, amp=False)
    trap = [p.grad.clone() for p in ddp.parameters()]
    largest = max(g.abs().max().item() for g in right)
    loops = {"trap": partial(accumulate_trap, ddp, micro, amp),
             "no_sync": partial(accumulate_no_sync, ddp, micro, amp)}
    timing = timed(loops, reps, device)
    calls = {}
    for name, loop in loops.items():
        calls[name] = profiled(loop, device.type == "cuda")["calls_per_step"]
    return dict(k=len(micro), max_abs_grad_diff=max_diff(right, trap), max_abs_grad=largest,
                calls=calls, timing=timing, compared=compared(timing, "trap", "no_sync"))


def report_torch_no_sync(no_sync, buckets, checks, predictions):
    k = no_sync["k"]
    calls = no_sync["calls"]
    print(f"measured: all-reduces for {k} micro-batches: no_sync {calls['no_sync']:.0f}, "
          f"the trap {calls['trap']:.0f} (counted)")
    print(f"measured: gradients, no_sync against the trap: max |difference| "
          f"{no_sync['max_abs_grad_diff']:.2e} of max |gradient| {no_sync['max_abs_grad']:.2e}")
    print_time(no_sync["timing"], "trap", f"the trap, {k} micro-batches")
    print_time(no_sync["timing"], "no_sync", f"no_sync, {k} micro-batches")
    c = no_sync["compared"]
    print_comparison(c, "trap", "no_sync")
    ok = calls["no_sync"] == buckets and calls["trap"] == k * buckets
    if not faster(c):
        ok = False
    held(predictions, "no_sync_once", ok,
         f"all-reduces {calls['no_sync']:.0f} and {calls['trap']:.0f} (predicted "
         f"{buckets} and {k * buckets}); trap / no_sync {c['ratio']:.2f}x{mark(c)}")
    tolerance = 1e-5 * no_sync["max_abs_grad"]
    check(checks, "no_sync_grads_equal", no_sync["max_abs_grad_diff"] <= tolerance)


def state_bytes_of(model, optimizer):
    """Parameters, gradients and AdamW state held on this rank (of FSDP2's DTensors: the
    local shard)."""
    tensors = list(model.parameters())
    for p in model.parameters():
        tensors.append(p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                tensors.append(value)
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):  # a DTensor: FSDP2's shard of a parameter
            t = t.to_local()
        total += t.nbytes
    return total


def torch_sharded_state(check_model, batches, device):
    """Predicted: DDP keeps every parameter, its gradient and AdamW's two moments on every
    rank, 16 bytes a parameter; FSDP2 keeps 1/N of each (a shard of every parameter's
    first dimension), all-gathering a block's parameters just before it runs and
    reduce-scattering its gradients. The same steps end where DDP's end (fp32 rounding)."""
    ddp = DDP(copy.deepcopy(check_model))
    ddp_optimizer = adamw(ddp)
    sharded = copy.deepcopy(check_model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in sharded.transformer.h:  # one all-gather per block, just in time
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)  # the rest: the tied embedding and head, ln_f
    sharded_optimizer = adamw(sharded)
    for x, y in batches:
        train_step(ddp, ddp_optimizer, x, y, amp=False)
        train_step(sharded, sharded_optimizer, x, y, amp=False)
    gathered = [p.full_tensor() for p in sharded.parameters()]
    shard_bytes = state_bytes_of(sharded, sharded_optimizer)
    return dict(max_abs_param_diff=max_diff(ddp.parameters(), gathered),
                replicated_bytes=state_bytes_of(ddp.module, ddp_optimizer),
                sharded_bytes=across_ranks([shard_bytes], dist.ReduceOp.MAX, device)[0])


def report_torch_sharded_state(sharded, params, world, checks, predictions):
    predicted = 16 * params / world
    print(f"measured: max |parameter difference| after {STEPS_CHECKED} AdamW steps, "
          f"FSDP2 against DDP: {sharded['max_abs_param_diff']:.2e}")
    print(f"measured: parameters + gradients + AdamW state per rank: DDP "
          f"{sharded['replicated_bytes'] / 2**20:.2f} MiB, FSDP2 "
          f"{sharded['sharded_bytes'] / 2**20:.2f} MiB (the largest shard)")
    ratio = sharded["sharded_bytes"] / sharded["replicated_bytes"]
    print(f"derived: FSDP2 / DDP {ratio:.3f}; 1/N = {1 / world:.3f}")
    close = abs(sharded["sharded_bytes"] / predicted - 1) < 0.05
    held(predictions, "fsdp_one_over_n", close,
         f"{sharded['sharded_bytes'] / 2**20:.2f} MiB, predicted 16 bytes x {params} "
         f"parameters / {world} = {predicted / 2**20:.2f} MiB")
    check(checks, "fsdp_equals_ddp", sharded["max_abs_param_diff"] < PARAM_TOL)


def micro_batches_of(sizes, rows, rank, world, device):
    """MICRO_STEPS micro-batches of (inputs, targets): this rank's rows of each global
    batch, the same random tokens on every rank."""
    shape = (MICRO_STEPS, rows * world, sizes.seq_len + 1)
    seed = torch.Generator().manual_seed(1)
    tokens = torch.randint(sizes.vocab_size, shape, generator=seed)
    micro = []
    for batch in tokens[:, rank::world].to(device):
        micro.append((batch[:, :-1], batch[:, 1:]))
    return micro


def torch_half(args, device):
    """The PyTorch half, in the section's order: each experiment, then its report."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    sizes = pick_sizes(args.quick, device.type == "cuda")
    result = torch_machine(args, sizes, device, world)
    amp = result["device"]["bf16"]  # the timed steps in bf16 on a GPU that has it
    torch.manual_seed(0)  # the same weights on every rank (DDP broadcasts rank 0's too)
    model = GPT(sizes.config()).to(device)
    check_model = GPT(sizes.config(attn="manual")).to(device)
    micro = micro_batches_of(sizes, result["model"]["rows"], rank, world, device)
    x, y = micro[0]
    trace = None
    if rank == 0:
        trace = args.out / f"06_ddp_prod_torch{staged_suffix(args)}_trace.json"
    tensors = len(list(model.parameters()))
    buckets = predicted_buckets(model, None)
    checks = {}
    predictions = {}

    print("\n[1] DDP against hand-rolled: the same result\npredicted: max |parameter "
          "difference| at most 1e-5 (fp32 rounding), 0 with 2 ranks")
    same = torch_same_result(check_model, micro[:STEPS_CHECKED])
    report_torch_same_result(same, checks, predictions)

    print(f"\n[2] DDP against hand-rolled: step time, and why\npredicted: DDP faster, "
          f"{speedup_expected(device, result['interconnect']['staged'])}")
    print(f"predicted: all-reduces a step {tensors} -> {buckets}; overlap with backward "
          f"0% -> over 10% (with 2 buckets or more)")
    step_time = torch_step_time(model, x, y, amp, sizes.reps, device, trace)
    report_torch_step_time(step_time, tensors, buckets, trace, predictions)

    print("\n[3] bucket_cap_mb swept\npredicted: the all-reduces predicted_buckets counts; "
          "one bucket for all gradients overlaps almost nothing")
    sweep = torch_bucket_sweep(model, x, y, amp, sizes.caps, sizes.reps, device)
    report_torch_bucket_sweep(sweep, predictions)

    print(f"\n[4] no_sync under gradient accumulation, {MICRO_STEPS} micro-batches\n"
          f"predicted: all-reduces {buckets}, not {MICRO_STEPS * buckets}; the same "
          f"gradients; faster")
    no_sync = torch_no_sync(model, micro, amp, sizes.reps, device)
    report_torch_no_sync(no_sync, buckets, checks, predictions)

    params = param_count(check_model.config)
    print(f"\n[5] The bridge: FSDP2 shards the state\npredicted: 1/{world} of "
          f"{16 * params / 2**20:.2f} MiB per rank; the same parameters as DDP")
    sharded = torch_sharded_state(check_model, micro[:STEPS_CHECKED], device)
    report_torch_sharded_state(sharded, params, world, checks, predictions)

    timings = dict(step_time=step_time["timing"], no_sync=no_sync["timing"])
    for row in sweep:
        timings[f"bucket_cap_mb {row['bucket_cap_mb']:g}"] = row["timing"]
    result.update(same_result=same, step_time=step_time, bucket_sweep=sweep,
                  no_sync=no_sync, sharded_state=sharded, checks=checks,
                  predictions=predictions,
                  predicted_calls={"hand-rolled": tensors, "DDP": buckets})
    return with_busy(result, timings)


def speedup_expected(device, staged):
    if device.type == "cpu":
        return "on a CPU 1.0-1.3x, by fewer calls"
    if staged:
        return "staged through host memory ~1.2x"
    return "with peer-to-peer by a few percent"




# ---------------------------------------------------------------------------------------
# JAX: one process sees every device; jit inserts the collectives the shardings imply.

@dataclasses.dataclass
class Program:
    """One placement of the training step: compiled for its shardings, with its placed
    state, its placed batches and the losses of its first two steps."""
    compiled: object  # jax.stages.Compiled
    state: object     # the (model, optimizer) state, placed
    batches: list     # [(inputs, targets)], placed
    losses: list

    def step(self):
        return jax.block_until_ready(self.compiled(self.state, *self.batches[0]))


def compile_placement(step, state, shardings, rows, data):
    """The step compiled for one placement (`shardings`: every state array's; `rows`: the
    batch's), run for two steps from the same start."""
    placed = jax.device_put(state, shardings)
    batches = []
    for tokens in data:
        x = jax.device_put(tokens[:, :-1], rows)
        y = jax.device_put(tokens[:, 1:], rows)
        batches.append((x, y))
    compiled = step.lower(placed, *batches[0]).compile()
    first_loss, after = compiled(placed, *batches[0])
    second_loss, _ = compiled(jax.device_put(after, shardings), *batches[1])
    return Program(compiled, placed, batches, [float(first_loss), float(second_loss)])


def collectives_in(program):
    """The collectives in the compiled program's text, counted, and its first all-reduce."""
    text = program.compiled.as_text()
    counts = {}
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        counts[kind] = len(re.findall(rf"\s{kind}(?:-start)?\(", text))
    lines = re.findall(r"\S.*\sall-reduce(?:-start)?\(.*", text)
    example = ""
    if lines:
        example = lines[0][:150]
    return counts, example


def named_counts(counts):
    found = []
    for kind, count in counts.items():
        if count > 0:
            found.append(f"{kind} x{count}")
    if not found:
        return "none"
    return ", ".join(found)


def relative_diff(losses, reference):
    diffs = []
    for a, b in zip(losses, reference):
        diffs.append(abs(a - b) / abs(b))
    return max(diffs)


def jax_same_result(one_device, data_parallel):
    """Predicted: one device's program has no collectives. Split the batch's rows over
    the 'data' axis, keep the parameters whole on every device, and jit works out that a
    parameter's gradient is now a sum over the devices: it inserts all-reduces (XLA's
    combiner merges them into a few, its buckets). The two steps' losses equal one
    device's to fp32 rounding (~1e-6 relative; a sum missed or doubled: ~1e-2)."""
    one_counts, _ = collectives_in(one_device)
    counts, example = collectives_in(data_parallel)
    return dict(one_device_collectives=one_counts, collectives=counts,
                allreduce_example=example, one_device_losses=one_device.losses,
                losses=data_parallel.losses,
                max_rel_loss_diff=relative_diff(data_parallel.losses, one_device.losses))


def report_jax_same_result(same, checks, predictions):
    print(f"measured: collectives in the compiled programs (counted in their text): one "
          f"device {named_counts(same['one_device_collectives'])}; data parallel "
          f"{named_counts(same['collectives'])}")
    print(f"  the first: {same['allreduce_example']} ...")
    one = same["one_device_losses"]
    print(f"measured: losses of 2 AdamW steps: one device {one[0]:.6f}, {one[1]:.6f}; "
          f"data parallel {same['losses'][0]:.6f}, {same['losses'][1]:.6f}")
    diff = same["max_rel_loss_diff"]
    print(f"derived: max relative difference {diff:.1e}")
    inserted = same["collectives"]["all-reduce"]
    alone = same["one_device_collectives"]["all-reduce"]
    held(predictions, "jit_inserts_allreduce", inserted > 0 and alone == 0 and diff < 1e-5,
         f"all-reduces inserted {inserted}, on one device {alone}; losses {diff:.1e} apart")
    check(checks, "data_parallel_loss_equals_one_device", diff < LOSS_TOL)
    check(checks, "allreduce_in_compiled_text", "all-reduce" in same["allreduce_example"])


def jax_step_time(one_device, data_parallel, reps):
    """Predicted: one device runs the rows of N; the mesh gives each device 1/N of them.
    On N GPUs with peer-to-peer, faster, by less than N x: every device still runs the
    whole AdamW update, smaller matmuls run less efficiently, and the all-reduce of the
    gradients (~1-2 ms for GPT-2 over NVLink) comes on top. Staged through host memory,
    that all-reduce (~18 ms for GPT-2) eats the gain: ~1.0x. On a CPU the simulated
    devices share the same cores: no faster."""
    steps = {"one device": one_device.step, "data parallel": data_parallel.step}
    timing = timed(steps, reps)
    return dict(timing=timing, compared=compared(timing, "one device", "data parallel"))


def report_jax_step_time(step_time, expect_faster, predictions):
    print_time(step_time["timing"], "one device", "one device, all the rows")
    print_time(step_time["timing"], "data parallel", "data parallel, 1/N of them each")
    c = step_time["compared"]
    print_comparison(c, "one device", "data parallel")
    expected = "no faster"
    if expect_faster:
        expected = "faster"
    ok = faster(c) == expect_faster
    if c["busy"]:
        ok = False  # a busy machine decides nothing
    held(predictions, "data_parallel_step_time", ok,
         f"predicted {expected}: one device / data parallel {c['ratio']:.2f}x{mark(c)}")


def split_largest_divisible(array, mesh):
    """The bridge's placement of one array: split over 'data' along its largest
    dimension that N divides; an array with none stays whole on every device."""
    by_size = sorted(range(array.ndim), key=lambda dim: -array.shape[dim])
    for dim in by_size:
        if array.shape[dim] % mesh.size == 0:
            axes = [None for _ in range(array.ndim)]  # every dimension whole,
            axes[dim] = "data"  # but this one, split over the devices
            return NamedSharding(mesh, PartitionSpec(*axes))
    return NamedSharding(mesh, PartitionSpec())


def bytes_on(program, device):
    """The bytes of the state's shards that live on `device`."""
    total = 0
    for array in jax.tree.leaves(program.state):
        for shard in array.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def jax_sharded_state(data_parallel, sharded, one_device, devices):
    """Predicted: replicated, every device holds the parameters and both AdamW moments,
    12 bytes a parameter. Split over 'data', each array that N divides holds 1/N of its
    bytes per device and the rest stays whole: the bytes per device follow from the
    shapes. jit now all-gathers the parameters before use and reduce-scatters the
    gradients (a CPU may lower them to all-reduces); the losses are one device's."""
    split = 0
    whole = 0
    for array in jax.tree.leaves(sharded.state):
        if array.sharding.is_fully_replicated:
            whole += array.nbytes
        else:
            split += array.nbytes
    counts, _ = collectives_in(sharded)
    return dict(replicated_bytes=bytes_on(data_parallel, devices[0]),
                sharded_bytes=bytes_on(sharded, devices[0]),
                predicted_bytes=whole + split // len(devices),
                split_share=split / (split + whole), collectives=counts,
                losses=sharded.losses,
                max_rel_loss_diff=relative_diff(sharded.losses, one_device.losses))


def report_jax_sharded_state(sharded, n, checks, predictions):
    print(f"measured: collectives in the compiled program: "
          f"{named_counts(sharded['collectives'])} (counted)")
    print(f"measured: parameters + AdamW state per device: replicated "
          f"{sharded['replicated_bytes'] / 2**20:.2f} MiB, split "
          f"{sharded['sharded_bytes'] / 2**20:.2f} MiB")
    ratio = sharded["sharded_bytes"] / sharded["replicated_bytes"]
    print(f"derived: split / replicated {ratio:.3f}; 1/N = {1 / n:.3f}; "
          f"{sharded['split_share']:.1%} of the bytes have a dimension that {n} divides")
    diff = sharded["max_rel_loss_diff"]
    print(f"measured: losses {sharded['losses'][0]:.6f}, {sharded['losses'][1]:.6f}; "
          f"derived: max relative difference from one device {diff:.1e}")
    as_predicted = sharded["sharded_bytes"] == sharded["predicted_bytes"]
    held(predictions, "split_bytes_as_predicted", as_predicted,
         f"{sharded['sharded_bytes'] / 2**20:.2f} MiB per device, predicted "
         f"{sharded['predicted_bytes'] / 2**20:.2f} from the shapes")
    check(checks, "split_loss_equals_one_device", diff < LOSS_TOL)
    check(checks, "split_bytes_match_shardings", as_predicted)


def jax_half(args, devices):
    """The JAX half, in the section's order: each experiment, then its report."""
    n = len(devices)
    gpu = devices[0].platform == "gpu"
    sizes = pick_sizes(args.quick, gpu)
    result = jax_machine(args, sizes, devices)
    rows = result["model"]["rows"]
    model = JaxGPT(sizes.config(), rngs=nnx.Rngs(0))  # fp32 on both sides of every check
    optimizer = nnx.Optimizer(model, jax_adamw(LR), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = jax.device_get(state)  # on the host: each placement puts it on its devices
    step = make_train_step(graphdef)
    generator = np.random.default_rng(1)
    data = []
    for _ in range(2):
        shape = (n * rows, sizes.seq_len + 1)
        data.append(generator.integers(0, sizes.vocab_size, shape, dtype=np.int32))
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
    one = SingleDeviceSharding(devices[0])
    whole = NamedSharding(mesh, PartitionSpec())  # the same array on every device
    by_rows = NamedSharding(mesh, PartitionSpec("data"))  # rows split over the devices
    checks = {}
    predictions = {}

    print("\n[1] jit on a Mesh: the collectives it inserts, the same result\npredicted: "
          "all-reduces in the data-parallel program, none on one device; losses 1e-5 apart "
          "at most")
    one_device = compile_placement(step, state, jax.tree.map(lambda a: one, state), one, data)
    data_parallel = compile_placement(step, state, jax.tree.map(lambda a: whole, state),
                                      by_rows, data)
    same = jax_same_result(one_device, data_parallel)
    report_jax_same_result(same, checks, predictions)
    transport = nccl_transport(args, gpu)  # once a collective has run
    result["interconnect"].update(transport=transport, staged=staged(args, transport))

    expect_faster = False
    expected = "no faster (~1.0x)"
    if gpu and not result["interconnect"]["staged"]:
        expect_faster = True
        expected = f"faster, by less than {n}x"
    print(f"\n[2] Data parallel against one device: step time\npredicted: {expected}")
    step_time = jax_step_time(one_device, data_parallel, sizes.reps)
    report_jax_step_time(step_time, expect_faster, predictions)

    print(f"\n[3] The bridge: the parameters and AdamW state split over 'data'\npredicted: "
          f"1/{n} of every array that {n} divides, per device; the same losses")
    split = jax.tree.map(partial(split_largest_divisible, mesh=mesh), state)
    sharded_program = compile_placement(step, state, split, by_rows, data)
    sharded = jax_sharded_state(data_parallel, sharded_program, one_device, devices)
    report_jax_sharded_state(sharded, n, checks, predictions)

    result.update(same_result=same, step_time=step_time, sharded_state=sharded,
                  checks=checks, predictions=predictions)
    return with_busy(result, dict(step_time=step_time["timing"]))


# ---------------------------------------------------------------------------------------
# The tools every experiment above uses, the same in both halves: timing on a machine that
# may be busy (interleaved, with its spread and the machine's load), and printing.

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


def synchronize(device):
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns, reps, device=None):
    """Seconds of each call of each function, the functions called in turn (A, B, A, B,
    ...), so a machine slowed for a while slows every side alike. A GPU is synchronised
    around each call; a JAX function blocks until its result is ready."""
    seconds = [[] for _ in fns]
    for _ in range(reps):
        for samples, fn in zip(seconds, fns):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            samples.append(time.perf_counter() - start)
    return seconds


def timed(fns, reps, device=None):
    """Milliseconds of each named function, interleaved after two warm-up calls each
    (DDP settles its buckets in its first steps), and the share of a core this process
    got before and after. Under torchrun, the slowest rank's time (a data-parallel step
    waits for it) and the lowest rank's share. Garbage is collected first: no collector
    pause lands in a timed call, and the DDP replicas of earlier experiments (reference
    cycles) give back their GPU memory."""
    gc.collect()
    shares = [share_now()]
    for fn in fns.values():
        fn()
        fn()
    seconds = interleaved(list(fns.values()), reps, device)
    shares.append(share_now())
    if dist.is_initialized():
        seconds = across_ranks(seconds, dist.ReduceOp.MAX, device)
        shares = across_ranks(shares, dist.ReduceOp.MIN, device)
    ms = {}
    for name, samples in zip(fns, seconds):
        ms[name] = [s * 1e3 for s in samples]
    return dict(ms=ms, shares=shares, busy=min(shares) < BUSY_SHARE)


def share_now():
    """cpu_share(); under torchrun on rank 0 alone, once every rank has reached a barrier
    and while the others wait in a second one (asleep there): the lesson's own ranks are
    not other programs. The other ranks say 1.0 (the minimum over ranks is rank 0's)."""
    if not dist.is_initialized():
        return cpu_share()
    dist.barrier()  # no rank still at its last work
    share = 1.0
    if dist.get_rank() == 0:
        share = cpu_share()
    dist.barrier()
    return share


def across_ranks(values, op, device):
    """The values reduced over all ranks (the largest with MAX, the smallest with MIN)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def compared(timing, slow, fast):
    """`fast` against `slow`: the median of the per-pair ratios slow_i / fast_i, with their
    range, and the difference of the medians. A finding only when the whole range lies on
    one side of 1 and the machine was not busy."""
    a = timing["ms"][slow]
    b = timing["ms"][fast]
    ratios = []
    for x, y in zip(a, b):
        ratios.append(x / y)
    finding = min(ratios) > 1 or max(ratios) < 1
    if timing["busy"]:
        finding = False
    return dict(ratio=statistics.median(ratios), low=min(ratios), high=max(ratios),
                finding=finding, saves_ms=statistics.median(a) - statistics.median(b),
                busy=timing["busy"])


def busy_mark(busy):
    if busy:
        return " (machine busy)"
    return ""


def mark(c):
    """What a comparison's number is, when it is not a finding."""
    if c["busy"]:
        return " (machine busy)"
    if not c["finding"]:
        return " (within noise)"
    return ""


def faster(c):
    """A finding that `fast` is faster than `slow`."""
    return c["finding"] and c["ratio"] > 1


def print_time(timing, name, label):
    ms = timing["ms"][name]
    busy = ""
    if timing["busy"]:
        busy = " (machine busy)"
    print(f"measured: {label}: {statistics.median(ms):.1f} ms (median of {len(ms)}, "
          f"[{min(ms):.1f}, {max(ms):.1f}]){busy}")


def print_comparison(c, slow, fast):
    effect = f"{fast} saves {c['saves_ms']:.1f} ms"
    if c["saves_ms"] < 0:
        effect = f"{fast} costs {-c['saves_ms']:.1f} ms"
    print(f"derived: {slow} / {fast}: {c['ratio']:.2f}x (pairs {c['low']:.2f} to "
          f"{c['high']:.2f}): {effect} a step{mark(c)}")


def check(checks, name, ok):
    checks[name] = ok
    if ok:
        print(f"check {name}: ok")
    else:
        print(f"check {name}: FAILED")


def held(predictions, name, ok, text):
    predictions[name] = ok
    if ok:
        print(f"prediction held: {text}")
    else:
        print(f"prediction missed: {text}")


# ---------------------------------------------------------------------------------------
# The machine: its devices, the sizes that fit them, the interconnect; flags and files.

def pick_sizes(quick, gpu):
    if quick:
        return QUICK
    if gpu:
        return GPU
    return CPU


def rows_that_fit(config, rows, memory_bytes, held_bytes, devices=1):
    """Sequences per device: `rows`, halved until one device fits the step over all
    `devices`' rows (JAX's one-device reference runs them all) by model_torch's predicted
    peak x ALLOCATOR_HEADROOM, beside `held_bytes` of other models' state."""
    while rows > 1:
        peak = predicted_peak_bytes(config, rows * devices)
        if ALLOCATOR_HEADROOM * peak + held_bytes <= memory_bytes:
            break
        rows //= 2
    return rows


def has_bf16_tensor_cores(device):
    """bf16 tensor cores came with compute capability 8.0 (A100); a T4 or V100 has none."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def staged_suffix(args):
    if args.interconnect == "staged":
        return "_staged"
    return ""


def use_interconnect(args, log):
    """Before NCCL starts (torch's process group, or JAX's first GPU collective): NCCL's
    log into --out/`log`, unless the user set one, to name the transport it chose;
    'staged' turns peer-to-peer off, so GPU-to-GPU bytes go through host memory."""
    if args.interconnect == "staged":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_FILE", str(args.out / log))


def nccl_transport(args, gpu):
    """The transports NCCL's log names once a collective has run: P2P/... peer to peer,
    SHM/... through host memory, NET/... between machines."""
    if not gpu:
        return "none, gloo on the CPU (--interconnect changes nothing here)"
    try:
        text = Path(os.environ["NCCL_DEBUG_FILE"]).read_text()
    except OSError:
        return "not reported"
    transports = sorted(set(re.findall(r" via (\S+)", text)))
    if not transports:
        return "not reported"
    return ", ".join(transports)


def staged(args, transport):
    """GPU-to-GPU bytes through host memory: asked for, or NCCL found no peer-to-peer
    path (a PCIe box without P2P, like the book's)."""
    if args.interconnect == "staged":
        return True
    return "SHM" in transport or "NET" in transport


def torch_start(args):
    """One process per device, nanoGPT's way: torchrun's variables say which. NCCL when
    every rank on this machine has a GPU of its own (NCCL refuses two ranks on one GPU),
    else gloo on the CPU."""
    rank = int(os.environ["RANK"])
    ranks_here = int(os.environ["LOCAL_WORLD_SIZE"])
    if int(os.environ["WORLD_SIZE"]) < 2:
        sys.exit("error: 1 rank: data parallelism needs 2 or more: torchrun --standalone "
                 "--nproc_per_node=2 06_ddp_prod.py (one GPU or none: on the CPU)")
    gpus = 0
    if args.device != "cpu":
        gpus = torch.cuda.device_count()
    if args.device == "cuda" and gpus < ranks_here:
        if rank > 0:
            sys.exit(1)  # rank 0 says why
        sys.exit(f"error: --device cuda: {ranks_here} ranks here and {gpus} GPUs, and NCCL "
                 f"needs a GPU per rank: fewer ranks (--nproc_per_node), or --device cpu")
    if gpus < ranks_here:
        if gpus > 0 and rank == 0:
            print(f"{ranks_here} ranks here and {gpus} GPU: NCCL needs a GPU per rank, so "
                  f"the ranks run on the CPU, with gloo")
        dist.init_process_group("gloo", timeout=TIMEOUT)  # main() destroys it
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    use_interconnect(args, f"06_ddp_prod_torch{staged_suffix(args)}_nccl_rank{rank}.log")
    dist.init_process_group("nccl", timeout=TIMEOUT)  # main() destroys it
    dist.all_reduce(torch.ones(1, device=device))  # the first collective: NCCL connects
    return device


def torch_machine(args, sizes, device, world):
    """Say what this run found; the rows per rank that fit its memory."""
    cuda = device.type == "cuda"
    name = "CPU"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = f"torch {torch.__version__}, gloo"
    bf16 = False
    if cuda:
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
        versions = f"torch {torch.__version__}, NCCL {nccl}"
        bf16 = has_bf16_tensor_cores(device)
    check_config = sizes.config(attn="manual")  # the largest step: fp32, T x T scores
    params = param_count(check_config)
    held_bytes = 28 * params  # a second replica (16 B/param + DDP's 4) and 2 models' weights
    rows = rows_that_fit(check_config, sizes.rows, memory, held_bytes)
    need = ALLOCATOR_HEADROOM * predicted_peak_bytes(check_config, rows) + held_bytes
    transport = nccl_transport(args, cuda)
    print("the PyTorch half (the JAX half is one process: python 06_ddp_prod.py)")
    if cuda:
        print(f"device: {world} ranks, one {name} ({memory / 2**30:.0f} GiB) each | {versions}")
    else:
        print(f"device: CPU ({memory / 2**30:.0f} GiB), {world} ranks on its cores | {versions}")
    print(f"interconnect: {args.interconnect}; NCCL reports: {transport}")
    if cuda and not bf16:
        print("no bf16 tensor cores (compute capability < 8.0): the timed steps run fp32")
    print(f"model: {sizes.preset}, n_layer {sizes.n_layer}, vocab {sizes.vocab_size}; "
          f"{rows} x {sizes.seq_len} tokens per rank")
    if cuda:
        print(f"memory: {need / 2**30:.1f} of {memory / 2**30:.0f} GiB per GPU predicted "
              f"(model_torch's accounting, the fp32 check model and a second replica)")
    return dict(lesson="06_ddp_prod", framework="torch", quick=args.quick, world_size=world,
                device=dict(name=name, kind=device.type, memory_bytes=memory,
                            versions=versions, bf16=bf16),
                interconnect=dict(name=args.interconnect, transport=transport,
                                  staged=staged(args, transport)),
                model=dict(dataclasses.asdict(sizes), rows=rows, params=params))


def jax_start(args):
    """The one process's devices, chosen before JAX's first call. On a CPU XLA simulates
    CPU_DEVICES devices (jax_num_cpu_devices), unless the user's environment names a
    count (XLA_FLAGS or JAX_NUM_CPU_DEVICES); the user's XLA_FLAGS stay as they are."""
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
    named = DEVICE_COUNT_FLAG in os.environ.get("XLA_FLAGS", "")
    if not named and "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
    use_interconnect(args, f"06_ddp_prod_jax{staged_suffix(args)}_nccl.log")  # XLA's too
    devices = jax.devices()
    gpu = devices[0].platform == "gpu"
    if args.device == "cuda" and not gpu:
        sys.exit("error: --device cuda: JAX sees no GPU (install jax[cuda13]), or run "
                 "--device cpu")
    if len(devices) == 1 and gpu:
        sys.exit("error: JAX sees 1 GPU: data parallelism needs 2 devices or more; on this "
                 "machine, simulated CPU devices: python 06_ddp_prod.py --device cpu")
    if len(devices) == 1:
        sys.exit(f"error: JAX sees 1 CPU device: data parallelism needs 2 or more; set "
                 f"{DEVICE_COUNT_FLAG}=4 in XLA_FLAGS, or JAX_NUM_CPU_DEVICES=4")
    return devices


def jax_machine(args, sizes, devices):
    """Say what this run found; the rows per device that let one device run all of them
    (the reference the others are checked against)."""
    n = len(devices)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    stats = devices[0].memory_stats()
    if stats is not None:  # a GPU: the pool JAX may use (75% of the card by default)
        memory = stats["bytes_limit"]
    versions = f"jax {jax.__version__}, flax {flax.__version__}"
    xla_flags = os.environ.get("XLA_FLAGS", "(none)")
    config = sizes.config(attn="manual")  # XLA's fp32 attention writes the T x T scores
    params = param_count(config)
    held_bytes = 24 * params  # two other placements' parameters and moments on device 0
    rows = rows_that_fit(config, sizes.rows, memory, held_bytes, devices=n)
    need = ALLOCATOR_HEADROOM * predicted_peak_bytes(config, rows * n) + held_bytes
    print("the JAX half (the PyTorch half: torchrun --standalone --nproc_per_node=2 "
          "06_ddp_prod.py)")
    print(f"device: {n} x {devices[0].device_kind} ({memory / 2**30:.0f} GiB for JAX) | "
          f"{versions}")
    print(f"XLA_FLAGS: {xla_flags}; interconnect: {args.interconnect}")
    print(f"model: {sizes.preset}, n_layer {sizes.n_layer}, vocab {sizes.vocab_size}, fp32 "
          f"(a GPU: JAX's TF32 matmuls); {rows} x {sizes.seq_len} tokens per device")
    if devices[0].platform == "gpu":
        print(f"memory: all {n * rows} rows on one GPU, the reference: {need / 2**30:.1f} "
              f"of {memory / 2**30:.0f} GiB predicted (model_torch's accounting)")
    return dict(lesson="06_ddp_prod", framework="jax", quick=args.quick, n_devices=n,
                device=dict(name=devices[0].device_kind, kind=devices[0].platform,
                            memory_bytes=memory, versions=versions, xla_flags=xla_flags),
                interconnect=dict(name=args.interconnect),
                model=dict(dataclasses.asdict(sizes), rows=rows, params=params))


def with_busy(result, timings):
    """machine_busy and cpu_shares, from every timed experiment; one line if busy."""
    busy = []
    shares = []
    for name, timing in timings.items():
        shares += timing["shares"]
        if timing["busy"]:
            busy.append(name)
    result.update(machine_busy=len(busy) > 0, cpu_shares=shares)
    if busy:
        print(f"\nmachine busy: other programs took the CPU during {', '.join(busy)}; "
              f"the marked numbers are not findings")
    return result


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--out", type=Path, default=Path("out"), help="trace and NCCL logs")
    parser.add_argument("--interconnect", choices=["default", "staged"], default="default",
                        help="staged: GPU-to-GPU bytes through host memory (NCCL, no P2P)")
    if int(os.environ.get("RANK", "0")) > 0:  # rank 0 prints a bad flag's message; the others exit 2 quietly
        with contextlib.redirect_stderr(io.StringIO()):
            return parser.parse_args()
    return parser.parse_args()


def main():
    args = parse_args()
    under_torchrun = "RANK" in os.environ  # nanoGPT's way: torchrun's variables say so
    json_file = None
    if args.json is not None and int(os.environ.get("RANK", "0")) == 0:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        json_file = open(args.json, "w")  # a path that cannot be written fails here, first
    args.out.mkdir(parents=True, exist_ok=True)
    if under_torchrun:
        device = torch_start(args)
        if dist.get_rank() > 0:
            sys.stdout = open(os.devnull, "w")  # rank 0 speaks for every rank
        try:
            result = torch_half(args, device)
        finally:
            gc.collect()  # DDP's replicas (reference cycles) go while their group lives
            dist.destroy_process_group()
    else:
        result = jax_half(args, jax_start(args))
    if json_file is not None:
        json.dump(result, json_file, indent=1)
        json_file.close()
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed:
        sys.exit(f"check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
