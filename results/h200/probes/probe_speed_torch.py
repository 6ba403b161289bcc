# Probe: levers on the torch capstone's final rung (gpt2, vocab 50304, B x T=1024, bf16
# autocast, SDPA, torch.compile, fused AdamW, host reads the loss every 5 steps).
# Each variant: fresh compile, 2 warm-up steps, 4 windows of 5 steps (CUDA-synchronised), median.
import contextlib, os, sys, time, statistics
sys.path.insert(0, ".")
import torch
import torch._inductor.config as icfg
from torch.nn.attention import sdpa_kernel, SDPBackend
from model_torch import GPT, GPTConfig, flops_per_token

dev = torch.device("cuda")
torch.set_float32_matmul_precision("high")
icfg.force_disable_caches = True
FPT = flops_per_token(GPTConfig.preset("gpt2", vocab_size=50257))
gen = torch.Generator().manual_seed(0)
DATA = [torch.randint(0, 50257, (128, 1025), generator=gen).to(dev) for _ in range(4)]

def run(label, batch=64, backend=None, mode=None, cdt=False, compile_opt=False):
    torch._dynamo.reset()
    icfg.coordinate_descent_tuning = cdt
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(GPTConfig.preset("gpt2", vocab_size=50304))
    opt = model.configure_optimizer(lr=6e-4, weight_decay=0.1, fused=True)
    cmodel = torch.compile(model, mode=mode)
    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    if compile_opt:
        opt_step = torch.compile(opt_step)
    def step(i):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        x = DATA[i % 4][:batch]
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = cmodel(x[:, :-1], x[:, 1:])
        loss.backward()
        opt_step()
        return loss.detach().clone()
    ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
    try:
        with ctx:
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
            last = losses[-1].item()
    except torch.OutOfMemoryError:
        print(f"{label:48s} OOM", flush=True)
        return
    finally:
        del cmodel, model, opt
        torch.cuda.empty_cache()
    ms = statistics.median(windows) * 1e3
    tps = batch * 1024 / (ms / 1e3)
    print(f"{label:48s} {ms:7.1f} ms/step [{min(windows)*1e3:.1f}, {max(windows)*1e3:.1f}] "
          f"{tps:10,.0f} tok/s  MFU {FPT * tps / 989e12:5.1%}  compile+3 {compile_s:4.0f} s  "
          f"loss@{i} {last:.4f}  peak {torch.cuda.max_memory_allocated() / 2**30:.0f} GiB",
          flush=True)
    torch.cuda.reset_peak_memory_stats()

which = sys.argv[1:] or ["all"]
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
V = {
    "flash": dict(),
    "cudnn": dict(backend=SDPBackend.CUDNN_ATTENTION),
    "flash+cudagraphs": dict(mode="reduce-overhead"),
    "cudnn+cudagraphs": dict(backend=SDPBackend.CUDNN_ATTENTION, mode="reduce-overhead"),
    "flash+compiled opt": dict(compile_opt=True),
    "flash B=128": dict(batch=128),
    "flash (again)": dict(),
}
for label, kw in V.items():
    if "all" in which or label in which:
        run(label, **kw)
