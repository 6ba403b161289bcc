# Probe: Inductor reduction knobs on the torch capstone's final rung (gpt2, vocab 50304,
# B=64 x T=1024, bf16 autocast, flash SDPA, torch.compile, fused AdamW). Each variant: fresh
# compile, 3 warm-up steps, 5 windows of 5 steps (CUDA-synchronised), median; then a profile
# of 3 steps: the kernels of the loss and the LayerNorms, ms per step.
import os, statistics, sys, time
sys.path.insert(0, ".")
import torch
import torch.nn.functional as F
import torch._inductor.config as icfg
import model_torch
from model_torch import GPT, GPTConfig, flops_per_token

dev = torch.device("cuda")
torch.set_float32_matmul_precision("high")
icfg.force_disable_caches = True
FPT = flops_per_token(GPTConfig.preset("gpt2", vocab_size=50257))
gen = torch.Generator().manual_seed(0)
DATA = [torch.randint(0, 50257, (64, 1025), generator=gen).to(dev) for _ in range(4)]
PLAIN_CE = F.cross_entropy

def bf16_ce(logits, targets, *a, **k):  # the model calls it on logits.float(): undo the upcast
    return PLAIN_CE(logits.to(torch.bfloat16), targets, *a, **k)

def run(label, persistent=True, cdt=False, bf16_loss=False, profile=False):
    torch._dynamo.reset()
    icfg.triton.persistent_reductions = persistent
    icfg.coordinate_descent_tuning = cdt
    model_torch.F.cross_entropy = bf16_ce if bf16_loss else PLAIN_CE
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(GPTConfig.preset("gpt2", vocab_size=50304))
    opt = model.configure_optimizer(lr=6e-4, weight_decay=0.1, fused=True)
    cmodel = torch.compile(model)
    def step(i):
        x = DATA[i % 4]
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = cmodel(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    t0 = time.perf_counter()
    for i in range(3):
        step(i).item()
    compile_s = time.perf_counter() - t0
    windows, i = [], 3
    for w in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        losses = [step(i + k) for k in range(5)]
        torch.cuda.synchronize()
        windows.append((time.perf_counter() - t) / 5)
        i += 5
    ms = statistics.median(windows) * 1e3
    tps = 64 * 1024 / (ms / 1e3)
    print(f"{label:40s} {ms:7.1f} ms/step [{min(windows)*1e3:.1f}, {max(windows)*1e3:.1f}] "
          f"{tps:10,.0f} tok/s  MFU {FPT * tps / 989e12:5.1%}  compile+3 {compile_s:4.0f} s  "
          f"loss@{i} {losses[-1].item():.4f}", flush=True)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for k in range(3):
                step(i + k)
            torch.cuda.synchronize()
        ka = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in ka) / 3e3
        print(f"   kernel time {total:.1f} ms/step; top kernels (ms/step, calls/step):")
        for e in ka[:14]:
            print(f"   {e.device_time_total / 3e3:7.2f} {e.count // 3:4d}  {e.key[:110]}")
    del cmodel, model, opt
    torch.cuda.empty_cache()

print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
run("final rung", profile=True)
run("persistent_reductions=False", persistent=False, profile=True)
run("bf16 logits into the loss", bf16_loss=True, profile=True)
run("coordinate_descent_tuning", cdt=True)
run("final rung (again)")
