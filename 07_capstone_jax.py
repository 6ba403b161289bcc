"""
Section 13.7: the waterfall, in JAX. GPT-2 124M (tiny on a CPU) from 07_capstone_torch.py's
tokens, batches and initial weights, down one measured rung per technique (RUNGS), each from
the same init on the same batches, so its loss must track the baseline's (the waterfall changes
the speed, not the math); the JAX profiler splits each rung's step by kernel class: what binds.

    python 07_capstone_jax.py               # one GPU: gpt2 (124M, T=1024), ~5 min
    python 07_capstone_jax.py --headline    # first jitted vs final rung, 100 steps each, ~2 min
    python 07_capstone_jax.py --scaling     # the final rung on one device, then on all of them
    python 07_capstone_jax.py --device cpu  # the tiny preset, ~2 min on 2 cores
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python 07_capstone_jax.py --device cpu --quick

Where the frameworks diverge: "compile" is jax.jit of the whole step (forward, backward, AdamW);
JAX runs fp32 matmuls as TF32 on a GPU unless asked for 'highest'; mixed precision is a dtype;
data parallelism is a sharding of the batch over a device mesh, in one process. Output: a table,
out/07_capstone_jax.png (--headline: 07_capstone_jax_headline.png), --json. Tokens are cached
in .cache/. Copy this file with model_jax.py and model_torch.py.
"""
import argparse, contextlib, gzip, hashlib, json, math, os, platform, re, statistics, sys
import sysconfig, tempfile, time, warnings
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # grow to 95% of the GPU, not
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # 75% at once: B=64 needs it
import jax, jax.numpy as jnp, numpy as np, optax, torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from model_torch import GPT as TorchGPT, GPTConfig, datasheet_bf16_peak, flops_per_token
from model_jax import GPT, adamw, cross_entropy, from_torch

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")  # CPU: harmless

# --- Data: real text, the same batches in both capstones (both files hold this block).

def read_corpus(data, max_bytes=20_000_000):
    """--data FILE, else the stdlib's *.py files (sorted, capped); a bad file: one line, exit 1."""
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages"}  # installed packages are not the stdlib
        files = sorted(p for p in root.rglob("*.py") if not skip & set(p.parts))
        return b"\n".join(p.read_bytes() for p in files)[:max_bytes]
    if not Path(data).is_file():
        sys.exit(f"error: --data {data}: not a file")
    raw = Path(data).read_bytes()[:max_bytes]
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(raw) - 3:  # not a multi-byte character cut by the cap
            sys.exit(f"error: --data {data}: not UTF-8 text (byte {e.start} is {raw[e.start]:#x})")
    return raw

def load_tokens(data, min_tokens, cache_dir=".cache"):
    """Token ids (uint16) and the tokenizer: GPT-2 BPE if tiktoken's files are cached (no network
    to fetch them), else UTF-8 bytes (ids < 256). Tokenized once, cached atomically."""
    raw = read_corpus(data)
    tk_cache = (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
                or os.path.join(tempfile.gettempdir(), "data-gym-cache"))
    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    bpe = all(os.path.exists(os.path.join(tk_cache, hashlib.sha1(f"{url}{f}".encode()).hexdigest()))
              for f in ("vocab.bpe", "encoder.json"))
    tokenizer = "gpt2-bpe" if bpe else "utf8-bytes"
    path = Path(cache_dir) / f"tokens-{tokenizer}-{hashlib.sha1(raw).hexdigest()[:16]}.npy"
    try:
        return np.load(path), tokenizer
    except (OSError, ValueError, EOFError):  # absent, or left unreadable: tokenize again
        pass
    if bpe:
        import tiktoken
        ids = tiktoken.get_encoding("gpt2").encode_ordinary(raw.decode("utf-8", errors="replace"))
    else:
        print("tokenizer: tiktoken's GPT-2 BPE files are not cached (no network): UTF-8 bytes")
        ids = np.frombuffer(raw, dtype=np.uint8)
    ids = np.asarray(ids, dtype=np.uint16)
    if len(ids) < min_tokens:
        sys.exit(f"error: --data {data}: {len(ids)} tokens, fewer than one batch's {min_tokens}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, ids)
    os.replace(tmp, path)  # a reader never sees a half-written cache, even after Ctrl-C
    return ids, tokenizer

def get_batch(tokens, step, batch_size, seq_len, seed=0):
    """Batch number `step`, drawn by a generator seeded by (seed, step): the same in every rung."""
    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - seq_len - 1, batch_size)
    windows = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)
    return windows[:, :-1], windows[:, 1:]

# --- The rungs, in the section's order: each changes one thing and keeps the rest of the last
# KEPT rung before it; "why": the regime it targets, and the prediction.
WINDOW = 5  # steps between host syncs once "no host sync per step" is on
RUNGS = [
    dict(name="un-jitted (op-by-op)", jit=False, precision="highest", bf16=False, attn="manual",
         donate=False, pad_vocab=False, accum=4, steps_per_sync=1, triton_gemm=True,
         cublaslt=False, checkpoint=False, shard=False, keep=True, builds_on=None,
         why="baseline: each jnp op dispatched from Python on its own, full fp32 matmuls, the "
             "T x T scores in memory: overhead- and fp32-bound, < 5% MFU on a GPU"),
    dict(name="+ jax.jit (whole step)", jit=True, why="overhead: one XLA program for forward, "
         "backward and AdamW, elementwise chains fused; fp32 units still cap the matmuls: 1.2-5x"),
    dict(name="+ TF32 (default precision)", precision="default", why="compute-bound on the wrong "
         "units: fp32 matmuls as TF32 (H100 datasheet: 495 vs 67 TFLOP/s): 2-3x; a CPU has none"),
    dict(name="+ bf16 compute dtype", bf16=True, why="dtype=bfloat16, param_dtype=float32: 2x "
         "TF32's peak, half the activation bytes; LayerNorm, residuals, loss stay fp32: 1.3-2x"),
    dict(name="+ donation + fused attention", donate=True, attn="sdpa", why="bandwidth: a fused "
         "attention (cuDNN) never writes the B*H*T*T scores; state updated in place: 1.2-1.5x"),
    dict(name="+ vocab 50304, 1 micro-step", pad_vocab=True, accum=1, why="50304 = 128 x 393 "
         "fills the largest matmul's tiles; 4x larger micro-batches amortise fixed costs: 1.1-1.3x"),
    dict(name="+ no host sync per step", steps_per_sync=WINDOW, why="overhead: Python waits for "
         f"the device every {WINDOW} steps, not every step; a ~100 ms step hides a < 1 ms gap: <1%"),
    dict(name="+ cuBLAS for every matmul", triton_gemm=False, why="the compiler's kernel choice: "
         "matmuls fused with a neighbour leave XLA's own Triton GEMMs for cuBLAS: a few %"),
    dict(name="+ cuBLASLt epilogues (detour)", cublaslt=True, keep=False, why="bandwidth: bias and "
         "GELU in the matmul's epilogue: one pass over the MLP activations less, 0-5% (CPU: none)"),
    dict(name="+ activation checkpointing (detour)", checkpoint=True, keep=False, why="memory "
         "does NOT bind: nnx.remat recomputes each block's forward, 1/3 more FLOPs: 20-30% SLOWER"),
    dict(name="+ data-parallel sharding", shard=True, why="the batch's rows sharded over every "
         "device, params replicated, XLA adds the gradient all-reduce: ~N x one device's tokens/s"),
]
for number, rung in enumerate(RUNGS[1:], 1):
    base = next(r for r in reversed(RUNGS[:number]) if r["keep"])
    rung.update({**base, "keep": True, **rung, "builds_on": base["name"]})
FINAL = [r for r in RUNGS if r["keep"] and not r["shard"]][-1]  # the best single-device setup
SAME_PROGRAM = ["name", "why", "keep", "builds_on", "steps_per_sync"]  # Python-side settings
GPU_ONLY = ["precision", "triton_gemm", "cublaslt"]  # a CPU ignores these: the same program

CONFIGS = {  # the model, sequences a step, timed steps (bf16 rungs, fp32 rungs, the headline's),
    # the step whose loss is checked, the matmul probe's n, the vocabulary (as shipped, padded)
    "gpu": dict(preset="gpt2", model={}, batch=64, steps=20, slow_steps=2, head_batch=16,
                head_steps=98, check_step=3, probe_n=8192, vocab=(50257, 50304)),
    "cpu": dict(preset="tiny", model={}, batch=8, steps=3, slow_steps=2, head_batch=8,
                head_steps=18, check_step=3, probe_n=1024, vocab=(50257, 50304)),
    "quick": dict(preset="tiny", model=dict(n_layer=1, n_head=2, n_embd=64, block_size=32),
                  batch=4, steps=1, slow_steps=1, head_batch=4, head_steps=1, check_step=2,
                  probe_n=256, vocab=(8193, 8320))}  # toy model; 8193 rows, padded to 128 x 65
TOLERANCE = 0.005  # each rung's loss at the check step against the baseline's, relative: bf16
# rounds to 2^-9 ~ 0.2% per value, averaged over the loss's sums; a few steps amplify it to ~0.1%
HEADLINE_TOLERANCE = 0.03  # the same over 100 steps: rounding differences grow along the run
ACCUM_TOLERANCE = 1e-4  # accumulated vs full-batch gradient, fp32, relative (norm)
FITS_BYTES = 23 * 2**30  # a 24 GB card (RTX 4090) less ~1 GiB for the CUDA context and libraries
CLASSES = {  # class: (its regime, words in a kernel's name, its XLA op or the op's JAX path)
    "communication": ("communication-bound", ("all-reduce", "all_reduce", "nccl")),
    "attention": ("compute-bound", ("sdpa", "fmha", "flash", "attention")),
    "loss": ("bandwidth-bound", ("loss",)),  # the step's named scopes
    "optimizer": ("bandwidth-bound", ("optimizer",)),
    "matmul": ("compute-bound", ("gemm", "nvjet", "xmma", "cutlass", "dot")),
    "other": ("copies", ("memcpy", "memset")),
    "norm+elementwise": ("bandwidth-bound", ("",)),  # every other kernel
    "idle": ("overhead-bound", ())}  # the wall time no kernel ran

# --- Measuring: the clock, this chip's matmul peak, energy, where the device time goes.

def sync(device):
    """JAX: every timed function blocks on its own result (jax.block_until_ready)."""

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

def burst_peak(n, dtype):
    """This chip's matmul FLOP/s by 01_roofline.py's burst method: 10 bursts of n x n matmuls
    lasting >= 5 ms, each after 100 ms idle and an untimed burst; 2 n^3 / median s per matmul."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    # XLA's default autotuning (level 4), which XLA_FLAGS turns off for the un-jitted rung
    matmul = jax.jit(jnp.matmul).lower(a, a).compile(dict(xla_gpu_autotune_level=4))
    calls = math.ceil(0.005 / bench(lambda: matmul(a, a).block_until_ready(), None, 1, 1)[0])
    burst = lambda: jax.block_until_ready([matmul(a, a) for _ in range(calls)])
    per_call = []
    for _ in range(10):
        time.sleep(0.1)
        per_call.append(bench(burst, None, reps=1, warmup=1)[0] / calls)
    return 2 * n**3 / statistics.median(per_call)

def energy_meter(devices):
    """A function reading the joules these GPUs have used so far (NVML), or None without NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(64)))
        ids = [int(visible.split(",")[d.id]) for d in devices]  # NVML numbers every GPU
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in ids]
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handles[0])  # mJ since the driver loaded
    except Exception:  # no pynvml, no driver or counter, a CPU, or GPUs named by UUID
        return None
    return lambda: sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles) / 1e3

def device_time(window, steps, op_paths, world):
    """ms per step and device by kernel class: one call of window() under the JAX profiler."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python events: they would swamp an op-by-op trace
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, profiler_options=options):
            wall_ms = bench(window, None, reps=1, warmup=0)[0] * 1e3 / steps
        events = json.load(gzip.open(next(Path(folder).rglob("*.trace.json.gz"))))["traceEvents"]
    names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
             if e.get("name") in ("process_name", "thread_name")}
    streams = {k for k, name in names.items()  # a GPU's kernels: its "Stream #n" lines
               if name.startswith("Stream") and "/device:GPU" in names.get((k[0], None), "")}
    ms = dict.fromkeys(CLASSES, 0.0)
    for e in events:  # on a CPU (no streams): the XLA ops, events that name one
        args = e.get("args", {})
        op = args.get("hlo_op", "")
        on_device = (e.get("pid"), e.get("tid")) in streams or not streams and op
        if e.get("ph") == "X" and on_device and not op.startswith(("while", "call", "conditional")):
            text = f"{e['name']} {op} {args.get('hlo_module')} {op_paths.get(op)}".lower()
            kind = next(c for c, (_, words) in CLASSES.items() if any(w in text for w in words))
            ms[kind] += e["dur"] / 1e3 / steps / world  # (a CPU loop's body counted, not the loop)
    # One GPU stream runs its kernels one after another: their sum is the busy time. CPU threads,
    # or a second stream (an all-reduce beside the backward), overlap: scaled to the wall time
    scale = min(1.0, wall_ms / max(sum(ms.values()), 1e-9))
    ms = {kind: t * scale for kind, t in ms.items()}
    ms["idle"] = max(0.0, wall_ms - sum(ms.values()))
    binds = max(ms, key=ms.get)
    return dict(ms=ms, step_ms=wall_ms, binds=binds, regime=CLASSES[binds][0])

# --- The training step, and one rung: the same init, the same batches, the same tokens per step.

def accumulated_grads(model, x, y, accum, jitted=True):
    """Loss and gradient of a batch from `accum` equal micro-batches: their gradients summed, then
    divided by accum. Jitted: a lax.scan (one micro-step to compile); else a Python loop."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def micro_step(grad_sum, xy):
        def loss_fn(params):
            logits, _ = nnx.merge(graphdef, params, rest)(xy[0])
            with jax.named_scope("loss"):  # a name the profile's classes look for
                return cross_entropy(logits, xy[1])
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(jnp.add, grad_sum, grads), loss

    grad_sum, losses = jax.tree.map(jnp.zeros_like, params), []
    micro = [a.reshape(accum, -1, a.shape[1]) for a in (x, y)]  # (micro-steps, rows, T)
    if jitted:
        grad_sum, losses = jax.lax.scan(micro_step, grad_sum, micro)
    else:
        for xy in zip(*micro):
            grad_sum, loss = micro_step(grad_sum, xy)
            losses.append(loss)
    return jnp.mean(jnp.asarray(losses)), jax.tree.map(lambda g: g / accum, grad_sum)

def accumulation_error():
    """Relative norm of (4 micro-batches' gradient - the full batch's): fp32, a toy model."""
    # PREDICTION: fp32 rounding, ~1e-7. A lost "/ accum" gives 4x the gradient (error 3.0), which
    # the losses would hide: AdamW's update g / sqrt(v) does not depend on the gradient's scale
    cfg = GPTConfig.preset("tiny", n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=256)
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: GPT(cfg)))  # random weights, no init ops
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: rng.normal(0, 0.1, s.shape).astype(s.dtype), shapes)
    x, y = jnp.asarray(rng.integers(0, 256, (2, 8, 16)), jnp.int32)
    grads = lambda s, n: accumulated_grads(nnx.merge(graphdef, s), x, y, n)[1]
    with jax.default_matmul_precision("highest"):  # one program computes both
        accumulated, full = jax.jit(lambda s: [grads(s, 4), grads(s, 1)])(state)
    difference = jax.tree.map(jnp.subtract, accumulated, full)
    return float(optax.global_norm(difference) / optax.global_norm(full))

def build(rung, run, r, n_batches):
    """The rung's model at torch's init with AdamW, its batches on its devices, and its step."""
    devices = run.devices[:1]
    if rung["shard"]:
        devices = run.devices
    mesh = jax.make_mesh((len(devices),), ("data",), (jax.sharding.AxisType.Auto,), devices=devices)
    vocab, r["world_size"] = run.vocab[rung["pad_vocab"]], len(devices)
    cfg = run.config(vocab_size=vocab, attn=rung["attn"], checkpoint=rung["checkpoint"])
    dtype = jnp.bfloat16 if rung["bf16"] else jnp.float32
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: GPT(cfg, dtype, attn_impl=run.attention)))
    model = nnx.merge(graphdef, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
    cut = ("transformer.wte.weight", "lm_head.weight")  # torch's init fills every parameter
    from_torch(model, {k: v[:vocab] if k in cut else v for k, v in run.init_state.items()})
    batches = [get_batch(run.tokens, i, run.batch, cfg.block_size) for i in range(n_batches)]
    if rung["checkpoint"] or rung is FINAL:  # bytes jax.vjp keeps for the backward, traced
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        x, y = (a[:run.batch // rung["accum"]] for a in batches[0])  # one micro-batch
        saved = jax.eval_shape(lambda p: jax.tree.leaves(
            jax.vjp(lambda p: nnx.merge(graphdef, p, rest)(x, y)[1], p)[1]), params)
        r["activation_bytes"] = int(sum(s.size * s.dtype.itemsize for s in saved))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, adamw(6e-4), wrt=nnx.Param)))
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))  # a replica per device
    rows = NamedSharding(mesh, PartitionSpec("data"))  # each device gets its rows of the batch
    data = [jax.device_put((x.astype(np.int32), y.astype(np.int32)), rows) for x, y in batches]

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = accumulated_grads(model, x, y, rung["accum"], rung["jit"])
        with jax.named_scope("optimizer"):
            optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))
    return step, state, data

def compile_step(step, rung, run, r, example):
    """jax.jit of the whole step, compiled once while the program stays the same; XLA's memory
    plan, and each XLA op's JAX path (the profile looks for the step's named scopes)."""
    program = {k: v for k, v in rung.items() if k not in SAME_PROGRAM + GPU_ONLY * (not run.gpu)}
    if run.compiled[0] != program:
        print("   compiling the whole step with XLA (~5-60 s on a GPU; fp32 autotunes longest)")
        options = dict(xla_gpu_autotune_level=4, xla_gpu_enable_triton_gemm=rung["triton_gemm"])
        if rung["cublaslt"]:  # named only where used: an XLA without the option fails one rung
            options["xla_gpu_enable_cublaslt"] = True
        start = time.perf_counter()  # (autotune level 4: XLA's default, off for the un-jitted)
        jitted = jax.jit(step, donate_argnums=(0,) if rung["donate"] else ())
        run.compiled = (program, jitted.lower(*example).compile(options))
        r["compile_s"] = time.perf_counter() - start
    mem = run.compiled[1].memory_analysis()  # per device: inputs, outputs, scratch
    r["xla_step_bytes"] = mem and int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                      - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    hlo = run.compiled[1].as_text()
    ops = re.findall(r'^\s*(?:ROOT )?%?([\w.-]+) = [^\n]*?op_name="([^"]*)"', hlo, re.M)
    return run.compiled[1], dict(ops)

def train(rung, run, r):
    """One untimed call, the timed calls (NVML's energy around them), one profiled; a call is
    `steps_per_sync` steps, then Python waits for the device."""
    per_call, op_paths = rung["steps_per_sync"], {}
    calls = max(1, (run.steps if rung["bf16"] else run.slow_steps) // per_call)  # fp32: slow
    with jax.default_matmul_precision(rung["precision"]):
        step, state, data = build(rung, run, r, (calls + 2) * per_call)
        if rung["jit"]:
            step, op_paths = compile_step(step, rung, run, r, (state, *data[0]))
    losses, seconds = [], []

    def window():
        nonlocal state  # the only reference: a donated buffer is updated in place
        start = time.perf_counter()
        with jax.default_matmul_precision(rung["precision"]):  # un-jitted: applies per op
            for _ in range(per_call):
                loss, state = step(state, *data[len(losses) % len(data)])
                losses.append(loss)
            jax.block_until_ready(state)  # Python waits: the AdamW update too, not the loss
        seconds.append(time.perf_counter() - start)

    window()
    meter = energy_meter(run.devices[:r["world_size"]])
    joules = meter and meter()
    median, fastest, slowest = (t / per_call * 1e3 for t in bench(window, None, calls, warmup=0))
    if meter:
        r["tokens_per_joule"] = calls * per_call * run.tokens_per_step / (meter() - joules)
    try:
        r["profile"] = device_time(window, per_call, op_paths, r["world_size"])
    except Exception as e:  # a profiler this jax version or device cannot run, or read
        r["profile"] = dict(ms={}, step_ms=0.0, binds="n/a", regime=f"no profile: {e}"[:200])
    return dict(r, ms_per_step=median, ms_min=fastest, ms_max=slowest, seconds=seconds,
                losses=[float(v) for v in losses],
                peak_mem_bytes=(run.devices[0].memory_stats() or {}).get("peak_bytes_in_use"))

def measure(rung, run):
    """One rung, or why it did not run: too few devices to shard over, out of memory."""
    print(f"== {rung['name']}: {rung['why']}", flush=True)
    r = dict(name=rung["name"], builds_on=rung["builds_on"], kept=rung["keep"], settings=rung,
             tokens_per_step=run.tokens_per_step, compile_s=0.0)
    if rung["shard"] and (len(run.devices) < 2 or run.batch % len(run.devices)):
        return dict(r, skipped=f"{len(run.devices)} device(s) for {run.batch} rows (a CPU can "
                    "simulate 4: XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    if not rung["jit"]:
        print("   first step: JAX compiles each jnp op on first use (~250 programs, 10-60 s)")
    try:
        return train(rung, run, r)
    except Exception as e:  # out of memory (RESOURCE_EXHAUSTED), or an option this XLA lacks
        return dict(r, failed=f"{type(e).__name__}: {str(e)[:300]}")
    finally:  # a GPU frees this rung's programs before the next allocates (a CPU keeps its
        if run.gpu:  # small one-op programs: the next rung would compile them again)
            jax.clear_caches()

# --- Reporting: numbers derived against the first rung, checks, the table, the figure.

def summarise(run, rungs):
    """Each rung against the first that ran; the checks (correctness only: timing never decides
    the exit code); each mode's ratio."""
    ran = [r for r in rungs if "ms_per_step" in r]
    for r in ran:
        r["tokens_per_s"] = run.tokens_per_step / r["ms_per_step"] * 1e3
        r["loss"] = r["losses"][run.check_step - 1]
        flops = run.flops_per_token * r["tokens_per_s"] / r["world_size"]  # per device
        r.update(speedup=r["tokens_per_s"] / ran[0]["tokens_per_s"], mfu_measured_peak=flops / run.peak,
                 mfu_datasheet=run.datasheet and flops / run.datasheet,
                 loss_rel_diff=abs(r["loss"] - ran[0]["loss"]) / ran[0]["loss"],
                 step_mem_bytes=r.get("xla_step_bytes") or r["peak_mem_bytes"])
        r["fits_24gb"] = r["step_mem_bytes"] and r["step_mem_bytes"] <= FITS_BYTES
        impossible = [r["ms_max"] - r["ms_min"] > r["ms_per_step"], (r["mfu_datasheet"] or 0) > 1,
                      r["mfu_measured_peak"] > 1.1]  # a spread wider than the median, > the peak
        r["unreliable"] = "unreliable (machine busy)" * any(impossible)
    saved = {r["name"]: r.get("activation_bytes") for r in ran}
    checks = dict(  # a kept rung ran; only the sharded one may be skipped, saying why
        kept_rungs_ran=all("ms_per_step" in r or "skipped" in r for r in rungs if r["kept"]),
        losses_track_baseline=all(r["loss_rel_diff"] <= TOLERANCE for r in ran),
        checkpointing_lowers_activation_memory=all(  # fewer bytes kept than the rung before
            saved.get(r["name"], math.inf) < (saved.get(r["builds_on"]) or 0)
            for r in rungs if r["settings"]["checkpoint"]),
        accumulated_gradient_equals_full_batch=run.accumulation_error <= ACCUM_TOLERANCE)
    result = dict(rungs=rungs, checks=checks)
    if run.args.scaling and len(ran) == 2:
        result["scaling"] = ran[1]["tokens_per_s"] / ran[1]["world_size"] / ran[0]["tokens_per_s"]
    if run.args.headline and len(ran) == 2:  # the same steps, from the same init and batches
        first, final = (np.array(r["losses"]) for r in ran)
        result["headline"] = dict(loss_gap=float(np.max(np.abs(final - first) / first)),
                                  time_ratio=ran[1]["speedup"], tolerance=HEADLINE_TOLERANCE,
                                  steps=len(first), batch=run.batch)
        checks["headline_losses_agree"] = result["headline"]["loss_gap"] <= HEADLINE_TOLERANCE
    return result

COLUMNS = [("ms/step", "ms_per_step", ".1f"), ("tokens/s", "tokens_per_s", ",.0f"),
           ("speed-up", "speedup", ".2f"), ("MFU(ds)", "mfu_datasheet", ".1%"),
           ("MFU(ms)", "mfu_measured_peak", ".1%"), ("GiB/step", "step_mem_gib", ".1f"),
           ("24GB", "fits_24gb", ""), ("tokens/J", "tokens_per_joule", ",.0f"),
           ("compile", "compile_s", ".1f"), ("loss", "loss", ".4f"),
           ("d(loss)", "loss_rel_diff", ".2%")]

def report(run, result):
    """The table (a row per rung: measured and derived numbers, what binds), the ratios, checks."""
    print(f"\n{'rung':36s}" + "".join(f"{title:>10s}" for title, _, _ in COLUMNS) + "  binds")
    for r in result["rungs"]:
        r = dict(r, step_mem_gib=(r.get("step_mem_bytes") or math.nan) / 2**30)
        cells = [format(r[k], spec) if r.get(k) is not None else "n/a" for _, k, spec in COLUMNS]
        if "tokens_per_s" not in r:
            cells = [r.get("skipped") or "FAILED: " + r["failed"]]
        print(f"{r['name']:36s}" + "".join(f"{c:>10s}" for c in cells),
              r.get("profile", {}).get("binds", ""), r.get("unreliable", ""))
    print("(measured: ms/step, tokens/s, tokens/J (NVML), compile s, binds (profiler), GiB/step "
          "(per device: XLA's compiled step; un-jitted: the peak); derived: speed-up, MFU, 24GB "
          f"(fits {FITS_BYTES / 2**30:.0f} GiB), loss at step {run.check_step} vs the first)")
    print(f"interconnect: {run.args.interconnect}; NCCL reports {nccl_transport()} (NCCL joins "
          "GPUs only: on a CPU the flag changes nothing)")
    if "scaling" in result:
        print(f"scaling (derived): {result['scaling']:.1%} of {len(run.devices)} x one device's "
              "tokens/s" + " (simulated CPU devices share the same cores)" * (not run.gpu))
    if "headline" in result:
        h = result["headline"]
        print(f"largest relative loss gap over the {h['steps']} steps (derived): "
              f"{h['loss_gap']:.2%} (tolerance {h['tolerance']:.0%}); the final rung's step "
              f"is {h['time_ratio']:.1f}x faster (derived)")
    for name, ok in result["checks"].items():
        print(f"check {name}: {'ok' if ok else 'FAILED'}")

def save_figure(result, out):
    """--headline: the loss against step and against time. Else the waterfall: each rung's
    tokens/s, and where its step's time goes."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("figure skipped (no matplotlib)")
    ran, name = [r for r in result["rungs"] if "tokens_per_s" in r], "07_capstone_jax.png"
    if "headline" in result:
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in ran:
            by_step.plot(r["losses"], label=r["name"])
            by_time.plot(np.cumsum(r["seconds"]), r["losses"])
        by_step.set(xlabel="optimizer step", ylabel="loss (measured)")
        by_time.set(xlabel="wall-clock seconds (measured)", xscale="log")
        by_step.legend()
        fig.suptitle(f"the same loss curve, {result['headline']['time_ratio']:.0f}x apart in "
                     "time (baseline: the first jitted rung, fp32 matmuls)")
        name = "07_capstone_jax_headline.png"
    else:  # every fix moves the bottleneck
        fig, (speed, split) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
        names, left = [r["name"] for r in ran], np.zeros(len(ran))
        speed.barh(names, [r["tokens_per_s"] for r in ran])
        speed.set(xlabel="tokens/s (measured)", title="07_capstone_jax: the waterfall")
        speed.invert_yaxis()
        for kind in CLASSES:
            share = np.array([r["profile"]["ms"].get(kind, 0) / max(r["profile"]["step_ms"], 1e-9)
                              for r in ran])
            split.barh(names, share, left=left, label=kind)
            left += share
        split.set(xlabel="share of the step (measured, profiler)", title="where the time goes")
        split.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    Path(out).mkdir(parents=True, exist_ok=True)
    tmp = Path(out) / f"{name}.tmp{os.getpid()}.png"
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, Path(out) / name)
    print(f"figure: {Path(out) / name}")

# --- Command line, set-up, and the run.

def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
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

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a toy model, a step or two per rung")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--out", default="out", help="figure folder")
    p.add_argument("--data", help="a UTF-8 text file (default: the Python standard library)")
    p.add_argument("--batch", type=positive_int, help="sequences per step, a multiple of 4")
    p.add_argument("--steps", type=positive_int, help="timed steps per rung (GPU: 20 bf16, 2 fp32)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--headline", action="store_true", help="first jitted vs final rung")
    mode.add_argument("--scaling", action="store_true", help="the final rung, alone and sharded")
    p.add_argument("--interconnect", choices=["default", "staged"], default="default",
                   help="staged: NCCL without peer-to-peer, GPU bytes through host memory")
    args = p.parse_args(argv)
    if args.batch is not None and args.batch % 4:
        p.error(f"--batch: {args.batch} is not a multiple of 4 (the early rungs' micro-batches)")
    check_outputs(args)
    return args

def setup(args):
    """Start the backend (its flags first), read the data, draw torch's initial weights."""
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
    flags = "--xla_gpu_autotune_level=0"  # the un-jitted rung's ~250 one-op programs: no tuning
    if args.quick and args.device == "cpu":  # a smoke test is all compile: XLA:CPU at its fastest
        flags += " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = f"{flags} {os.environ.get('XLA_FLAGS', '')}"  # the reader's win
    devices = jax.devices()  # the backend starts here
    gpu = devices[0].platform == "gpu"
    if args.device == "cuda" and not gpu:
        sys.exit("error: --device cuda: JAX sees no CUDA GPU (jax[cuda] installed?)")
    size = ("cpu", "gpu")[gpu]
    if args.quick:
        size = "quick"
    run = SimpleNamespace(args=args, gpu=gpu, devices=devices, attention="xla",
                          compiled=(None, None), **CONFIGS[size])
    if args.headline:  # both rungs train every step: 1 untimed, the timed, 1 profiled
        run.batch, run.steps, run.slow_steps = run.head_batch, run.head_steps, run.head_steps
    if args.batch is not None:
        run.batch = args.batch
    if args.steps is not None:
        run.steps = run.slow_steps = args.steps
    run.config = lambda **kw: GPTConfig.preset(run.preset, **run.model, **kw)
    tokens, run.tokenizer = load_tokens(args.data, run.config().block_size + 2)
    run.tokens = tokens % run.vocab[0]  # unchanged, except --quick's BPE ids: folded into 8193
    run.tokens_per_step = run.batch * run.config().block_size
    run.flops_per_token = flops_per_token(run.config(vocab_size=run.vocab[0]))
    run.name, run.datasheet = platform.processor() or platform.machine(), None
    if gpu:
        run.name = devices[0].device_kind
        run.datasheet = datasheet_bf16_peak(run.name)  # reference: the datasheet (None: unknown)
    torch.manual_seed(0)  # 07_capstone_torch's init; GPT-2's rows are its prefix
    run.init_state = TorchGPT(run.config(vocab_size=run.vocab[1])).state_dict()
    with contextlib.suppress(Exception):  # cuDNN's fused attention where jaxlib runs it (GPU)
        q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
        jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn")
        run.attention = "cudnn"
    return run

def main():
    args = parse_args()
    use_interconnect(args.interconnect)  # before JAX starts its backend (and NCCL)
    start, run = time.perf_counter(), setup(args)
    pool = (run.devices[0].memory_stats() or {}).get("bytes_limit", 0) / 2**30
    print(f"device: {len(run.devices)} x {run.name}, {pool:.0f} GiB JAX pool (0: a CPU) | jax "
          f"{jax.__version__} | data: {len(run.tokens):,} tokens ({run.tokenizer})")
    run.accumulation_error, dtype = accumulation_error(), (jnp.float32, jnp.bfloat16)[run.gpu]
    run.peak = burst_peak(run.probe_n, dtype)
    print(f"accumulation: 4 micro-batches' gradient vs the full batch's, relative error (measured) "
          f"{run.accumulation_error:.1e}, tolerance {ACCUM_TOLERANCE:.0e}\nmodel: {run.preset}, "
          f"{run.tokens_per_step:,} tokens a step, 6N + 12LTd = {run.flops_per_token / 1e6:.1f} "
          f"MFLOP a token (derived) | peak: dense bf16 {(run.datasheet or 0) / 1e12:.0f} TFLOP/s "
          f"(reference: datasheet; 0: unknown), {jnp.dtype(dtype).name} matmul "
          f"{run.peak / 1e12:.3g} TFLOP/s (measured, burst) | attention: {run.attention}\n"
          f"baseline: full fp32 matmuls ('highest'; JAX's default is TF32 on a GPU)")
    rungs = RUNGS
    if args.scaling:  # PREDICTION: the reference does each device's work (its micro-batch is
        # one device's share), so what scaling loses is the gradient all-reduce left exposed
        shares = len(run.devices)
        if run.batch % shares:  # the sharded rung says why it cannot run
            shares = 1
        rungs = [dict(FINAL, name=f"final rung, one device, accum {shares}", accum=shares),
                 RUNGS[-1]]
    if args.headline:  # the chapter's opening claim: the same loss curve, ~10x apart in time
        # PREDICTION: every step's loss within 3% (bf16 rounding only), the final rung ~10x faster
        # on a GPU (fp32 units, unfused attention against bf16 tensor cores and cuDNN). Baseline:
        # the first jitted rung, still full fp32 (the un-jitted one is too slow for 100 steps)
        rungs = [dict(rung, steps_per_sync=1) for rung in (RUNGS[1], FINAL)]
    result = dict(lesson="07_capstone_jax", quick=args.quick, preset=run.preset,
                  device=dict(name=run.name, count=len(run.devices), gpu=run.gpu),
                  tokens_per_step=run.tokens_per_step, flops_per_token=run.flops_per_token,
                  accumulation_rel_error=run.accumulation_error,
                  peaks=dict(datasheet_bf16=run.datasheet, measured_matmul_burst=run.peak),
                  loss_check=dict(step=run.check_step, rel_tolerance=TOLERANCE),
                  **summarise(run, [measure(rung, run) for rung in rungs]))
    report(run, result)
    if not args.scaling:
        save_figure(result, args.out)
    result["wall_s"] = time.perf_counter() - start
    print(f"wall time: {result['wall_s']:.0f} s")
    if args.json:
        write_json(args.json, result)
    Path(f"{tempfile.gettempdir()}/nccl-{os.getpid()}.log").unlink(missing_ok=True)  # ours only
    if not all(result["checks"].values()):
        sys.exit(f"error: check failed: {[k for k, ok in result['checks'].items() if not ok]}")

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
