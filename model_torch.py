"""
The shared GPT of the lessons, in PyTorch: nanoGPT's GPT-2, plus the accounting
(parameters, FLOPs, bytes) that every lesson predicts with before it measures.

    from model_torch import GPT, GPTConfig
    model = GPT(GPTConfig.preset("gpt2"))            # 124M, T=1024
    logits, loss = model(idx, targets)

Switches the lessons turn: `attn` ("sdpa": fused/flash attention, or "manual": the
T x T score matrix materialised), `checkpoint` (recompute each block in backward) and
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
        assert config.attn in ("sdpa", "manual"), f"attn must be sdpa or manual, not {config.attn!r}"
        self.n_head, self.attn = config.n_head, config.attn
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attn == "sdpa":
            # one fused kernel (flash / memory-efficient): the T x T scores never reach memory
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # the textbook version: a (B, nh, T, T) matrix is written, softmaxed and read back
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = F.softmax(att.masked_fill(~causal, float("-inf")).float(), dim=-1)  # fp32 softmax
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
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
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence length {T} > block_size {self.config.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            if self.config.checkpoint and torch.is_grad_enabled():
                # keep only the block's input; recompute its insides during backward
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:  # loss on fp32 logits, also under autocast
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            # the gradient flows through the loss; returned logits that still required grad would
            # make a compiled backward zero-fill and add a B x T x V gradient for them (6.6 GB at
            # B=64, T=1024): 130-132 vs 124 ms per capstone step on an H200 (results/h200/probes)
            logits = logits.detach()
        return logits, loss

    def configure_optimizer(self, lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=False):
        """AdamW as GPT-2 trained: matrices decay, biases and LayerNorm gains do not."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
                  dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


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


def block_activation_bytes(config, seq_len=None, bf16=False):
    """Bytes one block keeps per token for backward (see activation_bytes for the list)."""
    c = config
    T = c.block_size if seq_len is None else seq_len
    d, H, act = c.n_embd, c.n_head, 2 if bf16 else 4
    if c.checkpoint:
        return 4 * d  # only the block's fp32 input
    per_block = (2 * 4 * d + 14 * act * d) + 2 * 2 * 4  # 16 d values + LayerNorm stats
    if c.attn == "sdpa":
        return per_block + 4 * H                       # log-sum-exp
    return per_block + 4 * H * T + (2 * H * T if bf16 else 0)  # softmax out (+ bf16 copy)


def activation_bytes(config, batch_size, seq_len=None, bf16=False):
    """Predicted bytes that autograd keeps alive between forward and backward (saved
    tensors, parameters excluded), for this file's implementation. Per token, counted
    tensor by tensor (Korthikanti et al. 2022 do the same for Megatron):

      per block, fp32     x, ln_1 out, qkv (3d), heads merged, x + attn, ln_2 out,
                          c_fc out (4d), gelu out (4d)  ->  16 d floats
      per block, autocast the residual stream stays fp32 (4 B), the rest are bf16 copies
                          (2 B): 2 x 4d + 14 x 2d = 36 d bytes
      LayerNorm stats     mean and rstd, fp32, 2 per LayerNorm
      attention           sdpa: its output (already in the merged-heads layout, so the
                          merge copies nothing) and one fp32 log-sum-exp per head;
                          manual: the fp32 softmax output, n_head x T per token, and
                          under autocast its bf16 copy for att @ v
      outside the blocks  the ids (int64), ln_f's input, the lm_head input and the fp32
                          log-softmax (V floats), the targets (int64)
      autocast            the bf16 copies of the weight matrices, saved for backward:
                          2 bytes x (V d + 12 L d^2), once per step, not per token
      checkpointing       a block keeps only its input (fp32), its insides (and their
                          weight copies) are recomputed in backward
    """
    c = config
    T = c.block_size if seq_len is None else seq_len
    d, L, V = c.n_embd, c.n_layer, c.vocab_size
    act = 2 if bf16 else 4  # bytes of a matmul-side activation
    per_block = block_activation_bytes(c, T, bf16)
    head = 8 + (4 * d + 2 * 4) + act * d + 4 * V + 8    # ids, ln_f, lm_head in, log-softmax, targets
    weight_copies = 2 * (V * d + (0 if c.checkpoint else 12 * L * d * d)) if bf16 else 0
    return batch_size * T * (L * per_block + head) + weight_copies


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
        dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}: "
          f"{name} ({param_count(config) / 1e6:.1f}M params), bf16 autocast, B=4, T={config.block_size}: "
          f"loss {loss.item():.4f} (ln V = {math.log(config.vocab_size):.4f}), "
          f"fwd+bwd {dt * 1e3:.1f} ms (measured), peak {peak:.2f} GiB (measured)")
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(config.vocab_size)) < 0.5
