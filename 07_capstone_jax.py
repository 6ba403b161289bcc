"""
Section 13.7: the waterfall, in JAX. The same GPT-2 124M, the same tokens, batches and initial
weights as 07_capstone_torch.py, taken down JAX's version of the method, one measured rung per
technique, each kept for the rungs after it: un-jitted op-by-op baseline (full fp32 matmuls) ->
jax.jit of the whole step -> TF32 -> bf16 compute dtype -> buffer donation + fused attention ->
vocab 50304 + the whole batch in one micro-step -> no host sync per step (the loss read every
few steps) -> cuBLAS for every matmul (XLA's own Triton GEMMs off) -> activation checkpointing
(nnx.remat; a detour: it costs time when memory does not bind, so the next rung drops it again)
-> data-parallel sharding over every visible device. 65,536 tokens per step on a GPU (gradient accumulation over
equal micro-batches where the micro-batch is smaller), so each rung's loss at a common step must
track the baseline's: the waterfall changes the speed, not the math.

    python 07_capstone_jax.py                    # one GPU: gpt2 (124M, T=1024), ~6-7 min with compiles
    python 07_capstone_jax.py                    # several GPUs: the last rung shards the batch over all
    python 07_capstone_jax.py --device cpu       # the tiny preset, a few minutes on 2 cores
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python 07_capstone_jax.py --device cpu --quick
                                                 # every rung for a couple of steps, 4 simulated devices

Where the frameworks diverge: "compile" is jax.jit of the whole training step (forward, backward
and AdamW in one XLA program), not a wrapper around the model; precision is explicit (JAX's
default computes fp32 matmuls as TF32 on a GPU, so the baseline asks for 'highest'); mixed
precision is a dtype, not a context; data parallelism is a sharding of the batch over a device
mesh inside one process (no launcher, no wrapper: XLA inserts the gradient all-reduce).
Per rung it prints ms/step (median of the timed steps; compile time separately), tokens/s, MFU
with 07_capstone_torch.py's definition, peak memory, activation memory and the loss.
Output: the table, out/07_capstone_jax.png, --json. Data and tokens: as 07_capstone_torch.py.
"""

import argparse, hashlib, json, os, platform, sys, sysconfig, tempfile, time, warnings
from pathlib import Path

# model_jax imports model_torch, which imports torch: keep JAX from preallocating 75% of the GPU,
# but let it grow to 95% (torch stays on the CPU here): the B=64 rung's step needs one ~44 GiB
# scratch buffer, which did not fit under the default 75% cap (measured on an H200)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
import numpy as np
import jax
import jax.numpy as jnp
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from model_torch import GPT as TorchGPT, GPTConfig, datasheet_bf16_peak, flops_per_token
from model_jax import GPT, adamw, from_torch, make_train_step

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")  # CPU: harmless


# ---------------------------------------------------------------------------------------
# Data: real text, the same batches in both capstones (07_capstone_jax.py copies this block).

def load_tokens(data=None, cache_dir=".cache", max_bytes=20_000_000):
    """Token ids (np.uint16) of --data FILE, else the stdlib's *.py files (sorted, capped at
    max_bytes); GPT-2 BPE if tiktoken's files are cached locally, else UTF-8 bytes (< 256)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [Path(data)] if data else sorted(p for p in root.rglob("*.py")
                                             if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    chunks, size = [], 0
    for f in files:
        if size < max_bytes:
            chunks.append(f.read_bytes()[: max_bytes - size]); size += len(chunks[-1])
    raw = b"\n".join(chunks)
    # tiktoken downloads GPT-2's BPE on first use and we have no network: use it only if cached
    tk_cache = (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
                or os.path.join(tempfile.gettempdir(), "data-gym-cache"))
    urls = [f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{n}" for n in ("vocab.bpe", "encoder.json")]
    bpe = all(os.path.exists(os.path.join(tk_cache, hashlib.sha1(u.encode()).hexdigest())) for u in urls)
    tokenizer = "gpt2-bpe" if bpe else "utf8-bytes"
    path = Path(cache_dir) / f"tokens-{tokenizer}-{hashlib.sha1(raw).hexdigest()[:16]}.npy"
    if not path.exists():
        if bpe:
            import tiktoken
            ids = tiktoken.get_encoding("gpt2").encode_ordinary(raw.decode("utf-8", errors="replace"))
        else:
            print("tokenizer: tiktoken's GPT-2 BPE files are not cached (no network): UTF-8 bytes, ids < 256, model vocab unchanged")
            ids = np.frombuffer(raw, dtype=np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, np.asarray(ids, dtype=np.uint16))
    return np.load(path), tokenizer


def get_batch(tokens, step, batch_size, seq_len, seed=0):
    """Batch number `step`: batch_size windows at offsets from a generator seeded by (seed, step)."""
    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - seq_len - 1, size=batch_size)
    w = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)
    return w[:, :-1], w[:, 1:]


# ---------------------------------------------------------------------------------------
# The rungs, in the order the section tells them. Each changes one thing and keeps the rest.
# "why": the regime the rung targets and the prediction, printed before it is measured.

WINDOW = 5  # steps between host syncs once the rung "no host sync per step" is on

RUNGS = [
    dict(name="un-jitted (op-by-op)", jit=False, precision="highest", bf16=False, attn="manual",
         donate=False, vocab=50257, accum=4, host_sync=True, triton_gemm=True, checkpoint=False, shard=False,
         why="baseline: every jnp op dispatched from Python one at a time (no jax.jit), full fp32 "
             "matmuls (default_matmul_precision 'highest': no TF32), the T x T attention materialised: "
             "overhead- and fp32-compute-bound; expect < 5% MFU on a GPU"),
    dict(name="+ jax.jit (whole step)", jit=True,
         why="overhead- and bandwidth-bound parts: one XLA program for forward, backward and AdamW, no "
             "per-op dispatch, elementwise chains fused; the matmuls stay full fp32, so on a GPU the "
             "fp32 units still cap it: expect 1.2-2x there (far more where dispatch dominated)"),
    dict(name="+ TF32 (default precision)", precision="default",
         why="compute-bound on the wrong units: JAX's default precision runs fp32 matmuls as TF32 on "
             "tensor cores (495 TFLOP/s datasheet vs ~51 fp32, a reference value measured on an H200, "
             "REFERENCES.md): expect 2-3x; a CPU has no TF32: no-op"),
    dict(name="+ bf16 compute dtype", bf16=True,
         why="dtype=bfloat16, param_dtype=float32: bf16 matmuls (2x the TF32 peak) and half the "
             "activation bytes; params, LayerNorm, residual stream and loss stay fp32: expect 1.3-2x"),
    dict(name="+ donation + fused attention", donate=True, attn="sdpa",
         why="bandwidth-bound: jax.nn.dot_product_attention (cuDNN's fused kernel on a GPU) never writes "
             "the B*H*T*T scores; donating the old state lets XLA update params and AdamW moments in "
             "place instead of keeping two copies: expect 1.2-1.5x and less memory"),
    dict(name="+ vocab 50304, 1 micro-step", vocab=50304, accum=1,
         why="50257 is odd: the largest matmul (lm_head) runs with ragged tiles; 50304 = 128 x 393 "
             "fills them (nanoGPT: up to ~25%); a 4x larger micro-batch amortises fixed per-micro-step "
             "costs (the plain model_jax.make_train_step): expect 1.05-1.3x"),
    dict(name="+ no host sync per step", host_sync=False,
         why="overhead: float(loss) and block_until_ready every step make Python wait for the device "
             "to drain, then the device idle while the next step is dispatched; wait every "
             f"{WINDOW} steps and dispatch runs ahead. Here a step is ~100 ms of device work and the "
             "gap well under 1 ms: expect < 1%; it pays where steps take a few ms"),
    dict(name="+ cuBLAS for every matmul", triton_gemm=False,
         why="the compiler's kernel choice: XLA emits some matmuls (those it fuses with a neighbouring "
             "cast or add) as Triton GEMMs of its own; at these shapes cuBLAS's Hopper kernels run "
             "them faster. The compile option xla_gpu_enable_triton_gemm=False sends every dot to "
             "cuBLAS: expect a few % on a GPU, nothing on a CPU (no Triton there)"),
    dict(name="+ activation checkpointing (remat)", checkpoint=True,
         why="a memory fix applied where memory does NOT bind: nnx.remat recomputes each block's forward "
             "in backward, ~1/3 more block FLOPs: expect ~20-30% SLOWER, far fewer saved activations"),
    dict(name="+ data-parallel sharding (remat off)", checkpoint=False, shard=True,
         why="Mesh('data') over every device, batch rows sharded (NamedSharding), params replicated; "
             "XLA inserts the gradient all-reduce: expect close to W x tokens/s"),
]
for previous, rung in zip(RUNGS, RUNGS[1:]):  # cumulative: each rung inherits the one before
    rung.update({k: v for k, v in previous.items() if k not in rung and k != "why"})


# ---------------------------------------------------------------------------------------
# Measurement helpers.

def measured_matmul_peak(dtype, n):
    """FLOP/s of an n^3 matmul (median of 5 after warm-up): the realistic ceiling of this chip."""
    a, b = (jax.random.normal(jax.random.key(i), (n, n), dtype) for i in range(2))
    matmul, times = jax.jit(jnp.matmul), []
    for i in range(7):
        t0 = time.perf_counter(); matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / float(np.median(times[2:]))


def pick_attention(gpu):
    """On a GPU, time jax.nn.dot_product_attention's XLA and cuDNN backends (fwd+bwd, GPT-2 shapes)
    and keep cuDNN if it runs, agrees and is faster. On a CPU only XLA exists."""
    if not gpu:
        return "xla", {}
    q, k, v = (jax.random.normal(jax.random.key(i), (8, 1024, 12, 64), jnp.bfloat16) for i in range(3))
    results, outs = {}, {}
    for impl in ("xla", "cudnn"):
        try:
            attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
            fwd_bwd = jax.jit(jax.grad(lambda q, k, v: jnp.square(attn(q, k, v).astype(jnp.float32)).sum(), (0, 1, 2)))
            out = np.asarray(jax.jit(attn)(q, k, v).astype(jnp.float32))
            jax.block_until_ready(fwd_bwd(q, k, v))
            t0 = time.perf_counter()
            jax.block_until_ready([fwd_bwd(q, k, v) for _ in range(5)])
            results[impl], outs[impl] = (time.perf_counter() - t0) / 5 * 1e3, out
        except Exception as e:  # a backend this jaxlib, cuDNN or GPU does not offer
            results[impl] = f"unavailable: {type(e).__name__}"
    ok = "cudnn" in outs and "xla" in outs and np.allclose(outs["cudnn"], outs["xla"], atol=2e-2, rtol=2e-2)
    best = "cudnn" if ok and results["cudnn"] < results["xla"] else "xla"
    return best, dict(results, chosen=best)


def accumulating_step(graphdef, accum, jitted=True):
    """model_jax.make_train_step's step over `accum` equal micro-batches whose gradients are summed
    before one AdamW update (exact: equal token counts, mean of the means). Under jit a lax.scan
    (one copy of the micro-step to compile); un-jitted a Python loop (a scan would compile its body)."""
    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        gdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss_fn = lambda p, xm, ym: nnx.merge(gdef, p, rest)(xm, ym)[1]

        def micro_step(grad_sum, xy):
            loss, grads = jax.value_and_grad(loss_fn)(params, *xy)
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        split = lambda a: a.reshape(accum, -1, a.shape[1])  # (micro-steps, rows, T)
        grads, xs = jax.tree.map(jnp.zeros_like, params), (split(x), split(y))
        if jitted:
            grads, losses = jax.lax.scan(micro_step, grads, xs)
        else:
            losses = []
            for xy in zip(*xs):
                grads, loss = micro_step(grads, xy); losses.append(loss)
            losses = jnp.stack(losses)
        optimizer.update(model, jax.tree.map(lambda g: g / accum, grads))
        return losses.mean(), nnx.state((model, optimizer))
    return train_step


def saved_for_backward_bytes(model, x, y):
    """Bytes of the residuals jax.vjp keeps from the forward for the backward (one micro-batch),
    counted by tracing only (jax.eval_shape: no FLOPs, no memory): the activations, plus the
    weights (or their bf16 copies) the backward reads, as torch's count includes autocast's copies."""
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = lambda p: nnx.merge(gdef, p, rest)(x, y)[1]
    residuals = jax.eval_shape(lambda p: jax.tree.leaves(jax.vjp(loss_fn, p)[1]), params)
    return int(sum(r.size * r.dtype.itemsize for r in residuals))


# ---------------------------------------------------------------------------------------
# One rung: same init, same batches, same tokens per step; time the steps after warm-up.

def train_rung(rung, args, preset, init_state, batches, attn_impl):
    devices = jax.devices() if rung["shard"] else jax.devices()[:1]
    world = len(devices)
    mesh = jax.make_mesh((world,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    replicated, rows_sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    cfg = model_config(args, preset, vocab_size=rung["vocab"], attn=rung["attn"], checkpoint=rung["checkpoint"])
    model = GPT(cfg, dtype=jnp.bfloat16 if rung["bf16"] else jnp.float32, param_dtype=jnp.float32,
                rngs=nnx.Rngs(args.seed), attn_impl=attn_impl if rung["attn"] == "sdpa" else None)
    V = cfg.vocab_size
    from_torch(model, {k: v[:V] if k in ("transformer.wte.weight", "lm_head.weight") else v
                       for k, v in init_state.items()})  # torch's init: same weights in both capstones
    optimizer = nnx.Optimizer(model, adamw(6e-4, weight_decay=0.1), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = jax.device_put(state, replicated)  # one device: a plain copy; several: a replica each
    data = [tuple(jax.device_put(a.astype(np.int32), rows_sharded) for a in xy) for xy in batches]
    accum, B = rung["accum"], batches[0][0].shape[0]
    micro_rows = B // accum // world  # per device
    act = saved_for_backward_bytes(model, *(jnp.asarray(a[:micro_rows].astype(np.int32)) for a in batches[0]))
    del model, optimizer  # the step owns the state now (donation would invalidate their arrays)
    compile_s, xla_bytes = 0.0, None
    with jax.default_matmul_precision(rung["precision"]):
        if rung["jit"]:
            t0 = time.perf_counter()
            jitted = make_train_step(graphdef, donate=rung["donate"]) if accum == 1 else \
                jax.jit(accumulating_step(graphdef, accum), donate_argnums=(0,) if rung["donate"] else ())
            options = None if rung["triton_gemm"] else {"xla_gpu_enable_triton_gemm": False}
            step = jitted.lower(state, *data[0]).compile(options)  # compile once, ahead of the clock
            compile_s = time.perf_counter() - t0
            mem = step.memory_analysis()  # XLA's plan for one device: inputs + outputs + scratch
            if mem is not None:
                xla_bytes = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
        else:
            step = accumulating_step(graphdef, accum, jitted=False)  # each jnp op dispatched on its own
        warmup = 1
        slow = not (rung["jit"] and rung["bf16"])  # fp32 rungs take seconds per step: fewer steps
        n_steps = max(args.check_step, warmup + (args.eager_steps if slow else args.steps))
        times, losses, pending = [], [], []  # pending: losses still on the device
        t0 = time.perf_counter()
        for i in range(n_steps):
            loss, state = step(state, *data[i])
            pending.append(loss)
            # Python waits for the device after every step, or (no host sync) after a window of
            # steps; each step of a window is charged the window's mean
            if rung["host_sync"] or i < warmup or (i + 1 - warmup) % WINDOW == 0 or i == n_steps - 1:
                jax.block_until_ready(state)  # the AdamW update too, not just the loss
                losses += [float(v) for v in pending]
                t1 = time.perf_counter()
                times += [(t1 - t0) / len(pending)] * len(pending); pending, t0 = [], t1
    del state, step
    jax.clear_caches()  # drop this rung's executables and buffers before the next rung allocates
    stats = jax.devices()[0].memory_stats()  # None on a CPU
    timed = np.array(times[warmup:])
    ms = float(np.median(timed)) * 1e3
    return dict(name=rung["name"], settings={k: v for k, v in rung.items() if k not in ("name", "why")},
                why=rung["why"], world_size=world, micro_batch=B // accum // world, accum_steps=accum,
                tokens_per_step=int(batches[0][0].size), steps=n_steps, warmup_steps=warmup, timed_steps=len(timed),
                ms_per_step=ms, ms_min=float(timed.min()) * 1e3, ms_max=float(timed.max()) * 1e3,
                first_step_s=times[0], compile_s=compile_s,
                tokens_per_s=batches[0][0].size / (ms / 1e3), losses=losses, loss=losses[args.check_step - 1],
                peak_mem_bytes=stats.get("peak_bytes_in_use") if stats else None,
                xla_step_bytes=xla_bytes, activation_bytes=act,
                activation_source="counted: jax.vjp residuals of one micro-batch forward (jax.eval_shape)")


# ---------------------------------------------------------------------------------------

def model_config(args, preset, **overrides):
    quick = dict(n_layer=2, block_size=64) if args.quick else {}  # --quick: 2 layers, T=64
    return GPTConfig.preset(preset, **quick, **overrides)


def setup(args, gpu):
    preset = args.preset or ("gpt2" if gpu else "tiny")
    T = model_config(args, preset).block_size
    tokens, tokenizer = load_tokens(args.data)
    print(f"data: {len(tokens):,} tokens ({tokenizer}), {args.batch} x {T} = {args.batch * T:,} tokens per step")
    batches = [get_batch(tokens, s, args.batch, T, args.seed)
               for s in range(max(args.check_step, 2 + max(args.steps, args.eager_steps)))]
    torch.manual_seed(args.seed)  # 07_capstone_torch's init (vocab 50304; GPT-2's 50257 rows are its prefix)
    init_state = TorchGPT(model_config(args, preset, vocab_size=50304)).state_dict()
    return preset, init_state, batches, tokenizer


def plot(rungs, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("figure skipped (no matplotlib)")
    done = [r for r in rungs if "tokens_per_s" in r]
    base = done[0]["tokens_per_s"]
    fig, ax = plt.subplots(figsize=(11, 5))
    bars = ax.bar(range(len(done)), [r["tokens_per_s"] for r in done],
                  color=["tab:red" if r["settings"]["checkpoint"] else "tab:green" for r in done])
    for bar, r in zip(bars, done):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r['tokens_per_s'] / base:.1f}x\n{r['ms_per_step']:.0f} ms",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(done)), [r["name"] for r in done], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (measured)"); ax.set_ylim(0, 1.2 * max(b.get_height() for b in bars))
    ax.set_title("07_capstone_jax: the waterfall (cumulative speed-up over un-jitted fp32; red = costs time)")
    fig.tight_layout(); fig.savefig(path, dpi=120); plt.close(fig)
    print(f"figure: {path}")


def compare_with_torch(path, final, preset, tokens_per_step):
    """The target: the final single-device rung reaches >= 90% of the torch capstone's tokens/s."""
    if not path or not Path(path).exists():
        return dict(torch_json=path, torch_tokens_per_s=None, ratio_to_torch=None, ratio_target=0.9)
    t = json.loads(Path(path).read_text())
    rung = next((r for r in t["rungs"] if r["name"] == t["targets"]["best_single_device_rung"]), {})
    same = t["preset"] == preset and t["tokens_per_step"] == tokens_per_step
    ratio = final["tokens_per_s"] / rung["tokens_per_s"] if same and "tokens_per_s" in rung and "tokens_per_s" in final else None
    return dict(torch_json=path, torch_rung=rung.get("name"), torch_tokens_per_s=rung.get("tokens_per_s"),
                same_config=same, ratio_to_torch=ratio, ratio_target=0.9)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="every rung for two steps (tests)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--out", default="out", help="figure folder")
    p.add_argument("--data", help="a text file (default: the Python standard library's sources)")
    p.add_argument("--preset", choices=["gpt2", "gpt2-medium", "tiny"], help="default: gpt2 on GPU, tiny on CPU")
    p.add_argument("--batch", type=int, help="sequences per optimizer step (default 64 GPU, 8 CPU, 4 quick)")
    p.add_argument("--steps", type=int, help="timed steps of the jitted bf16 rungs (default 20 GPU, 3 CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-json", help="07_capstone_torch.py's --json, to report the ratio to torch")
    args = p.parse_args()
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
        if args.quick:  # a smoke test is all compile: XLA's CPU backend at -O0 (timings not meaningful)
            os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    try:
        devices = jax.devices()  # the backend starts here (after XLA_FLAGS are final)
    except RuntimeError as e:
        sys.exit(f"--device {args.device}: JAX found no usable backend ({e}); run with --device cpu")
    gpu = devices[0].platform == "gpu"
    if args.device == "cuda" and not gpu:
        sys.exit("--device cuda: JAX sees no CUDA GPU (jax[cuda] installed?); run with --device cpu")
    args.batch = args.batch or (4 if args.quick else 64 if gpu else 8)
    args.steps = args.steps or (1 if args.quick else 20 if gpu else 3)
    args.eager_steps = 1 if args.quick else 3
    args.check_step = 2 if args.quick else 4  # the step at which every rung's loss is compared
    if args.batch % 4:
        sys.exit("--batch must be a multiple of 4 (the early rungs accumulate 4 micro-batches)")
    wall0 = time.perf_counter()
    name = devices[0].device_kind if gpu else (platform.processor() or platform.machine())
    stats = devices[0].memory_stats()
    mem = (stats or {}).get("bytes_limit")
    print(f"device: {len(devices)} x {name}" + (f", {mem / 2**30:.0f} GiB JAX memory-pool limit (bytes_limit, not the card's memory)" if mem else f", {os.cpu_count()} cores")
          + f" | jax {jax.__version__} | python {platform.python_version()}")
    preset, init_state, batches, tokenizer = setup(args, gpu)
    cfg = model_config(args, preset, vocab_size=50257)
    fpt = flops_per_token(cfg)  # model FLOPs of GPT-2 as shipped: padded rows are not useful work
    peaks = dict(datasheet_bf16=datasheet_bf16_peak(name) if gpu else None,  # reference: datasheet
                 measured_bf16_matmul=measured_matmul_peak(jnp.bfloat16, 8192 if gpu else 512),
                 measured_fp32_matmul=None if gpu else measured_matmul_peak(jnp.float32, 512))
    # MFU's second denominator: this machine's own matmul peak, the faster of bf16 and fp32
    # (a CPU without bf16 units runs fp32 matmuls faster, and is then judged against fp32)
    measured_peak = max(peaks["measured_bf16_matmul"], peaks["measured_fp32_matmul"] or 0)
    attn_impl, attn_probe = pick_attention(gpu)
    print(f"model: {preset}{' (quick: 2 layers, T=64)' if args.quick else ''}, T={cfg.block_size}, "
          f"flops_per_token = 6N + 12LTd = {fpt / 1e6:.1f} MFLOP (derived) | peaks: datasheet bf16 "
          + (f"{peaks['datasheet_bf16'] / 1e12:.0f}" if peaks['datasheet_bf16'] else "n/a (unknown device)") + " TFLOP/s (reference), "
          f"measured bf16 matmul {peaks['measured_bf16_matmul'] / 1e12:.3g} TFLOP/s"
          + (f", fp32 {peaks['measured_fp32_matmul'] / 1e12:.3g}" if peaks["measured_fp32_matmul"] else "")
          + f" | fused attention: {attn_impl}" + (f" (probe, measured fwd+bwd ms: {attn_probe})" if attn_probe else ""))
    print("baseline matmul precision: full fp32 (jax.default_matmul_precision('highest'); JAX's default "
          "would be TF32 on a GPU)" + ("" if gpu else "; on a CPU TF32 does not exist, so that rung changes nothing"))
    rungs = []
    for rung in RUNGS:
        print(f"\n== {rung['name']}\n   why: {rung['why']}", flush=True)
        n = len(jax.devices())
        try:
            if rung["shard"] and n < 2:
                r = dict(name=rung["name"], skipped="one device: nothing to shard over (on a CPU, simulate "
                         "several: XLA_FLAGS=--xla_force_host_platform_device_count=4)")
            elif rung["shard"] and args.batch % n:
                r = dict(name=rung["name"], skipped=f"--batch {args.batch} does not split over {n} devices")
            else:
                try:
                    r = train_rung(rung, args, preset, init_state, batches, attn_impl)
                except Exception as e:  # out of memory is not an attention failure: no retry
                    if not (rung["attn"] == "sdpa" and attn_impl == "cudnn") or "RESOURCE_EXHAUSTED" in str(e):
                        raise
                    print(f"   cuDNN attention failed in the step ({type(e).__name__}): retrying this rung with XLA's")
                    r = train_rung(rung, args, preset, init_state, batches, "xla")  # this rung only
                    r["attention_fallback"] = "xla (cudnn failed on this rung)"
        except Exception as e:  # one rung failing must not lose the others
            oom = "RESOURCE_EXHAUSTED" in str(e)
            r = dict(name=rung["name"], failed=("does not fit (out of memory): " if oom else "")
                     + f"{type(e).__name__}: {str(e)[:400]}")
        if "tokens_per_s" in r:
            per_device = r["tokens_per_s"] / r["world_size"]
            r["mfu_datasheet"] = fpt * per_device / peaks["datasheet_bf16"] if peaks["datasheet_bf16"] else None
            r["mfu_measured_peak"] = fpt * per_device / measured_peak
            r["speedup"] = r["tokens_per_s"] / rungs[0]["tokens_per_s"] if rungs and "tokens_per_s" in rungs[0] else 1.0
            print(f"   measured: {r['ms_per_step']:.1f} ms/step (min {r['ms_min']:.1f}, max {r['ms_max']:.1f}), "
                  f"{r['tokens_per_s']:,.0f} tokens/s, compile {r['compile_s']:.1f} s, "
                  f"first step {r['first_step_s']:.1f} s, loss {r['loss']:.4f}")
        else:
            print(f"   {'skipped' if 'skipped' in r else 'FAILED'}: {r.get('skipped') or r.get('failed')}")
        rungs.append(r)

    # the math did not change: every rung's loss at the common step tracks the baseline's
    base = rungs[0].get("loss")
    tol = 0.005  # bf16 keeps 8 mantissa bits (rounding 2^-9 ~ 0.2% per value, averaged over the
    #              loss's sums); a few steps from the same init on the same batches amplify it to
    #              ~0.1% (measured: <= 0.08% on an H200, 0.01% on a CPU); a real bug (wrong mask,
    #              lost gradient, wrong accumulation) moves the loss by far more than 0.5%
    for r in rungs:
        if "loss" in r and base:
            r["loss_rel_diff"] = abs(r["loss"] - base) / base
    done = [r for r in rungs if "tokens_per_s" in r]
    ck = next(i for i, r in enumerate(rungs) if r["name"].startswith("+ activation checkpointing"))
    checks = {
        "all_single_device_rungs_ran": all("tokens_per_s" in r for r in rungs[:-1]),
        "last_rung_ran_or_skipped_with_reason": "tokens_per_s" in rungs[-1] or bool(rungs[-1].get("skipped")),
        "losses_track_baseline": bool(base) and all(r.get("loss_rel_diff", 1) <= tol for r in done),
        "checkpointing_lowers_activation_memory": "activation_bytes" in rungs[ck] and "activation_bytes" in rungs[ck - 1]
                                                  and rungs[ck]["activation_bytes"] < rungs[ck - 1]["activation_bytes"],
    }
    final = rungs[ck - 1]  # best single-device configuration: checkpointing is the detour after it
    targets = dict(final_single_device_rung=final["name"], mfu_datasheet=final.get("mfu_datasheet"),
                   speedup=final.get("speedup"),
                   **compare_with_torch(args.torch_json, final, preset, int(batches[0][0].size)))

    print(f"\n{'rung':38s} {'ms/step':>9s} {'tokens/s':>11s} {'speed-up':>8s} {'MFU(ds)':>8s} {'MFU(meas)':>9s} "
          f"{'peak mem':>9s} {'XLA mem':>8s} {'act mem':>8s} {'loss':>8s} {'d(loss)':>8s}")
    gib = lambda b: f"{b / 2**30:.2f}G" if b else "n/a"
    for r in rungs:
        if "tokens_per_s" not in r:
            print(f"{r['name']:38s} {r.get('skipped') or r.get('failed')}"); continue
        mfu = f"{r['mfu_datasheet']:.1%}" if r["mfu_datasheet"] else "n/a"
        print(f"{r['name']:38s} {r['ms_per_step']:9.1f} {r['tokens_per_s']:11,.0f} {r['speedup']:7.2f}x "
              f"{mfu:>8s} {r['mfu_measured_peak']:9.1%} {gib(r['peak_mem_bytes']):>9s} {gib(r['xla_step_bytes']):>8s} "
              f"{gib(r['activation_bytes']):>8s} {r['loss']:8.4f} {r['loss_rel_diff']:8.2%}")
    print(f"(measured: ms, tokens/s; peak mem = memory_stats peak_bytes_in_use, the process's high-water mark "
          f"(JAX cannot reset it{'' if gpu else '; n/a on a CPU'}); XLA mem = the compiled step's inputs + outputs + "
          f"scratch per device (XLA's memory analysis; n/a un-jitted); act mem = bytes jax.vjp saves for backward "
          f"(counted by tracing); derived: speed-up, MFU; loss compared at step {args.check_step}, tolerance {tol:.1%})")
    ratio = targets["ratio_to_torch"]
    print(f"targets: final single-device rung '{final['name']}': MFU {format(targets['mfu_datasheet'] or 0, '.1%') if targets['mfu_datasheet'] else 'n/a'} "
          f"of the datasheet peak, {format(targets['speedup'] or 0, '.1f') if targets['speedup'] else 'n/a'}x the un-jitted baseline; "
          + (f"{ratio:.0%} of torch's tokens/s (target 90%)" if ratio else "vs torch: pass --torch-json (same config)"))
    for k, v in checks.items():
        print(f"check {k}: {'ok' if v else 'FAILED'}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    plot(rungs, Path(args.out) / "07_capstone_jax.png")
    wall = time.perf_counter() - wall0
    print(f"wall time: {wall:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(
            lesson="07_capstone_jax", quick=args.quick,
            device=dict(name=name, type="cuda" if gpu else "cpu", memory_bytes=mem, count=len(devices),
                        jax=jax.__version__, python=platform.python_version()),
            preset=preset, seq_len=cfg.block_size, tokens_per_step=int(batches[0][0].size), tokenizer=tokenizer,
            flops_per_token=fpt, peaks=peaks, attention_probe=attn_probe, attention_impl=attn_impl,
            mfu_definition="flops_per_token (6N + 12LTd, GPT-2 vocab 50257) x tokens/s per device / peak FLOP/s "
                           "(datasheet dense bf16, or this run's measured matmul peak: the faster of bf16 and fp32)",
            loss_check=dict(step=args.check_step, rel_tolerance=tol), rungs=rungs, targets=targets,
            checks=checks, wall_s=wall), indent=1))
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
