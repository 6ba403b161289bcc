# Probe: the roofs the capstones' floor tables divide by are bursts taken on a cool card
# (>= 5 ms of calls after 100 ms idle). A training step runs for seconds at the card's power
# cap. The same 8192^3 bf16 matmul and the same 1 GiB copy measured both ways, then GPT-2's
# own GEMM shapes (64 x 1024 rows: the attention's and the MLP's projections and the
# 50304-wide head) sustained, with the SM clock, power and throttle reasons from NVML.
#   python .probes/matmul_sustained_torch.py   (one GPU)
import math, statistics, time
import pynvml as nv
import torch

nv.nvmlInit()
handle = nv.nvmlDeviceGetHandleByIndex(0)
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), torch.__version__)


def card():
    return (f"SM {nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)} MHz, "
            f"{nv.nvmlDeviceGetPowerUsage(handle) / 1e3:.0f} W, throttle "
            f"{nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle):#x}")


def burst(fn):  # the capstones' burst_seconds
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = math.ceil(0.005 / (time.perf_counter() - start))
    time.sleep(0.1)
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def sustained(fn, warm_s=3.0, samples=10, calls=40):
    start = time.perf_counter()
    while time.perf_counter() - start < warm_s:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    seconds = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        seconds.append((time.perf_counter() - t0) / calls)
    return seconds


def show(label, work, unit, scale, seconds):
    rates = [work / s / scale for s in seconds]
    print(f"  {label:44s} median {statistics.median(rates):6.0f} {unit} "
          f"[{min(rates):.0f}, {max(rates):.0f}]; {card()}", flush=True)


n = 8192
a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
source = torch.empty(2**28, device=dev)  # 1 GiB of fp32
target = torch.empty_like(source)
for rep in range(2):
    print(f"round {rep + 1}: 5 s idle first; {card()}")
    time.sleep(5)
    show("matmul 8192^3 bf16, burst (10 samples)", 2 * n**3, "TFLOP/s", 1e12,
         [burst(lambda: a @ b) for _ in range(10)])
    show("matmul 8192^3 bf16, sustained after 3 s", 2 * n**3, "TFLOP/s", 1e12,
         sustained(lambda: a @ b))
    time.sleep(5)
    show("copy 1 GiB, burst (10 samples)", 2 * source.nbytes, "GB/s", 1e9,
         [burst(lambda: target.copy_(source)) for _ in range(10)])
    show("copy 1 GiB, sustained after 3 s", 2 * source.nbytes, "GB/s", 1e9,
         sustained(lambda: target.copy_(source), calls=20))

print("GPT-2's GEMMs at 64 x 1024 rows, bf16, sustained after 3 s (forward shapes)")
rows = 64 * 1024
for name, k, m in (("attention qkv 768 -> 2304", 768, 2304), ("attention proj 768 -> 768", 768, 768),
                   ("mlp fc 768 -> 3072", 768, 3072), ("mlp proj 3072 -> 768", 3072, 768),
                   ("head 768 -> 50304", 768, 50304)):
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(k, m, device=dev, dtype=torch.bfloat16)
    show(name, 2 * rows * k * m, "TFLOP/s", 1e12, sustained(lambda: x @ w, warm_s=2.0))
