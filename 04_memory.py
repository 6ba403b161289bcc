"""
04_memory.py - Section 13.4: the memory anatomy of a training step.

Where do the bytes of an AdamW step go, and what makes a model fit? model_torch's
accounting predicts every part before the lesson measures it: CUDA's memory_allocated on
a GPU, the profiler's trace of allocations and frees on a CPU, and on both the bytes
autograd saves for backward (a saved-tensors hook).
  1. anatomy: parameters, gradients, AdamW's two moments, activations term by term
  2. mixed precision: what bf16 autocast keeps in fp32, what it halves, the step time
  3. activation checkpointing: fewer activation bytes, a slower step, equal gradients
  4. gradient accumulation: equal gradients, a peak bounded by the micro-batch
  5. what fits: the largest batch of each combination of the techniques, predicted and
     (on a GPU) found by trying steps; GPT-2 large at T=8192, which fits the book's
     24 GiB card only checkpointed
GPT-2 124M on a GPU, its batch chosen from the accounting to fit the card; a tiny GPT on a
CPU. One process: a second GPU adds nothing here. Copy this file and model_torch.py.
  python 04_memory.py                       # one GPU when there is one; otherwise the CPU
  python 04_memory.py --memory-gb 24        # as on the book's 24 GiB card (an RTX 4090)
  python 04_memory.py --device cpu --quick  # seconds: what the tests run
Expect the state to the byte, activations and peaks within a few percent, the state in
fp32 under autocast, equal gradients under checkpointing and accumulation, and each
technique raising the largest batch. Under a minute on an H100; about 30 s on a CPU.
The figure goes to out/04_memory.png.
"""

import os

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before torch: no profiler start/stop lines

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch.profiler import ProfilerActivity, profile

from model_torch import (ALLOCATOR_HEADROOM, GPT, GPTConfig, activation_bytes,
                         activation_terms, flops_per_token, micro_batches, param_count,
                         predicted_peak_bytes, predicted_rise_bytes,
                         recompute_flops_per_token, state_bytes)

MiB = 2**20
GiB = 2**30
BOOK_CARD_GB = 24  # the chapter's RTX 4090


def cpu_model():
    # a 4096-token vocabulary: at 50304 the logits would hide the blocks of so small a model
    return GPTConfig.preset("tiny", vocab_size=4096)


@dataclass
class Sizes:
    """The CPU's sizes; the GPU and --quick rows name only what differs."""
    model: GPTConfig = field(default_factory=cpu_model)  # experiments 1-4
    batch: int = 4          # sequences per step in 1-4 (a GPU: fewer if the card is small)
    micro_batches: int = 4  # k in 4: the batch as k micro-batches
    reps: int = 5           # timed steps of each configuration, interleaved
    search: bool = False    # 5: try steps to find the largest batches (a GPU)


SIZES = {
    "cpu": Sizes(),
    "cuda": Sizes(model=GPTConfig.preset("gpt2"), batch=8, reps=10, search=True),
    "quick": Sizes(model=GPTConfig.preset("tiny", n_layer=2, block_size=64, vocab_size=4096),
                   reps=2),
}


@dataclass(frozen=True)
class Configuration:
    name: str
    bf16: bool        # bf16 autocast
    checkpoint: bool  # activation checkpointing, one region per block


CONFIGURATIONS = [
    Configuration("fp32", bf16=False, checkpoint=False),
    Configuration("bf16 autocast", bf16=True, checkpoint=False),
    Configuration("fp32 + checkpoint", bf16=False, checkpoint=True),
    Configuration("bf16 autocast + checkpoint", bf16=True, checkpoint=True),
]
CHECKPOINTED = " + checkpoint"  # a name less this: the configuration not checkpointed

# each technique raises the largest batch: (without it, with it)
LADDER = [
    ("fp32", "bf16 autocast"),
    ("bf16 autocast", "bf16 autocast + checkpoint"),
    ("fp32", "fp32 + checkpoint"),
]

FIT_MODEL = GPTConfig.preset("gpt2")  # the fit table: GPT-2 124M, T=1024
# GPT-2 large (774M with T=1024; 783M with this longer position table), T=8192
BIG_MODEL = GPTConfig(n_layer=36, n_head=20, n_embd=1280, block_size=8192)

# model_torch names each saved tensor by what keeps it; the largest is better known by
# what it is: the logits, kept as fp32 log-probabilities for the loss's backward
TERM_NAMES = {"log_softmax": "logits (fp32 log-softmax, V per token)"}

GPU_BF16_SPEEDUP = 1.5  # predicted: a bf16 step at least this much faster on tensor cores
CPU_BF16_SPEEDUP = 1.1  # predicted: a CPU's bf16 step at most this much faster


# ---------------------------------------------------------------------------------------
# A training step, plain and watched

def new_run(config, batch, device):
    """A model built on the device (memory_allocated then sees only its parameters), its
    AdamW and one batch of random tokens. lr=0: AdamW steps its moments but not the
    weights, so every configuration, in every experiment, sees the same weights."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(replace(config))  # its own config: checkpointing is switched on it
    shape = (batch, config.block_size)
    x = torch.randint(0, config.vocab_size, shape).to(device)
    y = torch.randint(0, config.vocab_size, shape).to(device)
    opt = model.configure_optimizer(lr=0.0, fused=True)
    return model, opt, x, y


def train_step(model, opt, x, y, bf16):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(x, y)[1]  # the logits dropped at once: no B x T x V tensor kept alive
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed_step(model, opt, x, y, bf16, checkpoint, device):
    """A training step, for the clock: it returns once the device is done."""
    def step():
        model.config.checkpoint = checkpoint  # read at every forward
        train_step(model, opt, x, y, bf16)
        sync(device)
    return step


def forward_counted(model, x, y, bf16):
    """One forward: the loss (graph alive) and the bytes autograd saved for backward,
    each storage once, parameters excluded (the non-reentrant checkpoint saves through
    these hooks too)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)[1]
    return loss, sum(saved.values())


def watched_step(model, opt, x, y, configuration, device):
    """One training step in this configuration, watched: the bytes autograd saved (counted
    by the hook; on a GPU also measured by the allocator), the step's peak, the loss and
    the dtypes of the state; beside them, the accounting's predictions."""
    model.config.checkpoint = configuration.checkpoint
    params = list(model.parameters())

    def step():
        before = allocated(device)
        loss, counted = forward_counted(model, x, y, configuration.bf16)
        measured = counted  # a CPU has no allocation counter: the count stands in
        if device == "cuda":
            measured = allocated(device) - before
        loss_value = loss.item()
        loss.backward()
        opt.step()
        return dict(activations_counted=counted, activations_measured=measured,
                    loss=loss_value)

    row, rise = peak_rise(step, device)
    row["peak_measured"] = nbytes(params) + nbytes(moments(opt)) + rise
    row["dtypes"] = dict(params=sorted({str(p.dtype) for p in params}),
                         grads=sorted({str(p.grad.dtype) for p in params}),
                         optimizer=sorted({str(t.dtype) for t in moments(opt)}))
    opt.zero_grad(set_to_none=True)
    batch = len(x)
    bf16 = configuration.bf16
    row["activations_predicted"] = activation_bytes(model.config, batch, bf16=bf16)
    row["peak_predicted"] = predicted_peak_bytes(model.config, batch, bf16)
    return row


def gradients_of(model, x, y):
    """The fp32 gradients of one forward and backward, cloned; .grad set back to None."""
    loss = model(x, y)[1]
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


# ---------------------------------------------------------------------------------------
# 1. Anatomy

def anatomy(sizes, device):
    """PREDICTION: params = grads = 4 B x N and AdamW's exp_avg + exp_avg_sq = 8 B x N:
    16 B of state per parameter, to the byte (GPT-2 124M: 1.85 GiB; the CPU's tiny GPT:
    20.6 MiB). Activations, alive from forward until backward frees them: the accounting's
    activation_terms, to the byte by autograd's count, within 2% by a GPU's allocator
    (GPT-2, batch 8: 6,234 MiB). At GPT-2's vocabulary the largest single tensor is the
    logits, 4 B x 50304 per token: a quarter of the activations, more than the 12 blocks'
    MLP hidden layers together."""
    config = sizes.model
    n = param_count(config)
    predicted = state_bytes(config)
    predicted["activations"] = activation_bytes(config, sizes.batch)
    print(f"\n[1] anatomy of one fp32 step: batch {sizes.batch} x {config.block_size} "
          f"tokens")
    print(f"predicted: state 16 B x {n:,} params = {mib(16 * n)} MiB, to the byte; "
          f"activations {mib(predicted['activations'])} MiB, within 2%")
    base = allocated(device)
    model, opt, x, y = new_run(config, sizes.batch, device)
    params = list(model.parameters())
    after_init = allocated(device)
    loss, saved = forward_counted(model, x, y, bf16=False)
    after_forward = allocated(device)
    loss.backward()
    after_backward = allocated(device)
    opt.step()
    after_step = allocated(device)
    counted = dict(params=nbytes(params),
                   grads=nbytes([p.grad for p in params]),
                   optimizer=nbytes(moments(opt)),
                   activations=saved)
    measured = {}
    # the activations against what the allocator measured (a CPU: what autograd counted)
    activations_ratio = predicted["activations"] / counted["activations"]
    if device == "cuda":  # each part: the jump in memory_allocated where it appears
        measured["params"] = after_init - base - nbytes([x, y])
        measured["activations"] = after_forward - after_init
        measured["grads"] = after_backward - after_init
        measured["optimizer"] = after_step - after_backward
        activations_ratio = predicted["activations"] / measured["activations"]
    terms = {}
    for name, size in activation_terms(config, sizes.batch).items():
        terms[TERM_NAMES.get(name, name)] = size
    checks = {}
    for part in ("params", "grads", "optimizer"):
        checks[f"anatomy_{part}_exact"] = predicted[part] == counted[part]
    checks["anatomy_activations_within_2pct"] = abs(activations_ratio - 1) < 0.02
    predictions = dict(anatomy=all(checks.values()))
    return dict(predicted=predicted, counted=counted, measured=measured,
                activations_ratio=activations_ratio, activation_terms=terms,
                checks=checks, predictions=predictions)


def report_anatomy(result):
    predicted = result["predicted"]
    counted = result["counted"]
    measured = result["measured"]
    print("  MiB            predicted    counted   measured")
    for part in predicted:
        shown = "-"
        if part in measured:
            shown = mib(measured[part])
        print(f"  {part:<12}{mib(predicted[part]):>12}{mib(counted[part]):>11}{shown:>11}")
    print("  (counted: numel x element_size of the state; the saved-tensors hook's bytes. "
          "measured: jumps in CUDA's memory_allocated)")
    print("  the activations, term by term (predicted):")
    terms = sorted(result["activation_terms"].items(), key=lambda term: -term[1])
    for name, size in terms:
        share = size / predicted["activations"]
        print(f"    {name:<40}{mib(size):>9} MiB {share:6.1%}")
    print(f"{verdict(result['predictions']['anatomy'])}: the state to the byte; activations "
          f"predicted / measured {result['activations_ratio']:.4f} (a CPU: / counted)")


# ---------------------------------------------------------------------------------------
# 2. Mixed precision

def mixed_precision(sizes, device, configurations, bf16_skipped):
    """PREDICTION: bf16 autocast casts copies, not the model: params, grads and AdamW's
    moments stay fp32, 16 B per parameter still. Matmul inputs are saved in bf16; the
    residual stream, LayerNorm statistics and the logits stay fp32: 36 d bytes per block
    and token instead of 64 d (Korthikanti et al. 2022 count 34 d: dropout masks in,
    LayerNorm inputs in bf16), plus bf16 copies of the weights once per step. GPT-2,
    batch 8: activations 6,234 -> 4,442 MiB (-29%); the tiny CPU GPT: 49.2 -> 37.4 MiB.
    Time: on a GPU, bf16 tensor cores outrun fp32 without TF32 on the matmuls (NVIDIA's
    H100 SXM datasheet: 989 vs 67 TFLOP/s; its Ada whitepaper, RTX 4090: 165 vs 83), by
    less on the bandwidth-bound rest: the step >= 1.5x as fast. A CPU without bf16 matrix
    units (AVX2, AVX-512 without AMX) converts to bf16 and back around fp32 arithmetic:
    its bf16 step is at most 1.1x as fast, most likely several times slower."""
    config = sizes.model
    configurations = [c for c in configurations if not c.checkpoint]
    expected = f"at most {CPU_BF16_SPEEDUP}x as fast: a CPU has no bf16 matrix units"
    if device == "cuda":
        expected = f"at least {GPU_BF16_SPEEDUP}x as fast on bf16 tensor cores"
    print(f"\n[2] mixed precision: fp32 vs bf16 autocast, batch {sizes.batch} x "
          f"{config.block_size} tokens, the same weights")
    if bf16_skipped is None:
        plain = activation_bytes(config, sizes.batch)
        halved = activation_bytes(config, sizes.batch, bf16=True)
        print(f"predicted: params, grads, AdamW moments stay float32; activations "
              f"{mib(plain)} -> {mib(halved)} MiB; the bf16 step {expected}")
    else:
        print(f"  bf16 skipped: {bf16_skipped}; fp32 measured alone")
    model, opt, x, y = new_run(config, sizes.batch, device)
    steps = []
    for c in configurations:
        steps.append(timed_step(model, opt, x, y, c.bf16, c.checkpoint, device))
    seconds, shares, busy = compare(steps, sizes.reps)  # the warm-up creates the moments
    rows = {}
    for c, samples in zip(configurations, seconds):
        rows[c.name] = watched_step(model, opt, x, y, c, device)
        rows[c.name]["seconds"] = samples
    result = dict(rows=rows, cpu_shares=shares, busy=busy, skipped=bf16_skipped,
                  expected=expected, checks={}, predictions={})
    if bf16_skipped is not None:
        return result
    fp32 = rows["fp32"]
    bf16 = rows["bf16 autocast"]
    state_dtypes = set()
    for dtypes in bf16["dtypes"].values():
        state_dtypes.update(dtypes)
    loss_change = abs(bf16["loss"] / fp32["loss"] - 1)
    result["checks"] = dict(autocast_keeps_state_fp32=state_dtypes == {"torch.float32"},
                            bf16_loss_close_to_fp32=loss_change < 1e-3)
    speed = ratio(fp32["seconds"], bf16["seconds"])
    speed_held = speed["median"] <= CPU_BF16_SPEEDUP
    if device == "cuda":
        speed_held = speed["median"] >= GPU_BF16_SPEEDUP and speed["min"] > 1
    activations_ratio = bf16["activations_measured"] / bf16["activations_predicted"]
    result["speed"] = speed
    activations_held = abs(activations_ratio - 1) < 0.02
    result["predictions"] = dict(mixed_precision_activations=activations_held,
                                 mixed_precision_speed=speed_held)
    return result


def print_rows(rows, busy):
    """The rows of experiments 2 and 3: bytes predicted and measured, step times."""
    print("  configuration                 activations MiB       peak MiB          step ms,")
    print("                              predicted measured  predicted measured  measured")
    for name, row in rows.items():
        timing = "-"
        if "seconds" in row:
            timing = milliseconds(row["seconds"]) + busy_mark(busy)
        print(f"  {name:<27}{mib(row['activations_predicted']):>10}"
              f"{mib(row['activations_measured']):>9}{mib(row['peak_predicted']):>11}"
              f"{mib(row['peak_measured']):>9}  {timing}")
    print("  (measured: CUDA's allocator on a GPU; on a CPU, the saved-tensors hook's "
          "count and the profiler's trace)")


def report_mixed_precision(result):
    rows = result["rows"]
    print_rows(rows, result["busy"])
    if result["skipped"] is not None:
        return
    fp32 = rows["fp32"]
    bf16 = rows["bf16 autocast"]
    for part, dtypes in bf16["dtypes"].items():
        print(f"  measured: under autocast, {part}: {', '.join(dtypes)}")
    print(f"  measured: loss fp32 {fp32['loss']:.5f}, bf16 {bf16['loss']:.5f} "
          f"(the same weights)")
    speed = result["speed"]
    shown = f"{speed['median']:.2f}x [{speed['min']:.2f}, {speed['max']:.2f}]"
    shown += noise_mark(speed, result["busy"])
    print(f"  derived: the bf16 step is {shown} as fast as fp32 (pair by pair)")
    predictions = result["predictions"]
    activations = bf16["activations_measured"] / bf16["activations_predicted"]
    print(f"{verdict(predictions['mixed_precision_activations'])}: bf16 activations "
          f"measured / predicted {activations:.4f} (predicted: within 2%)")
    print(f"{verdict(predictions['mixed_precision_speed'])}: the bf16 step {shown} as fast "
          f"(predicted: {result['expected']})")


# ---------------------------------------------------------------------------------------
# 3. Activation checkpointing

def checkpointing(sizes, device, configurations, plain_rows):
    """PREDICTION: a checkpointed block keeps only its fp32 input, 4 d bytes per token
    instead of ~64 d in fp32: GPT-2, batch 8: activations 6,234 -> 1,908 MiB in fp32,
    4,442 -> 1,970 in bf16 (its weight copies are recomputed too); the tiny CPU GPT:
    49.2 -> 19.0 MiB. Backward runs each block's forward again, up to its last matmul
    (model_torch.recompute_flops_per_token): 16 L d^2 + 4 L T d more FLOPs per token,
    +18% for GPT-2 at T=1024 (+17% for the tiny GPT). So it costs time,
    on a GPU and on a CPU: about its FLOPs' share where the step is compute-bound (GPT-2
    in fp32), more where the GPU waits for Python (a short bf16 step: the recompute's
    launches and the checkpoint's bookkeeping run on the CPU). The gradients equal the
    plain ones to fp32 rounding (<= 1e-5 relative): the recompute repeats the same ops on
    the same inputs."""
    config = sizes.model
    checkpointed = [c for c in configurations if c.checkpoint]
    extra_share = recompute_flops_per_token(config) / flops_per_token(config)
    print(f"\n[3] activation checkpointing, per block: batch {sizes.batch} x "
          f"{config.block_size} tokens")
    for c in checkpointed:
        plain = activation_bytes(config, sizes.batch, bf16=c.bf16)
        checkpointed_config = replace(config, checkpoint=True)
        fewer = activation_bytes(checkpointed_config, sizes.batch, bf16=c.bf16)
        print(f"predicted: {c.name}: activations {mib(plain)} -> {mib(fewer)} MiB")
    print(f"predicted: gradients equal to the plain ones (<= 1e-5); +{extra_share:.0%} "
          f"FLOPs: checkpointing costs time")
    model, opt, x, y = new_run(config, sizes.batch, device)
    # fp32 recomputation repeats the same ops on the same inputs: equal to rounding. A block
    # recomputed from a wrong input, or a gradient lost, is off by O(1)
    model.config.checkpoint = False
    reference = gradients_of(model, x, y)
    model.config.checkpoint = True
    error = max_rel_error(gradients_of(model, x, y), reference)
    del reference
    timings = {}
    shares = []
    busy = False
    for c in checkpointed:
        if c.bf16 and device != "cuda":
            continue  # a CPU's bf16 step: seconds of conversions, not how a CPU trains
        plain_step = timed_step(model, opt, x, y, c.bf16, False, device)
        checkpointed_step = timed_step(model, opt, x, y, c.bf16, True, device)
        steps = [plain_step, checkpointed_step]
        seconds, pair_shares, pair_busy = compare(steps, sizes.reps)
        cost = ratio(seconds[1], seconds[0])
        held = cost["min"] > 1  # it costs time: the whole range above 1x
        timings[c.name] = dict(plain=seconds[0], checkpointed=seconds[1], cost=cost,
                               held=held)
        shares += pair_shares
        busy = busy or pair_busy
    rows = {}
    for c in checkpointed:  # after the timing's warm-up: AdamW's moments exist
        rows[c.name] = watched_step(model, opt, x, y, c, device)
    saves = []
    as_predicted = []
    for name, row in rows.items():
        plain = plain_rows[name.removesuffix(CHECKPOINTED)]
        saves.append(row["activations_counted"] < plain["activations_counted"])
        measured_ratio = row["activations_measured"] / row["activations_predicted"]
        as_predicted.append(abs(measured_ratio - 1) < 0.02)
    costs = [timing["held"] for timing in timings.values()]
    checks = dict(checkpoint_saves_activations=all(saves),
                  checkpoint_grads_equal=error <= 1e-5)
    predictions = dict(checkpoint_activations=all(as_predicted),
                       checkpoint_costs_time=all(costs))
    return dict(rows=rows, timings=timings, grad_max_rel_error=error,
                extra_flops=extra_share, cpu_shares=shares, busy=busy,
                checks=checks, predictions=predictions)


def report_checkpointing(result, plain_rows):
    rows = result["rows"]
    print_rows(rows, result["busy"])
    print(f"  measured: gradients, checkpointed vs not (fp32): max relative error "
          f"{result['grad_max_rel_error']:.1e} (check: <= 1e-5)")
    for name, row in rows.items():
        plain = plain_rows[name.removesuffix(CHECKPOINTED)]
        fewer = plain["activations_measured"] / row["activations_measured"]
        print(f"  derived: {name}: activations / {fewer:.1f} (measured)")
    for name, timing in result["timings"].items():
        print(f"  measured: {name}: step {milliseconds(timing['checkpointed'])} ms, "
              f"without checkpointing {milliseconds(timing['plain'])} ms"
              f"{busy_mark(result['busy'])}")
    predictions = result["predictions"]
    ratios = []
    for name, row in rows.items():
        measured_ratio = row["activations_measured"] / row["activations_predicted"]
        ratios.append(f"{name} {measured_ratio:.4f}")
    print(f"{verdict(predictions['checkpoint_activations'])}: activations measured / "
          f"predicted: {', '.join(ratios)} (predicted: within 2%)")
    for name in rows:
        if name not in result["timings"]:
            print(f"  {name}: not timed on a CPU (its bf16 step: seconds of conversions)")
    for name, timing in result["timings"].items():
        cost = timing["cost"]
        shown = f"{cost['median'] - 1:+.0%} "
        shown += f"[{cost['min'] - 1:+.0%}, {cost['max'] - 1:+.0%}]"
        shown += noise_mark(cost, result["busy"])
        print(f"{verdict(timing['held'])}: {name} costs {shown} of the step, pair by pair "
              f"(predicted: it costs time; FLOPs +{result['extra_flops']:.0%})")


# ---------------------------------------------------------------------------------------
# 4. Gradient accumulation

def forward_backward(model, chunks):
    """The gradient of the mean loss over equal chunks, one chunk's graph alive at a time
    (each loss / len(chunks), adding into .grad): the most bytes one chunk saved."""
    saved = []
    for x, y in chunks:
        loss, saved_bytes = forward_counted(model, x, y, bf16=False)
        (loss / len(chunks)).backward()
        saved.append(saved_bytes)
    return max(saved)


def accumulation(sizes, device):
    """PREDICTION: with equal token counts the mean of the k micro-batch mean losses is the
    full batch's, so the sum of grad(loss_i / k) is grad(loss) up to fp32 rounding (~1e-6
    relative; 1e-4 allowed). Activations live one micro-batch at a time: the peak above
    the weights is one micro-batch's activations and head gradients plus the gradients
    (kept from the first micro-batch on), not the whole batch's (predicted_rise_bytes),
    within 5%: GPT-2, 8 sequences: 9,378 MiB as one batch, 2,819 as 4 micro-batches of 2; the
    tiny CPU GPT, 4 sequences: 81.2 MiB, 25.5 as 4 micro-batches of 1."""
    config = sizes.model
    k = min(sizes.micro_batches, sizes.batch)
    micro = sizes.batch // k
    predicted_full = predicted_rise_bytes(config, sizes.batch, grads_alive=False)
    predicted_micro = predicted_rise_bytes(config, micro, grads_alive=True)
    print(f"\n[4] gradient accumulation, fp32: {k} micro-batches of {micro} x "
          f"{config.block_size} tokens vs one batch of {sizes.batch}")
    print(f"predicted: gradients equal (<= 1e-4 relative); peak above the weights "
          f"{mib(predicted_full)} MiB for the batch, {mib(predicted_micro)} MiB for its "
          f"micro-batches, within 5%")
    model, _, x, y = new_run(config, sizes.batch, device)
    full = [(x, y)]
    chunks = []
    for x_micro, y_micro in zip(x.chunk(k), y.chunk(k)):
        # its own tensors, as from a data loader
        chunks.append((x_micro.clone(), y_micro.clone()))
    saved_full, rise_full = peak_rise(lambda: forward_backward(model, full), device)
    grads_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    saved_micro, rise_micro = peak_rise(lambda: forward_backward(model, chunks), device)
    grads_micro = [p.grad for p in model.parameters()]
    # forgetting the 1/k is off by k - 1; a micro-batch skipped, by about 1/k
    error = max_rel_error(grads_micro, grads_full)
    checks = dict(accumulated_grads_equal_full_batch=error < 1e-4,
                  accumulation_peak_below_full_batch=rise_micro < rise_full)
    full_ratio = rise_full / predicted_full
    micro_ratio = rise_micro / predicted_micro
    held = abs(full_ratio - 1) < 0.05 and abs(micro_ratio - 1) < 0.05
    return dict(k=k, micro_batch=micro, batch=sizes.batch,
                activations_predicted_full=activation_bytes(config, sizes.batch),
                activations_predicted_micro=activation_bytes(config, micro),
                activations_counted_full=saved_full,
                activations_counted_micro=saved_micro,
                peak_rise_predicted_full=predicted_full,
                peak_rise_predicted_micro=predicted_micro,
                peak_rise_full=rise_full,
                peak_rise_micro=rise_micro,
                grad_max_rel_error=error, checks=checks,
                predictions=dict(accumulation_peak=held))


def report_accumulation(result):
    print(f"  measured: gradients, max relative error {result['grad_max_rel_error']:.1e} "
          f"(check: < 1e-4)")
    print("  MiB                   activations          peak above the weights")
    print("                        predicted  counted   predicted  measured")
    labels = dict(full=f"one batch of {result['batch']}",
                  micro=f"{result['k']} micro-batches of {result['micro_batch']}")
    for key, label in labels.items():
        print(f"  {label:<20}{mib(result[f'activations_predicted_{key}']):>11}"
              f"{mib(result[f'activations_counted_{key}']):>9}"
              f"{mib(result[f'peak_rise_predicted_{key}']):>12}"
              f"{mib(result[f'peak_rise_{key}']):>10}")
    full = result["peak_rise_full"] / result["peak_rise_predicted_full"]
    micro = result["peak_rise_micro"] / result["peak_rise_predicted_micro"]
    print(f"{verdict(result['predictions']['accumulation_peak'])}: peaks measured / predicted "
          f"{full:.3f} (one batch), {micro:.3f} (micro-batches) (predicted: within 5%)")


# ---------------------------------------------------------------------------------------
# 5. What fits

def search_largest_batch(fits, fit, miss):
    """The largest batch for which fits(batch) is True (0: none), from a batch that should
    fit and one that should not: each is tried first (and halved or doubled while it is
    wrong), then the gap between them is bisected."""
    while fit > 0 and not fits(fit):
        miss = fit
        fit = fit // 2
    while fits(miss):
        fit = miss
        miss = 2 * miss
    while miss - fit > 1:
        middle = (fit + miss) // 2
        if fits(middle):
            fit = middle
        else:
            miss = middle
    return fit


def predicted_largest_batch(config, memory_bytes, bf16, headroom=1.0):
    """Pure arithmetic: the largest batch whose predicted peak, times headroom, fits."""
    def fits(batch):
        return headroom * predicted_peak_bytes(config, batch, bf16) <= memory_bytes
    return search_largest_batch(fits, 0, 1)


def step_fits(model, opt, batch, bf16):
    """One training step at this batch on the GPU: True, or False when memory ran out
    (the allocator's OutOfMemoryError, or a library's workspace failing)."""
    config = model.config
    torch.cuda.empty_cache()  # every try starts from an empty cache, as a new run would
    try:
        x = torch.randint(0, config.vocab_size, (batch, config.block_size), device="cuda")
        train_step(model, opt, x, x, bf16)
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        pass
    except RuntimeError as error:  # e.g. CUBLAS_STATUS_ALLOC_FAILED
        message = str(error)
        if "ALLOC_FAILED" not in message and "out of memory" not in message.lower():
            raise
    opt.zero_grad(set_to_none=True)  # out of the except block: its traceback held tensors
    gc.collect()
    torch.cuda.empty_cache()
    return False


def measured_largest_batch(config, bf16, fit, miss):
    """The largest batch that fits this card, found by full steps with out-of-memory
    caught, starting from the accounting's two predictions."""
    model, opt, _, _ = new_run(config, 1, "cuda")
    step_fits(model, opt, 1, bf16)  # creates AdamW's moments: every try is a steady step
    def fits(batch):
        return step_fits(model, opt, batch, bf16)
    return search_largest_batch(fits, fit, miss)


def what_fits(memories, search, configurations):
    """PREDICTION: the largest batch lies between two predictions of the accounting: its
    peak times ALLOCATOR_HEADROOM (1.2: the caching allocator's rounding and cached
    blocks, cuBLAS's workspaces) fits, and the tensors alone (an upper bound) fit. bf16
    halves most block activations (not the fp32 logits), checkpointing keeps one tensor
    per block: each raises the largest batch. GPT-2 124M at T=1024 on a 24 GiB card:
    fp32 16-19 sequences, bf16 20-24, checkpointed 30-36 in either precision;
    on an 80 GB H100 (78.6 GiB for tensors) 56-67, 71-85, 103-125 and 104-125. On a GPU
    each is tried: one step per batch, out-of-memory caught, between the two predictions."""
    here = list(memories)[0]  # this card's memory (or --memory-gb's); the book's after it
    print(f"\n[5] what fits: GPT-2 124M, {FIT_MODEL.block_size}-token sequences, one "
          f"AdamW step")
    print(f"predicted: the largest batch between the accounting's with {ALLOCATOR_HEADROOM}x "
          f"headroom and with the tensors alone; each technique raises it")
    if search:
        print("  (trying steps on this card, out-of-memory caught: half a minute or so)")
        torch.set_float32_matmul_precision("high")  # TF32: a faster search, the same bytes
    rows = {}
    for c in configurations:
        config = replace(FIT_MODEL, checkpoint=c.checkpoint)
        with_headroom = {}
        tensors_alone = {}
        for label, memory in memories.items():
            with_headroom[label] = predicted_largest_batch(config, memory, c.bf16,
                                                           ALLOCATOR_HEADROOM)
            tensors_alone[label] = predicted_largest_batch(config, memory, c.bf16)
        measured = None
        if search:
            measured = measured_largest_batch(config, c.bf16, with_headroom[here],
                                              tensors_alone[here] + 1)
        rows[c.name] = dict(predicted=tensors_alone,
                            predicted_with_headroom=with_headroom,
                            measured=measured)
    torch.set_float32_matmul_precision("highest")
    predictions = {}
    if search:
        between = []
        for row in rows.values():
            between.append(row["predicted_with_headroom"][here] <= row["measured"])
            between.append(row["measured"] <= row["predicted"][here])
        raises = []
        for without, with_it in LADDER:
            if without in rows and with_it in rows:
                raises.append(rows[without]["measured"] < rows[with_it]["measured"])
        predictions["fit_between_predictions"] = all(between)
        predictions["fit_each_technique_raises"] = all(raises)
    return dict(model=asdict(FIT_MODEL), memories=memories, here=here, rows=rows,
                checks={}, predictions=predictions)


def report_what_fits(result):
    here = result["here"]
    header = f"  {'largest batch':<27}"
    for label in result["memories"]:
        header += f"{label + ' card':<26}"
    print(header.rstrip())
    for name, row in result["rows"].items():
        line = f"  {name:<27}"
        for label in result["memories"]:
            cell = f"{row['predicted_with_headroom'][label]}-{row['predicted'][label]}"
            if label == here and row["measured"] is not None:
                cell += f", measured {row['measured']}"
            line += f"{cell:<26}"
        print(line.rstrip())
    print(f"  (predicted: with {ALLOCATOR_HEADROOM}x headroom - the tensors alone; measured: "
          f"the largest batch whose step ran; for tensors: the card less what is used "
          f"outside torch's allocator)")
    predictions = result["predictions"]
    if not predictions:
        print("  not tried: predictions only, without a GPU to try them on")
        return
    print(f"{verdict(predictions['fit_between_predictions'])}: every measured largest batch "
          f"between its two predictions")
    print(f"{verdict(predictions['fit_each_technique_raises'])}: each technique raises the "
          f"measured largest batch")


def measured_peak_batch1(config, bf16):
    """max_memory_allocated over one steady-state batch-1 step on this card (None: it does
    not fit)."""
    model, opt, _, _ = new_run(config, 1, "cuda")
    if not step_fits(model, opt, 1, bf16):  # the first step creates AdamW's moments
        return None
    torch.cuda.reset_peak_memory_stats()
    if not step_fits(model, opt, 1, bf16):
        return None
    return torch.cuda.max_memory_allocated()


def big_model(memories, search, configurations):
    """PREDICTION: GPT-2 large at T=8192: its state is 16 B x 783M = 11.7 GiB in any
    precision, its fp32 activations 24.1 GiB per sequence (bf16: 15.7). Batch 1 peaks at
    36.0 GiB in fp32 and 27.5 GiB in bf16, over a 24 GiB card; checkpointed at 14.8 and
    14.9 GiB: a 24 GiB card fits it only checkpointed (batch 2 there, and any batch by
    accumulation). On a GPU batch 1 is tried on this card: it fits where its predicted
    peak with ALLOCATOR_HEADROOM fits, and not where the peak alone is over."""
    here = list(memories)[0]
    print(f"\n[5b] GPT-2 large ({param_count(BIG_MODEL) / 1e6:.0f}M) at "
          f"T={BIG_MODEL.block_size}: the state fits a {BOOK_CARD_GB} GiB card, the "
          f"activations do not")
    print(f"predicted: on a {BOOK_CARD_GB} GiB card batch 1 fits only checkpointed")
    if search:
        torch.set_float32_matmul_precision("high")  # TF32: a faster try, the same bytes
    rows = {}
    for c in configurations:
        config = replace(BIG_MODEL, checkpoint=c.checkpoint)
        largest = {}
        for label, memory in memories.items():
            largest[label] = predicted_largest_batch(config, memory, c.bf16)
        peak = predicted_peak_bytes(config, 1, c.bf16)
        row = dict(predicted=largest, peak_predicted=peak, peak_measured=None)
        if search:
            row["peak_measured"] = measured_peak_batch1(config, c.bf16)
        rows[c.name] = row
    torch.set_float32_matmul_precision("highest")
    predictions = {}
    if search:
        agree = []
        # a peak between memory / headroom and memory may go either way: not judged
        for row in rows.values():
            fits = row["peak_measured"] is not None
            if ALLOCATOR_HEADROOM * row["peak_predicted"] <= memories[here]:
                agree.append(fits)
            if row["peak_predicted"] > memories[here]:
                agree.append(not fits)
        predictions["big_model_fits_as_predicted"] = all(agree)
    return dict(model=asdict(BIG_MODEL), memories=memories, here=here, rows=rows,
                checks={}, predictions=predictions)


def report_big_model(result):
    here = result["here"]
    print("  batch 1, GiB               peak predicted  measured    largest batch predicted")
    for name, row in result["rows"].items():
        measured = "-"
        if row["peak_measured"] is not None:
            measured = f"{row['peak_measured'] / GiB:.1f}"
        elif result["predictions"]:
            measured = f"over {here}"
        largest = []
        for label, batch in row["predicted"].items():
            largest.append(f"{label}: {batch}")
        print(f"  {name:<27}{row['peak_predicted'] / GiB:>10.1f}{measured:>14}    "
              f"{', '.join(largest)}")
    print("  (measured: max_memory_allocated over one batch-1 step; over: out of memory)")
    if not result["predictions"]:
        print("  not tried: predictions only, without a GPU to try them on")
        return
    print(f"{verdict(result['predictions']['big_model_fits_as_predicted'])}: batch 1 fits "
          f"{here} where predicted (with headroom), and not where its peak is over")


def figure(rows, state, path):
    """Each configuration at its peak, predicted beside measured: the parameters, AdamW's
    moments and the activations, alive from forward into backward, and the rest of the
    peak (at backward's start: the head's gradients). The gradients are not yet alive
    there: backward frees each layer's activations as it writes that layer's gradients."""
    fig = Figure(figsize=(9, 4.8))
    ax = fig.subplots()
    x = 0
    ticks = []
    for name, row in rows.items():
        ticks.append(x + 0.5)
        for kind in ("predicted", "measured"):
            activations = row[f"activations_{kind}"]
            peak = row[f"peak_{kind}"]
            held = state["params"] + state["optimizer"] + activations
            parts = {"params": state["params"], "AdamW moments": state["optimizer"],
                     "activations": activations, "the rest of the peak": max(0, peak - held)}
            bottom = 0
            for color, (part, size) in enumerate(parts.items()):
                ax.bar(x, size / MiB, bottom=bottom, color=f"C{color}", label=part)
                bottom += size / MiB
            ax.plot([x - 0.4, x + 0.4], [peak / MiB, peak / MiB], "k-", lw=2, label="peak")
            x += 1
        x += 1  # a gap between configurations
    labels = [f"{name}\npredicted | measured" for name in rows]
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set(ylabel="MiB", title="one training step at its peak: what is alive")
    handles, names = ax.get_legend_handles_labels()
    legend = dict(zip(names, handles))  # one entry per part
    ax.legend(legend.values(), legend.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------
# The tools every experiment above uses: clocks on a busy machine (interleaved samples,
# medians with their spread), bytes on a GPU and on a CPU, and printing

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


def interleaved(fns, reps):
    """Seconds of each call of each function, the functions called in turn (A, B, A, B,
    ...), so a machine slowed for a while slows every side alike. Each function
    synchronises its own device before it returns."""
    seconds = [[] for _ in fns]
    for _ in range(reps):
        for samples, fn in zip(seconds, fns):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return seconds


def compare(fns, reps):
    """Time the functions interleaved, after one warm-up call each; the CPU's share is
    sampled before and after: busy when another program took the CPU meanwhile."""
    shares = [cpu_share()]
    for fn in fns:
        fn()  # warm-up: the first call allocates, and on a GPU loads its kernels
    seconds = interleaved(fns, reps)
    shares.append(cpu_share())
    busy = min(shares) < BUSY_SHARE
    return seconds, shares, busy


def ratio(a_seconds, b_seconds):
    """a / b pair by pair (the i-th of each, measured side by side): median, min, max."""
    ratios = [a / b for a, b in zip(a_seconds, b_seconds)]
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))


def noise_mark(r, busy):
    """'' for a finding: the ratio's whole range on one side of 1, the machine quiet."""
    if busy:
        return " (machine busy)"
    if r["min"] <= 1 <= r["max"]:
        return " (within noise)"
    return ""


def milliseconds(seconds):
    """A timing as its median with its [min, max], in ms."""
    median = statistics.median(seconds) * 1e3
    return f"{median:.1f} [{min(seconds) * 1e3:.1f}, {max(seconds) * 1e3:.1f}]"


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def allocated(device):
    """The bytes of live tensors on the GPU; a CPU has no such counter (0)."""
    if device == "cuda":
        return torch.cuda.memory_allocated()
    return 0


def peak_rise(fn, device):
    """Call fn; return its result and the most bytes alive during it above those at its
    start. CUDA: the allocator's peak counter. CPU: the profiler's trace (the JSON that
    Perfetto and chrome://tracing read) lists every allocation (+bytes) and free (-bytes):
    the largest running sum. fn must free only what it allocated."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    changes = [event for event in trace["traceEvents"] if event.get("name") == "[memory]"]
    changes.sort(key=lambda event: event["ts"])
    alive = 0
    most = 0
    for change in changes:
        alive += change["args"]["Bytes"]
        most = max(most, alive)
    return result, most


def mib(n):
    return f"{n / MiB:,.1f}"


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def moments(opt):
    """AdamW's exp_avg and exp_avg_sq tensors (not its per-parameter 'step' counters)."""
    states = opt.state.values()
    return [s["exp_avg"] for s in states] + [s["exp_avg_sq"] for s in states]


def max_rel_error(tensors, references):
    """The largest max |a - b| / max |b| over pairs of tensors."""
    errors = []
    for a, b in zip(tensors, references):
        scale = b.abs().max().clamp_min(1e-30)
        errors.append(((a - b).abs().max() / scale).item())
    return max(errors)


# ---------------------------------------------------------------------------------------
# The section, in order

def main():
    args = parse_args()
    json_file = None
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        json_file = open(args.json, "w")  # a path that cannot be written fails here
    args.out.mkdir(parents=True, exist_ok=True)
    device = args.device
    if device == "auto":
        device = "cpu"
        if torch.cuda.is_available():
            device = "cuda"
    bf16_skipped = bf16_unsupported(device)
    machine = describe_device(device, bf16_skipped)
    memory = device_memory(device, args.memory_gb, bf16_skipped)
    sizes = SIZES[device]
    if args.quick:
        sizes = SIZES["quick"]
    if device == "cuda":
        sizes = sized_for(sizes, memory["tensors"])
    configurations = []
    for c in CONFIGURATIONS:
        if bf16_skipped is None or not c.bf16:
            configurations.append(c)
    print(f"model: {asdict(sizes.model)}; fused AdamW; fp32 without TF32")

    results = {}
    results["anatomy"] = anatomy(sizes, device)
    report_anatomy(results["anatomy"])
    results["mixed_precision"] = mixed_precision(sizes, device, configurations,
                                                 bf16_skipped)
    report_mixed_precision(results["mixed_precision"])
    plain_rows = results["mixed_precision"]["rows"]
    results["checkpointing"] = checkpointing(sizes, device, configurations, plain_rows)
    report_checkpointing(results["checkpointing"], plain_rows)
    results["accumulation"] = accumulation(sizes, device)
    report_accumulation(results["accumulation"])
    memories = fit_memories(memory)
    results["what_fits"] = what_fits(memories, sizes.search, configurations)
    report_what_fits(results["what_fits"])
    results["big_model"] = big_model(memories, sizes.search, configurations)
    report_big_model(results["big_model"])

    rows = dict(plain_rows, **results["checkpointing"]["rows"])
    path = args.out / "04_memory.png"
    if args.memory_gb is not None:  # the figure's name says which run made it
        path = args.out / f"04_memory_{args.memory_gb:g}gb.png"
    figure(rows, state_bytes(sizes.model), path)
    print(f"\nfigure: {path}")
    finish(args, json_file, results, machine, memory, sizes)


# ---------------------------------------------------------------------------------------
# Flags, the device and its memory (what the sizes are chosen for), the results

def memory_gb(text):
    """--memory-gb: a card's memory in GiB, from 6 (two GPT-2 sequences fit) to 1024."""
    value = float(text)
    if not 6 <= value <= 1024:  # NaN too
        raise argparse.ArgumentTypeError(f"{text}: a card's memory in GiB, from 6 to 1024")
    return value


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--out", type=Path, default=Path("out"), help="figure folder")
    parser.add_argument("--memory-gb", type=memory_gb,
                        help="behave as on a card of this many GiB: torch's allocator capped, "
                             "the sizes chosen for it (default: the whole card; on a CPU only "
                             "[5]'s predictions use it, default 24: the book's card)")
    return parser.parse_args()


def bf16_unsupported(device):
    """Why this device runs no bf16 rows, or None. A GPU before compute capability 8.0 (a
    T4, a V100) has no bf16 tensor cores; a CPU runs bf16 autocast, slowly ([2] shows it)."""
    if device != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 0):
        return f"compute capability {major}.{minor} < 8.0: no bf16 tensor cores"
    return None


def describe_device(device, bf16_skipped):
    info = dict(type=device, torch=torch.__version__)
    if device == "cuda":
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["name"] = properties.name
        info["capability"] = f"{properties.major}.{properties.minor}"
        info["total_memory"] = properties.total_memory
        print(f"device: {properties.name}, {properties.total_memory / GiB:.1f} GiB, compute "
              f"capability {info['capability']} | torch {torch.__version__}")
    else:
        threads = torch.get_num_threads()
        info["name"] = f"CPU, {threads} threads, {torch.backends.cpu.get_cpu_capability()}"
        print(f"device: {info['name']} | torch {torch.__version__}")
    if bf16_skipped is not None:
        print(f"bf16 rows skipped: {bf16_skipped}")
    return info


def tensor_bytes(memory_gb, outside):
    """The bytes torch's allocator can hold on a card of memory_gb GiB: all of it but what
    is used outside the allocator (the CUDA context; 0 on a CPU)."""
    return int(memory_gb * GiB) - outside


def cap_fraction(memory_gb, total, outside):
    """The fraction of this card's total memory to pass to
    torch.cuda.set_per_process_memory_fraction so that torch's allocator holds what it
    would on a card of memory_gb GiB: the cap counts the allocator's own bytes only, not
    the CUDA context, which the smaller card holds too."""
    return tensor_bytes(memory_gb, outside) / total


def warm_up_cuda(bf16_skipped):
    """cuBLAS takes its workspaces from the allocator on first use, and the CUDA context
    grows as kernels load: both before anything is counted."""
    precisions = [False]
    if bf16_skipped is None:
        precisions.append(True)
    for bf16 in precisions:
        model, opt, x, y = new_run(SIZES["quick"].model, 1, "cuda")
        train_step(model, opt, x, y, bf16)
    gc.collect()
    torch.cuda.empty_cache()


def device_memory(device, memory_gb, bf16_skipped):
    """The memory the lesson sizes for: on a GPU the whole card, or with --memory-gb a
    smaller one, emulated by capping torch's allocator. What the CUDA context (and any
    other program) uses lies outside the allocator: measured as total - free - reserved
    once torch has warmed up. On a CPU nothing is capped: --memory-gb (default the book's
    24 GiB) only sets the card [5] predicts for."""
    if device != "cuda":
        if memory_gb is None:
            memory_gb = BOOK_CARD_GB
        print(f"memory: a CPU: [5] predicts for a {memory_gb:g} GiB card (--memory-gb); "
              f"nothing is capped")
        tensors = tensor_bytes(memory_gb, 0)
        return dict(gb=memory_gb, outside=0, tensors=tensors, fraction=None)
    warm_up_cuda(bf16_skipped)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    free = torch.cuda.mem_get_info()[0]
    outside = total - free - torch.cuda.memory_reserved()
    if memory_gb is not None and memory_gb * GiB >= total:
        print(f"memory: --memory-gb {memory_gb:g} is not less than this card's "
              f"{total / GiB:.1f} GiB: the whole card")
        memory_gb = None
    fraction = None
    if memory_gb is None:
        memory_gb = total / GiB
        print(f"memory: the whole card, {memory_gb:.1f} GiB; {outside / GiB:.2f} GiB of it "
              f"used outside torch's allocator (the CUDA context; measured: total - free - "
              f"reserved)")
    else:
        fraction = cap_fraction(memory_gb, total, outside)
        torch.cuda.set_per_process_memory_fraction(fraction)
        print(f"memory: as a {memory_gb:g} GiB card: torch's allocator capped at "
              f"{tensor_bytes(memory_gb, outside) / GiB:.2f} GiB (a fraction {fraction:.4f} "
              f"of this card's {total / GiB:.1f}), since the cap does not count the "
              f"{outside / GiB:.2f} GiB used outside the allocator (the CUDA context; "
              f"measured: total - free - reserved), which a {memory_gb:g} GiB card holds too")
    return dict(gb=memory_gb, outside=outside, tensors=tensor_bytes(memory_gb, outside),
                fraction=fraction, total=total)


def step_batch(config, most, memory_bytes):
    """The batch of experiments 1-4 on a GPU: the most sequences, up to `most`, whose fp32
    step fits memory_bytes by the accounting with ALLOCATOR_HEADROOM (fp32 without
    checkpointing peaks highest of the four configurations). None: not one sequence."""
    count = micro_batches(config, most, memory_bytes, bf16=False)
    if count is None:
        return None
    return most // count


def sized_for(sizes, memory_bytes):
    """The GPU's sizes with the batch this card holds, printed with its prediction."""
    batch = step_batch(sizes.model, sizes.batch, memory_bytes)
    if batch is None or batch < 2:
        sys.exit(f"{memory_bytes / GiB:.1f} GiB for tensors hold fewer than 2 GPT-2 "
                 f"sequences per step (predicted): run with --device cpu")
    peak = ALLOCATOR_HEADROOM * predicted_peak_bytes(sizes.model, batch)
    print(f"sizes: batch {batch} (at most {sizes.batch}): its fp32 step "
          f"{peak / GiB:.1f} of {memory_bytes / GiB:.1f} GiB predicted (with the "
          f"allocator's {ALLOCATOR_HEADROOM}x headroom)")
    return replace(sizes, batch=batch)


def fit_memories(memory):
    """[5]'s columns, GiB: this card (or --memory-gb's), then the book's 24 GiB card."""
    memories = {f"{memory['gb']:.1f} GiB": memory["tensors"]}
    book = f"{BOOK_CARD_GB:.1f} GiB"
    if book not in memories:
        memories[book] = tensor_bytes(BOOK_CARD_GB, memory["outside"])
    return memories


def verdict(held):
    if held:
        return "prediction held"
    return "prediction missed"


def busy_mark(busy):
    if busy:
        return " (machine busy)"
    return ""


def finish(args, json_file, results, machine, memory, sizes):
    """Gather the checks, predictions and CPU shares; say whether the machine was busy;
    write the JSON; exit non-zero if a check failed."""
    checks = {}
    predictions = {}
    shares = []
    busy = []
    for name, result in results.items():
        checks.update(result.pop("checks"))
        predictions.update(result.pop("predictions"))
        shares += result.get("cpu_shares", [])
        if result.get("busy"):
            busy.append(name)
    if busy:
        print(f"machine busy: other programs took the CPU during {', '.join(busy)}; the "
              f"marked numbers are not findings")
    for name, ok in checks.items():
        print(f"check {name}: {'ok' if ok else 'FAILED'}")
    if json_file is not None:
        result = dict(lesson="04_memory", quick=args.quick, device=machine, memory=memory,
                      sizes=asdict(sizes), checks=checks, predictions=predictions,
                      machine_busy=bool(busy), cpu_shares=shares, **results)
        json.dump(result, json_file, indent=1)
        json_file.close()
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        sys.exit(f"check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
