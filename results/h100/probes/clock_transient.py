# Probe: why are the torch waterfall's compiled comparisons' 3rd candidate and 4th incumbent
# calls slow? Two compiled GPT-2 steps (bf16 autocast, SDPA, fused AdamW; vocab 50257 and
# 50304), timed in turn as the capstone does (after a fresh compile and a 0.15 s pause), with
# the SM clock, power and throttle reasons read from NVML after each call (outside its timing),
# the collector on, then off. If the slow calls meet a clock dip, it is the GPU settling.
#   python results/h100/probes/clock_transient.py   (from the repository root, one GPU; it ran
#   from a copy outside the repository, as the first line of clock_transient.txt shows)
import gc, sys, time
import pynvml as nv
import torch
sys.path.insert(0, ".")
from model_torch import GPT, GPTConfig

nv.nvmlInit()
handle = nv.nvmlDeviceGetHandleByIndex(0)
torch.set_float32_matmul_precision("high")
dev = torch.device("cuda")
B, T = 64, 1024
x = torch.randint(0, 50257, (B, T), device=dev)
y = torch.randint(0, 50257, (B, T), device=dev)


def trainer(vocab):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2", vocab_size=vocab)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    compiled = torch.compile(model)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return step


def state():
    return (nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),
            nv.nvmlDeviceGetPowerUsage(handle) / 1e3,
            nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def timed_pairs(a, b, pairs, label):
    print(label)
    for i in range(pairs):
        for name, fn in (("A", a), ("B", b)):
            start = time.perf_counter()
            fn()
            ms = (time.perf_counter() - start) * 1e3
            mhz, watts, why = state()
            print(f"  pair {i} {name} {ms:7.1f} ms   SM {mhz} MHz  {watts:5.0f} W  throttle {why:#x}", flush=True)


a = trainer(50257)
for _ in range(3):
    a()
for collector in (True, False):
    b = trainer(50304)  # fresh compile: the GPU idles meanwhile, as before each rung
    for _ in range(3):
        b()
    time.sleep(0.15)
    a()
    if not collector:
        gc.collect()
        gc.disable()
    timed_pairs(a, b, 8, f"collector {'on' if collector else 'off'}, after a fresh compile:")
    gc.enable()
    time.sleep(20)  # idle, as a compile leaves it
    a()
    timed_pairs(a, b, 8, f"collector {'on' if collector else 'off'}, after 20 s idle:")
