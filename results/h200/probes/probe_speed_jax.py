# Probe: the JAX capstone's final rung (gpt2, vocab 50304, B x T=1024, bf16 compute dtype,
# fp32 params, cuDNN attention, donation, one micro-step) under XLA flags given in XLA_FLAGS.
# usage: XLA_FLAGS=... python probe_speed_jax.py LABEL [BATCH]. Fresh compile, 5 windows of 5.
import os, sys, time, statistics
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path.insert(0, ".")
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from model_jax import GPT, adamw, make_train_step
from model_torch import GPTConfig, flops_per_token

label, batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64
fpt = flops_per_token(GPTConfig.preset("gpt2", vocab_size=50257))
model = GPT(GPTConfig.preset("gpt2", vocab_size=50304), dtype=jnp.bfloat16,
            param_dtype=jnp.float32, rngs=nnx.Rngs(0), attn_impl="cudnn")
opt = nnx.Optimizer(model, adamw(6e-4, weight_decay=0.1), wrt=nnx.Param)
graphdef, state = nnx.split((model, opt))
del model, opt
rng = np.random.default_rng(0)
data = []
for _ in range(4):
    w = rng.integers(0, 50257, (batch, 1025), dtype=np.int32)
    data.append((jnp.asarray(w[:, :-1]), jnp.asarray(w[:, 1:])))
t0 = time.perf_counter()
step = make_train_step(graphdef, donate=True).lower(state, *data[0]).compile()
compile_s = time.perf_counter() - t0
for i in range(3):
    loss, state = step(state, *data[i % 4])
jax.block_until_ready(state)
windows = []
for w in range(5):
    t0 = time.perf_counter()
    for i in range(5):
        loss, state = step(state, *data[i % 4])
    jax.block_until_ready(state)
    windows.append((time.perf_counter() - t0) / 5)
ms = statistics.median(windows) * 1e3
tps = batch * 1024 / (ms / 1e3)
print(f"JAX {label:44s} {ms:7.1f} ms/step [{min(windows)*1e3:.1f}, {max(windows)*1e3:.1f}] "
      f"{tps:10,.0f} tok/s  MFU {fpt * tps / 989e12:5.1%}  compile {compile_s:3.0f} s  "
      f"loss {float(loss):.4f}  XLA_FLAGS='{os.environ.get('XLA_FLAGS', '')}'", flush=True)
