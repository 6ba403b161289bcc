# Probe: JAX capstone final config (gpt2, vocab 50304, B=64 x T=1024, bf16 compute, cuDNN attention, donation, 1 micro-step)
import os, sys, time, statistics
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path.insert(0, ".")
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from model_jax import GPT, adamw, make_train_step
from model_torch import GPTConfig, flops_per_token
label = sys.argv[1]
fpt = flops_per_token(GPTConfig.preset("gpt2", vocab_size=50257))
cfg = GPTConfig.preset("gpt2", vocab_size=50304)
model = GPT(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0), attn_impl="cudnn")
opt = nnx.Optimizer(model, adamw(6e-4, weight_decay=0.1), wrt=nnx.Param)
graphdef, state = nnx.split((model, opt)); del model, opt
rng = np.random.default_rng(0)
data = [tuple(jnp.asarray(a) for a in np.split(rng.integers(0, 50257, (64, 1025), dtype=np.int32), [1024], axis=1)) for _ in range(4)]
data = [(x, y) for x, y in [(d[0], jnp.concatenate([d[0][:, 1:], d[1]], 1)) for d in data]]
t0 = time.perf_counter(); step = make_train_step(graphdef, donate=True).lower(state, *data[0]).compile(); comp = time.perf_counter() - t0
loss, state = step(state, *data[0]); jax.block_until_ready(state)
wins = []
for w in range(4):
    t0 = time.perf_counter()
    for i in range(5):
        loss, state = step(state, *data[i % 4])
    jax.block_until_ready(state); wins.append((time.perf_counter() - t0) / 5)
ms = statistics.median(wins) * 1e3
print(f"JAX {label:40s} {ms:7.1f} ms/step (windows {[round(w*1e3,1) for w in wins]}) MFU {fpt*65536/(ms/1e3)/989e12:.1%} tokens/s {65536/(ms/1e3):,.0f} compile {comp:.0f}s loss {float(loss):.3f}", flush=True)
