"""Probe: why does XLA take ~57 s to compile 07_capstone_jax.py's "+ jax.jit (whole step)"
rung (GPT-2 124M, B=64 x T=1024, fp32 compute at precision 'highest', manual attention,
4 micro-steps in a lax.scan, AdamW; TF32 takes 23 s, bf16 21 s)?

The same step compiled with the rung's options (autotune level 4, XLA's Triton GEMMs on),
then with each candidate option changed alone: autotuning level 1 (the same search of
kernels by their timings, without level 4's buffer initialisation and result checks), level
0 (no search: XLA's default kernels), and with --cublas XLA's Triton GEMMs off. For each: compile seconds, ms/step
(median and spread of 3 timed steps after one warm-up), the matmul kernels the compiled
program calls, the first loss. Then where the profiler's kernels come from: one profiled
step, a few kernel events' names and hlo_op, and whether the compiled text's instruction
of that name (or its fused computation) carries an op_name with the "loss"/"optimizer"
named scopes.

    python results/h200/probes/jax_compile_time.py [--quick] [--json FILE] [--cublas]

About 120 s on one H200 (three compiles of <= 57 s each, 12 steps at ~1.4 s); --cublas:
one more compile.
--quick: a toy model on any device, seconds.
"""

import argparse
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
os.environ["XLA_FLAGS"] = "--xla_gpu_autotune_level=0 " + os.environ.get("XLA_FLAGS", "")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model_jax import GPT, adamw, cross_entropy
from model_torch import GPTConfig

p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true")
p.add_argument("--json")
p.add_argument("--cublas", action="store_true", help="also: Triton GEMMs off (~+25 s)")
args = p.parse_args()

batch = 64
accum = 4
cfg = GPTConfig.preset("gpt2", vocab_size=50257, attn="manual")
if args.quick:
    batch = 8
    cfg = GPTConfig.preset("gpt2", vocab_size=512, attn="manual", n_layer=2, n_head=2,
                           n_embd=64, block_size=64)
T = cfg.block_size
print(f"device: {jax.devices()[0].device_kind} | jax {jax.__version__}", flush=True)

# warm the backend (cuBLAS, cuDNN, ptxas) as the lesson's earlier work does
small = jnp.ones((256, 256))
jax.block_until_ready(jax.jit(jnp.matmul)(small, small))

model = GPT(cfg, jnp.float32, rngs=nnx.Rngs(0))
graphdef, state = nnx.split((model, nnx.Optimizer(model, adamw(6e-4), wrt=nnx.Param)))
del model
rng = np.random.default_rng(0)
batches = []
for _ in range(4):
    w = rng.integers(0, cfg.vocab_size, (batch, T + 1)).astype(np.int32)
    batches.append((jnp.asarray(w[:, :-1]), jnp.asarray(w[:, 1:])))


def step(state, x, y):  # as the lesson's: a scan over 4 micro-batches, then AdamW
    model, optimizer = nnx.merge(graphdef, state)
    g, params, rest = nnx.split(model, nnx.Param, ...)

    def micro(grad_sum, xy):
        def loss_fn(params):
            logits, _ = nnx.merge(g, params, rest)(xy[0])
            with jax.named_scope("loss"):
                return cross_entropy(logits, xy[1])
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(jnp.add, grad_sum, grads), loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    xs = (x.reshape(accum, -1, T), y.reshape(accum, -1, T))
    grad_sum, losses = jax.lax.scan(micro, zeros, xs)
    grads = jax.tree.map(lambda t: t / accum, grad_sum)
    with jax.named_scope("optimizer"):
        optimizer.update(model, grads)
    return jnp.mean(losses), nnx.state((model, optimizer))


VARIANTS = [  # label: compile options (the rung's first)
    ("the rung's: autotune 4, Triton GEMMs", dict(xla_gpu_autotune_level=4,
                                                  xla_gpu_enable_triton_gemm=True)),
    # level 1: the same timing search, without level 4's buffer checks and result comparison
    ("autotune 1, Triton GEMMs", dict(xla_gpu_autotune_level=1,
                                      xla_gpu_enable_triton_gemm=True)),
    ("autotune 0, Triton GEMMs", dict(xla_gpu_autotune_level=0,
                                      xla_gpu_enable_triton_gemm=True)),
]
if args.cublas:
    VARIANTS.append(("autotune 4, cuBLAS only", dict(xla_gpu_autotune_level=4,
                                                     xla_gpu_enable_triton_gemm=False)))
rows = []
last = None
for label, options in VARIANTS:
    start = time.perf_counter()
    with jax.default_matmul_precision("highest"):
        lowered = jax.jit(step).lower(state, *batches[0])
        lower_s = time.perf_counter() - start
        compiled = lowered.compile(options)
    compile_s = time.perf_counter() - start - lower_s
    text = compiled.as_text()
    kernels = dict(triton_gemm_fusions=len(re.findall(r"kind=kCustom.*triton_gemm", text)),
                   cublas_calls=len(re.findall(r'custom_call_target="__cublas', text)))
    s = state
    loss, s = compiled(s, *batches[0])
    first_loss = float(loss)  # the warm-up step
    ms = []
    for i in range(3):
        t0 = time.perf_counter()
        loss, s = compiled(s, *batches[(i + 1) % 4])
        jax.block_until_ready(s)
        ms.append((time.perf_counter() - t0) * 1e3)
    row = dict(label=label, options=options, lower_s=lower_s, compile_s=compile_s,
               ms_median=statistics.median(ms), ms_spread=max(ms) - min(ms),
               first_loss=first_loss, **kernels)
    rows.append(row)
    print(f"{label:38s} lower {lower_s:5.1f} s  compile {compile_s:6.1f} s  "
          f"{row['ms_median']:8.1f} ms/step (spread {row['ms_spread']:.1f})  "
          f"loss {first_loss:.6f}  triton GEMM fusions {kernels['triton_gemm_fusions']}, "
          f"cuBLAS calls {kernels['cublas_calls']}", flush=True)
    last = (compiled, text)

# Where the profiler's kernels come from (the last variant's program)
compiled, text = last
with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
        jax.block_until_ready(compiled(state, *batches[0]))
    trace = next(Path(folder).rglob("*.trace.json.gz"))
    events = json.load(gzip.open(trace))["traceEvents"]
ops = {}  # instruction name -> its op_name; fused computations -> their ops' op_names
for name, path in re.findall(r'^\s*(?:ROOT )?%?([\w.-]+) = [^\n]*?op_name="([^"]*)"',
                             text, re.M):
    ops[name] = path
calls = dict(re.findall(r'^\s*(?:ROOT )?%?([\w.-]+) = [^\n]*?calls=%?([\w.-]+)', text,
                        re.M))
bodies = {}
for match in re.finditer(r"^%?([\w.-]+) [^\n]*\{\n(.*?)^\}", text, re.M | re.S):
    bodies[match.group(1)] = " ".join(re.findall(r'op_name="([^"]*)"', match.group(2)))
kernels = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
print(f"profiled: {len(kernels)} events with hlo_op of {len(events)}")
scopes = dict(loss=0, optimizer=0)
for e in kernels:
    op = e["args"]["hlo_op"]
    seen = f"{ops.get(op, '')} {bodies.get(calls.get(op, ''), '')}"
    for scope in scopes:
        if f"/{scope}/" in seen or f"({scope})" in seen:
            scopes[scope] += 1
for e in kernels[:8]:
    op = e["args"]["hlo_op"]
    print(f"  event {e['name'][:50]!r} hlo_op {op!r}: own op_name {ops.get(op)!r}; "
          f"calls {calls.get(op)!r} with {len(bodies.get(calls.get(op, ''), ''))} chars "
          f"of op_names")
print(f"events whose instruction or fused computation names the scope: {scopes}")
if args.json:
    Path(args.json).write_text(json.dumps(dict(rows=rows, scopes=scopes), indent=1))
