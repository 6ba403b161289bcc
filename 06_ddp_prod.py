"""
Section 13.6: production data parallelism, two philosophies.

PyTorch runs a process per device:
1. DDP on the GPT ends where 05's hand-rolled version ends (checked).
2. Its step time against hand-rolled, and the bucket_cap_mb sweep.
3. How much of the all-reduce runs under backward, from the profiler.
4. no_sync under gradient accumulation: fewer all-reduces, the same gradients (checked).
5. The bridge: FSDP2 shards params, grads and AdamW state: 1/N of the bytes a rank.
JAX runs one process for every device: a Mesh with a 'data' axis, the all-reduce that
jit puts in the compiled program, the same loss as one device (checked), and [5] sharded
parameters.

Copy it with model_torch.py and model_jax.py. Expect a line per number as it is
measured, then "checks: ALL PASSED"; in --out, a profiler trace for ui.perfetto.dev.
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 06_ddp_prod.py  # CPU
    torchrun --standalone --nproc_per_node=2 06_ddp_prod.py  # 2 GPUs (1 GPU: 1 rank)
    torchrun --standalone --nproc_per_node=2 06_ddp_prod.py --interconnect staged
    python 06_ddp_prod.py  # JAX: every GPU, else 4 simulated CPU devices
    # past one machine, torch: the same on each node
    #   torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
    #            --rdzv-endpoint=HOST:29500 06_ddp_prod.py
    # past one machine, JAX: one process per machine, and as its first JAX call
    #   jax.distributed.initialize("HOST:1234", num_processes=2, process_id=i)
"""

import os
import signal
import sys


def interrupted(signum, frame):
    """Ctrl-C during the imports, and all through the JAX half: one line, exit 130. (A
    KeyboardInterrupt raised there can land in a callback, of Python's import machinery or of
    JAX's garbage collection, which prints it and goes on.)"""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted)  # before the imports below, which take seconds

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import re
import statistics
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model_torch import GPT, GPTConfig

LR = 6e-4
PARAM_TOL = LR / 6  # fp32, manual attention: rounding; a wrong all-reduce: ~LR a step
MICRO_STEPS = 4     # gradient accumulation: k micro-batches per optimizer step
PROFILED_STEPS = 2  # steps under torch.profiler per variant: a small trace
TIMEOUT_S = 60      # a rank left waiting this long in a collective gives up, never hangs
CPU_DEVICES = 4     # JAX on a CPU: simulated devices, unless XLA_FLAGS names a count
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
HOST_MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
NO_NCCL = "no NCCL here: the flag changes nothing"
BUSY = "unreliable (machine busy)"

@dataclasses.dataclass
class Sizes:
    preset: str = "tiny"     # model_torch's preset: 4 heads, d 128
    n_layer: int = 4         # transformer blocks
    vocab_size: int = 50304  # GPT-2's tokens, padded
    batch: int = 2           # rows per rank (JAX: per device)
    seq_len: int = 128       # tokens per row
    passes: int = 3          # timing turns (A B C, A B C, ...)
    reps: int = 1            # steps per turn; a turn counts their median
    caps: tuple = (0.25, 1, None, 25)  # bucket_cap_mb swept; None: DDP's default

    def config(self):
        return GPTConfig.preset(self.preset, n_layer=self.n_layer,
                                block_size=self.seq_len, vocab_size=self.vocab_size)

CPU = Sizes()
QUICK = dataclasses.replace(CPU, n_layer=1, vocab_size=4096, seq_len=64, passes=2,
                            caps=(0.25, None))  # a smoke run, not a measurement
GPU = dataclasses.replace(CPU, preset="gpt2", n_layer=12, batch=8, seq_len=1024,
                          passes=7, reps=5, caps=(1, 5, 25, None, 100, 1000))

def pick_sizes(quick, gpu):
    if gpu:
        return GPU
    if quick:
        return QUICK
    return CPU

def use_interconnect(name):
    """Before the process group starts. 'staged' turns NCCL's peer-to-peer off, so every
    GPU-to-GPU byte goes through host memory, as on a PCIe box without P2P. NCCL's own
    log (NCCL_DEBUG=INFO, into a file per process) then says which transport it chose."""
    if name == "staged":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    log = f"{tempfile.gettempdir()}/nccl-{os.getpid()}.log"
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_FILE", log)

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

def header(args, sizes, name, memory, versions, transport, per):
    config = sizes.config()
    print(f"device: {name}, {memory / 2**30:.0f} GiB | {versions}")
    print(f"interconnect: {args.interconnect}; NCCL reports: {transport}")
    print(f"model: {config.n_layer} layers, d {config.n_embd}, "
          f"vocab {config.vocab_size}, {sizes.batch} x {sizes.seq_len} tokens per {per}")
    return dict(lesson="06_ddp_prod", framework=args.framework, quick=args.quick,
                device=dict(name=name, versions=versions),
                interconnect=dict(name=args.interconnect, transport=transport),
                model=dict(vars(config), batch=sizes.batch, seq_len=sizes.seq_len))

# ---------------------------------------------------------------------------------------
# Timing, the same for both frameworks: variants in turns, compared by their medians.

def sync(device):
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)

def median_time(fn, device, reps):
    """One warm-up call, then the median of reps timed calls, in seconds. GPU work is
    asynchronous, so the device is synchronised before every clock read."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)

def exp_step_time(steps, passes, reps, device=None):
    """Time the steps in turns (A B C, A B C, ...), so that a busy moment hits them all.
    Under torchrun a turn counts the slowest rank: a data-parallel step waits for it."""
    samples = {name: [] for name in steps}
    for _ in range(passes):
        for name, step in steps.items():
            seconds = median_time(step, device, reps)
            ms = torch.tensor(seconds * 1e3, device=device)
            if dist.is_initialized():
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            samples[name].append(ms.item())
    result = {}
    for name, ms in samples.items():
        q1, median, q3 = statistics.quantiles(ms, n=4, method="inclusive")
        spread = max(ms) - min(ms)
        result[name] = dict(median_ms=median, q1_ms=q1, q3_ms=q3,
                            unreliable=spread > median)
    return result

def compared(row, base, base_name):
    """What row saves against base: the difference of their medians, resolved when
    their IQRs do not overlap, unreliable when either timing is."""
    saves = base["median_ms"] - row["median_ms"]
    apart = row["q3_ms"] < base["q1_ms"] or base["q3_ms"] < row["q1_ms"]
    unreliable = any([row["unreliable"], base["unreliable"]])
    return dict(against=base_name, saves_ms=saves, resolved=apart,
                saves_unreliable=unreliable)

def time_text(t):
    iqr = f"IQR {t['q1_ms']:.1f}-{t['q3_ms']:.1f}"
    text = f"{t['median_ms']:.1f} ms/step (median; {iqr}; measured)"
    if t["unreliable"]:  # the turns spread wider than their median
        text += f" {BUSY}"
    return text

def saves_text(t, base):
    verdict = "the IQRs overlap: within noise"
    if t["resolved"]:
        verdict = "the IQRs are apart: resolved"
    shown = round(base["median_ms"], 1) - round(t["median_ms"], 1)  # adds up as printed
    medians = f"{base['median_ms']:.1f} - {t['median_ms']:.1f}, the medians"
    text = f"saves {shown:+.1f} ms against {t['against']} ({medians}; derived); {verdict}"
    if t["saves_unreliable"]:
        text += f" {BUSY}"
    return text

# ---------------------------------------------------------------------------------------
# PyTorch: a process per device; DDP's hooks run the all-reduce during backward.

def torch_start(args):
    """NCCL on GPU LOCAL_RANK if every rank on this machine has a GPU, else gloo.
    Returns the device, the backend, the device's name and its memory in bytes."""
    ranks_here = int(os.environ["LOCAL_WORLD_SIZE"])
    if args.device != "cpu" and torch.cuda.device_count() >= ranks_here:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.mem_get_info(device)[1]
    elif args.device == "cuda":
        sys.exit("error: --device cuda: fewer GPUs than ranks here; use --device cpu")
    else:
        device = torch.device("cpu")
        backend = "gloo"
        name = "CPU"
        memory = HOST_MEMORY
    use_interconnect(args.interconnect)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group(backend, timeout=timeout)  # main() ends it
    dist.all_reduce(torch.ones(1, device=device))  # the first collective: NCCL connects
    sync(device)
    return device, backend, name, memory

def loss_of(model, x, y, amp, micro_steps=1):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        _, loss = model(x, y)
    return loss / micro_steps  # equal micro-batches: the sum of k losses / k, their mean

def train_step(model, opt, x, y, amp, handrolled=False):
    opt.zero_grad(set_to_none=True)
    loss_of(model, x, y, amp).backward()  # DDP, FSDP2: hooks run the collectives
    if handrolled:  # 05's way: the whole backward, then every gradient: no overlap
        for p in model.parameters():
            dist.all_reduce(p.grad.div_(dist.get_world_size()))
    opt.step()

def adamw(model):
    plain = getattr(model, "module", model)  # DDP wraps the GPT as .module
    return plain.configure_optimizer(lr=LR)

def max_diff(xs, ys):
    """The largest |x - y| over all tensors and all ranks."""
    diffs = [(x.detach() - y.detach()).abs().max() for x, y in zip(xs, ys)]
    largest = torch.stack(diffs).max().double()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()

def torch_same_math(base, batches):
    # PREDICTION [1]: hand-rolled and DDP do the same math (the mean of the ranks'
    # gradients, the same AdamW): after 3 steps they agree to rounding, bit for bit
    # with 2 ranks.
    hand = copy.deepcopy(base)
    hand_opt = adamw(hand)
    ddp = DDP(copy.deepcopy(base))
    ddp_opt = adamw(ddp)
    for x, y in batches:
        train_step(hand, hand_opt, x, y, amp=False, handrolled=True)
        train_step(ddp, ddp_opt, x, y, amp=False)
    return max_diff(hand.parameters(), ddp.parameters()), ddp, ddp_opt

def bucket_name(cap):
    if cap is None:
        return "default"
    return f"{cap:g} MiB"

def torch_steps(base, x, y, amp, caps):
    # PREDICTION [2], GPT-2 on two GPUs: 498 MB of fp32 gradients per rank and step
    # against 6 x 124M x 8192 = 6 TFLOP, tens of ms in eager bf16 (H200: 989 TFLOP/s,
    # datasheet). NVLink 4 (450 GB/s each way, datasheet): 1-2 ms of all-reduce, DDP
    # wins about that (148 calls become ~15); the bucket size moves a ms either way: a
    # small bucket pays a copy and launch each, one huge one cannot start before
    # backward ends. Staged through host memory (PCIe 5.0 x16: 64 GB/s each way, spec,
    # plus a host copy): 10-20 ms, like the compute: DDP hides much of it and wins
    # clearly; tiny buckets pay a latency each, one huge bucket waits for the whole
    # backward. CPU (gloo): the ranks share the cores, DDP gains by fewer calls only.
    hand = copy.deepcopy(base)
    hand_step = partial(train_step, hand, adamw(hand), x, y, amp, handrolled=True)
    steps = {"hand-rolled": hand_step}
    for cap in caps:
        ddp = DDP(copy.deepcopy(base), bucket_cap_mb=cap)  # None: DDP's default, 25 MiB
        steps[bucket_name(cap)] = partial(train_step, ddp, adamw(ddp), x, y, amp)
    return steps

def torch_overlap(step, device, trace=None):
    # PREDICTION [3]: hand-rolled hides nothing; DDP all buckets but the last. GPU: NCCL
    # kernels against the others; CPU: gloo's all-reduce (own threads) against
    # autograd's ops.
    activity = getattr(torch.profiler.ProfilerActivity, device.type.upper())
    after_one = torch.profiler.schedule(wait=0, warmup=1, active=PROFILED_STEPS, repeat=1)
    with torch.profiler.profile(activities=[activity], schedule=after_one) as prof:
        for _ in range(1 + PROFILED_STEPS):  # a first step unrecorded: the ranks'
            step()  # profilers start apart, and a collective would count the wait
            sync(device)
            prof.step()
    comm = []
    compute = []
    for event in prof.events():
        start_ns = round(event.time_range.start * 1e3)  # microseconds to ns: exact sums
        end_ns = round(event.time_range.end * 1e3)
        if event.name == "gloo:all_reduce":
            comm.append((start_ns, end_ns))
        elif event.name.startswith("autograd::engine::evaluate_function"):
            compute.append((start_ns, end_ns))
        elif event.device_type == torch.autograd.DeviceType.CUDA:  # a GPU kernel
            if event.is_user_annotation:
                continue
            if "nccl" in event.name.lower():
                comm.append((start_ns, end_ns))
            else:
                compute.append((start_ns, end_ns))
    if trace is not None:  # Chrome/Perfetto JSON
        prof.export_chrome_trace(str(trace))
    comm_ns = covered(comm)
    both = comm_ns + covered(compute) - covered(comm + compute)  # |A| + |B| - |A or B|
    return dict(allreduce_calls_per_step=len(comm) // PROFILED_STEPS,
                comm_ms_per_step=comm_ns / 1e6 / PROFILED_STEPS,
                overlap_fraction=both / max(comm_ns, 1))

def covered(spans):
    """The time that (start, end) spans cover, overlaps counted once."""
    total = 0
    reached = float("-inf")
    for start, end in sorted(spans):
        total += max(0, end - max(start, reached))
        reached = max(reached, end)
    return total

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

def torch_no_sync(ddp, micro):
    # PREDICTION [4]: k = 4: the trap all-reduces every backward, the right way the
    # last only: the same gradients (fp32: rounding, 1e-5 of the largest; a micro-batch
    # lost or counted twice moves them by a quarter), 3 all-reduces of every gradient
    # saved: 3-6 ms over NVLink, tens of ms staged.
    accumulate_no_sync(ddp, micro, amp=False)
    right = [p.grad.clone() for p in ddp.parameters()]
    accumulate_trap(ddp, micro, amp=False)
    trap = [p.grad.clone() for p in ddp.parameters()]
    largest = max(g.abs().max().item() for g in right)
    return dict(k=len(micro), max_abs_grad_diff=max_diff(right, trap),
                max_abs_grad=largest)

def state_bytes(model, opt):
    """Params, grads and AdamW state on this rank (of a DTensor: its shard)."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters())]
    for state in opt.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):  # a DTensor: FSDP2's shard
            t = t.to_local()
        total += t.nbytes
    return total

def torch_sharded_state(base, batches, device, ddp, ddp_opt):
    # PREDICTION [5]: DDP keeps params, grads and both AdamW moments on every rank
    # (16 bytes a param), FSDP2 1/N: it all-gathers a block's params just in time and
    # reduce-scatters its grads. The same steps end where DDP's end.
    from torch.distributed.fsdp import fully_shard  # FSDP2: public since torch 2.6
    sharded = copy.deepcopy(base)
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    for block in sharded.transformer.h:  # an all-gather unit per block,
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)  # then the rest (the tied embedding and head, ln_f)
    opt = adamw(sharded)
    for x, y in batches:
        train_step(sharded, opt, x, y, amp=False)
    gathered = [p.full_tensor() for p in sharded.parameters()]
    replicated = state_bytes(ddp.module, ddp_opt)
    shard = state_bytes(sharded, opt)
    return dict(max_abs_param_diff=max_diff(ddp.parameters(), gathered),
                replicated_bytes=replicated, sharded_bytes=shard,
                sharded_over_replicated=shard / replicated)

def torch_micro_batches(sizes, rank, world, device):
    """MICRO_STEPS batches of (inputs, targets): this rank's rows of the global batch."""
    shape = (MICRO_STEPS, sizes.batch * world, sizes.seq_len + 1)  # alike on every rank
    seed = torch.Generator().manual_seed(1)
    tokens = torch.randint(sizes.vocab_size, shape, generator=seed)
    micro = []
    for rows in tokens[:, rank::world].to(device):
        micro.append((rows[:, :-1], rows[:, 1:]))
    return micro

def run_torch(args):
    device, backend, name, memory = torch_start(args)
    rank = dist.get_rank()
    world = dist.get_world_size()
    cuda = backend == "nccl"
    sizes = pick_sizes(args.quick, cuda)
    trace = args.out / f"06_ddp_trace_{args.interconnect}.json"
    if rank != 0:  # one rank speaks and writes
        sys.stdout = open(os.devnull, "w")
        trace = None
    torch.manual_seed(0)  # the same weights on every rank (DDP broadcasts rank 0's too)
    base = GPT(sizes.config()).to(device)
    exact = dataclasses.replace(sizes.config(), attn="manual")  # deterministic
    check_base = GPT(exact).to(device)
    micro = torch_micro_batches(sizes, rank, world, device)
    versions = f"torch {torch.__version__} | {world} ranks, backend {backend}"
    transport = NO_NCCL
    if cuda:
        transport = nccl_transport()
    result = header(args, sizes, name, memory, versions, transport, "rank")
    result.update(world_size=world, backend=backend)

    checked = 3  # AdamW steps
    param_diff, ddp, ddp_opt = torch_same_math(check_base, micro[:checked])
    print(f"[1] max |param diff| after {checked} AdamW steps, DDP vs hand-rolled: "
          f"{param_diff:.2e} (fp32, measured)")
    result["equivalence"] = dict(steps=checked, max_abs_param_diff=param_diff)

    steps = torch_steps(base, *micro[0], cuda, sizes.caps)
    times = exp_step_time(steps, sizes.passes, sizes.reps, device)
    rows = {}
    for step_name, t in times.items():
        print(f"[2] {step_name:>11}: {time_text(t)}")
        rows[step_name] = dict(t, name=step_name)
        if step_name == "hand-rolled":
            continue
        against = "default"  # each bucket size against DDP's default,
        if step_name == "default":
            against = "hand-rolled"  # and that against 05's way
        rows[step_name].update(compared(t, times[against], against))
        print(f"[2] {step_name:>11}: {saves_text(rows[step_name], times[against])}")
    for step_name, step in steps.items():
        step_trace = None
        if step_name == "default":
            step_trace = trace
        overlap = torch_overlap(step, device, step_trace)
        rows[step_name].update(overlap)
        calls = overlap["allreduce_calls_per_step"]
        print(f"[3] {step_name:>11}: {calls:3d} all-reduces/step (counted), "
              f"{overlap['comm_ms_per_step']:.1f} ms of communication, "
              f"{overlap['overlap_fraction']:.0%} of it under backward "
              f"(measured, profiler)")
    hand = rows.pop("hand-rolled")
    result["step_time"] = dict(handrolled=hand, ddp=rows["default"])
    result["bucket_sweep"] = list(rows.values())
    print(f"trace of the default buckets, {PROFILED_STEPS} steps (ui.perfetto.dev): "
          f"{trace}")

    no_sync_ddp = DDP(copy.deepcopy(base))
    no_sync = torch_no_sync(no_sync_ddp, micro)
    print(f"[4] gradients, no_sync vs the trap (which syncs every micro-batch): "
          f"max |diff| {no_sync['max_abs_grad_diff']:.2e} of max |grad| "
          f"{no_sync['max_abs_grad']:.2e} (measured)")
    loops = dict(no_sync=accumulate_no_sync, backward_only_in_no_sync=accumulate_trap)
    accumulations = {}
    for loop_name, loop in loops.items():
        accumulations[loop_name] = partial(loop, no_sync_ddp, micro, cuda)
    times = exp_step_time(accumulations, sizes.passes, 1, device)
    trap = times["backward_only_in_no_sync"]
    times["no_sync"].update(compared(times["no_sync"], trap, "backward_only_in_no_sync"))
    for loop_name, accumulate in accumulations.items():
        counted = torch_overlap(accumulate, device)  # after the timing: buckets settled
        calls = counted["allreduce_calls_per_step"]
        no_sync[loop_name] = dict(times[loop_name], allreduce_calls=calls)
        print(f"[4] {loop_name:24s}: {calls:3d} all-reduces for {MICRO_STEPS} "
              f"micro-batches (counted), {time_text(times[loop_name])}")
    print(f"[4] no_sync: {saves_text(times['no_sync'], trap)}")
    result["no_sync"] = no_sync

    fsdp = torch_sharded_state(check_base, micro[:checked], device, ddp, ddp_opt)
    print(f"[5] max |param diff| after {checked} AdamW steps, FSDP2 vs DDP: "
          f"{fsdp['max_abs_param_diff']:.2e} (fp32, measured)")
    replicated_mib = fsdp["replicated_bytes"] / 2**20
    sharded_mib = fsdp["sharded_bytes"] / 2**20
    print(f"[5] params + grads + AdamW state per rank: replicated {replicated_mib:.2f} "
          f"MiB, FSDP2 {sharded_mib:.2f} MiB (measured); FSDP2 / replicated "
          f"{fsdp['sharded_over_replicated']:.3f} (derived), 1/N = {1 / world:.3f}")
    result["fsdp"] = fsdp

    calls = no_sync["no_sync"]["allreduce_calls"]
    trap_calls = no_sync["backward_only_in_no_sync"]["allreduce_calls"]
    grad_tol = 1e-5 * no_sync["max_abs_grad"]
    bytes_share = fsdp["sharded_over_replicated"] * world
    result["checks"] = dict(
        ddp_equals_handrolled=param_diff < PARAM_TOL,
        no_sync_grads_equal=no_sync["max_abs_grad_diff"] <= grad_tol,
        no_sync_allreduces_once=calls == rows["default"]["allreduce_calls_per_step"],
        trap_allreduces_every_backward=trap_calls == MICRO_STEPS * calls,
        fsdp_matches_ddp=fsdp["max_abs_param_diff"] < PARAM_TOL,
        fsdp_bytes_about_1_over_n=abs(bytes_share - 1) < 0.05)
    return result, rank == 0

# ---------------------------------------------------------------------------------------
# JAX: one process sees every device; jit inserts the collectives the shardings imply.

def use_cpu_devices():
    """Before JAX starts: XLA's count of simulated CPU devices, added to the user's
    XLA_FLAGS when they name none. Returns the count asked for, and whether we added it."""
    flags = os.environ.get("XLA_FLAGS", "")
    named = re.search(rf"{DEVICE_COUNT_FLAG}=(\d+)", flags)
    if named:
        return int(named.group(1)), False
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={CPU_DEVICES}".strip()
    return CPU_DEVICES, True

def jax_start(args):
    """The first JAX call. Returns the devices, and whether they are GPUs."""
    asked, added = use_cpu_devices()
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    use_interconnect(args.interconnect)  # XLA's GPU collectives go through NCCL too
    import jax
    gpu = jax.default_backend() == "gpu"
    n = jax.device_count()
    if args.device == "cuda" and not gpu:
        sys.exit("error: --device cuda: JAX sees no GPU (install jax[cuda13], "
                 "or use --device cpu)")
    if not gpu and added:
        print(f"XLA_FLAGS: added {DEVICE_COUNT_FLAG}={CPU_DEVICES} ({asked} CPU devices)")
    if not gpu and n != asked:
        sys.exit(f"error: JAX sees {n} CPU devices where XLA_FLAGS asks for {asked}: "
                 f"set XLA_FLAGS before anything starts JAX")
    if n < 2:
        sys.exit(f"error: JAX sees 1 device: data parallelism needs 2 or more; on a CPU: "
                 f"XLA_FLAGS={DEVICE_COUNT_FLAG}=4 python 06_ddp_prod.py --device cpu")
    return jax.devices(), gpu

def largest_divisible(array, mesh):
    """The bridge: split an array along its largest dimension that N divides (else
    keep it whole on every device)."""
    from jax.sharding import NamedSharding, PartitionSpec
    by_size = sorted(range(array.ndim), key=lambda dim: -array.shape[dim])
    for dim in by_size:
        if array.shape[dim] % mesh.size == 0:
            axes = [None for _ in range(array.ndim)]  # every dimension whole,
            axes[dim] = "data"  # but this one, split over the devices
            return NamedSharding(mesh, PartitionSpec(*axes))
    return NamedSharding(mesh, PartitionSpec())

def jax_placements(devices, state):
    """Each placement: the sharding of every state array, and of the batch's rows."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,))
    one = SingleDeviceSharding(devices[0])
    replicated = NamedSharding(mesh, PartitionSpec())
    by_rows = NamedSharding(mesh, PartitionSpec("data"))
    single_device = jax.tree.map(lambda a: one, state)
    data_parallel = jax.tree.map(lambda a: replicated, state)
    sharded_params = jax.tree.map(partial(largest_divisible, mesh=mesh), state)
    return dict(single_device=(single_device, one),
                data_parallel=(data_parallel, by_rows),
                sharded_params=(sharded_params, by_rows))

def jax_same_math(step, state, shardings, rows, data):
    # PREDICTION [1]: data parallel: a replicated parameter's gradient over a sharded
    # batch is a sum over the shards: XLA inserts an all-reduce, and two steps' losses
    # equal one device's to fp32 rounding (1e-4 relative; a sum missed or doubled
    # moves them further).
    import jax
    placed = jax.device_put(state, shardings)
    batches = []
    for tokens in data:
        x = jax.device_put(tokens[:, :-1], rows)
        y = jax.device_put(tokens[:, 1:], rows)
        batches.append((x, y))
    compiled = step.lower(placed, *batches[0]).compile()
    loss, after = compiled(placed, *batches[0])
    second_loss, _ = compiled(jax.device_put(after, shardings), *batches[1])
    run = partial(jax_step, compiled, placed, *batches[0])
    return compiled, placed, run, [float(loss), float(second_loss)]

def jax_step(compiled, state, x, y):
    import jax
    return jax.block_until_ready(compiled(state, x, y))

def jax_collectives(text):
    """The collectives in a compiled program's text, counted; its first all-reduce."""
    counts = {}
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        counts[kind] = len(re.findall(rf"\s{kind}(?:-start)?\(", text))
    example = ""
    lines = re.findall(r"\S.*\sall-reduce(?:-start)?\(.*", text)
    if lines:
        example = lines[0][:150]
    return counts, example

def jax_sharded_state(placed, device):
    # PREDICTION [5]: sharded params: all-gathers and reduce-scatters, and on each
    # device 1/N of the bytes of every array that N divides, the rest whole.
    import jax
    leaves = jax.tree.leaves(placed)
    n = jax.device_count()
    total = sum(a.nbytes for a in leaves)
    split = sum(a.nbytes for a in leaves if not a.sharding.is_fully_replicated)
    mine = 0
    for a in leaves:
        for shard in a.addressable_shards:
            if shard.device == device:
                mine += shard.data.nbytes
    return dict(state_bytes_per_device=mine, sharded_share=split / total,
                expected_bytes_per_device=total - split + split // n)

def run_jax(args):
    devices, gpu = jax_start(args)
    import flax
    import jax
    import numpy as np
    from flax import nnx
    from model_jax import GPT as JaxGPT, adamw as jax_adamw, make_train_step
    n = len(devices)
    sizes = pick_sizes(args.quick, gpu)
    if gpu:
        sizes = dataclasses.replace(sizes, batch=4)  # one device will run n x 4 rows
    memory = HOST_MEMORY
    stats = devices[0].memory_stats()
    if stats is not None:  # a GPU: JAX's pool
        memory = stats.get("bytes_limit", HOST_MEMORY)
    versions = f"jax {jax.__version__}, flax {flax.__version__}"
    transport = NO_NCCL
    if gpu:
        transport = nccl_transport()
    machine = f"{n} x {devices[0].device_kind}"
    per = "device; fp32 (a GPU: JAX's TF32 matmuls)"
    result = header(args, sizes, machine, memory, versions, transport, per)
    result["n_devices"] = n
    model = JaxGPT(sizes.config(), rngs=nnx.Rngs(0))  # fp32 on both sides of the check
    optimizer = nnx.Optimizer(model, jax_adamw(LR), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = jax.device_get(state)
    step = make_train_step(graphdef)
    rng = np.random.default_rng(1)
    shape = (n * sizes.batch, sizes.seq_len + 1)
    data = []
    for _ in range(2):
        data.append(rng.integers(0, sizes.vocab_size, shape, dtype=np.int32))

    print("compiling the step for 3 placements (GPT-2: tens of seconds)")
    steps = {}
    for name, (shardings, rows) in jax_placements(devices, state).items():
        compiled, placed, run, losses = jax_same_math(step, state, shardings, rows, data)
        steps[name] = run
        counts, example = jax_collectives(compiled.as_text())
        placement = dict(losses=losses, collectives=counts, allreduce_example=example)
        placement.update(jax_sharded_state(placed, devices[0]))
        result[name] = placement
        reference = result["single_device"]["losses"]
        relative = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
        placement["max_rel_loss_diff"] = max(relative)
        found = [f"{kind} x{count}" for kind, count in counts.items() if count > 0]
        if not found:
            found = ["none"]
        print(f"[{name}] collectives in the compiled program: {', '.join(found)}")
        if example and name == "data_parallel":
            print(f"    {example} ...  (jit put it there; XLA's buckets)")
        print(f"    losses {losses[0]:.6f}, {losses[1]:.6f} (measured); against one "
              f"device: max relative diff {max(relative):.1e} (derived)")
        mib = placement["state_bytes_per_device"] / 2**20
        print(f"    params + AdamW state {mib:.2f} MiB/device (measured)")

    # PREDICTION [2]: one device does the rows of N: data parallel is ~2x faster over
    # NVLink (1-2 ms of all-reduce), less staged (10-20 ms), and on a CPU not at all:
    # the simulated devices share its cores.
    times = exp_step_time(steps, sizes.passes, sizes.reps)
    for name, t in times.items():
        print(f"[{name}] step {time_text(t)}")
        if name != "single_device":
            t.update(compared(t, times["single_device"], "single_device"))
            print(f"[{name}] {saves_text(t, times['single_device'])}")
        result[name]["step"] = t

    dp = result["data_parallel"]
    sharded = result["sharded_params"]
    ratio = sharded["state_bytes_per_device"] / dp["state_bytes_per_device"]
    print(f"sharded / replicated bytes per device: {ratio:.3f} (derived; 1/N = "
          f"{1 / n:.3f}; {sharded['sharded_share']:.1%} of the bytes have a dimension "
          f"that {n} divides)")
    result["sharded_over_replicated"] = ratio
    bytes_match = []
    for name in ("single_device", "data_parallel", "sharded_params"):
        p = result[name]
        bytes_match.append(p["state_bytes_per_device"] == p["expected_bytes_per_device"])
    result["checks"] = dict(
        data_parallel_loss_equals_single_device=dp["max_rel_loss_diff"] < 1e-4,
        sharded_params_loss_equals_single_device=sharded["max_rel_loss_diff"] < 1e-4,
        sharded_bytes_match_shardings=all(bytes_match),
        allreduce_in_compiled_text="all-reduce" in dp["allreduce_example"])
    return result, True

# ---------------------------------------------------------------------------------------
# Flags, outputs, and the run.

def writable_folder(folder):
    """Make the folder now and write a file in it: a bad path fails before the run."""
    if folder.exists() and not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write in {folder}: {error.strerror}")
    return folder

def json_file(text):
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    writable_folder(path.parent)
    return path

def out_folder(text):
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return writable_folder(Path(text))

def parse_args(argv=None):
    launched = "jax"
    if "RANK" in os.environ:  # torchrun sets RANK
        launched = "torch"
    p = argparse.ArgumentParser(description="Section 13.6: production data parallelism")
    p.add_argument("--framework", choices=["torch", "jax"], default=launched)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--interconnect", choices=["default", "staged"], default="default")
    p.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    p.add_argument("--json", type=json_file, help="write every number here")
    p.add_argument("--out", type=out_folder, default="out", help="folder for the trace")
    args = p.parse_args(argv)
    if args.framework != launched:
        p.exit(2, "The PyTorch half: torchrun --nproc_per_node=N --standalone "
               "06_ddp_prod.py\nThe JAX half is ONE process: "
               "python 06_ddp_prod.py --framework jax\n")
    return args

def peer_failure(error):
    """A collective that could not finish: no rendezvous, a peer gone, a timeout.
    torch names them DistError; gloo raises them as RuntimeErrors that name gloo."""
    return isinstance(error, dist.DistError) or "gloo" in str(error)

def main():
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each line as measured, into a pipe too
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler start/stop lines
    warnings.filterwarnings("ignore", message=".*Profiler clears events")  # we read each
    run = run_jax
    if args.framework == "torch":
        run = run_torch  # Ctrl-C a KeyboardInterrupt from here: the process group ends cleanly
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result, speaks = run(args)
    except RuntimeError as error:
        if not peer_failure(error):
            raise
        rank = os.environ.get("RANK", 0)
        reason = str(error).splitlines()[0][:300]
        sys.exit(f"error: rank {rank}: {type(error).__name__}: {reason}")
    finally:
        if dist.is_initialized():  # free the models (and DDP's work objects) while the
            gc.collect()  # process group lives, then end it: no rank aborts at exit
            dist.destroy_process_group()
        log = os.environ.get("NCCL_DEBUG_FILE", "")
        if log.endswith(f"nccl-{os.getpid()}.log"):  # ours, not the user's
            Path(log).unlink(missing_ok=True)
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed:
        print(f"checks: FAILED {failed}")
    else:
        print("checks: ALL PASSED")
    if args.json and speaks:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if failed:
        sys.exit(1)

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
