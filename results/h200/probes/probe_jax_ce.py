# Probe: JAX capstone's final configuration (gpt2, vocab 50304, B=64 x T=1024, bf16, cuDNN
# attention, donation, jit, no per-step sync) with optax's integer-label cross-entropy (a gather:
# its gradient is a scatter) vs model_jax.cross_entropy (one-hot mask), timed in interleaved reps;
# then a profile of the one-hot variant's kernels. `python probe_jax_ce.py onehot` times only it
# (run under different XLA_FLAGS). PROBE_SMALL=1: a CPU dry run of the script's logic.
import os, sys, time, statistics, glob, gzip, json
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path.insert(0, ".")
import numpy as np, jax, jax.numpy as jnp, optax
from flax import nnx
import model_jax
from model_jax import GPT, adamw, make_train_step
from model_torch import GPTConfig, flops_per_token

small = os.environ.get("PROBE_SMALL") == "1"
preset, B, T = ("tiny", 2, 64) if small else ("gpt2", 64, 1024)
cfg = GPTConfig.preset(preset, vocab_size=50304, block_size=T)
fpt = flops_per_token(GPTConfig.preset(preset, vocab_size=50257, block_size=T))
data = [tuple(jnp.asarray(a) for a in (w[:, :-1], w[:, 1:]))
        for w in (np.random.default_rng(i).integers(0, 50257, (B, T + 1)).astype(np.int32) for i in range(4))]
onehot_ce = model_jax.cross_entropy
gather_ce = lambda logits, targets: optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def build(ce):
    model_jax.cross_entropy = ce  # GPT.__call__ looks the name up when traced
    model = GPT(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0),
                attn_impl=None if small else "cudnn")
    opt = nnx.Optimizer(model, adamw(), wrt=nnx.Param)
    gd, state = nnx.split((model, opt))
    t0 = time.perf_counter()
    step = make_train_step(gd, donate=True).lower(state, *data[0]).compile()
    mem = step.memory_analysis()
    print(f"  compile {time.perf_counter() - t0:.0f} s, XLA temp {mem.temp_size_in_bytes / 2**30:.1f} GiB", flush=True)
    return [step, state]


def timed(sv, n=25):
    step, state = sv
    times, t0 = [], time.perf_counter()
    for i in range(n):
        loss, state = step(state, *data[i % 4])
        if (i + 1) % 5 == 0:
            jax.block_until_ready(state); t1 = time.perf_counter(); times.append((t1 - t0) / 5 * 1e3); t0 = t1
    sv[1] = state
    return statistics.median(times[1:]), times, float(loss)


variants = {"one-hot mask (model_jax)": onehot_ce} if sys.argv[1:] == ["onehot"] else \
    {"gather (optax integer labels)": gather_ce, "one-hot mask (model_jax)": onehot_ce}
print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} device {jax.devices()[0].device_kind}")
built = {}
for name, ce in variants.items():
    print(name); built[name] = build(ce)
for rep in range(3 if len(variants) > 1 else 2):
    for name, sv in built.items():
        ms, ws, loss = timed(sv)
        print(f"rep {rep} {name:32s} {ms:6.1f} ms/step (windows {[round(w, 1) for w in ws]}) "
              f"MFU {fpt * B * T / (ms / 1e3) / 989e12:.1%} loss {loss:.4f}", flush=True)

def report(path):
    ev = json.load(gzip.open(path))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tname = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
    per_thread, per_kernel = {}, {}
    for e in ev:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        key = (pname.get(e["pid"], str(e["pid"])), tname.get((e["pid"], e["tid"]), str(e["tid"])))
        per_thread[key] = per_thread.get(key, 0) + e["dur"] / 1e3 / 3
        if "stream" in key[1].lower() and ("gpu" in key[0].lower() or "device" in key[0].lower()):
            t, c = per_kernel.get(e["name"], (0, 0))
            per_kernel[e["name"]] = (t + e["dur"] / 1e3 / 3, c + 1)
    for k, t in sorted(per_thread.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  thread {k}: {t:.1f} ms/step")
    cats = {}
    for n, (t, c) in per_kernel.items():
        l = n.lower()
        cat = next((c_ for c_, keys in [("attention", ("cudnn", "fmha", "sdpa", "flash")),
                                          ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "dot", "sm90")),
                                          ("scatter", ("scatter",)), ("reduce", ("reduce", "reduction")),
                                          ("copy/memset", ("memset", "memcpy", "copy"))]
                    if any(k in l for k in keys)), "other fusions")
        cats[cat] = cats.get(cat, 0) + t
    tot = sum(cats.values())
    print(f"GPU kernel time per step: {tot:.1f} ms")
    for c, t in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"   {c:14s} {t:7.1f} ms  {t / max(tot, 1e-9):5.1%}")
    for n, (t, c) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:22]:
        print(f"   {t:7.2f} ms {c // 3:4d}x  {n[:110]}")
    return tot


if len(variants) > 1:
    for j, (name, sv) in enumerate(built.items()):
        logdir = f"/tmp/jprof{j}"
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            for i in range(3):
                loss, sv[1] = sv[0](sv[1], *data[i % 4])
            jax.block_until_ready(sv[1])
        files = glob.glob(f"{logdir}/**/*.json.gz", recursive=True)
        for f in sorted(files, key=lambda f: "perfetto" not in f):
            print(f"== profile of {name}: {f}")
            if report(f) > 0:
                break
