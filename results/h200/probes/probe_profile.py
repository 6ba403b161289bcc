# Probe: where the torch capstone's final step spends its time (gpt2, vocab 50304, B=64 x T=1024,
# bf16 autocast, SDPA, fused AdamW, torch.compile, no per-step sync). Kernel time by category
# from torch.profiler, for flash and cuDNN attention; then both timed in interleaved reps.
import sys, time, statistics, torch
sys.path.insert(0, ".")
from model_torch import GPT, GPTConfig, flops_per_token, param_count
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.profiler import profile, ProfilerActivity
import torch._inductor.config
torch._inductor.config.force_disable_caches = True  # the cache key ignores the SDPA backend (pytorch#185449)
import torch.nn.functional as F
dev = torch.device("cuda"); torch.set_float32_matmul_precision("high")
cfg50257 = GPTConfig.preset("gpt2", vocab_size=50257)
fpt = flops_per_token(cfg50257)
B, T = 64, 1024
g = torch.Generator().manual_seed(0)
xs = [torch.randint(0, 50257, (B, T + 1), generator=g).to(dev) for _ in range(4)]
BACK = dict(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION)

# attention alone at the run's shape: fwd+bwd per layer
q, k, v = (torch.randn(B, 12, T, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dy = torch.randn(B, 12, T, 64, device=dev, dtype=torch.bfloat16)
for name, be in BACK.items():
    with sdpa_kernel([be]):
        ts = []
        for i in range(13):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.backward(dy); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    ms = statistics.median(ts[3:])
    causal_flops = 4 * B * 12 * T * T * 64 / 2 * 3.5  # fwd 2 matmuls + bwd 5 (2.5x fwd), causal half
    print(f"attention fwd+bwd {name:5s} B={B}: {ms:.2f} ms/layer x 12 = {12 * ms:.1f} ms/step, "
          f"{causal_flops / ms / 1e9:.0f} TFLOP/s on the causal half", flush=True)
del q, k, v, dy, y

def cat(n):
    n = n.lower()
    for c, keys in [("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
                    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm100")),
                    ("optimizer", ("adam",)), ("loss (fused CE)", ("log_softmax", "nll", "cross_entropy")),
                    ("layernorm", ("layer_norm",)), ("gelu", ("gelu", "tanh")),
                    ("embedding", ("embedding", "index", "scatter")), ("copy/fill", ("memcpy", "memset", "copy", "fill"))]:
        if any(k in n for k in keys):
            return c
    return "other triton" if n.startswith("triton") else "other"

def build(backend, detach=True):
    """detach=True: model_torch as committed (logits returned detached when targets are given);
    False: the loss computed outside the model, so the compiled graph returns logits that require grad."""
    torch._dynamo.reset(); torch.manual_seed(0)
    with torch.device(dev): m = GPT(GPTConfig.preset("gpt2", vocab_size=50304))
    opt = m.configure_optimizer(fused=True)
    if detach:
        cm = torch.compile(m)
    else:
        def fwd(x, y):
            logits, _ = m(x)
            return logits, F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        cm = torch.compile(fwd)
    def step(i):
        with sdpa_kernel([BACK[backend]]):
            x = xs[i % 4]
            with torch.autocast("cuda", torch.bfloat16):
                _, loss = cm(x[:, :-1], x[:, 1:])
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        return loss
    t0 = time.perf_counter()
    for i in range(3): step(i).item()
    print(f"[{backend}, detach={detach}] compile + 3 steps {time.perf_counter() - t0:.0f} s, loss {step(3).item():.4f}", flush=True)
    return step

def profile_steps(step, backend, n=3):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n): step(i)
        torch.cuda.synchronize()
    per, kern = {}, []
    for e in prof.key_averages():
        t = e.self_device_time_total / 1e3 / n  # ms per step
        if t <= 0: continue
        per[cat(e.key)] = per.get(cat(e.key), 0) + t; kern.append((t, e.count // n, e.key))
    tot = sum(per.values())
    print(f"[{backend}] kernel time per step (profiled, {n} steps): {tot:.1f} ms")
    for c, t in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"   {c:18s} {t:7.1f} ms  {t / tot:5.1%}")
    mm = 6 * param_count(GPTConfig.preset("gpt2", vocab_size=50304), position=False) * B * T
    print(f"   matmul FLOPs (6N, vocab 50304) / matmul kernel time = {mm / (per.get('matmul', 1) / 1e3) / 1e12:.0f} TFLOP/s")
    print("   top kernels (ms/step, calls/step):")
    for t, c, k in sorted(kern, reverse=True)[:16]:
        print(f"   {t:7.2f} {c:4d}  {cat(k):14s} {k[:110]}")

def time_steps(step, n=25):
    evs = []
    for i in range(n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); loss = step(i); e1.record(); evs.append((e0, e1))
        if (i + 1) % 5 == 0: loss.item()
    torch.cuda.synchronize()
    ev = [a.elapsed_time(b) for a, b in evs[2:]]
    return statistics.median(ev), min(ev), max(ev)

steps = {"flash, logits with grad (before)": build("flash", detach=False),
         "flash, logits detached": build("flash"),
         "cudnn, logits detached (now)": build("cudnn")}
for b, s in steps.items():
    profile_steps(s, b)
for rep in range(2):
    for b, s in steps.items():
        med, lo, hi = time_steps(s)
        p = torch.cuda.power_draw() / 1e3
        print(f"rep {rep} {b:34s}: {med:6.1f} ms/step (min {lo:.1f}, max {hi:.1f}), MFU {fpt * B * T / (med / 1e3) / 989e12:.1%}, "
              f"power {p:.0f} W, SM clock {torch.cuda.clock_rate()} MHz", flush=True)
