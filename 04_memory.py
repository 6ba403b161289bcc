"""
04_memory.py - Section 13.4: the memory anatomy of a training step.

Where do the bytes of one training step go, and what do the classic techniques buy? For
the GPT of model_torch.py (gpt2, 124M, on a GPU; a tiny one on the CPU):
  1. anatomy       parameters, gradients, AdamW's two moments, activations, temporaries:
                   predicted from model_torch's accounting, then measured after init,
                   forward, backward and the optimizer step
  2. bf16          autocast: what stays fp32, how the activations shrink, the step time
  3. checkpoint    recompute each block in backward: activations down, time up, same grads
  4. accumulation  k micro-batches of loss / k: the full batch's gradient at a micro-batch's peak
  5. what fits     the largest batch under a memory budget for each combination of
                   techniques, by doubling + bisection with the OOM caught (GPU only)
Measured on CUDA with torch.cuda.memory_allocated / max_memory_allocated (what tensors
hold; nvidia-smi shows memory_reserved, the caching allocator's pool). On any device, the
bytes autograd saves for backward are counted with torch.autograd.graph.saved_tensors_hooks.

Run:
  python 04_memory.py                       # GPU if there is one (~3 min on an H200), else CPU (~1 min)
  python 04_memory.py --budget-gb 24        # the fit table for a 24 GB card (RTX 4090) on a bigger GPU
  python 04_memory.py --device cpu --quick  # a few seconds: what the tests run
Memory per GPU is the subject, so one GPU is all this lesson uses.

Expect: 16 bytes of state per parameter (params, grads, AdamW) predicted to the byte;
activations (gpt2, 8 x 1024 tokens: several GiB, more than the 1.9 GiB of state) within a few
percent; bf16 keeps the state fp32 and shrinks the blocks' activations, not the fp32
log-softmax over the vocabulary; checkpointing keeps one tensor per block for ~+20-40% GPU
time with equal gradients; accumulation's gradients equal to ~1e-6; every technique raises
the largest batch that fits. On the CPU the vocabulary is cut to 4096: at 50304 the tied
head is 89% of the tiny model and hides the blocks, and bf16 matmuls are ~10x slower than
fp32 on CPUs without bf16 instructions (AVX2). The accounting is the same arithmetic.
"""

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from model_torch import GPT, GPTConfig, activation_bytes, block_activation_bytes, flops_per_token, state_bytes

MiB, GiB = 2**20, 2**30


def mib(n):
    return f"{n / MiB:,.1f}"


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def batch(cfg, B, T, dev, seed=0):  # random tokens: memory and time do not care what they say
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(dev) for _ in range(2))


def new_model(cfg, dev, seed=0):
    torch.manual_seed(seed)
    with torch.device(dev):  # built on the device: memory_allocated sees only the parameters
        model = GPT(replace(cfg))  # its own config: lesson 3 flips model.config.checkpoint
    return model, model.configure_optimizer(lr=1e-4, fused=dev.type == "cuda")


def train_step(model, opt, x, y, bf16):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def moments(opt):  # AdamW's exp_avg and exp_avg_sq (not its per-parameter 'step' counters)
    return [t for s in opt.state.values() for k, t in s.items() if k != "step"]


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def forward_counted(model, x, y, bf16):
    """One forward under saved_tensors_hooks: the loss (graph alive) and the bytes autograd
    saved for backward by dtype, each storage once, parameters excluded (they exist anyway).
    The non-reentrant checkpoint saves each block's input with save_for_backward, so these
    hooks see what it keeps; the insides it recomputes go to its own hooks, not ours."""
    params, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = (s.nbytes(), str(t.dtype).removeprefix("torch."))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x, y)
    by_dtype = {}
    for n, dtype in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return loss, sum(by_dtype.values()), by_dtype


def time_steps(fn, dev, reps, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(1e3 * (time.perf_counter() - t0))
    return dict(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times))


# --------------------------------------------------------------------------------------
# 1. The anatomy of one step

def anatomy(cfg, B, T, dev, checks):
    """PREDICTION (model_torch's accounting, before anything runs): params = grads = 4 B x N,
    AdamW's exp_avg + exp_avg_sq = 8 B x N: 16 B of state per parameter, to the byte.
    Activations = activation_bytes(cfg, B, T), alive from forward until backward frees
    them. Temporaries (CUDA: a phase's peak above what is alive at its start and end) are
    led by backward's first gradients, each the size of the fp32 logits (4 V B per token)."""
    cuda = dev.type == "cuda"
    pred = dict(state_bytes(cfg), activations=activation_bytes(cfg, B, T))
    P, G, O, A = pred["params"], pred["grads"], pred["optimizer"], pred["activations"]
    x, y = batch(cfg, B, T, dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    model, opt = new_model(cfg, dev)
    params = list(model.parameters())
    counted, points = dict(params=nbytes(params)), []

    def mark(point, predicted, live):  # live: the tensors we know are alive, counted
        row = dict(point=point, predicted=predicted, counted=live)
        if cuda:
            row.update(allocated=torch.cuda.memory_allocated() - base, peak=torch.cuda.max_memory_allocated() - base)
            row["temporaries"] = row["peak"] - max(points[-1]["allocated"] if points else 0, row["allocated"])
            torch.cuda.reset_peak_memory_stats()
        points.append(row)

    mark("after init", P, counted["params"])
    loss, counted["activations"], _ = forward_counted(model, x, y, bf16=False)
    mark("after forward", P + A, counted["params"] + counted["activations"])
    loss.backward()
    counted["grads"] = nbytes(p.grad for p in params)
    mark("after backward", P + G, counted["params"] + counted["grads"])
    opt.step()
    counted["optimizer"] = nbytes(moments(opt))
    mark("after optimizer step", P + G + O, counted["params"] + counted["grads"] + counted["optimizer"])
    opt.zero_grad(set_to_none=True)
    mark("after zero_grad", P + O, counted["params"] + counted["optimizer"])

    measured = {}
    if cuda:  # each component is the jump in memory_allocated where it appears
        a = [r["allocated"] for r in points]
        measured = dict(params=a[0], activations=a[1] - a[0], grads=a[2] - a[0], optimizer=a[3] - a[2])
    print(f"\n[1] anatomy of one fp32 step, B={B} x T={T}: predicted by the accounting, counted "
          f"(numel x element_size; activations through saved_tensors_hooks)"
          + (", measured (memory_allocated)" if cuda else ""))
    print(f"  {'MiB':<16}{'predicted':>12}{'counted':>12}{'measured':>12}   predicted / {'measured' if cuda else 'counted'}")
    for k, name in (("params", "parameters"), ("grads", "gradients"), ("optimizer", "AdamW moments"),
                    ("activations", "activations")):
        ref = measured.get(k, counted[k])
        print(f"  {name:<16}{mib(pred[k]):>12}{mib(counted[k]):>12}{mib(measured[k]) if cuda else 'n/a (CPU)':>12}"
              f"   {pred[k] / ref:.4f}")
    print(f"  in bytes: params {P:,} predicted, {counted['params']:,} counted; grads {counted['grads']:,}; "
          f"AdamW moments {counted['optimizer']:,} (+ {len(opt.state)} 'step' counters of 4 B"
          + (", each a 512 B allocator block with fused AdamW)" if cuda else ")"))
    print(f"  {'MiB':<22}{'predicted alive':>16}{'counted':>10}" + (f"{'allocated':>11}{'peak':>11}{'temporaries':>13}" if cuda else ""))
    for r in points:
        print(f"  {r['point']:<22}{mib(r['predicted']):>16}{mib(r['counted']):>10}"
              + (f"{mib(r['allocated']):>11}{mib(r['peak']):>11}{mib(r['temporaries']):>13}" if cuda else ""))
    if not cuda:
        print("  (the CPU keeps no allocator statistics: no peaks, no temporaries; 'counted' is the live tensors)")
    for k in ("params", "grads", "optimizer"):
        checks[f"anatomy_{k}_exact"] = pred[k] == counted[k]
    ratio = A / measured.get("activations", counted["activations"])
    checks["anatomy_activations_within_10pct"] = abs(ratio - 1) < 0.10
    print(f"  activations: predicted / {'measured' if cuda else 'counted'} = {ratio:.4f} (target: within 10%); "
          f"the fp32 log-softmax over V={cfg.vocab_size} alone is {4 * cfg.vocab_size * B * T / A:.0%} of them")
    return dict(predicted=pred, counted=counted, measured=measured, points=points, step_counters=len(opt.state))


# --------------------------------------------------------------------------------------
# 2 and 3. Mixed precision and activation checkpointing: one step measured per config

def measure(model, opt, x, y, bf16, dev, reps):
    """Time steps (the warm-up step also creates AdamW's state), then one more step with its
    saved bytes counted and, on CUDA, memory_allocated after forward and the step's peak."""
    cuda = dev.type == "cuda"
    r = time_steps(lambda: train_step(model, opt, x, y, bf16), dev, reps)
    state = nbytes(model.parameters()) + nbytes(moments(opt))
    if cuda:
        sync(dev)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss, r["activations_counted"], r["saved_by_dtype"] = forward_counted(model, x, y, bf16)
    if cuda:
        r["activations_allocated"] = torch.cuda.memory_allocated() - base
    loss.backward()
    r["dtypes"] = dict(params=sorted({str(p.dtype) for p in model.parameters()}),
                       grads=sorted({str(p.grad.dtype) for p in model.parameters()}),
                       optimizer=sorted({str(t.dtype) for t in moments(opt)}))
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        r["peak_step"] = state + torch.cuda.max_memory_allocated() - base
    return r


def print_rows(rows, cuda):
    print(f"  {'MiB, ms':<18}{'act. predicted':>15}{'act. counted':>13}"
          + (f"{'act. measured':>14}{'step peak':>11}" if cuda else "") + "   step ms: median (min-max)")
    for name, r in rows.items():
        print(f"  {name:<18}{mib(r['activations_predicted']):>15}{mib(r['activations_counted']):>13}"
              + (f"{mib(r['activations_allocated']):>14}{mib(r['peak_step']):>11}" if cuda else "")
              + f"   {r['median_ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})")


def mixed_precision(cfg, B, T, dev, reps, checks):
    """PREDICTION: autocast casts copies, not the model: params, grads and AdamW state stay
    fp32, so the 16 B/param of state does not move. Activations: matmul inputs are saved as
    bf16 copies; the residual stream, LayerNorm statistics and the log-softmax stay fp32
    (activation_bytes(bf16=True), which adds the bf16 weight copies once per step). Time: on
    a GPU the matmuls move to bf16 tensor cores, several x faster than fp32 (TF32 off,
    PyTorch's default); on a CPU without bf16 instructions autocast is SLOWER."""
    model, opt = new_model(cfg, dev)
    x, y = batch(cfg, B, T, dev)
    with torch.no_grad():
        loss32 = model(x, y)[1].item()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss16 = model(x, y)[1].item()
    rows = {}
    for name, bf16 in (("fp32", False), ("bf16 autocast", True)):
        rows[name] = measure(model, opt, x, y, bf16, dev, reps)
        rows[name]["activations_predicted"] = activation_bytes(cfg, B, T, bf16=bf16)
    bf = rows["bf16 autocast"]
    speedup = rows["fp32"]["median_ms"] / bf["median_ms"]
    copies = activation_bytes(cfg, 0, bf16=True)  # batch 0 leaves only the per-step weight copies
    print(f"\n[2] mixed precision, B={B} x T={T}: fp32 vs bf16 autocast; activations and step time measured")
    print_rows(rows, dev.type == "cuda")
    print("  under autocast: " + "; ".join(f"{k} {', '.join(v)}" for k, v in bf["dtypes"].items()))
    print("  saved for backward under autocast: " + ", ".join(f"{k} {mib(v)} MiB" for k, v in bf["saved_by_dtype"].items())
          + f"; of the bf16, {mib(copies)} MiB are weight copies, once per step whatever the batch (predicted)")
    print(f"  per block per token in bf16: ours {block_activation_bytes(cfg, T, bf16=True):,} B (predicted; no dropout, fp32 residual); "
          f"Korthikanti et al. 2022: 34 d = {34 * cfg.n_embd:,} B (reference formula, with dropout, flash attention)")
    print(f"  loss fp32 {loss32:.5f}, bf16 {loss16:.5f} (same weights and batch); bf16 step speed {speedup:.2f}x fp32 (derived)"
          + ("" if dev.type == "cuda" else " - this CPU emulates bf16 matmuls; on a CPU, memory is the point"))
    checks["autocast_keeps_state_fp32"] = all(v == ["torch.float32"] for v in bf["dtypes"].values())
    checks["bf16_loss_close_to_fp32"] = abs(loss16 / loss32 - 1) < 1e-3
    return dict(rows=rows, loss_fp32=loss32, loss_bf16=loss16, bf16_speedup=speedup)


def checkpointing(cfg, B, T, dev, reps, plain_rows, checks):
    """PREDICTION: each block keeps only its fp32 input (4 d bytes per token) instead of its
    insides (16 d values): activations fall to activation_bytes(checkpoint=True); the head
    (ln_f, the V-wide log-softmax) is outside the blocks and stays. Cost: the blocks'
    forward runs again in backward, 24 L d^2 + 4 L T d more FLOPs per token: about
    +20-40% step time on a GPU. Gradients: the same kernels on the same inputs, so equal to rounding."""
    model, opt = new_model(cfg, dev)
    x, y = batch(cfg, B, T, dev)
    grads = {}
    for flag in (False, True):
        model.config.checkpoint = flag  # the switch is read at every forward
        model(x, y)[1].backward()
        grads[flag] = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
    err = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in zip(grads[False], grads[True]))
    bitwise = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    del grads
    rows = {k: plain_rows[k] for k in ("fp32", "bf16 autocast") if k in plain_rows}
    for name, bf16 in (("fp32 + checkpoint", False), ("bf16 + checkpoint", True)):
        rows[name] = measure(model, opt, x, y, bf16, dev, reps)
        rows[name]["activations_predicted"] = activation_bytes(replace(cfg, checkpoint=True), B, T, bf16=bf16)
    extra = (24 * cfg.n_layer * cfg.n_embd**2 + 4 * cfg.n_layer * T * cfg.n_embd) / flops_per_token(cfg, T)
    print(f"\n[3] activation checkpointing per block (use_reentrant=False), B={B} x T={T}: "
          f"predicted +{extra:.0%} FLOPs (the blocks' forward, again)")
    print_rows(rows, dev.type == "cuda")
    out = dict(rows=rows, predicted_extra_flops=extra, grad_max_rel_error=err, grads_bitwise_equal=bitwise)
    key = "activations_allocated" if dev.type == "cuda" else "activations_counted"
    for prec, plain in (("fp32", "fp32"), ("bf16", "bf16 autocast")):
        if plain in rows:
            p, c = rows[plain], rows[f"{prec} + checkpoint"]
            out[f"{prec}_activations_ratio"] = p[key] / c[key]
            out[f"{prec}_time_overhead"] = c["median_ms"] / p["median_ms"] - 1
            print(f"  {prec}: activations / {p[key] / c[key]:.1f}, step time {c['median_ms'] / p['median_ms'] - 1:+.0%} (derived)")
    print(f"  gradients with vs without checkpointing (fp32): max relative error {err:.1e}, bitwise equal: {bitwise}")
    checks["checkpoint_grads_equal"] = err <= 1e-5
    checks["checkpoint_saves_activations"] = "fp32" in rows and rows["fp32 + checkpoint"][key] < rows["fp32"][key]
    return out


# --------------------------------------------------------------------------------------
# 4. Gradient accumulation

def accumulation(cfg, b, k, T, dev, checks):
    """PREDICTION: with equal token counts, the mean of the k micro-batch mean losses is the
    full batch's mean loss, so the sum of grad(loss_i / k) is grad(loss): equal up to fp32
    rounding (~1e-6 relative, only the summation order differs). Activations live one
    micro-batch at a time, so the step's peak is the micro-batch's, not the k x batch's."""
    cuda = dev.type == "cuda"
    model, opt = new_model(cfg, dev)
    x, y = batch(cfg, k * b, T, dev)

    def run(chunks):
        opt.zero_grad(set_to_none=True)
        if cuda:
            sync(dev)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        saved_max = 0
        for xc, yc in chunks:
            loss, saved, _ = forward_counted(model, xc, yc, bf16=False)
            (loss / len(chunks)).backward()  # adds into .grad
            saved_max = max(saved_max, saved)
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
        return [p.grad.clone() for p in model.parameters()], saved_max, peak

    g_full, saved_full, peak_full = run([(x, y)])
    g_acc, saved_acc, peak_acc = run([(xc.clone(), yc.clone()) for xc, yc in zip(x.chunk(k), y.chunk(k))])
    err = max(((a - c).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, c in zip(g_full, g_acc))
    print(f"\n[4] gradient accumulation: {k} micro-batches of {b} x {T} (loss / {k}) vs one batch of {k * b} x {T}, fp32")
    print(f"  gradients: max relative error {err:.1e} (check: < 1e-4)")
    print(f"  activations of one forward, MiB: predicted {mib(activation_bytes(cfg, k * b, T))} vs "
          f"{mib(activation_bytes(cfg, b, T))}; counted {mib(saved_full)} vs {mib(saved_acc)}")
    if cuda:
        print(f"  forward + backward peak above the parameters, measured: full batch {mib(peak_full)} MiB, accumulated "
              f"{mib(peak_acc)} MiB (both include the {mib(nbytes(g_full))} MiB of gradients)")
    checks["accumulated_grads_equal_full_batch"] = err < 1e-4
    checks["accumulation_peak_below_full_batch"] = (peak_acc < peak_full) if cuda else (saved_acc < saved_full)
    return dict(k=k, micro_batch=b, grad_max_rel_error=err, activations_counted_full=saved_full,
                activations_counted_micro=saved_acc, peak_full=peak_full, peak_accumulated=peak_acc)


# --------------------------------------------------------------------------------------
# 5. What fits

FIT_ROWS = [  # (name, bf16, config overrides): the techniques, one at a time
    ("fp32, manual attn", False, dict(attn="manual")),
    ("fp32", False, {}),
    ("bf16", True, {}),
    ("fp32 + checkpoint", False, dict(checkpoint=True)),
    ("bf16 + checkpoint", True, dict(checkpoint=True)),
]
LADDER = [("fp32, manual attn", "fp32"), ("fp32", "bf16"), ("bf16", "bf16 + checkpoint"), ("fp32", "fp32 + checkpoint")]


def predicted_fit(cfg, T, budget, bf16):
    """Largest batch by the accounting: all 16 B/param of state, the activations (linear in B,
    plus the bf16 weight copies once), and backward's first temporaries, two fp32 V-wide
    gradients per token (of the log-softmax and of the logits). Ignores fragmentation."""
    a1, a2 = activation_bytes(cfg, 1, T, bf16), activation_bytes(cfg, 2, T, bf16)
    per_seq = a2 - a1 + 8 * cfg.vocab_size * T
    return max(0, int((budget - sum(state_bytes(cfg).values()) - (2 * a1 - a2)) // per_seq))


def try_step(model, opt, B, T, bf16, dev):
    """One training step at batch B: its peak reserved bytes, or None if it ran out of memory."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        xb = torch.randint(0, model.config.vocab_size, (B, T), device=dev)
        train_step(model, opt, xb, xb, bf16)
        sync(dev)
        return torch.cuda.max_memory_reserved()
    except torch.cuda.OutOfMemoryError:
        pass  # leave the except block before cleaning: its traceback holds the step's tensors
    except RuntimeError as e:  # a library's workspace allocation may say it differently
        if "out of memory" not in str(e).lower() and "ALLOC_FAILED" not in str(e):
            raise
    opt.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return None


def largest_batch(probe, cap, seconds):
    """Doubling until the first miss, then bisection between the last fit and the first miss.
    Peak memory is linear in the batch, so the first bisection probe is aimed where the line
    through the two largest fits meets the cap, and the next one checks its neighbour."""
    lo, hi, peaks, t0, B = 0, None, {}, time.time(), 1
    while hi is None and time.time() - t0 < seconds:
        peak = probe(B)
        if peak is None:
            hi = B
        else:
            lo, peaks[B], B = B, peak, 2 * B
    aim = None
    if hi is not None and hi - lo > 1 and len(peaks) >= 2:
        (b1, p1), (b2, p2) = sorted(peaks.items())[-2:]
        aim = min(max(b2 + int((cap - p2) * (b2 - b1) / max(p2 - p1, 1)), lo + 1), hi - 1)
    guess = aim
    while hi is not None and hi - lo > 1 and time.time() - t0 < seconds:
        mid = aim if aim is not None and lo < aim < hi else (lo + hi) // 2
        fits = probe(mid) is not None
        aim = (mid + 1 if fits else mid - 1) if mid == guess else None
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo, hi, hi is not None and hi - lo <= 1


def what_fits(cfg, T, dev, budget_gb, quick, checks):
    """PREDICTION (predicted_fit): each technique cuts bytes per sequence, so each raises the
    largest batch: flash attention (sdpa) drops the n_head x T fp32 softmax per token and
    layer, bf16 halves most block activations (not the fp32 log-softmax over V),
    checkpointing keeps one tensor per block. Accumulation then reaches any batch."""
    cuda = dev.type == "cuda"
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else None
    budget = int(budget_gb * GiB) if budget_gb else total if cuda else 24 * GiB
    if cuda and budget > total:
        print(f"  --budget-gb {budget_gb} is more than this card's {total / GiB:.1f} GiB: the whole card it is")
        budget = total
    if not cuda:
        cfg, T = GPTConfig.preset("gpt2"), 1024  # on the CPU: the accounting's answer for the real model
    print(f"\n[5] what fits in {budget / GiB:.1f} GiB: the largest batch of {T}-token sequences for a full training "
          f"step (AdamW){'' if cuda else ' of gpt2'}")
    if not cuda:
        print("  measured search skipped: the CPU has no caching allocator to cap and probe (an OOM there is "
              "the OS killing the process); predictions only")
    else:
        torch.set_float32_matmul_precision("high")  # TF32 speeds the search up; memory is the same
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        cap = min(budget, torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved())
    rows = []
    for name, bf16, overrides in FIT_ROWS:
        rcfg = replace(cfg, **overrides)
        row = dict(name=name, bf16=bf16, **overrides, predicted=predicted_fit(rcfg, T, budget, bf16))
        line = f"  {name:<20}predicted {row['predicted']:>5}"
        if cuda:
            t0, probes = time.time(), []
            model, opt = new_model(rcfg, dev)

            def probe(B):
                probes.append([B, try_step(model, opt, B, T, bf16, dev)])
                return probes[-1][1]

            row["measured"], row["first_miss"], row["search_finished"] = largest_batch(probe, cap, 10 if quick else 30)
            row.update(probes=probes, seconds=time.time() - t0)
            del model, opt, probe
            m = row["measured"]
            line += (f"   measured {'does not fit' if m == 0 else m:>5}" + ("" if row["search_finished"] else
                     " (search stopped at its time cap)") + f"   ({len(probes)} probes, {row['seconds']:.0f} s)")
        rows.append(row)
        print(line)
    if cuda and any(r["predicted"] > r["measured"] for r in rows):
        print("  predicted > measured: the prediction counts tensors only; it ignores the caching allocator's"
              " fragmentation and temporaries")
    out = dict(budget_gib=budget / GiB, rows=rows, skipped=None if cuda else "no caching allocator on the CPU")
    key = "measured" if cuda else "predicted"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.set_float32_matmul_precision("highest")
    by = {r["name"]: r for r in rows}
    out["each_technique_raises"] = all(by[a][key] < by[b][key] for a, b in LADDER)
    if cuda and not quick and all(r["search_finished"] for r in rows):
        checks["fit_each_technique_raises"] = out["each_technique_raises"]
    best = max(r[key] for r in rows)
    print(f"  each technique raises the largest batch ({key}): {out['each_technique_raises']}")
    if best:
        print(f"  + gradient accumulation: any batch, e.g. build-nanogpt's 512 x 1024 tokens as "
              f"{-(-512 // best)} micro-steps of <= {best} sequences (time grows with the micro-steps)")
    return out


def main():
    ap = argparse.ArgumentParser(description="Section 13.4: the memory anatomy of a training step.")
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (the tests)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--json", help="write every measured number to this file")
    ap.add_argument("--out", default="out", help="figure directory (accepted for uniformity: this lesson's results are tables)")
    ap.add_argument("--budget-gb", type=float, help="memory budget of the fit table in GiB (default: the whole card)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA GPU on this machine; run with --device cpu")
        sys.exit(1)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda" if cuda else "cpu")
    if args.quick:  # seconds on 2 CPU cores
        cfg, B, (k, b), reps = GPTConfig.preset("tiny", n_layer=2, block_size=64, vocab_size=4096), 2, (4, 1), 1
    elif cuda:
        cfg, B, (k, b), reps = GPTConfig.preset("gpt2"), 8, (4, 4), 10
    else:  # the docstring says why the CPU vocabulary is 4096
        cfg, B, (k, b), reps = GPTConfig.preset("tiny", vocab_size=4096), 4, (4, 1), 3
    T = cfg.block_size
    name = torch.cuda.get_device_name(dev) if cuda else f"CPU, {torch.get_num_threads()} threads"
    mem = torch.cuda.get_device_properties(dev).total_memory / GiB if cuda else None
    print(f"device: {name}" + (f", {mem:.1f} GiB" if cuda else f", {torch.backends.cpu.get_cpu_capability()}")
          + f" | torch {torch.__version__}")
    print(f"model: {cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab_size}, T={T}; batch {B}; "
          f"AdamW ({'fused' if cuda else 'foreach'}); fp32 matmuls without TF32 unless said")
    if cuda:  # cuBLAS takes its workspaces from the caching allocator on first use: do that before counting
        a = torch.randn(64, 64, device=dev, requires_grad=True)
        for bf16 in (False, True):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                (a @ a).float().sum().backward()
        del a
    checks, results = {}, {}
    sections = [("anatomy", lambda: anatomy(cfg, B, T, dev, checks)),
                ("mixed_precision", lambda: mixed_precision(cfg, B, T, dev, reps, checks)),
                ("checkpointing", lambda: checkpointing(cfg, B, T, dev, reps,
                                                        results["mixed_precision"].get("rows", {}), checks)),
                ("accumulation", lambda: accumulation(cfg, b, k, T, dev, checks)),
                ("fit", lambda: what_fits(cfg, T, dev, args.budget_gb, args.quick, checks))]
    for section, fn in sections:
        try:
            results[section] = fn()
        except Exception as e:  # one failed experiment must not lose the others' numbers
            print(f"\n!! {section} failed: {type(e).__name__}: {e}")
            results[section] = dict(error=f"{type(e).__name__}: {e}")
            checks[f"{section}_ran"] = False
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print("\nchecks: " + ", ".join(f"{k} {'OK' if v else 'FAILED'}" for k, v in checks.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            lesson="04_memory", device=dict(type=dev.type, name=name, memory_gib=mem, torch=torch.__version__),
            quick=args.quick, config=dict(asdict(cfg), batch_size=B, seq_len=T), **results, checks=checks), indent=1))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
