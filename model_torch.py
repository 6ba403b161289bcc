"""
The shared GPT of the lessons, in PyTorch: nanoGPT's GPT-2, plus the accounting
(parameters, FLOPs, bytes) that every lesson predicts with before it measures.

    from model_torch import GPT, GPTConfig
    model = GPT(GPTConfig.preset("gpt2"))            # 124M, T=1024
    logits, loss = model(idx, targets)

Switches the lessons turn: `attn` ("sdpa": fused/flash attention, or "manual": the
T x T score matrix materialised), `checkpoint` (recompute each block in backward),
`fused_classifier` (the head and the loss chunk by chunk over the tokens, so the
B x T x V logits never exist; with targets the model returns (None, loss)) and
`vocab_size` (50257 as GPT-2 shipped it, 50304 padded to a multiple of 128).
Mixed precision is not a switch here: the lessons wrap the model in torch.autocast.
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    block_size: int = 1024   # longest sequence (T); also the size of the position table
    vocab_size: int = 50304  # GPT-2's 50257 tokens, padded to a multiple of 128
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    attn: str = "sdpa"        # "sdpa" (fused, no T x T in memory) or "manual"
    checkpoint: bool = False  # activation checkpointing, one region per block
    fused_classifier: bool = False  # head + loss chunk by chunk: the B x T x V logits never exist

    @staticmethod
    def preset(name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return replace(GPTConfig(**PRESETS[name]), **overrides)


PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),          # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),             # 7M, CPU
}


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        assert config.attn in ("sdpa", "manual"), f"attn: sdpa or manual, not {config.attn!r}"
        self.n_head = config.n_head
        self.attn = config.attn
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.size()  # batch, sequence length, embedding dim (n_embd)
        q, k, v = self.c_attn(x).split(C, dim=2)
        # heads become a batch dimension: nh heads of hs = C // nh channels each
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.attn == "sdpa":
            # one fused kernel (flash / memory-efficient): the T x T scores never reach memory
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:
            # the textbook version: a (B, nh, T, T) matrix is written, softmaxed and read back
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~causal, float("-inf"))
            att = F.softmax(att.float(), dim=-1)  # softmax in fp32, also under autocast
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads: (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU (and jax.nn.gelu's default)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))  # pre-LayerNorm: the residual stream is never normalised
        x = x + self.mlp(self.ln_2(x))
        return x


# Tokens per chunk of the fused classifier: a chunk's fp32 logits are 8192 x 50304 x 4 B =
# 1.6 GB at GPT-2's vocabulary, against 13 GB for a whole 64 x 1024 batch.
CLASSIFIER_CHUNK = 8192


def chunk_cross_entropy(logits, targets, n):
    """One chunk of the fused classifier: its logits to fp32, then the chunk's summed
    cross-entropy and its gradient with respect to the logits, (softmax - one_hot) / n,
    where n is the number of tokens the loss is the mean over."""
    logits = logits.float()  # the loss on fp32 logits, also under autocast
    logsumexp = torch.logsumexp(logits, dim=1, keepdim=True)
    target_logit = logits.gather(1, targets[:, None])
    loss = (logsumexp - target_logit).sum()
    is_target = torch.arange(logits.size(1), device=logits.device) == targets[:, None]
    grad = torch.exp(logits - logsumexp) - is_target.float()  # the softmax minus the one-hot
    return loss, grad / n


class FusedClassifier(torch.autograd.Function):
    """lm_head and the mean cross-entropy, chunk by chunk over the N tokens (as llm.c's fused
    classifier and Liger's fused linear cross-entropy): the forward forms each chunk's
    logits, its loss and its gradient, and folds that gradient straight into dx = g W and
    dW = g^T x, so no N x V tensor ever exists. Backward only scales the saved dx and dW.
    Under autocast the matmuls run in bf16 as the plain head's do; dW adds up in fp32."""

    @staticmethod
    def forward(ctx, x, weight, targets):  # x (N, d), weight (V, d), targets (N,)
        n = len(targets)
        loss = torch.zeros((), device=x.device)
        dx = torch.empty_like(x, dtype=torch.float32)
        dweight = torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, n, CLASSIFIER_CHUNK):
            end = start + CLASSIFIER_CHUNK
            x_chunk = x[start:end]
            logits = x_chunk @ weight.T  # (chunk, V), in the compute dtype autocast picks
            chunk_loss, grad = chunk_cross_entropy(logits, targets[start:end], n)
            loss += chunk_loss
            grad = grad.to(logits.dtype)  # as autograd casts the plain head's gradient
            dx[start:end] = grad @ weight
            dweight += (grad.T @ x_chunk).float()
        ctx.save_for_backward(dx, dweight)
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dweight = ctx.saved_tensors
        return dx * grad_loss, dweight * grad_loss, None


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying: one V x d matrix
        # GPT-2 init: N(0, 0.02); residual projections scaled by 1/sqrt(2 L)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets=None):
        """Logits (B, T, V) and, when targets are given, the mean cross-entropy.

        Unlike nanoGPT, the logits come back detached when targets are given: the gradient
        flows through the loss alone. Logits that still required grad would make a compiled
        backward allocate, zero-fill and add a B x T x V gradient for an output nobody uses
        (6.6 GB in bf16 at B=64, T=1024, V=50304). Call without targets for logits that
        carry a gradient.
        """
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence length {T} > {self.config.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            if self.config.checkpoint and torch.is_grad_enabled():
                # keep only the block's input; recompute its insides during backward
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.transformer.ln_f(x)
        if self.config.fused_classifier and targets is not None:
            loss = FusedClassifier.apply(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
            return None, loss
        logits = self.lm_head(x)
        loss = None
        if targets is not None:  # loss on fp32 logits, also under autocast
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            logits = logits.detach()
        return logits, loss

    def configure_optimizer(self, lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=False):
        """AdamW as GPT-2 trained: matrices decay, biases and LayerNorm gains do not."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
                  dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
        # fused=False would also turn off torch's default on a GPU, foreach (a few kernels per
        # update for all tensors at once), for a Python loop over the parameters: pass None
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)


# ---------------------------------------------------------------------------------------
# Accounting: what the lessons predict before they measure. Pure arithmetic on the config.

# Dense bf16 tensor-core peaks in FLOP/s: the denominator of MFU. Reference values, not
# measurements (NVIDIA H100/H200 and A100 datasheets; Ada whitepaper for the RTX 4090).
BF16_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "RTX 4090": 165e12}


def datasheet_bf16_peak(device_name):
    """The datasheet bf16 peak for a GPU name like 'NVIDIA H200', or None if unknown."""
    return next((peak for gpu, peak in BF16_PEAK_FLOPS.items() if gpu in device_name), None)


def param_count(config, position=True):
    """Exactly sum(p.numel() for p in GPT(config).parameters()); the tied head counts once."""
    d, L, V = config.n_embd, config.n_layer, config.vocab_size
    per_block = (2 * d                # ln_1 gain + bias
                 + d * 3 * d + 3 * d  # c_attn
                 + d * d + d          # attn c_proj
                 + 2 * d              # ln_2
                 + d * 4 * d + 4 * d  # c_fc
                 + 4 * d * d + d)     # mlp c_proj
    n = V * d + L * per_block + 2 * d  # wte (= lm_head) + blocks + ln_f
    return n + (config.block_size * d if position else 0)


def flops_per_token(config, seq_len=None):
    """Training FLOPs per token: 6N + 12 L T d (Kaplan et al. 2020, sec. 2.1; PaLM app. B;
    nanoGPT's estimate_mfu). N excludes the position table (a lookup, no matmul) but
    includes the tied embedding, because it is the lm_head matmul. 6 = 2 FLOPs per
    multiply-add x (1 forward + 2 backward). 12 L T d: the attention scores QK^T and
    their use on V, 2 matmuls of 2 T d FLOPs per token per layer, times 3; counted for
    the full T x T square, as a dense kernel computes it (causality would halve it).
    """
    T = config.block_size if seq_len is None else seq_len
    return 6 * param_count(config, position=False) + 12 * config.n_layer * T * config.n_embd


def state_bytes(config, param_bytes=4):
    """Bytes of the training state: fp32 params, fp32 grads, AdamW's two fp32 moments.
    torch.autocast leaves all three in fp32 (it casts copies inside the region)."""
    n = param_count(config)
    return dict(params=param_bytes * n, grads=param_bytes * n, optimizer=2 * 4 * n)


def block_activation_terms(config, seq_len=None, bf16=False):
    """Bytes one block keeps for backward, per token, term by term (activation_bytes lists
    which tensor is which). bf16: under torch.autocast."""
    c = config
    T = c.block_size if seq_len is None else seq_len
    d, H = c.n_embd, c.n_head
    act = 2 if bf16 else 4  # bytes of an activation that feeds a matmul
    if c.checkpoint:
        return dict(block_input=4 * d)  # the fp32 residual stream entering the block
    terms = dict(
        layernorm_inputs=2 * 4 * d,     # the fp32 residual stream entering ln_1 and ln_2
        layernorm_stats=2 * 2 * 4,      # mean and rstd of each LayerNorm, fp32
        matmul_inputs=7 * d * act,      # ln_1 out, attention out, ln_2 out (d each), gelu out (4d)
        qkv=3 * d * act,                # q, k, v, kept by the attention
        mlp_hidden=4 * d * act,         # c_fc out, kept by the GELU
    )
    if c.attn == "sdpa":
        terms["attention_logsumexp"] = 4 * H  # one fp32 log-sum-exp per head
    else:
        terms["attention_probs"] = 4 * H * T  # the fp32 softmax output
        if bf16:
            terms["attention_probs_bf16"] = 2 * H * T  # its bf16 copy, the input of att @ v
    return terms


def activation_terms(config, batch_size, seq_len=None, bf16=False):
    """Predicted bytes that autograd keeps alive between forward and backward (saved
    tensors, parameters excluded), for this file's implementation, term by term. Counted
    tensor by tensor (Korthikanti et al. 2022 do the same for Megatron):

      blocks.*            per block and token: see block_activation_terms. In fp32 that is
                          16 d floats + LayerNorm stats; under autocast the residual stream
                          stays fp32 (2 x 4d bytes) and the 14 d matmul-side values are bf16
      token_ids, targets  int64 per token; position_ids: int64 per position, once
      ln_f_*              its fp32 input and its stats; lm_head_input: ln_f's output
      log_softmax         the fp32 log-probabilities over the vocabulary, V per token
      loss                the fp32 scalar the mean reduction keeps
      classifier_dx/_dw   fused_classifier only, in place of lm_head_input, log_softmax,
                          targets and loss: the gradients its forward already formed, fp32,
                          d per token (dx) and V x d once (dW); no V-wide value per token
      causal_mask         manual attention only: the T x T bool mask, once per layer
                          (recomputed, not kept, under checkpointing)
      weight_copies       autocast only: the bf16 copies of the weight matrices, saved for
                          backward, 2 bytes x (V d + 12 L d^2), once per step, not per token
      checkpointing       a block keeps only its input (fp32); its insides (and their
                          weight copies) are recomputed in backward
    """
    c = config
    T = c.block_size if seq_len is None else seq_len
    d, L, V = c.n_embd, c.n_layer, c.vocab_size
    tokens = batch_size * T
    act = 2 if bf16 else 4
    terms = {f"blocks.{name}": tokens * L * b
             for name, b in block_activation_terms(c, T, bf16).items()}
    terms.update(token_ids=8 * tokens, position_ids=8 * T)
    terms.update(ln_f_input=4 * d * tokens, ln_f_stats=2 * 4 * tokens)
    if c.fused_classifier:
        terms.update(classifier_dx=4 * d * tokens, classifier_dw=4 * V * d)
    else:
        terms.update(lm_head_input=act * d * tokens, log_softmax=4 * V * tokens)
        terms.update(targets=8 * tokens, loss=4)
    if c.attn == "manual" and not c.checkpoint:
        terms["causal_mask"] = L * T * T
    if bf16:
        matrices = 12 * L * d * d  # the blocks' four matrices
        if c.checkpoint:
            matrices = 0
        if not c.fused_classifier:
            matrices += V * d  # the head's: the fused head keeps no copy
        terms["weight_copies"] = 2 * matrices
    return terms


def activation_bytes(config, batch_size, seq_len=None, bf16=False):
    """Total of activation_terms: the bytes saved for backward in one step."""
    return sum(activation_terms(config, batch_size, seq_len, bf16).values())


if __name__ == "__main__":
    # Smoke check: one bf16 forward + backward of a preset on the best device.
    #   python model_torch.py gpt2
    import sys
    import time
    name = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = GPTConfig.preset(name)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    idx, targets = torch.randint(0, 50257, (2, 4, config.block_size), device=device)
    for step in range(3):  # step 0 warms up
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = model(idx, targets)  # random targets: loss near ln V at init
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    print(f"torch {torch.__version__} on {device}: {name}, {param_count(config) / 1e6:.1f}M params")
    print(f"bf16 autocast, B=4, T={config.block_size}: loss {loss.item():.4f} "
          f"(ln V = {math.log(config.vocab_size):.4f})")
    print(f"fwd+bwd {seconds * 1e3:.1f} ms (measured)")
    if device == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (measured)")
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.5, "loss far from ln V at init"
