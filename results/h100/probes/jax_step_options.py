# Probe: where does the JAX capstone's final step lose to torch's (idle between kernels,
# matmul kernels), and does any of XLA's own options close it? The final rung (its settings
# from results/<card>/07_capstone_jax_final_rung.json) compiled once per option set, the
# compiled programs' GEMM and command-buffer counts, the steps timed in turn (A, B, C, ...,
# after ~2 s of untimed steps of all of them), one profiled step each split by class as the
# capstone splits it, and every variant's losses against the first's (the same batches).
# Then the matmul roof as the capstone measures it (a burst after 100 ms idle) beside the
# same matmul sustained (3 s back to back first, as a training step runs at its power cap).
#   python .probes/jax_step_options.py results/h100/07_capstone_jax_final_rung.json
import importlib, json, re, statistics, sys, time
sys.path.insert(0, ".")
import jax
import jax.numpy as jnp

final_file = sys.argv[1]
sys.argv = sys.argv[:1]
cap = importlib.import_module("07_capstone_jax")
args = cap.parse_args()
shared, facts = cap.setup(args)
device = shared.devices[0]
settings = dict(cap.BASELINE, **json.load(open(final_file))["settings"])
print("final rung settings:", settings)

base = cap.xla_options(device, settings["triton_gemm"])
VARIANTS = [
    ("as the capstone compiles it", dict(base)),
    ("cuBLASLt on", dict(base, xla_gpu_enable_cublaslt=True)),
    ("cuBLASLt off", dict(base, xla_gpu_enable_cublaslt=False)),
    ("autotune level 4 (XLA's default)", dict(base, xla_gpu_autotune_level=4)),
    ("cuDNN LayerNorm", dict(base, xla_gpu_enable_cudnn_layer_norm=True)),
    ("command buffers off", dict(base, xla_gpu_enable_command_buffer="")),
    ("command buffers from 1 op", dict(base, xla_gpu_graph_min_graph_size=1)),
]

trainers = []
for label, options in VARIANTS:
    trainer = cap.build(settings, shared, 1, label)
    x, y = jax.device_put(shared.host_batch(0), trainer.rows)
    start = time.perf_counter()
    try:
        lowered = jax.jit(trainer.step, donate_argnums=(0,)).lower(trainer.state, x, y)
        compiled = lowered.compile(options)
    except Exception as e:  # an option this XLA does not know, or cannot parse
        print(f"{label}: not compiled: {type(e).__name__}: {str(e)[:300]}")
        continue
    text = compiled.as_text()
    trainer.step = compiled
    trainer.compiled = text
    buffers = cap.count_lines(r"= .*command_buffer", text)
    fusions = cap.count_lines(r"^\s*(?:ROOT )?%?[\w.-]+ = \S+ fusion\(", text)
    epilogues = sorted(set(re.findall(r"epilogue\W+(\w+)", text)))
    print(f"{label}: compiled in {time.perf_counter() - start:.1f} s; "
          f"cublasLt calls {text.count('__cublas$lt$matmul')}, "
          f"cuBLAS gemm calls {text.count('__cublas$gemm')}, "
          f"triton gemms {text.count('__triton_gemm')}, "
          f"cuDNN norm calls {text.count('__cudnn$norm')}, "
          f"cuDNN fmha calls {text.count('__cudnn$fmha')}, "
          f"command buffers {buffers}, fusions {fusions}, epilogues {epilogues}", flush=True)
    cap.run_steps(trainer, 2, shared)
    trainers.append(trainer)

# ~2 s of untimed steps, all variants in turn, then the timed rounds
start = time.perf_counter()
while time.perf_counter() - start < 2.0:
    for trainer in trainers:
        cap.run_steps(trainer, 1, shared)
STEPS = 4
ROUNDS = 8
calls = []
for trainer in trainers:
    shared.host_batch(len(trainer.losses) + STEPS * ROUNDS)
    calls.append(lambda t=trainer: cap.run_steps(t, STEPS, shared))
seconds = cap.interleaved(calls, ROUNDS)
first_ms = [s / STEPS * 1e3 for s in seconds[0]]
print(f"\ntimed in turn, {ROUNDS} rounds of {STEPS} steps each (ms/step: median [min, max]; "
      f"ratio: per-round speed-up over the first, median [min, max])")
for trainer, samples in zip(trainers, seconds):
    ms = [s / STEPS * 1e3 for s in samples]
    ratios = [a / b for a, b in zip(first_ms, ms)]
    print(f"  {trainer.name:34s} {statistics.median(ms):7.1f} [{min(ms):.1f}, {max(ms):.1f}]"
          f"  {statistics.median(ratios):.3f}x [{min(ratios):.3f}, {max(ratios):.3f}]")

print("\none profiled step each (ms by class, as the capstone splits them)")
for trainer in trainers:
    cap.run_steps(trainer, 2, shared)
    instructions = cap.program_instructions(trainer.compiled)
    split, wall, unmatched = cap.profile_split(lambda: cap.run_steps(trainer, 1, shared),
                                               instructions, 1)
    parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in split.items() if v)
    print(f"  {trainer.name:34s} step {wall * 1e3:.1f}: {parts} (unmatched {unmatched * 1e3:.2f})",
          flush=True)

print("\nlosses: every variant's against the first's, step by step (the same batches)")
reference = trainers[0].losses
for trainer in trainers[1:]:
    n = min(len(reference), len(trainer.losses))
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference[:n], trainer.losses[:n]))
    print(f"  {trainer.name:34s} {n} steps, largest relative difference {worst:.2e}")

# The matmul roof: a burst after 100 ms idle (the capstone's way) and sustained
del trainers, calls
n = shared.sizes.peak_size
a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16), device)
b = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16), device)
matmul = jax.jit(jnp.matmul).lower(a, b).compile(cap.xla_options(device))
flops = 2 * n**3
try:
    import pynvml as nv
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    def card():
        return (f"SM {nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)} MHz, "
                f"{nv.nvmlDeviceGetPowerUsage(handle) / 1e3:.0f} W, throttle "
                f"{nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle):#x}")
except Exception as e:
    missing = f"(no NVML: {e})"
    def card():
        return missing
for rep in range(2):
    time.sleep(5)  # a cool card, as after a compile
    burst = [flops / cap.burst_seconds(lambda: matmul(a, b)) / 1e12 for _ in range(10)]
    print(f"\nmatmul {n} bf16, burst after 100 ms idle (10 samples): median "
          f"{statistics.median(burst):.0f} TFLOP/s [{min(burst):.0f}, {max(burst):.0f}]; {card()}")
    start = time.perf_counter()
    while time.perf_counter() - start < 3.0:
        cap.sync([matmul(a, b) for _ in range(20)][-1])
    print(f"after 3 s back to back: {card()}")
    sustained = []
    for _ in range(10):
        t0 = time.perf_counter()
        out = None
        for _ in range(40):
            out = matmul(a, b)
        cap.sync(out)
        sustained.append(flops * 40 / (time.perf_counter() - t0) / 1e12)
    print(f"sustained, 10 samples of 40 back to back: median {statistics.median(sustained):.0f} "
          f"TFLOP/s [{min(sustained):.0f}, {max(sustained):.0f}]; {card()}")
