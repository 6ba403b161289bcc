# Probe: final torch capstone config (gpt2, vocab 50304, B=64 x T=1024, bf16, flash, fused AdamW, compile)
import sys, time, statistics, torch, numpy as np
sys.path.insert(0, ".")
from model_torch import GPT, GPTConfig, flops_per_token
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch._inductor.config as icfg
dev = torch.device("cuda"); torch.set_float32_matmul_precision("high")
fpt = flops_per_token(GPTConfig.preset("gpt2", vocab_size=50257))
B, T = 64, 1024
g = torch.Generator().manual_seed(0)
xs = [torch.randint(0, 50257, (B, T + 1), generator=g).to(dev) for _ in range(4)]
def run(label, mode=None, backend=SDPBackend.FLASH_ATTENTION, steps=15, nosync=False, cdt=False):
    torch._dynamo.reset(); icfg.coordinate_descent_tuning = cdt
    torch.manual_seed(0)
    with torch.device(dev): m = GPT(GPTConfig.preset("gpt2", vocab_size=50304))
    opt = m.configure_optimizer(fused=True)
    cm = torch.compile(m, mode=mode)
    t0 = time.perf_counter(); times = []; evs = []
    with sdpa_kernel([backend]):
        for i in range(steps + 2):
            x = xs[i % 4]
            s = time.perf_counter()
            e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True); e0.record()
            with torch.autocast("cuda", torch.bfloat16):
                _, loss = cm(x[:, :-1], x[:, 1:])
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True); e1.record(); evs.append((e0, e1))
            if not nosync or i < 2:
                loss.item(); torch.cuda.synchronize()
                times.append(time.perf_counter() - s)
            if i == 1: comp = time.perf_counter() - t0
        torch.cuda.synchronize()
    ev = [a.elapsed_time(b) / 1e3 for a, b in evs[2:]]
    ms = statistics.median(times[2:]) * 1e3 if not nosync else statistics.median(ev) * 1e3
    p = torch.cuda.power_draw() / 1e3 if hasattr(torch.cuda, "power_draw") else -1
    print(f"{label:40s} {ms:7.1f} ms/step (event median {statistics.median(ev)*1e3:.1f}, min {min(ev)*1e3:.1f}) "
          f"MFU {fpt * B * T / (ms / 1e3) / 989e12:.1%}  compile+2 steps {comp:.0f}s  power {p:.0f} W clock {torch.cuda.clock_rate()} MHz", flush=True)
    del cm, m, opt; torch.cuda.empty_cache()
run("default")
run("default, no per-step sync", nosync=True)
run("cudnn attention", backend=SDPBackend.CUDNN_ATTENTION)
run("coordinate_descent_tuning", cdt=True)
run("max-autotune-no-cudagraphs", mode="max-autotune-no-cudagraphs")
