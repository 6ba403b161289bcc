# A/B: the final torch capstone config on byte-level ids (< 256, the offline fallback) vs ids spread over GPT-2's vocab
import sys, time, statistics, torch
sys.path.insert(0, ".")
from model_torch import GPT, GPTConfig, flops_per_token
from torch.nn.attention import sdpa_kernel, SDPBackend
dev = torch.device("cuda"); torch.set_float32_matmul_precision("high")
fpt = flops_per_token(GPTConfig.preset("gpt2", vocab_size=50257))
B, T = 64, 1024
g = torch.Generator().manual_seed(0)
data = {"bytes (ids < 256)": [torch.randint(0, 256, (B, T + 1), generator=g).to(dev) for _ in range(4)],
        "spread (ids < 50257)": [torch.randint(0, 50257, (B, T + 1), generator=g).to(dev) for _ in range(4)]}
torch.manual_seed(0)
with torch.device(dev): m = GPT(GPTConfig.preset("gpt2", vocab_size=50304))
opt = m.configure_optimizer(fused=True); cm = torch.compile(m)
def steps(xs, n):
    ts = []
    for i in range(n):
        x = xs[i % 4]; torch.cuda.synchronize(); s = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = cm(x[:, :-1], x[:, 1:])
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True); loss.item(); torch.cuda.synchronize()
        ts.append(time.perf_counter() - s)
    return ts
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    steps(data["bytes (ids < 256)"], 3)
    for rep in range(3):
        for k, xs in data.items():
            ms = statistics.median(steps(xs, 12)) * 1e3
            print(f"{k:22s} rep {rep}: {ms:6.1f} ms/step, MFU {fpt * B * T / (ms / 1e3) / 989e12:.1%}", flush=True)
    # the embedding backward alone: 65536 ids scattered into the 50304 x 768 table
    w = torch.randn(50304, 768, device=dev, requires_grad=True)
    for k, xs in data.items():
        ids = xs[0][:, :-1]; gout = torch.randn(B, T, 768, device=dev)
        for i in range(13):
            if i == 3: torch.cuda.synchronize(); s = time.perf_counter()
            torch.nn.functional.embedding(ids, w).backward(gout); w.grad = None
        torch.cuda.synchronize(); print(f"embedding backward, {k}: {(time.perf_counter() - s) / 10 * 1e3:.2f} ms", flush=True)
