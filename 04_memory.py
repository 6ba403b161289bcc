"""
04_memory.py - Section 13.4: the memory anatomy of a training step.

Where do the bytes of an AdamW step go? Each part is predicted by model_torch's accounting, then
measured (CUDA's memory_allocated; on a CPU, the profiler's allocations and frees): 1. params,
grads, AdamW's moments, activations term by term; 2. bf16 autocast; 3. checkpointing;
4. accumulation; 5. the largest batch on this card and under a 24 GiB budget (an RTX 4090), and
GPT-2 large at T=8192, which fits 24 GiB only with the techniques. Copy this file and
model_torch.py; gpt2 124M on one GPU, a tiny GPT on a CPU; figure out/04_memory.png.
  python 04_memory.py                       # one GPU when there is one; otherwise the CPU
  python 04_memory.py --device cpu --quick  # seconds: what the tests run
Expect the state to the byte, activations and peaks within a few percent, bf16 state in fp32,
equal gradients under checkpointing and accumulation, each technique raising the largest batch.
"""
import argparse, gc, json, math, os, statistics, sys, time
from dataclasses import asdict, replace
from itertools import accumulate
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before torch: silences the profiler's USDT lines
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from model_torch import (GPT, GPTConfig, activation_bytes, activation_terms,  # noqa: E402
                         block_activation_terms, flops_per_token, state_bytes)

MiB, GiB = 2**20, 2**30
SIZES = {  # model; batch (1-3); k micro-batches of micro sequences (4); timed steps per config
    "cuda": (GPTConfig.preset("gpt2"), 8, 4, 4, 10),
    "cpu": (GPTConfig.preset("tiny", vocab_size=4096), 4, 4, 1, 3),  # V=50304 would hide the blocks
    "quick": (GPTConfig.preset("tiny", n_layer=2, block_size=64, vocab_size=4096), 2, 4, 1, 2)}
CONFIGURATIONS = [("fp32", False, False), ("bf16 autocast", True, False),  # name, bf16, checkpoint
                  ("fp32 + checkpoint", False, True), ("bf16 + checkpoint", True, True)]
FIT_MODEL = GPTConfig.preset("gpt2")  # the fit table: GPT-2 124M, T=1024
BIG_MODEL = GPTConfig(n_layer=36, n_head=20, n_embd=1280, block_size=8192)  # GPT-2 large, T=8192
LADDER = [("fp32", "bf16 autocast"), ("bf16 autocast", "bf16 + checkpoint"),
          ("fp32", "fp32 + checkpoint")]  # each technique raises the largest batch
BUSY = " unreliable (machine busy)"

def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()
def allocated(device):  # the bytes of live tensors; a CPU has no such counter
    return torch.cuda.memory_allocated() if device == "cuda" else 0
def mib(n):
    return f"{n / MiB:,.1f}"
def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)
def moments(opt):  # AdamW's exp_avg and exp_avg_sq (not its per-parameter 'step' counters)
    return [t for s in opt.state.values() for k, t in s.items() if k != "step"]
def max_rel_error(tensors, references):
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
               for a, b in zip(tensors, references))

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

def new_run(config, batch, device):
    """Built on the device (memory_allocated sees only its parameters). AdamW with lr=0 steps its
    moments but not the weights, so every configuration sees the same weights."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(replace(config))  # its own config: checkpointing is flipped on model.config
    tokens = torch.randint(0, config.vocab_size, (2, batch, config.block_size)).to(device)
    return model, model.configure_optimizer(lr=0.0, fused=True), tokens[0], tokens[1]

def train_step(model, opt, x, y, bf16):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(x, y)[1]  # the logits are dropped at once: no B x T x V tensor kept alive
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

def forward_counted(model, x, y, bf16):
    """One forward: the loss (graph alive) and the bytes autograd saved for backward, each storage
    once, parameters excluded (the non-reentrant checkpoint saves through these hooks too)."""
    params, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}
    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            return model(x, y)[1], sum(seen.values())

def rise_during(fn, device):
    """The most bytes alive during fn above those at its start. CUDA: the allocator's peak. CPU:
    the running sum of the profiler's allocations and frees (fn frees only what it allocated)."""
    if device == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    return max(accumulate((e.nbytes() for e in events), initial=0))

def predicted_peak(config, batch, bf16):
    """Bytes alive at the peak of a steady-state step (AdamW's moments exist, gradients set to
    None). Backward frees each layer's activations as it writes that layer's gradients, so the
    peak is the larger of two moments, not the sum of the parts:
      backward's start  params + moments + activations + the head's two fp32 V-wide gradients
                        (of the log-probabilities, of the logits): 8 V bytes per token
      backward's end    params + grads + moments (16 B per parameter) + two V x d fp32 tensors:
                        the tied embedding's gradient arrives a second time and is summed
    Checkpointed backward re-runs one block at a time, whose insides (and bf16 weight copies)
    live again: beside the activations early, beside the gradients late."""
    state, tokens, recompute = state_bytes(config), batch * config.block_size, 0
    if config.checkpoint:
        inside = block_activation_terms(replace(config, checkpoint=False), bf16=bf16)
        recompute = tokens * sum(inside.values()) + bf16 * 2 * 12 * config.n_embd**2
    start = (state["params"] + state["optimizer"] + activation_bytes(config, batch, bf16=bf16)
             + max(8 * config.vocab_size * tokens, recompute))
    return max(start, sum(state.values()) + max(recompute, 8 * config.vocab_size * config.n_embd))

def largest_batch(fits, first_miss=1):
    """The largest batch that fits (0: none), doubling from a first guess, then bisecting."""
    fit, miss = 0, first_miss
    while fits(miss):
        fit, miss = miss, 2 * miss
    while miss - fit > 1:
        middle = (fit + miss) // 2
        fit, miss = (middle, miss) if fits(middle) else (fit, middle)
    return fit

def predicted_largest_batch(config, budget, bf16):
    """Pure arithmetic: the largest batch whose predicted peak fits `budget` bytes (0: none)."""
    return largest_batch(lambda batch: predicted_peak(config, batch, bf16) <= budget)

def anatomy(config, batch, device):
    """PREDICTION: params = grads = 4 B x N, AdamW's exp_avg + exp_avg_sq = 8 B x N: 16 B of state
    per parameter, to the byte. Activations, alive from forward until backward frees them:
    activation_terms; for gpt2 at T=1024 the fp32 log-softmax over 50304 tokens is a quarter."""
    base = allocated(device)
    model, opt, x, y = new_run(config, batch, device)
    params, init = list(model.parameters()), allocated(device)
    loss, activations = forward_counted(model, x, y, bf16=False)
    forward = allocated(device)
    loss.backward()
    backward = allocated(device)
    opt.step()
    counted = dict(params=nbytes(params), grads=nbytes(p.grad for p in params),
                   optimizer=nbytes(moments(opt)), activations=activations)
    measured = {}
    if device == "cuda":  # each part: the jump in memory_allocated where it appears
        measured = dict(params=init - base - nbytes([x, y]), activations=forward - init,
                        grads=backward - init, optimizer=allocated(device) - backward)
    predicted = dict(state_bytes(config), activations=activation_bytes(config, batch))
    ratio = predicted["activations"] / (measured or counted)["activations"]
    checks = {f"anatomy_{k}_exact": predicted[k] == counted[k] for k in state_bytes(config)}
    checks["anatomy_activations_within_2pct"] = abs(ratio - 1) < 0.02
    return dict(predicted=predicted, counted=counted, measured=measured, activations_ratio=ratio,
                activation_terms=activation_terms(config, batch), checks=checks)

def measure(model, opt, x, y, bf16, device, reps):
    """Time steps (the first creates AdamW's moments), then take one more apart."""
    median, low, high = bench(lambda: train_step(model, opt, x, y, bf16), device, reps, warmup=1)
    row, params = dict(median_s=median, min_s=low, max_s=high), list(model.parameters())
    def step():
        before = allocated(device)
        loss, row["activations_counted"] = forward_counted(model, x, y, bf16)
        # measured: CUDA's allocated bytes; on a CPU (allocated 0) the count
        row["activations_measured"] = allocated(device) - before or row["activations_counted"]
        row["loss"] = loss.item()
        loss.backward()
        opt.step()
    row["peak"] = nbytes(params) + nbytes(moments(opt)) + rise_during(step, device)
    row["dtypes"] = {k: sorted({str(t.dtype) for t in ts}) for k, ts in (
        ("params", params), ("grads", [p.grad for p in params]), ("optimizer", moments(opt)))}
    grads = [p.grad.clone() for p in params]
    opt.zero_grad(set_to_none=True)
    return row, grads

def configurations(config, batch, reps, device):
    """PREDICTIONS. bf16 autocast casts copies, not the model: params, grads and AdamW state stay
    fp32. Matmul inputs are saved in bf16; the residual stream, LayerNorm statistics and the
    log-softmax stay fp32 (activation_terms(bf16=True): 28 d + 32 B per block and token, where
    Korthikanti et al. 2022 count 34 d with dropout), plus bf16 weight copies once per step, more
    than the saving for a tiny model. Time: bf16 tensor cores several x fp32 (TF32 off); on a CPU
    without bf16 instructions SLOWER. Checkpointing: a block keeps only its fp32 input (4 d bytes
    per token, not 16 d values) and runs its forward again in backward: 24 L d^2 + 4 L T d more
    FLOPs per token (gpt2, T=1024: +24%), the same gradients to rounding. Peaks: predicted_peak."""
    model, opt, x, y = new_run(config, batch, device)
    rows, grads = {}, {}
    for name, bf16, checkpoint in CONFIGURATIONS:
        model.config.checkpoint = checkpoint  # the switch is read at every forward
        rows[name], grads[name] = measure(model, opt, x, y, bf16, device, reps)
        rows[name]["activations_predicted"] = activation_bytes(model.config, batch, bf16=bf16)
        rows[name]["peak_predicted"] = predicted_peak(model.config, batch, bf16)
    error = max_rel_error(grads["fp32 + checkpoint"], grads["fp32"])
    saves = all(rows[f"{p} + checkpoint"]["activations_counted"] < rows[q]["activations_counted"]
                for p, q in (("fp32", "fp32"), ("bf16", "bf16 autocast")))
    fp32, bf16 = rows["fp32"], rows["bf16 autocast"]
    checks = dict(checkpoint_saves_activations=saves, checkpoint_grads_equal=error <= 1e-5,
                  autocast_keeps_state_fp32=set().union(*bf16["dtypes"].values()) == {"torch.float32"},
                  bf16_loss_close_to_fp32=abs(bf16["loss"] / fp32["loss"] - 1) < 1e-3)
    layers, width, seq_len = config.n_layer, config.n_embd, config.block_size
    extra = (24 * layers * width**2 + 4 * layers * seq_len * width) / flops_per_token(config)
    return dict(rows=rows, grad_max_rel_error=error, checkpoint_extra_flops=extra, checks=checks)

def accumulation(config, k, micro, device):
    """PREDICTION: with equal token counts the mean of the k micro-batch mean losses is the full
    batch's, so the sum of grad(loss_i / k) is grad(loss) up to fp32 rounding (~1e-6 relative).
    Activations live one micro-batch at a time: the peak is a micro-batch's, not k x batch's."""
    model, _, x, y = new_run(config, k * micro, device)
    out, grads = dict(k=k, micro_batch=micro), {}
    for name, chunks in (("full", [(x, y)]), ("micro", list(zip(x.chunk(k), y.chunk(k))))):
        saved = []
        def forward_backward():
            for x_chunk, y_chunk in chunks:
                loss, saved_bytes = forward_counted(model, x_chunk, y_chunk, bf16=False)
                (loss / len(chunks)).backward()  # adds into .grad
                saved.append(saved_bytes)
        model.zero_grad(set_to_none=True)
        out[f"peak_rise_{name}"] = rise_during(forward_backward, device)
        out[f"activations_counted_{name}"] = max(saved)
        out[f"activations_predicted_{name}"] = activation_bytes(config, len(chunks[0][0]))
        grads[name] = [p.grad.clone() for p in model.parameters()]
    out["grad_max_rel_error"] = error = max_rel_error(grads["micro"], grads["full"])
    lower = out["peak_rise_micro"] < out["peak_rise_full"]
    out["checks"] = dict(accumulated_grads_equal_full_batch=error < 1e-4,
                         accumulation_peak_below_full_batch=lower)
    return out

def largest_batches(config, bf16, budgets, probe, peak_only=False):
    """Per budget, the largest batch: predicted; measured when probe (a GPU), OOM caught.
    peak_only: one uncapped batch-1 step; its measured peak against each budget (1 fits, 0 not)."""
    predicted = {k: predicted_largest_batch(config, b, bf16) for k, b in budgets.items()}
    row = dict(predicted=predicted, measured={}, peak_batch1=predicted_peak(config, 1, bf16))
    if not probe:
        return row
    model, opt, _, _ = new_run(config, 1, "cuda")
    def fits(batch):
        try:
            x = torch.randint(0, config.vocab_size, (batch, config.block_size), device="cuda")
            train_step(model, opt, x, x, bf16)
            torch.cuda.synchronize()
            return True
        except RuntimeError as e:  # CUDA's OutOfMemoryError, or a library's workspace failing
            oom = isinstance(e, torch.cuda.OutOfMemoryError) or "ALLOC_FAILED" in str(e)
            if not (oom or "out of memory" in str(e).lower()):
                raise
        opt.zero_grad(set_to_none=True)  # out of the except block: its traceback held tensors
        gc.collect()
        torch.cuda.empty_cache()
        return False
    fits(1)  # a first step creates AdamW's moments: every probe is the steady state predicted
    if peak_only:
        torch.cuda.reset_peak_memory_stats()
        fits(1)
        row["measured_peak_batch1"] = peak = torch.cuda.max_memory_allocated()
        row["measured"] = {key: int(peak <= budget) for key, budget in budgets.items()}
        return row
    for key, budget in budgets.items():
        torch.cuda.empty_cache()  # the cap counts the allocator's cache too
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        row["measured"][key] = largest_batch(fits, predicted[key] + max(1, predicted[key] // 8))
    torch.cuda.set_per_process_memory_fraction(1.0)
    return row

def what_fits(budget_gb, measure):
    """PREDICTION (predicted_largest_batch): bf16 halves most block activations (not the fp32
    log-softmax over V), checkpointing keeps one tensor per block: each raises the largest batch.
    The big model's state is 16 B x 783M = 12.5 GB in any precision, its fp32 activations ~24 GB
    per 8192-token sequence: at batch 1 fp32 needs ~39 GB and bf16 ~30 GB, over 24 GiB (25.8 GB);
    checkpointing ~16 GB: batch 2, any batch by accumulation. Measured on a GPU: the peak of one
    uncapped batch-1 step (max_memory_allocated) against the budget."""
    budgets, measure_big = {"budget": budget_gb * GiB}, False
    if measure:
        print("\n(searching the largest batches: full steps probed, OOM caught; about a minute)")
        gc.collect()
        budgets["card"] = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
        measure_big = budgets["budget"] < budgets["card"]  # else the card cannot stand for it
        torch.set_float32_matmul_precision("high")  # TF32 speeds the search up; memory is the same
    rows, big_rows, checks = {}, {}, {}
    for name, bf16, checkpoint in CONFIGURATIONS:
        fit, big = (replace(model, checkpoint=checkpoint) for model in (FIT_MODEL, BIG_MODEL))
        big_rows[name] = largest_batches(big, bf16, {"budget": budget_gb * GiB}, measure_big, True)
        rows[name] = largest_batches(fit, bf16, budgets, measure)
    torch.set_float32_matmul_precision("highest")
    if measure:
        raises = all(rows[a]["measured"]["card"] < rows[b]["measured"]["card"] for a, b in LADDER)
        checks["fit_each_technique_raises"] = raises
    if measure_big:
        fits = {name: row["measured"]["budget"] for name, row in big_rows.items()}
        checks["big_model_fits_only_with_the_techniques"] = fits["fp32"] == 0 < fits["bf16 + checkpoint"]
    big = dict(name="GPT-2 large (774M) at T=8192", model=asdict(BIG_MODEL),
               budget=budget_gb * GiB, measured=measure_big, rows=big_rows)
    return dict(model=asdict(FIT_MODEL), budgets=budgets, rows=rows, big=big, checks=checks)
def report_anatomy(result):
    predicted, counted, measured = result["predicted"], result["counted"], result["measured"]
    print("\n[1] anatomy of one fp32 step, MiB: predicted, counted, measured (CUDA only)")
    for key in predicted:
        print(f"  {key:<12}{mib(predicted[key]):>10}{mib(counted[key]):>10}{mib(measured.get(key, math.nan)):>10}")
    print(f"  activations predicted / measured (CPU: counted) {result['activations_ratio']:.4f}")
    for name, size in sorted(result["activation_terms"].items(), key=lambda kv: -kv[1]):
        print(f"    {name:<26}{mib(size):>10} MiB  {size / predicted['activations']:6.1%} predicted")
def report_configurations(result):
    rows, fp32, bf16 = result["rows"], result["rows"]["fp32"], result["rows"]["bf16 autocast"]
    print("\n[2, 3] autocast, checkpointing; MiB activations, peak: predicted / measured; step ms")
    for name, row in rows.items():
        busy = BUSY * (row["max_s"] - row["min_s"] > row["median_s"])
        print(f"  {name:<18}{mib(row['activations_predicted']):>9} / {mib(row['activations_measured']):<9}"
              f"{mib(row['peak_predicted']):>9} / {mib(row['peak']):<9}{row['median_s'] * 1e3:9.1f} "
              f"({row['min_s'] * 1e3:.1f}-{row['max_s'] * 1e3:.1f}) ms measured{busy}")
    print("  under autocast: " + "; ".join(f"{k} {v[0]}" for k, v in bf16["dtypes"].items()))
    print(f"  loss fp32 {fp32['loss']:.5f}, bf16 {bf16['loss']:.5f} (measured, same weights)")
    print(f"  bf16 step speed {fp32['median_s'] / bf16['median_s']:.2f}x fp32 (derived)")
    for precision, plain in (("fp32", fp32), ("bf16", bf16)):
        checkpointed = rows[f"{precision} + checkpoint"]
        overhead = checkpointed["median_s"] / plain["median_s"] - 1
        ratio = plain["activations_measured"] / checkpointed["activations_measured"]
        print(f"  {precision} + checkpoint: activations / {ratio:.1f} (measured), step time "
              f"{overhead:+.0%} (derived; FLOPs +{result['checkpoint_extra_flops']:.0%} predicted)"
              + BUSY * (overhead < 0))  # recomputing costs time: a saving is noise
    print(f"  gradients, checkpointed vs not (fp32): max relative error {result['grad_max_rel_error']:.1e}")
def report_accumulation(result, k, micro, seq_len):
    print(f"\n[4] accumulation, fp32: {k} micro-batches of {micro} x {seq_len} vs one of {k * micro}")
    print(f"  gradients: max relative error {result['grad_max_rel_error']:.1e} (check: < 1e-4)")
    for name in ("full", "micro"):
        print(f"  {name}: activations {mib(result[f'activations_predicted_{name}'])} MiB predicted, "
              f"{mib(result[f'activations_counted_{name}'])} counted; forward + backward peak "
              f"{mib(result[f'peak_rise_{name}'])} MiB above params + moments (measured)")
def report_fit(result):
    budgets, big = result["budgets"], result["big"]
    print(f"\n[5] largest batch of {result['model']['block_size']}-token sequences, AdamW step: "
          "predicted / measured (OOM caught)")
    for name, row in result["rows"].items():
        print(f"  {name:<19}" + "   ".join(f"{key} {budget / GiB:.1f} GiB: "
              f"{row['predicted'][key]:>4} / {row['measured'].get(key, '-')}"
              for key, budget in budgets.items()))
    print(f"  {big['name']} under {big['budget'] / GiB:g} GiB (0: at no batch; else accumulate):")
    for name, row in big["rows"].items():
        measured = f"{row.get('measured_peak_batch1', math.nan) / GiB:.1f}".replace("nan", "n/a")
        print(f"    {name:<19} largest batch {row['predicted']['budget']} predicted; batch 1 peaks"
              f" at {row['peak_batch1'] / GiB:.1f} GiB predicted / {measured} measured")
def figure(rows, state, out_dir):
    """Parts stacked, predicted beside measured, the peak in black; temporaries: the rest."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.8))
    bars = [(row[f"activations_{kind}"], row[peak]) for row in rows.values()
            for kind, peak in (("predicted", "peak_predicted"), ("measured", "peak"))]
    for i, (activations, peak) in enumerate(bars):
        x, hide, bottom = i + i // 2, "_" * (i > 0), 0  # a label "_..." stays out of the legend
        rise = peak - state["params"] - state["optimizer"] - max(activations, state["grads"])
        parts = dict(state, activations=activations, temporaries=max(0, rise))
        for color, (part, size) in enumerate(parts.items()):
            ax.bar(x, size / MiB, bottom=bottom, color=f"C{color}", label=hide + part)
            bottom += size / MiB
        ax.plot([x - 0.4, x + 0.4], [peak / MiB] * 2, "k-", lw=2, label=hide + "peak")
    ax.set_xticks([3 * i + 0.5 for i in range(len(rows))],
                  [f"{name}\npredicted | measured" for name in rows], fontsize=7)
    ax.set(ylabel="MiB", title="one training step: its parts and its peak")
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path, tmp = Path(out_dir) / "04_memory.png", Path(out_dir) / f"04_memory.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return path

def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value
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
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Section 13.4: the memory of a training step.")
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (the tests)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--json", help="write every measured number to this file")
    parser.add_argument("--out", default="out", help="folder for the figure (default out/)")
    parser.add_argument("--budget-gb", type=positive_float, default=24.0,
                        help="the emulated card's memory in GiB for section 5 (default 24)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: torch sees no CUDA GPU here; run with --device cpu")
    check_outputs(args)
    return args

def main():
    args = parse_args()
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    config, batch, k, micro, reps = SIZES["quick" if args.quick else device]
    name = f"CPU, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
    if device == "cuda":
        name = f"{torch.cuda.get_device_name()}, {torch.cuda.mem_get_info()[1] / GiB:.1f} GiB"
        for bf16 in (False, True):  # cuBLAS takes workspaces from the allocator: before counting
            train_step(*new_run(SIZES["quick"][0], 1, device), bf16)
    print(f"device: {name} | torch {torch.__version__}")
    print(f"model: {asdict(config)}, batch {batch}; fused AdamW; fp32 without TF32")
    results = dict(anatomy=anatomy(config, batch, device))
    report_anatomy(results["anatomy"])
    results["configurations"] = configurations(config, batch, reps, device)
    report_configurations(results["configurations"])
    results["accumulation"] = accumulation(config, k, micro, device)
    report_accumulation(results["accumulation"], k, micro, config.block_size)
    results["fit"] = what_fits(args.budget_gb, measure=device == "cuda" and not args.quick)
    report_fit(results["fit"])
    path = figure(results["configurations"]["rows"], state_bytes(config), args.out)
    print(f"\nfigure: {path}" if path else "\nmatplotlib missing: figure skipped")
    checks = {key: ok for result in results.values() for key, ok in result.pop("checks").items()}
    print("\nchecks:", ", ".join(f"{key} {'ok' if ok else 'FAILED'}" for key, ok in checks.items()))
    if args.json:
        write_json(args.json, dict(lesson="04_memory", quick=args.quick, checks=checks,
                                   device=dict(type=device, name=name, torch=torch.__version__),
                                   config=dict(asdict(config), batch_size=batch,
                                               seq_len=config.block_size), **results))
    if not all(checks.values()):
        sys.exit("error: checks failed: " + ", ".join(key for key, ok in checks.items() if not ok))

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
