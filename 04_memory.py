"""
04_memory.py - Section 13.4: the memory anatomy of a training step.

Where do the bytes of an AdamW step go? model_torch's accounting predicts each part, then
the lesson measures it: CUDA's memory_allocated on a GPU, the profiler's allocations and
frees on a CPU, and on both the bytes autograd saves for backward (a saved-tensors hook).
  1. anatomy: parameters, gradients, AdamW's two moments, activations term by term
  2. bf16 autocast: what it keeps in fp32, what it halves, the step time
  3. activation checkpointing: fewer activation bytes, a slower step, equal gradients
  4. gradient accumulation: equal gradients, a peak bounded by the micro-batch
  5. what fits: the largest batch on this card and under a 24 GiB budget (an RTX 4090),
     and GPT-2 large at T=8192, which fits 24 GiB only with the techniques
GPT-2 124M on a GPU, a tiny GPT on a CPU; one process (a second GPU adds nothing here).
Copy this file and model_torch.py; the figure goes to out/04_memory.png.
  python 04_memory.py                       # one GPU when there is one; otherwise the CPU
  python 04_memory.py --device cpu --quick  # seconds: what the tests run
  python 04_memory.py --budget-gb 16        # section 5 for a 16 GiB card
Expect the state to the byte, activations and peaks within a few percent, the state in
fp32 under autocast, equal gradients under checkpointing and accumulation, and each
technique raising the largest batch.
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
import gc
import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before torch: no profiler USDT lines
try:  # first: a missing file is said at once, not after torch has imported
    from model_torch import (GPT, GPTConfig, activation_bytes, activation_terms,  # noqa: E402
                             block_activation_terms, flops_per_token, state_bytes)
except ModuleNotFoundError as error:
    if error.name != "model_torch":
        raise
    sys.exit("error: model_torch.py is missing: copy it beside 04_memory.py")
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

if __name__ == "__main__":  # from here Ctrl-C is a KeyboardInterrupt: main() ends cleanly
    signal.signal(signal.SIGINT, signal.default_int_handler)

MiB = 2**20
GiB = 2**30
BUSY = "  unreliable (machine busy)"

def cpu_model():
    # a 4096-token vocabulary: at 50304 the logits would hide the blocks of so small a model
    return GPTConfig.preset("tiny", vocab_size=4096)

@dataclass
class Sizes:
    """The CPU's sizes; the GPU and --quick rows name only what differs."""
    model: GPTConfig = field(default_factory=cpu_model)
    batch: int = 4          # sequences per step in experiments 1-3
    micro_batches: int = 4  # k, experiment 4
    micro_batch: int = 1    # sequences per micro-batch in experiment 4
    reps: int = 3           # timed steps per configuration

QUICK_MODEL = GPTConfig.preset("tiny", n_layer=2, block_size=64, vocab_size=4096)
SIZES = {
    "cpu": Sizes(),
    "cuda": Sizes(model=GPTConfig.preset("gpt2"), batch=8, micro_batch=4, reps=10),
    "quick": Sizes(model=QUICK_MODEL, batch=2, reps=2),
}

CONFIGURATIONS = [  # name, bf16 autocast, activation checkpointing
    ("fp32", False, False),
    ("bf16 autocast", True, False),
    ("fp32 + checkpoint", False, True),
    ("bf16 + checkpoint", True, True),
]

# each technique raises the largest batch: (without, with)
LADDER = [
    ("fp32", "bf16 autocast"),
    ("bf16 autocast", "bf16 + checkpoint"),
    ("fp32", "fp32 + checkpoint"),
]

FIT_MODEL = GPTConfig.preset("gpt2")  # the fit table: GPT-2 124M, T=1024
# GPT-2 large (774M with T=1024; 783M with this longer position table), T=8192
BIG_MODEL = GPTConfig(n_layer=36, n_head=20, n_embd=1280, block_size=8192)

# model_torch names each saved tensor by what keeps it; the largest is better known by
# what it is: the logits, kept as fp32 log-probabilities for the loss's backward
TERM_NAMES = {"log_softmax": "logits (fp32 log-softmax, V per token)"}

def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()

def allocated(device):
    """The bytes of live tensors on the GPU; a CPU has no such counter (0)."""
    if device == "cuda":
        return torch.cuda.memory_allocated()
    return 0

def mib(n):
    return f"{n / MiB:,.1f}"

def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)

def moments(opt):
    """AdamW's exp_avg and exp_avg_sq tensors (not its per-parameter 'step' counters)."""
    states = opt.state.values()
    return [s["exp_avg"] for s in states] + [s["exp_avg_sq"] for s in states]

def gradients(model):
    return [p.grad.clone() for p in model.parameters()]

def max_rel_error(tensors, references):
    """The largest max |a - b| / max |b| over pairs of tensors."""
    errors = []
    for a, b in zip(tensors, references):
        scale = b.abs().max().clamp_min(1e-30)
        errors.append(((a - b).abs().max() / scale).item())
    return max(errors)

def mark(unreliable):
    if unreliable:
        return BUSY
    return ""

def spread_too_wide(timing):
    """The one rule for a timing: samples spread wider than their median."""
    return timing["max_s"] - timing["min_s"] > timing["median_s"]

def bench(fn, device, reps, warmup=1):
    """Call fn warmup times, then time reps calls: median, min and max seconds. GPU work
    is asynchronous: the device is synchronised before every clock read."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times))

def new_run(config, batch, device):
    """A model built on the device (memory_allocated then sees only its parameters), its
    AdamW and one batch of random tokens. lr=0: AdamW steps its moments but not the
    weights, so every configuration sees the same weights."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(replace(config))  # its own config: checkpointing is flipped on it
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

def peak_rise(fn, device):
    """Call fn; return its result and the most bytes alive during it above those at its
    start. CUDA: the allocator's peak. CPU: the running sum of the profiler's
    allocations (positive) and frees (negative); fn frees only what it allocated."""
    if device == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        result = fn()
        sync(device)
        return result, torch.cuda.max_memory_allocated() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = prof.profiler.kineto_results.events()
    changes = [e for e in events if e.name() == "[memory]"]
    changes.sort(key=lambda e: e.start_ns())
    alive = 0
    most = 0
    for change in changes:
        alive += change.nbytes()
        most = max(most, alive)
    return result, most

def predicted_peak(config, batch, bf16):
    """Bytes alive at the peak of a steady-state step (AdamW's moments exist, gradients
    set to None). Backward frees each layer's activations as it writes that layer's
    gradients, so the peak is the larger of two moments, not the sum of the parts:
      backward's start  params + moments + activations + the head's gradients
      backward's end    params + grads + moments + the embedding's gradients
    Checkpointed backward re-runs one block at a time: its insides (and, under autocast,
    its bf16 weight copies) live again, beside the activations early and the gradients
    late."""
    state = state_bytes(config)
    tokens = batch * config.block_size
    activations = activation_bytes(config, batch, bf16=bf16)
    # two fp32 V-wide gradients per token: of the log-probabilities, of the logits
    head_grads = 8 * config.vocab_size * tokens
    # two fp32 V x d tensors: the tied embedding's gradient arrives twice and is summed
    embedding_grads = 8 * config.vocab_size * config.n_embd
    recompute = 0  # checkpointing: one block alive again
    if config.checkpoint:
        plain = replace(config, checkpoint=False)
        inside = block_activation_terms(plain, bf16=bf16)
        recompute = tokens * sum(inside.values())
        if bf16:
            recompute += 2 * 12 * config.n_embd**2  # that block's bf16 weight copies
    held = state["params"] + state["optimizer"]  # alive through the whole step
    backward_start = held + activations + max(head_grads, recompute)
    backward_end = held + state["grads"] + max(embedding_grads, recompute)
    return max(backward_start, backward_end)

def largest_batch(fits, first_try=1):
    """The largest batch that fits (0: none), doubling from a first try, then bisecting."""
    fit = 0
    miss = first_try
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

def predicted_largest_batch(config, budget, bf16):
    """Pure arithmetic: the largest batch whose predicted peak fits `budget` bytes."""
    return largest_batch(lambda batch: predicted_peak(config, batch, bf16) <= budget)

def anatomy(sizes, device):
    """PREDICTION: params = grads = 4 B x N and AdamW's exp_avg + exp_avg_sq = 8 B x N:
    16 B of state per parameter, to the byte. Activations, alive from forward until
    backward frees them: activation_terms, within 2% (a CPU's count: to the byte). For
    GPT-2 at T=1024 the largest single tensor is the logits, 4 B x 50304 per token: a
    quarter of the activations, more than the 12 blocks' MLP hidden layers together."""
    base = allocated(device)
    model, opt, x, y = new_run(sizes.model, sizes.batch, device)
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
    predicted = state_bytes(sizes.model)
    predicted["activations"] = activation_bytes(sizes.model, sizes.batch)
    terms = {}
    for name, size in activation_terms(sizes.model, sizes.batch).items():
        terms[TERM_NAMES.get(name, name)] = size
    measured = {}
    ratio = predicted["activations"] / counted["activations"]  # CPU: against the count
    if device == "cuda":  # each part: the jump in memory_allocated where it appears
        measured["params"] = after_init - base - nbytes([x, y])
        measured["activations"] = after_forward - after_init
        measured["grads"] = after_backward - after_init
        measured["optimizer"] = after_step - after_backward
        ratio = predicted["activations"] / measured["activations"]
    checks = {}
    for part in ("params", "grads", "optimizer"):
        checks[f"anatomy_{part}_exact"] = predicted[part] == counted[part]
    checks["anatomy_activations_within_2pct"] = abs(ratio - 1) < 0.02
    return dict(predicted=predicted, counted=counted, measured=measured,
                activations_ratio=ratio, activation_terms=terms, checks=checks)

def step_taken_apart(model, opt, x, y, bf16, device):
    """One more training step, watched: activation bytes counted by the hook and measured
    by the allocator, the loss, the peak, the state's dtypes and the gradients."""
    params = list(model.parameters())

    def step():
        before = allocated(device)
        loss, counted = forward_counted(model, x, y, bf16)
        measured = allocated(device) - before
        if device != "cuda":
            measured = counted  # a CPU has no allocation counter: the count stands in
        loss_value = loss.item()
        loss.backward()
        opt.step()
        return counted, measured, loss_value

    result, rise = peak_rise(step, device)
    counted, measured, loss_value = result
    dtypes = dict(params=sorted({str(p.dtype) for p in params}),
                  grads=sorted({str(p.grad.dtype) for p in params}),
                  optimizer=sorted({str(t.dtype) for t in moments(opt)}))
    row = dict(activations_counted=counted, activations_measured=measured,
               loss=loss_value, dtypes=dtypes)
    row["peak_measured"] = nbytes(params) + nbytes(moments(opt)) + rise
    grads = gradients(model)
    opt.zero_grad(set_to_none=True)
    return row, grads

def autocast_and_checkpointing(sizes, device):
    """PREDICTION, autocast: bf16 autocast casts copies, not the model: params, grads and
    AdamW's moments stay fp32. Matmul inputs are saved in bf16; the residual stream,
    LayerNorm statistics and the logits stay fp32: 36 d bytes per block and token instead
    of 64 d (Korthikanti et al. 2022 count 34 d: dropout masks in, LayerNorm inputs in
    bf16), plus bf16 copies of the weights once per step, more than the saving for a tiny
    model. Time: bf16 tensor cores several x fp32 (TF32 off); on a CPU without bf16
    instructions the step is SLOWER.
    PREDICTION, checkpointing: a block keeps only its fp32 input (4 d bytes per token, not
    64 d) and runs its forward again in backward: 24 L d^2 + 4 L T d more FLOPs per token
    (GPT-2 at T=1024: +24%), and the same gradients, since it recomputes the same ops.
    Peaks: predicted_peak."""
    model, opt, x, y = new_run(sizes.model, sizes.batch, device)
    rows = {}
    grads = {}
    for name, bf16, checkpoint in CONFIGURATIONS:
        model.config.checkpoint = checkpoint  # the switch is read at every forward
        # the warm-up step creates AdamW's moments
        timing = bench(lambda: train_step(model, opt, x, y, bf16), device, sizes.reps)
        row, grads[name] = step_taken_apart(model, opt, x, y, bf16, device)
        row.update(timing)
        row["activations_predicted"] = activation_bytes(model.config, sizes.batch, bf16=bf16)
        row["peak_predicted"] = predicted_peak(model.config, sizes.batch, bf16)
        rows[name] = row
    fp32 = rows["fp32"]
    bf16 = rows["bf16 autocast"]
    # fp32 recomputation repeats the same ops on the same inputs: equal to rounding. A block
    # recomputed from a wrong input, or a gradient lost, is off by O(1)
    error = max_rel_error(grads["fp32 + checkpoint"], grads["fp32"])
    saves = []
    for checkpointed, plain in (("fp32 + checkpoint", fp32), ("bf16 + checkpoint", bf16)):
        saves.append(rows[checkpointed]["activations_counted"] < plain["activations_counted"])
    state_dtypes = set()
    for dtypes in bf16["dtypes"].values():
        state_dtypes.update(dtypes)
    checks = dict(checkpoint_saves_activations=all(saves),
                  checkpoint_grads_equal=error <= 1e-5,
                  autocast_keeps_state_fp32=state_dtypes == {"torch.float32"},
                  bf16_loss_close_to_fp32=abs(bf16["loss"] / fp32["loss"] - 1) < 1e-3)
    config = sizes.model
    recompute_flops = 24 * config.n_layer * config.n_embd**2
    recompute_flops += 4 * config.n_layer * config.block_size * config.n_embd
    extra = recompute_flops / flops_per_token(config)
    return dict(rows=rows, grad_max_rel_error=error, checkpoint_extra_flops=extra,
                checks=checks)

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
    relative). Activations live one micro-batch at a time: the peak is a micro-batch's,
    not k x its."""
    k = sizes.micro_batches
    model, _, x, y = new_run(sizes.model, k * sizes.micro_batch, device)
    full = [(x, y)]
    micro = []
    for x_micro, y_micro in zip(x.chunk(k), y.chunk(k)):
        micro.append((x_micro.clone(), y_micro.clone()))  # its own tensors, as from a loader
    saved_full, rise_full = peak_rise(lambda: forward_backward(model, full), device)
    grads_full = gradients(model)
    model.zero_grad(set_to_none=True)
    saved_micro, rise_micro = peak_rise(lambda: forward_backward(model, micro), device)
    grads_micro = gradients(model)
    # forgetting the 1/k is off by k - 1; a micro-batch skipped, by about 1/k
    error = max_rel_error(grads_micro, grads_full)
    checks = dict(accumulated_grads_equal_full_batch=error < 1e-4,
                  accumulation_peak_below_full_batch=rise_micro < rise_full)
    return dict(k=k, micro_batch=sizes.micro_batch,
                activations_predicted_full=activation_bytes(sizes.model, k * sizes.micro_batch),
                activations_predicted_micro=activation_bytes(sizes.model, sizes.micro_batch),
                activations_counted_full=saved_full,
                activations_counted_micro=saved_micro,
                peak_rise_full=rise_full,
                peak_rise_micro=rise_micro,
                grad_max_rel_error=error, checks=checks)

def step_fits(model, opt, batch, bf16):
    """One full training step at this batch on the GPU: True, or False when memory ran
    out (the allocator's OutOfMemoryError, or a library's workspace failing)."""
    config = model.config
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

def measured_largest_batches(config, bf16, budgets, predicted):
    """Per budget, the largest batch found by full steps under a memory cap, OOM caught."""
    model, opt, _, _ = new_run(config, 1, "cuda")
    step_fits(model, opt, 1, bf16)  # creates AdamW's moments: every probe is steady state
    total = torch.cuda.get_device_properties(0).total_memory
    def fits(batch):
        return step_fits(model, opt, batch, bf16)

    measured = {}
    for key, budget in budgets.items():
        torch.cuda.empty_cache()  # the cap counts the allocator's cache too
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        first_try = predicted[key] + max(1, predicted[key] // 8)
        measured[key] = largest_batch(fits, first_try)
    torch.cuda.set_per_process_memory_fraction(1.0)
    return measured

def measured_peak_batch1(config, bf16):
    """max_memory_allocated over one steady-state batch-1 step, uncapped (None: it does
    not fit even the whole card)."""
    model, opt, _, _ = new_run(config, 1, "cuda")
    step_fits(model, opt, 1, bf16)  # creates AdamW's moments
    torch.cuda.reset_peak_memory_stats()
    if not step_fits(model, opt, 1, bf16):
        return None
    return torch.cuda.max_memory_allocated()

def fit_row(config, bf16, budgets, probe):
    predicted = {}
    for key, budget in budgets.items():
        predicted[key] = predicted_largest_batch(config, budget, bf16)
    measured = {}
    if probe:
        measured = measured_largest_batches(config, bf16, budgets, predicted)
    return dict(predicted=predicted, measured=measured,
                peak_batch1=predicted_peak(config, 1, bf16))

def big_row(config, bf16, budget, probe):
    """The big model: its largest batch predicted; on a GPU, batch 1's measured peak
    against the budget (measured 1: it fits, 0: it does not)."""
    row = dict(predicted=dict(budget=predicted_largest_batch(config, budget, bf16)),
               measured={}, peak_batch1=predicted_peak(config, 1, bf16))
    if probe:
        peak = measured_peak_batch1(config, bf16)
        row["measured_peak_batch1"] = peak
        row["measured"]["budget"] = 0
        if peak is not None and peak <= budget:
            row["measured"]["budget"] = 1
    return row

def what_fits(budget_gb, on_gpu):
    """PREDICTION (predicted_largest_batch): bf16 halves most block activations (not the
    fp32 logits), checkpointing keeps one tensor per block: each raises the largest
    batch. The big model's state is 16 B x 783M = 11.7 GiB in any precision, its fp32
    activations 24.1 GiB per 8192-token sequence (bf16: 15.7): batch 1 peaks at 36.0 GiB
    in fp32 and 27.5 GiB in bf16, over 24 GiB; checkpointed at 14.8 GiB: batch 2, and any
    batch by accumulation. Measured on a GPU: the peak of one uncapped batch-1 step
    (max_memory_allocated) against the budget."""
    budget = budget_gb * GiB
    budgets = dict(budget=budget)
    measure_big = False
    if on_gpu:
        print("\n(searching the largest batches: full steps, OOM caught; about a minute)")
        gc.collect()
        free, _ = torch.cuda.mem_get_info()
        budgets["card"] = free + torch.cuda.memory_reserved()
        measure_big = budget < budgets["card"]  # else the card cannot stand for the budget
        torch.set_float32_matmul_precision("high")  # TF32: a faster search, the same bytes
    rows = {}
    big_rows = {}
    for name, bf16, checkpoint in CONFIGURATIONS:
        fit_config = replace(FIT_MODEL, checkpoint=checkpoint)
        big_config = replace(BIG_MODEL, checkpoint=checkpoint)
        big_rows[name] = big_row(big_config, bf16, budget, measure_big)
        rows[name] = fit_row(fit_config, bf16, budgets, on_gpu)
    torch.set_float32_matmul_precision("highest")
    checks = {}
    if on_gpu:
        raises = [rows[a]["measured"]["card"] < rows[b]["measured"]["card"] for a, b in LADDER]
        checks["fit_each_technique_raises"] = all(raises)
    if measure_big:
        fp32_fits = big_rows["fp32"]["measured"]["budget"]
        both_fit = big_rows["bf16 + checkpoint"]["measured"]["budget"]
        checks["big_model_fits_only_with_the_techniques"] = fp32_fits == 0 and both_fit == 1
    big = dict(name="GPT-2 large (774M) at T=8192", model=asdict(BIG_MODEL),
               budget=budget, measured=measure_big, rows=big_rows)
    return dict(model=asdict(FIT_MODEL), budgets=budgets, rows=rows, big=big,
                checks=checks)

def report_anatomy(result):
    predicted = result["predicted"]
    counted = result["counted"]
    measured = result["measured"]
    print("\n[1] anatomy of one fp32 step, MiB: predicted, counted, measured (CUDA only)")
    for part in predicted:
        shown = "-"
        if part in measured:
            shown = mib(measured[part])
        print(f"  {part:<12}{mib(predicted[part]):>10}{mib(counted[part]):>10}{shown:>10}")
    print(f"  activations predicted / measured (CPU: counted): "
          f"{result['activations_ratio']:.4f}")
    print("  the activations, term by term (predicted):")
    terms = sorted(result["activation_terms"].items(), key=lambda term: -term[1])
    for name, size in terms:
        share = size / predicted["activations"]
        print(f"    {name:<40}{mib(size):>9} MiB {share:6.1%}")

def report_configurations(result):
    rows = result["rows"]
    print("\n[2, 3] autocast, checkpointing: activations and peak in MiB, predicted / "
          "measured; step time measured")
    for name, row in rows.items():
        activations = f"{mib(row['activations_predicted'])} / {mib(row['activations_measured'])}"
        peak = f"{mib(row['peak_predicted'])} / {mib(row['peak_measured'])}"
        milliseconds = f"{row['median_s'] * 1e3:.1f} ms"
        spread = f"({row['min_s'] * 1e3:.1f}-{row['max_s'] * 1e3:.1f})"
        busy = mark(spread_too_wide(row))
        print(f"  {name:<18} activations {activations:<17} peak {peak:<17}"
              f"{milliseconds:>10} {spread}{busy}")
    fp32 = rows["fp32"]
    bf16 = rows["bf16 autocast"]
    for part, dtypes in bf16["dtypes"].items():
        print(f"  under autocast, {part}: {', '.join(dtypes)}")
    print(f"  loss fp32 {fp32['loss']:.5f}, bf16 {bf16['loss']:.5f} (measured, same weights)")
    speed = fp32["median_s"] / bf16["median_s"]
    busy = mark(spread_too_wide(fp32) or spread_too_wide(bf16))
    print(f"  bf16 step speed {speed:.2f}x fp32 (derived){busy}")
    extra_flops = result["checkpoint_extra_flops"]
    for precision, plain in (("fp32", fp32), ("bf16", bf16)):
        checkpointed = rows[f"{precision} + checkpoint"]
        ratio = plain["activations_measured"] / checkpointed["activations_measured"]
        overhead = checkpointed["median_s"] / plain["median_s"] - 1
        # recomputing cannot make a step faster: more than 10% faster is noise
        unreliable = spread_too_wide(plain) or spread_too_wide(checkpointed) or overhead < -0.1
        print(f"  {precision} + checkpoint: activations / {ratio:.1f} (measured)")
        print(f"  {precision} + checkpoint: step time {overhead:+.0%} (derived), "
              f"FLOPs +{extra_flops:.0%} (predicted){mark(unreliable)}")
    print(f"  gradients, checkpointed vs not (fp32): max relative error "
          f"{result['grad_max_rel_error']:.1e} (check: <= 1e-5)")

def report_accumulation(result, seq_len):
    k = result["k"]
    micro = result["micro_batch"]
    print(f"\n[4] accumulation, fp32: {k} micro-batches of {micro} x {seq_len} "
          f"vs one batch of {k * micro}")
    print(f"  gradients: max relative error {result['grad_max_rel_error']:.1e} "
          f"(check: < 1e-4)")
    for name in ("full", "micro"):
        predicted = mib(result[f"activations_predicted_{name}"])
        counted = mib(result[f"activations_counted_{name}"])
        rise = mib(result[f"peak_rise_{name}"])
        print(f"  {name}: activations {predicted} MiB predicted, {counted} MiB counted")
        print(f"  {name}: forward + backward peak {rise} MiB above params + moments "
              f"(measured)")

def report_fit(result):
    budgets = result["budgets"]
    big = result["big"]
    seq_len = result["model"]["block_size"]
    print(f"\n[5] largest batch of {seq_len}-token sequences, AdamW step: "
          f"predicted / measured (OOM caught)")
    for name, row in result["rows"].items():
        for key, budget in budgets.items():
            measured = row["measured"].get(key, "-")
            print(f"  {name:<18} {key} {budget / GiB:.1f} GiB: "
                  f"{row['predicted'][key]:>4} / {measured}")
    print(f"  {big['name']} under {big['budget'] / GiB:g} GiB "
          f"(0: at no batch; else accumulate):")
    for name, row in big["rows"].items():
        measured = "n/a"
        if row.get("measured_peak_batch1") is not None:
            measured = f"{row['measured_peak_batch1'] / GiB:.1f}"
        print(f"    {name:<18} largest batch {row['predicted']['budget']} predicted; "
              f"batch 1 peaks at {row['peak_batch1'] / GiB:.1f} GiB predicted, "
              f"{measured} measured")

def figure(rows, state, out_dir):
    """Each configuration's parts stacked, predicted beside measured, the peak in black;
    temporaries: the rest of the peak."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.8))
    x = 0
    ticks = []
    for name, row in rows.items():
        ticks.append(x + 0.5)
        for kind in ("predicted", "measured"):
            activations = row[f"activations_{kind}"]
            peak = row[f"peak_{kind}"]
            held = state["params"] + state["optimizer"] + max(activations, state["grads"])
            parts = dict(state, activations=activations, temporaries=max(0, peak - held))
            bottom = 0
            for color, (part, size) in enumerate(parts.items()):
                ax.bar(x, size / MiB, bottom=bottom, color=f"C{color}", label=part)
                bottom += size / MiB
            ax.plot([x - 0.4, x + 0.4], [peak / MiB, peak / MiB], "k-", lw=2, label="peak")
            x += 1
        x += 1  # a gap between configurations
    labels = [f"{name}\npredicted | measured" for name in rows]
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set(ylabel="MiB", title="one training step: its parts and its peak")
    handles, names = ax.get_legend_handles_labels()
    legend = dict(zip(names, handles))  # one entry per part
    ax.legend(legend.values(), legend.keys(), fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / "04_memory.png"
    fig.savefig(path, dpi=120)
    return path

def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value

def path_text(text):
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return text

def writable_folder(flag, path, folder):
    """Make the folder if it is missing; stop now, in one line, if nothing can be
    written there."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        sys.exit(f"error: {flag} {path}: cannot write there ({error.strerror})")

def check_outputs(args):
    """Refuse unusable output paths before the work, not after it."""
    if args.json is not None:
        if Path(args.json).is_dir():
            sys.exit(f"error: --json {args.json}: is a folder; name a file")
        writable_folder("--json", args.json, Path(args.json).parent)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        sys.exit(f"error: --out {args.out}: exists and is not a folder")
    writable_folder("--out", args.out, args.out)

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Section 13.4: the memory of a step.")
    parser.add_argument("--quick", action="store_true", help="seconds-long run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", type=path_text, help="write every number to this file")
    parser.add_argument("--out", type=path_text, default="out",
                        help="folder for the figure (default out/)")
    parser.add_argument("--budget-gb", type=positive_float, default=24.0,
                        help="the emulated card's memory in GiB, section 5 (default 24)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: torch sees no CUDA GPU here; use --device cpu")
    check_outputs(args)
    return args

def warm_up_cuda():
    """cuBLAS takes its workspaces from the allocator on first use: take them before
    anything is counted."""
    for bf16 in (False, True):
        model, opt, x, y = new_run(QUICK_MODEL, 1, "cuda")
        train_step(model, opt, x, y, bf16)

def main():
    args = parse_args()
    device = "cpu"
    if args.device != "cpu" and torch.cuda.is_available():
        device = "cuda"
    sizes = SIZES[device]
    if args.quick:
        sizes = SIZES["quick"]
    threads = torch.get_num_threads()
    name = f"CPU, {threads} threads, {torch.backends.cpu.get_cpu_capability()}"
    if device == "cuda":
        memory = torch.cuda.mem_get_info()[1] / GiB
        name = f"{torch.cuda.get_device_name()}, {memory:.1f} GiB"
        warm_up_cuda()
    print(f"device: {name} | torch {torch.__version__}")
    print(f"model: {asdict(sizes.model)}, batch {sizes.batch}; fused AdamW; "
          f"fp32 without TF32")
    results = {}
    results["anatomy"] = anatomy(sizes, device)
    report_anatomy(results["anatomy"])
    results["configurations"] = autocast_and_checkpointing(sizes, device)
    report_configurations(results["configurations"])
    results["accumulation"] = accumulation(sizes, device)
    report_accumulation(results["accumulation"], sizes.model.block_size)
    search = device == "cuda"
    if args.quick:
        search = False  # the fit table predicted only
    results["fit"] = what_fits(args.budget_gb, search)
    report_fit(results["fit"])
    rows = results["configurations"]["rows"]
    path = figure(rows, state_bytes(sizes.model), args.out)
    if path is None:
        print("\nmatplotlib missing: figure skipped")
    else:
        print(f"\nfigure: {path}")
    checks = {}
    for result in results.values():
        checks.update(result.pop("checks"))
    for key, ok in checks.items():
        print(f"check {key}: {'ok' if ok else 'FAILED'}")
    if args.json is not None:
        config = dict(asdict(sizes.model), batch_size=sizes.batch,
                      seq_len=sizes.model.block_size)
        device_info = dict(type=device, name=name, torch=torch.__version__)
        report = dict(lesson="04_memory", quick=args.quick, checks=checks,
                      device=device_info, config=config, **results)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    failed = [key for key, ok in checks.items() if not ok]
    if failed:
        sys.exit("error: checks failed: " + ", ".join(failed))

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
