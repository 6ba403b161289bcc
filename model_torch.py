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
Mixed precision is not a switch here: the lessons wrap the model in torch.autocast, and
`bf16_residual` then keeps the residual stream (every add, every LayerNorm's input) in
bf16 instead of autocast's fp32.
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
    bf16_residual: bool = False  # under autocast: the residual stream in bf16, not fp32

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


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm, except for a bf16 input under autocast (the bf16 residual stream):
    autocast would run it on an fp32 copy of its input and keep that copy for backward
    (4 bytes a value, not 2). Here it reads the bf16 input itself, computes in fp32 as
    autocast's does, and writes its output in bf16: the same fp32 result, rounded as the
    next matmul's autocast cast would round it."""

    def forward(self, x):
        if x.dtype != torch.bfloat16 or not torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            if x.device.type == "cuda":  # CUDA's kernel wants its gain and bias in the
                # input's dtype (fp32 gain: "expected scalar type BFloat16"); fp32 inside
                return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype),
                                    self.bias.to(x.dtype), self.eps)
            return super().forward(x)  # bf16 input, fp32 gain and bias: fp32 inside


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd)
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
    """lm_head and the mean cross-entropy, chunk by chunk over the N tokens (as llm.c's
    fused classifier and Liger's fused linear cross-entropy): the forward forms each
    chunk's logits, its loss and its gradient, and folds that gradient straight into dx
    = g W and dW = g^T x, so no N x V tensor ever exists. Backward only scales the saved
    dx and dW. Under autocast the matmuls run in bf16 as the plain head's do; dW adds up
    in fp32."""

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
            ln_f=LayerNorm(config.n_embd),
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

        Unlike nanoGPT, the logits come back detached when targets are given: the
        gradient flows through the loss alone. Logits that still required grad would
        make a compiled backward allocate, zero-fill and add a B x T x V gradient for an
        output nobody uses (6.6 GB in bf16 at B=64, T=1024, V=50304). Call without
        targets for logits that carry a gradient."""
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence length {T} > {self.config.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        if self.config.bf16_residual and torch.is_autocast_enabled(idx.device.type):
            x = x.to(torch.bfloat16)  # the residual stream in bf16 from here on
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

@dataclass(frozen=True)
class Datasheet:
    bf16_flops: float  # dense bf16 tensor-core FLOP/s, fp32 accumulate (no 2:4 sparsity)
    bandwidth: float   # device memory bytes/s


# Reference values, not measurements, by the exact name torch.cuda.get_device_name() gives:
# the H100 SXM, PCIe and NVL differ by 25%, so a substring would hand a PCIe card the SXM's
# peak. Sources: NVIDIA's H100, H200, A100, L40S, L4 and A10 datasheets (their sparse
# figures halved); the Ada, Ampere GA102 and Blackwell GB202 whitepapers for the GeForce
# cards (their tensor FLOP/s with fp32 accumulate, as training uses).
DATASHEETS = {
    "NVIDIA H100 80GB HBM3": Datasheet(989e12, 3.35e12),  # H100 SXM
    "NVIDIA H100 PCIe": Datasheet(756e12, 2.0e12),
    "NVIDIA H100 NVL": Datasheet(835e12, 3.9e12),
    "NVIDIA H200": Datasheet(989e12, 4.8e12),  # H200 SXM
    "NVIDIA H200 NVL": Datasheet(835e12, 4.8e12),
    "NVIDIA A100-SXM4-80GB": Datasheet(312e12, 2.039e12),
    "NVIDIA A100-SXM4-40GB": Datasheet(312e12, 1.555e12),
    "NVIDIA A100 80GB PCIe": Datasheet(312e12, 1.935e12),
    "NVIDIA A100-PCIE-40GB": Datasheet(312e12, 1.555e12),
    "NVIDIA L40S": Datasheet(362e12, 0.864e12),
    "NVIDIA L4": Datasheet(121e12, 0.300e12),
    "NVIDIA A10": Datasheet(125e12, 0.600e12),
    "NVIDIA GeForce RTX 4090": Datasheet(165.2e12, 1.008e12),
    "NVIDIA GeForce RTX 3090": Datasheet(71e12, 0.936e12),
    "NVIDIA GeForce RTX 5090": Datasheet(209.5e12, 1.792e12),
}


def datasheet(device_name):
    """This GPU's datasheet row, or None for a name not in DATASHEETS (a lesson then
    measures its roofs and says it has no reference for them)."""
    return DATASHEETS.get(device_name)


def datasheet_bf16_peak(device_name):
    """The dense bf16 peak in FLOP/s (the denominator of MFU), or None if unknown."""
    row = datasheet(device_name)
    if row is None:
        return None
    return row.bf16_flops


def param_count(config, position=True):
    """Exactly sum(p.numel() for p in GPT(config).parameters()); the tied head counts
    once."""
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


def residual_bytes(config, bf16):
    """Bytes of a value of the residual stream: fp32 (autocast keeps the adds in fp32),
    bf16 under autocast with config.bf16_residual."""
    if bf16 and config.bf16_residual:
        return 2
    return 4


def block_activation_terms(config, seq_len=None, bf16=False):
    """Bytes one block keeps for backward, per token, term by term (activation_bytes lists
    which tensor is which). bf16: under torch.autocast."""
    c = config
    T = c.block_size if seq_len is None else seq_len
    d, H = c.n_embd, c.n_head
    act = 2 if bf16 else 4  # bytes of an activation that feeds a matmul
    residual = residual_bytes(c, bf16)
    if c.checkpoint:
        return dict(block_input=residual * d)  # the residual stream entering the block
    terms = dict(
        layernorm_inputs=2 * residual * d,  # the residual stream entering ln_1 and ln_2
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

      blocks.*            per block and token: see block_activation_terms. In fp32 that
                          is 16 d floats + LayerNorm stats; under autocast the residual
                          stream stays fp32 (2 x 4d bytes; 2 x 2d with bf16_residual)
                          and the 14 d matmul-side values are bf16
      token_ids, targets  int64 per token; position_ids: int64 per position, once
      ln_f_*              its input (the residual stream) and its stats; lm_head_input:
                          ln_f's output
      log_softmax         the fp32 log-probabilities over the vocabulary, V per token
      loss                the fp32 scalar the mean reduction keeps
      classifier_dx/_dw   fused_classifier only, in place of lm_head_input, log_softmax,
                          targets and loss: the gradients its forward already formed,
                          fp32, d per token (dx) and V x d once (dW); no V-wide value
      causal_mask         manual attention only: the T x T bool mask, once per layer
                          (recomputed, not kept, under checkpointing)
      weight_copies       autocast only: the bf16 copies of the weight matrices, saved
                          for backward, 2 bytes x (V d + 12 L d^2), once per step
      checkpointing       a block keeps only its input (the residual); its insides (and
                          their weight copies) are recomputed in backward
    """
    c = config
    T = c.block_size if seq_len is None else seq_len
    d, L, V = c.n_embd, c.n_layer, c.vocab_size
    tokens = batch_size * T
    act = 2 if bf16 else 4
    terms = {f"blocks.{name}": tokens * L * b
             for name, b in block_activation_terms(c, T, bf16).items()}
    terms.update(token_ids=8 * tokens, position_ids=8 * T)
    terms.update(ln_f_input=residual_bytes(c, bf16) * d * tokens)
    terms.update(ln_f_stats=2 * 4 * tokens)
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


def predicted_peak_bytes(config, batch_size, bf16=False):
    """Bytes alive at the peak of a steady-state eager training step with AdamW (its
    moments exist; gradients set to None between steps). Backward frees each layer's
    activations as it writes that layer's gradients, so the peak is the larger of two
    moments, not the sum of the parts:
      backward's start  params + moments + activations + the head's gradients
      backward's end    params + grads + moments + the embedding's gradients
    Checkpointed backward re-runs one block at a time: its insides (and, under autocast,
    its bf16 weight copies) live again, beside the activations early and the gradients
    late. torch.compile and XLA keep fewer activations (they recompute the cheap ones),
    so for them this is an upper bound."""
    c = config
    state = state_bytes(c)
    tokens = batch_size * c.block_size
    activations = activation_bytes(c, batch_size, bf16=bf16)
    head_grads = 8 * c.vocab_size * tokens  # two fp32 V-wide gradients per token
    if c.fused_classifier:  # one chunk's logits at a time: bf16 or fp32, fp32, their gradient
        head_grads = 12 * c.vocab_size * min(tokens, CLASSIFIER_CHUNK)
    embedding_grads = 8 * c.vocab_size * c.n_embd  # the tied embedding's, twice, summed
    recompute = 0  # checkpointing: one block alive again
    if c.checkpoint:
        plain = replace(c, checkpoint=False)
        recompute = tokens * sum(block_activation_terms(plain, bf16=bf16).values())
        if bf16:
            recompute += 2 * 12 * c.n_embd**2  # that block's bf16 weight copies
    held = state["params"] + state["optimizer"]  # alive through the whole step
    backward_start = held + activations + max(head_grads, recompute)
    backward_end = held + state["grads"] + max(embedding_grads, recompute)
    return max(backward_start, backward_end)


def predicted_rise_bytes(config, batch_size, grads_alive):
    """The accounting's peak above the weights for one fp32 forward and backward (no AdamW
    step): at backward's start the activations and the head's two fp32 V-wide gradients
    per token; at its end the gradients and the tied embedding's two V x d ones, summed
    into its .grad. While accumulating (grads_alive), the earlier micro-batches' gradients
    are alive throughout, and the embedding's sum is a third V x d, added into the .grad
    that exists."""
    c = config
    grads = state_bytes(c)["grads"]
    tokens = batch_size * c.block_size
    start = activation_bytes(c, batch_size) + 8 * c.vocab_size * tokens
    embedding = 8 * c.vocab_size * c.n_embd
    if grads_alive:
        start += grads
        embedding = 12 * c.vocab_size * c.n_embd
    return max(start, grads + embedding)


def recompute_flops_per_token(config):
    """The FLOPs per token activation checkpointing adds: backward runs each block's
    forward again, but torch's non-reentrant checkpoint stops once every tensor backward
    needs is back, so the block's last matmul (the MLP's c_proj, whose output nothing
    saves) is not run again: 2 x 8 L d^2 for the other matmuls (c_attn 3 d^2, attention's
    c_proj d^2, c_fc 4 d^2) and 4 L T d for the attention scores."""
    c = config
    return 16 * c.n_layer * c.n_embd**2 + 4 * c.n_layer * c.block_size * c.n_embd


# What a card needs beyond the tensors a step keeps alive: on one H200 with torch 2.11, the
# largest fp32 GPT-2 batches found under an allocator cap were 16 sequences where the
# tensors alone predicted 19 (24 GiB) and 111 where they predicted 120 (the whole card):
# the caching allocator's rounding and free blocks, and cuBLAS's workspaces, took 7-15%.
ALLOCATOR_HEADROOM = 1.2


def micro_batches(config, batch_size, memory_bytes, bf16=False):
    """The fewest micro-batches (a divisor of batch_size) whose step fits memory_bytes by
    predicted_peak_bytes with ALLOCATOR_HEADROOM: the same tokens per optimizer step on
    every card, more micro-steps on a smaller one. None: one sequence at a time does not
    fit."""
    for count in range(1, batch_size + 1):
        if batch_size % count:
            continue
        peak = predicted_peak_bytes(config, batch_size // count, bf16)
        if ALLOCATOR_HEADROOM * peak <= memory_bytes:
            return count
    return None


# ---------------------------------------------------------------------------------------
# The floor of a step: lower bounds on what one optimizer step must compute and move,
# class by class, for a profiler's kernel classes. A class cannot run faster than its
# FLOPs at the matmul roof nor than its bytes at the copy bandwidth, so max(FLOPs / roof,
# bytes / bandwidth) is its floor. Every count is a minimum: each operand read once, each
# result written once, only the tensors that must cross from one kernel to another (a
# matmul's output, a matmul's input, the residual stream between its adds); what a kernel
# re-reads, recomputes or spills, and what fusion could not remove, is left out.

FLOOR_CLASSES = ("matmul", "attention", "elementwise/norm/loss", "optimizer")


def block_linears(config):
    """(inputs, outputs) of each linear layer of a block: c_attn, attn c_proj, c_fc,
    mlp c_proj."""
    d = config.n_embd
    return [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]


def matmul_floor(config, tokens, bf16, micro_batches=1):
    """FLOPs and bytes of the linear layers' matmuls (and of manual attention's): per
    token and layer, 3 GEMMs per linear (forward; backward's dX and dW), 2 x in x out
    FLOPs each; each reads its two operands and writes its result once, at the compute
    dtype. Checkpointing runs each block's forward again in backward, up to the last
    tensor backward needs: all but the MLP's output projection."""
    c = config
    d, L, V, T = c.n_embd, c.n_layer, c.vocab_size, c.block_size
    act = 2 if bf16 else 4  # bytes of a matmul's operand: autocast's bf16, else fp32
    flops = 0  # per token, all layers
    data = 0
    weights = 0  # per micro-step
    linears = block_linears(c)
    for inputs, outputs in linears:
        gemms = 3  # forward, dX, dW
        if c.checkpoint and (inputs, outputs) != linears[-1]:
            gemms = 4  # its forward again
        flops += L * gemms * 2 * inputs * outputs
        data += L * gemms * act * (inputs + outputs)  # X read, Y written (dY, dX / X, dY)
        weights += L * gemms * act * inputs * outputs  # W read (dW written)
    if c.attn == "manual":  # its two matmuls per head, over the full T x T square
        passes = 3
        if c.checkpoint:
            passes = 4
        flops += L * passes * 2 * 2 * T * d  # QK^T and PV: 2 T hs FLOPs a head, n_head
        data += L * passes * 2 * act * c.n_head * T  # scores written, probabilities read
    flops += 3 * 2 * d * V  # the head: never recomputed
    data += 3 * act * (d + V)  # its input and the logits (and their gradients)
    weights += 3 * act * V * d
    return dict(flops=tokens * flops, bytes=tokens * data + micro_batches * weights)


def attention_floor(config, tokens, bf16):
    """The fused attention kernel (sdpa) only: the causal half of QK^T and PV (a kernel
    may skip the masked half), forward and backward (twice forward), 2 d FLOPs a query-
    key pair; q, k, v read and o written, and in backward q, k, v, o, dO read and dq,
    dk, dv written; one fp32 log-sum-exp a head and token written and read. Manual
    attention's work is in matmul_floor and elementwise_floor (the profiler names its
    kernels so)."""
    c = config
    if c.attn != "sdpa":
        return dict(flops=0, bytes=0)
    d, L, T, H = c.n_embd, c.n_layer, c.block_size, c.n_head
    act = 2 if bf16 else 4
    forwards = 1
    if c.checkpoint:
        forwards = 2
    # a query meets (T + 1) / 2 keys on average (causal), 2 x 2 d FLOPs each (QK^T, PV)
    forward_flops = 2 * d * (T + 1)
    forward_bytes = 4 * act * d + 4 * H  # q, k, v read; o and the log-sum-exp written
    # q, k, v, o, dO and the log-sum-exp read; dq, dk, dv written
    backward_bytes = 8 * act * d + 4 * H
    flops = tokens * L * forward_flops * (forwards + 2)
    data = tokens * L * (forwards * forward_bytes + backward_bytes)
    return dict(flops=flops, bytes=data)


def elementwise_floor(config, tokens, bf16, micro_batches=1):
    """The bytes the LayerNorms, GELUs, residual adds, casts and the loss must move
    between the matmuls, fused as far as they can be. Per token and block, forward:
    ln_1's output written; the attention branch's output and the residual read, the
    residual and ln_2's output written; GELU's input read and output written (4 d each);
    the MLP branch's output and the residual read, the residual written. Backward: each
    LayerNorm reads its output's gradient, its input and the residual's gradient and
    writes the residual's gradient (and its copy at the matmul's dtype when that
    differs); GELU reads its output's gradient and input and writes its input's
    gradient. Once a token: the embeddings' sum written and its gradient read, ln_f, and
    the loss: the logits read once and their gradient written once. Once a micro-step
    under autocast: each weight matrix read in fp32 and written in bf16, its bf16
    gradient read and written in fp32; with more micro-steps each later one adds its
    gradients into the fp32 ones. No FLOPs counted: these kernels are bandwidth-bound."""
    c = config
    d, L, V, T, H = c.n_embd, c.n_layer, c.vocab_size, c.block_size, c.n_head
    act = 2 if bf16 else 4
    residual = residual_bytes(c, bf16)
    cast = 0  # the residual's gradient copied to the matmuls' dtype
    if act != residual:
        cast = act
    forward = act * d  # ln_1's output
    # attention's output and the residual read; the residual and ln_2's output written
    forward += act * d + 2 * residual * d + act * d
    forward += 2 * act * 4 * d  # GELU: its input read, its output written
    # the MLP's output and the residual read, the residual written
    forward += act * d + 2 * residual * d
    layernorm_backward = act * d + 3 * residual * d + cast * d
    backward = 2 * layernorm_backward + 3 * act * 4 * d  # two LayerNorms, GELU
    if c.attn == "manual":  # the T x T scores between its two matmuls, their softmax
        forward += 2 * act * H * T  # the scores read, the probabilities written
        backward += 3 * act * H * T  # the gradient and probabilities read, one written
    recomputed = 0  # checkpointing: the forward again, up to what backward needs
    if c.checkpoint:
        recomputed = forward - (act * d + 2 * residual * d)  # not the block's last add
    per_token = L * (forward + recomputed + backward)
    per_token += residual * d  # the embeddings' sum, written
    per_token += residual * d  # its gradient, read by the embeddings' backward
    per_token += act * d  # ln_f's output
    per_token += act * d + 2 * residual * d + cast * d  # ln_f's backward
    per_token += 2 * act * V  # the loss: the logits read, their gradient written
    matrices = 12 * L * d * d + V * d  # the weights the matmuls read
    per_step = 0
    if bf16:  # fp32 weights cast for the matmuls, their bf16 dW back to fp32
        per_step += micro_batches * matrices * (6 + 6)
        if c.checkpoint:  # cast again for the forward run again (not the MLP's c_proj)
            per_step += micro_batches * 8 * L * d * d * 6
    if micro_batches > 1:  # each later micro-step adds its gradients into the fp32 ones
        added = 12  # fp32: the sum's two inputs read, it written
        if bf16:
            added = 4  # beyond the cast above: the fp32 sum read as well
        per_step += (micro_batches - 1) * matrices * added
    return dict(flops=0, bytes=tokens * per_token + per_step)


def optimizer_floor(config):
    """AdamW's one pass: params, grads and both moments read, params and moments written:
    7 fp32 values, 28 bytes, a parameter (its few FLOPs a value are left out)."""
    return dict(flops=0, bytes=28 * param_count(config))


def step_floor_terms(config, tokens, bf16, micro_batches=1):
    """Lower bounds on one optimizer step of `tokens` tokens (in micro_batches micro-
    steps), {class: {"flops": ..., "bytes": ...}}, for the classes in FLOOR_CLASSES.
    bf16: under autocast (matmuls, their inputs and outputs, the logits in bf16; the
    loss in fp32 read from the bf16 logits); config.bf16_residual: the residual stream
    in bf16 too."""
    return {
        "matmul": matmul_floor(config, tokens, bf16, micro_batches),
        "attention": attention_floor(config, tokens, bf16),
        "elementwise/norm/loss": elementwise_floor(config, tokens, bf16, micro_batches),
        "optimizer": optimizer_floor(config),
    }


def floor_seconds(terms, matmul_flops, copy_bytes_per_s):
    """Each class's floor in seconds: its FLOPs at the matmul roof or its bytes at the
    copy bandwidth, whichever takes longer (both roofs measured: FLOP/s and bytes/s)."""
    seconds = {}
    for name, term in terms.items():
        compute = term["flops"] / matmul_flops
        memory = term["bytes"] / copy_bytes_per_s
        seconds[name] = max(compute, memory)
    return seconds


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
