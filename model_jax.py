"""
The shared GPT of the lessons, in JAX with Flax NNX: the same network as model_torch.py,
parameter for parameter, so the two frameworks can run the same weights (`from_torch`)
and be compared on the same FLOPs (the config and its accounting come from model_torch).

    from model_jax import GPT, adamw, make_train_step
    model = GPT(GPTConfig.preset("gpt2"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, adamw(6e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    train_step = make_train_step(graphdef)
    loss, state = train_step(state, x, y)          # a plain jax.jit: no per-call NNX work
    nnx.update((model, optimizer), state)          # when you want the objects back

Precision is explicit, as JAX does it: parameters are stored in `param_dtype` (fp32), and
the matmuls compute in `dtype` (bf16 for mixed precision). The residual stream and the
LayerNorms stay fp32, and the loss is taken on fp32 logits, as under torch.autocast. With
`config.bf16_residual` the residual stream is carried in `dtype` too (half the bytes every
add and LayerNorm reads and writes); the LayerNorms still compute in fp32.

Two options of GPT change how a step computes, not what: `recompute_gelu` (backward keeps
the GELU's input only and recomputes its tanh) and `split_qkv` (q, k and v from three
matmuls by c_attn's thirds, not one matmul split). Both save bytes XLA would otherwise
write and read on a GPU; the JAX capstone measures each as a rung.
"""

import math
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import model_torch
from model_torch import GPTConfig  # one config, one FLOP formula for both frameworks

normal = nnx.initializers.normal


class CausalSelfAttention(nnx.Module):

    def __init__(self, config, dtype, param_dtype, rngs, attn_impl=None, split_qkv=False):
        d = config.n_embd
        L = config.n_layer
        self.n_head = config.n_head
        self.attn = config.attn
        self.dtype = dtype
        self.attn_impl = attn_impl  # dot_product_attention's: None, "xla", "cudnn"
        self.split_qkv = split_qkv
        linear = partial(nnx.Linear, dtype=dtype, param_dtype=param_dtype,
                         bias_init=nnx.initializers.zeros, rngs=rngs)
        self.c_attn = linear(d, 3 * d, kernel_init=normal(0.02))  # q, k, v in one matmul
        self.c_proj = linear(d, d, kernel_init=normal(0.02 / math.sqrt(2 * L)))

    def qkv(self, x):
        """q, k and v, (B, T, C) each. One matmul by c_attn, then split: on a GPU XLA
        copies each third out of the (B, T, 3C) result for cuDNN's attention, and in
        backward concatenates their gradients back. With split_qkv, three matmuls by
        c_attn's thirds (the same weights) write q, k and v whole."""
        if not self.split_qkv:
            return jnp.split(self.c_attn(x), 3, axis=2)
        C = x.shape[-1]
        x = x.astype(self.dtype)  # as nnx.Linear computes: everything in the compute dtype
        kernel = self.c_attn.kernel[...].astype(self.dtype)  # (C, 3C)
        bias = self.c_attn.bias[...].astype(self.dtype)
        q = x @ kernel[:, :C] + bias[:C]
        k = x @ kernel[:, C:2 * C] + bias[C:2 * C]
        v = x @ kernel[:, 2 * C:] + bias[2 * C:]
        return q, k, v

    def __call__(self, x):
        B, T, C = x.shape  # batch, sequence length, embedding dim (n_embd)
        q, k, v = self.qkv(x)
        # nh heads of hs = C // nh channels each; JAX's attention keeps heads third
        k = k.reshape(B, T, self.n_head, C // self.n_head)  # (B, T, nh, hs)
        q = q.reshape(B, T, self.n_head, C // self.n_head)  # (B, T, nh, hs)
        v = v.reshape(B, T, self.n_head, C // self.n_head)  # (B, T, nh, hs)
        if self.attn == "sdpa":
            # one fused attention (cuDNN flash on a GPU when asked): no T x T in memory
            y = jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=self.attn_impl)  # (B, T, nh, hs)
        else:
            # the textbook version: a (B, nh, T, T) matrix written, softmaxed, read back
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(k.shape[-1])
            causal = jnp.tril(jnp.ones((T, T), dtype=bool))
            att = jnp.where(causal, att, -jnp.inf)
            att = jax.nn.softmax(att.astype(jnp.float32), axis=-1)  # fp32, as autocast
            y = jnp.einsum("bhqk,bkhd->bqhd", att.astype(self.dtype), v)  # (B, T, nh, hs)
        y = y.reshape(B, T, C)  # re-assemble the heads: (B, T, C)
        return self.c_proj(y)


def gelu(x):
    return jax.nn.gelu(x, approximate=True)  # GPT-2's tanh GELU


class MLP(nnx.Module):

    def __init__(self, config, dtype, param_dtype, rngs, recompute_gelu=False):
        d = config.n_embd
        L = config.n_layer
        linear = partial(nnx.Linear, dtype=dtype, param_dtype=param_dtype,
                         bias_init=nnx.initializers.zeros, rngs=rngs)
        self.c_fc = linear(d, 4 * d, kernel_init=normal(0.02))
        self.c_proj = linear(4 * d, d, kernel_init=normal(0.02 / math.sqrt(2 * L)))
        self.recompute_gelu = recompute_gelu

    def __call__(self, x):
        if self.recompute_gelu:
            # backward keeps only the GELU's input and recomputes its tanh from it; plain
            # autodiff keeps the tanh too, one more (B, T, 4d) tensor written and read
            hidden = jax.checkpoint(gelu)(self.c_fc(x))
        else:
            hidden = gelu(self.c_fc(x))
        return self.c_proj(hidden)


class Block(nnx.Module):

    def __init__(self, config, dtype, param_dtype, rngs, attn_impl=None, split_qkv=False,
                 recompute_gelu=False):
        # LayerNorm computes in fp32, with torch's epsilon (nnx defaults to 1e-6)
        ln = partial(nnx.LayerNorm, config.n_embd, epsilon=1e-5, dtype=jnp.float32,
                     param_dtype=param_dtype, rngs=rngs)
        self.ln_1 = ln()
        self.attn = CausalSelfAttention(config, dtype, param_dtype, rngs, attn_impl,
                                        split_qkv)
        self.ln_2 = ln()
        self.mlp = MLP(config, dtype, param_dtype, rngs, recompute_gelu)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))  # bf16 branch + fp32 residual -> fp32 residual
        x = x + self.mlp(self.ln_2(x))  # (bf16_residual: bf16 + bf16 -> bf16)
        return x


class GPT(nnx.Module):

    def __init__(self, config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=None,
                 attn_impl=None, split_qkv=False, recompute_gelu=False):
        assert config.attn in ("sdpa", "manual"), f"attn: sdpa or manual: {config.attn!r}"
        if rngs is None:
            rngs = nnx.Rngs(0)
        self.config = config
        self.dtype = dtype
        embed = partial(nnx.Embed, embedding_init=normal(0.02), param_dtype=param_dtype,
                        rngs=rngs)
        self.wte = embed(config.vocab_size, config.n_embd)  # also the lm_head (tied)
        self.wpe = embed(config.block_size, config.n_embd)
        self.h = nnx.List([Block(config, dtype, param_dtype, rngs, attn_impl, split_qkv,
                                 recompute_gelu)
                           for _ in range(config.n_layer)])
        self.ln_f = nnx.LayerNorm(config.n_embd, epsilon=1e-5, dtype=jnp.float32,
                                  param_dtype=param_dtype, rngs=rngs)

    def __call__(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.config.block_size, f"length {T} > {self.config.block_size}"
        x = self.wte(idx) + self.wpe(jnp.arange(T))  # fp32 residual stream
        if self.config.bf16_residual:
            # the residual stream in the compute dtype: every block's adds then stay in
            # it; each LayerNorm reads it and computes in fp32, as model_torch's does
            x = x.astype(self.dtype)
        for block in self.h:
            if self.config.checkpoint:
                # keep only the block's input; recompute its insides during backward
                x = nnx.remat(Block.__call__)(block, x)
            else:
                x = block(x)
        x = self.ln_f(x)
        wte = self.wte.embedding[...]
        if self.config.fused_classifier and targets is not None:
            tokens = x.reshape(B * T, -1)
            loss = fused_classifier(tokens, wte, targets.reshape(B * T), self.dtype)
            return None, loss
        logits = x.astype(self.dtype) @ wte.astype(self.dtype).T  # tied lm_head
        loss = None
        if targets is not None:  # loss on fp32 logits, also in bf16 compute
            loss = cross_entropy(logits, targets)
        return logits, loss


def cross_entropy(logits, targets):
    """Mean cross-entropy on fp32 logits (bf16 would lose precision). The target's logit
    is picked with a one-hot mask, which XLA fuses into the reductions and the softmax's
    gradient; a gather (optax's integer-label loss) costs XLA extra passes over the
    B x T x V logits."""
    logits = logits.astype(jnp.float32)
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
    target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logit)


# Tokens per chunk of the fused classifier, as model_torch.CLASSIFIER_CHUNK.
CLASSIFIER_CHUNK = 8192


def chunk_cross_entropy(logits, targets, n):
    """One chunk of the fused classifier: its logits to fp32, then the chunk's summed
    cross-entropy and its gradient with respect to the logits, (softmax - one_hot) / n,
    where n is the number of tokens the loss is the mean over."""
    logits = logits.astype(jnp.float32)  # the loss on fp32 logits, also in bf16 compute
    is_target = jnp.arange(logits.shape[-1]) == targets[:, None]
    logsumexp = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1, keepdims=True)
    loss = jnp.sum(logsumexp - target_logit)
    grad = jnp.exp(logits - logsumexp) - is_target  # the softmax minus the one-hot
    return loss, grad / n


def fused_classifier(x, wte, targets, dtype):
    """The tied lm_head and the mean cross-entropy, chunk by chunk over the N tokens, as
    model_torch.FusedClassifier: no N x V tensor exists. A custom_vjp, so its forward (a
    lax.scan over the chunks) forms each chunk's loss and gradient and folds the gradient
    into dx = g W and dW = g^T x at once; its backward only scales the saved dx and dW.
    (A scan under jax.checkpoint would be shorter, but it would recompute the head's
    matmul in backward: one more N x V x d matmul.) x (N, d) fp32, wte (V, d), targets
    (N,)."""
    n, d = x.shape
    full = n // CLASSIFIER_CHUNK * CLASSIFIER_CHUNK  # tokens in whole chunks, then a rest

    def forward(x, wte):
        w = wte.astype(dtype)

        def chunk(dw, x_and_targets):
            x_chunk = x_and_targets[0].astype(dtype)
            logits = x_chunk @ w.T  # (chunk, V) in the compute dtype, as the plain head
            loss, grad = chunk_cross_entropy(logits, x_and_targets[1], n)
            grad = grad.astype(dtype)  # as the plain head's backward casts it
            dx = (grad @ w).astype(jnp.float32)
            dw = dw + (grad.T @ x_chunk).astype(jnp.float32)
            return dw, (loss, dx)

        dw = jnp.zeros(wte.shape, jnp.float32)
        whole = (x[:full].reshape(-1, CLASSIFIER_CHUNK, d),
                 targets[:full].reshape(-1, CLASSIFIER_CHUNK))
        dw, (losses, dx) = jax.lax.scan(chunk, dw, whole)
        dx = dx.reshape(full, d)
        loss = jnp.sum(losses)
        if full < n:  # the last, shorter chunk
            dw, (rest_loss, rest_dx) = chunk(dw, (x[full:], targets[full:]))
            dx = jnp.concatenate([dx, rest_dx])
            loss = loss + rest_loss
        return loss / n, (dx, dw.astype(wte.dtype))

    def backward(saved, grad_loss):
        dx, dw = saved
        return dx * grad_loss, dw * grad_loss

    @jax.custom_vjp
    def loss_of(x, wte):
        return forward(x, wte)[0]

    loss_of.defvjp(forward, backward)
    return loss_of(x, wte)


def adamw(lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95)):
    """AdamW as model_torch.configure_optimizer: matrices decay, biases, gains do not."""
    decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.adamw(lr, b1=betas[0], b2=betas[1], eps=1e-8, weight_decay=weight_decay,
                       mask=decay)


def make_train_step(graphdef, donate=False):
    """One AdamW step as a plain jax.jit over the split state of (model, optimizer).

    nnx.split turns the objects into a static graphdef and a pytree of arrays; the jitted
    function merges them, steps, and returns the new state. (nnx.jit does the same
    bookkeeping in Python on every call, which costs time on small and medium models.)
    With donate=True the old state's buffers are reused for the new one.
    """
    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: m(x, y)[1])(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))
    return jax.jit(train_step, donate_argnums=(0,) if donate else ())


# ---------------------------------------------------------------------------------------
# Accounting that differs from model_torch's: what JAX keeps for the backward, op by op.

def residual_bytes(config, batch_size, dtype=jnp.float32):
    """Bytes of the values JAX's autodiff keeps for the backward of one batch's loss when
    the step runs op by op (no jax.jit): the arrays the backward function of jax.vjp
    closes over, counted from shapes alone by jax.eval_shape (nothing computed or held).
    Op by op JAX keeps every intermediate its rules need, so this is more than torch's
    autograd keeps (model_torch.activation_bytes): each T x T value of the manual softmax
    (scores, exponentials, probabilities) and the tanh GELU's intermediates. Under jax.jit
    XLA decides what it keeps; ask it: `compiled.memory_analysis()`."""
    model = nnx.eval_shape(lambda: GPT(config, dtype))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((batch_size, config.block_size), jnp.int32)

    def backward_closure(params, x):
        def loss_of(params):
            logits, _ = nnx.merge(graphdef, params, rest)(x)
            return cross_entropy(logits, x)

        _, backward = jax.vjp(loss_of, params)
        return jax.tree.leaves(backward)  # the residuals: what backward needs

    saved = 0
    for leaf in jax.eval_shape(backward_closure, params, tokens):
        saved += leaf.size * leaf.dtype.itemsize
    return saved


# The loss's forward and backward, op by op, hold up to four fp32 B x T x V values at
# once beside the residuals (the logits' exponentials, their one-hot select, the gradient
# and its scaled copy): with them, eager_peak_bytes came within 2% of the allocator's peak
# of an un-jitted GPT-2 step on one H200 (16 x 1024 tokens, fp32).
EAGER_LOSS_TEMPORARIES = 4


def eager_peak_bytes(config, batch_size, dtype=jnp.float32):
    """Predicted peak of an un-jitted training step with AdamW over micro-batches of
    batch_size rows: the fp32 parameters, their gradients, the running sum of gradients
    and AdamW's two moments (5 x 4 bytes a parameter), one micro-batch's residuals
    (residual_bytes), and the loss's temporaries."""
    state = 20 * model_torch.param_count(config)
    logits = 4 * batch_size * config.block_size * config.vocab_size  # fp32 B x T x V
    residuals = residual_bytes(config, batch_size, dtype)
    return state + residuals + EAGER_LOSS_TEMPORARIES * logits


def predicted_peak_bytes(config, batch_size, bf16=False):
    """Predicted peak of a jitted (XLA) training step with AdamW, one micro-batch of
    batch_size rows, on one device: what XLA's plans of GPT-2 steps show it keeps, counted
    with model_torch's terms. XLA's own plan (`compiled.memory_analysis()`) is the answer;
    this is the prediction made before compiling. Where XLA differs from torch's autograd:
      the state twice: params and AdamW's moments as the step's inputs and its outputs
                (without donation both exist at once), plus the gradients and their sum
      blocks    model_torch.block_activation_terms as for fused attention; manual
                attention adds the T x T scores and probabilities, both kept (2 per head
                and token, at the compute dtype's width), not torch's fp32 probabilities
      head      the logits and their gradient at the compute dtype: XLA fuses the loss's
                fp32 softmax into the gradient, no fp32 log-softmax is kept; the fused
                classifier: a chunk's fp32 logits, their softmax and gradient, and dW
      recompute checkpointing: one block's insides alive again in backward"""
    c = config
    T = c.block_size
    tokens = batch_size * T
    n = model_torch.param_count(c)
    width = 4  # bytes of a value in the compute dtype
    if bf16:
        width = 2
    state = 2 * 12 * n + 2 * 4 * n
    fused = replace(c, attn="sdpa")
    per_token = sum(model_torch.block_activation_terms(fused, T, bf16).values())
    if c.attn == "manual" and not c.checkpoint:
        per_token += 2 * width * c.n_head * T
    activations = tokens * c.n_layer * per_token
    head = 2 * width * c.vocab_size * tokens
    if c.fused_classifier:
        chunk = min(tokens, model_torch.CLASSIFIER_CHUNK)
        head = 3 * 4 * c.vocab_size * chunk + 4 * c.vocab_size * c.n_embd
    recompute = 0
    if c.checkpoint:
        plain = replace(c, checkpoint=False)
        inside = model_torch.block_activation_terms(plain, T, bf16)
        recompute = tokens * sum(inside.values())
    return state + activations + head + recompute


def from_torch(model, state_dict):
    """Copy a model_torch.GPT state dict into this model (in place): same weights, same
    function. torch's Linear stores (out, in) and computes x W^T; nnx's kernel is
    (in, out)."""
    sd = {k: jnp.asarray(v.detach().float().cpu().numpy()) for k, v in state_dict.items()}
    model.wte.embedding[...] = sd["transformer.wte.weight"]
    model.wpe.embedding[...] = sd["transformer.wpe.weight"]

    def copy_ln(ln, name):
        ln.scale[...] = sd[name + ".weight"]
        ln.bias[...] = sd[name + ".bias"]

    def copy_linear(lin, name):
        lin.kernel[...] = sd[name + ".weight"].T  # torch (out, in) -> nnx (in, out)
        lin.bias[...] = sd[name + ".bias"]

    for i, block in enumerate(model.h):
        p = f"transformer.h.{i}."
        copy_ln(block.ln_1, p + "ln_1")
        copy_linear(block.attn.c_attn, p + "attn.c_attn")
        copy_linear(block.attn.c_proj, p + "attn.c_proj")
        copy_ln(block.ln_2, p + "ln_2")
        copy_linear(block.mlp.c_fc, p + "mlp.c_fc")
        copy_linear(block.mlp.c_proj, p + "mlp.c_proj")
    copy_ln(model.ln_f, "transformer.ln_f")
    return model


if __name__ == "__main__":
    # Smoke check on the best device: (1) the same weights give the same logits as
    # model_torch in fp32; (2) one bf16 forward + backward of the preset.
    #   python model_jax.py gpt2
    import sys
    import time
    import numpy as np
    import torch
    from model_torch import GPT as TorchGPT
    name = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    config = GPTConfig.preset(name)
    torch.manual_seed(0)
    torch_model = TorchGPT(config)
    idx = np.random.default_rng(0).integers(0, 50257, (2, config.block_size))
    with torch.no_grad():
        torch_logits = torch_model(torch.from_numpy(idx))[0].numpy()
    with jax.default_matmul_precision("highest"):  # true fp32 (a GPU would use TF32)
        model = from_torch(GPT(config), torch_model.state_dict())
        err = float(jnp.abs(model(jnp.asarray(idx))[0] - torch_logits).max())
    kind = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {kind}: {name} fp32 logits vs torch (CPU): "
          f"max |diff| = {err:.2e} (measured)")
    assert err < 1e-4, err

    model = GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    ids = np.random.default_rng(1).integers(0, 50257, (2, 4, config.block_size))
    x = jnp.asarray(ids[0])
    y = jnp.asarray(ids[1])
    loss_and_grad = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p)(x, y)[1]))
    for step in range(3):  # step 0 compiles
        t0 = time.perf_counter()
        loss, grads = jax.block_until_ready(loss_and_grad(params))
        dt = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use", float("nan")) / 2**30
    print(f"jax: {name}, bf16 compute, B=4, T={config.block_size}: loss {loss:.4f} "
          f"(ln V = {math.log(config.vocab_size):.4f}), fwd+bwd {dt * 1e3:.1f} ms "
          f"(measured), peak {peak:.2f} GiB (measured)")
    assert abs(float(loss) - math.log(config.vocab_size)) < 0.5, "loss far from ln V"
