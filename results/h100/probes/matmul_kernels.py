# Probe: the matmul class of a capstone's final rung, kernel by kernel. Both final rungs'
# matmuls do the same FLOPs; in the steady state JAX's took ~3.3 ms a step more than torch's
# (probes/final_rungs_alternated_*). Here each rung (its settings from the file given), built
# and compiled as its capstone does, runs ~2 s untimed, then 4 steps are profiled at once and
# the kernels its capstone classes as matmul are listed by name: count and ms a step, and
# (JAX) the instruction's result shape and operand layout from the compiled program.
#   python .probes/matmul_kernels.py torch results/h100/probes/torch_final_rung_fused_adamw.json
#   python .probes/matmul_kernels.py jax results/h100/07_capstone_jax_final_rung.json
import collections, importlib, json, sys, time
sys.path.insert(0, ".")

framework = sys.argv[1]
final_file = sys.argv[2]
sys.argv = sys.argv[:1] + sys.argv[3:]  # the capstone's own flags, if any
cap = importlib.import_module(f"07_capstone_{framework}")
shared, facts = cap.setup(cap.parse_args())
settings = dict(cap.BASELINE, **json.load(open(final_file))["settings"])
print(framework, "final rung settings:", settings)
trainer = cap.build(settings, shared, 1, "final rung")
if framework == "jax":
    cap.compile_step(trainer, shared)
cap.run_steps(trainer, 3, shared)  # torch compiles here
start = time.perf_counter()
while time.perf_counter() - start < 2.0:
    cap.run_steps(trainer, 4, shared)
STEPS = 4
if framework == "jax":
    shared.host_batch(len(trainer.losses) + STEPS)

kernels = collections.defaultdict(lambda: [0, 0.0, ""])  # name: count, us, what it computes
if framework == "jax":
    instructions = cap.program_instructions(trainer.compiled)
    wall, events = cap.trace_events(lambda: cap.run_steps(trainer, STEPS, shared))
    for e in cap.device_events(events):
        op = e.get("args", {}).get("hlo_op", "")
        computes = None
        if not op.startswith("command_buffer"):
            computes = instructions.get(op)
        if computes is None:
            computes = instructions.get(e["name"])
        if computes is None:
            computes = op
        if cap.kernel_class(e["name"], computes) == "matmul":
            kernels[e["name"]][0] += 1
            kernels[e["name"]][1] += e["dur"]
            kernels[e["name"]][2] = computes
else:
    from torch.profiler import profile, ProfilerActivity, DeviceType
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        cap.run_steps(trainer, STEPS, shared)
        cap.sync(shared.device)
        wall = time.perf_counter() - start
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and cap.kernel_class(e.name) == "matmul":
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.time_range.elapsed_us()
total = sum(us for count, us, computes in kernels.values())
print(f"{STEPS} steps profiled at once: {wall * 1e3 / STEPS:.2f} ms a step, matmul kernels "
      f"{total / 1e3 / STEPS:.2f} ms a step, {len(kernels)} kernel names")
for name, (count, us, computes) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
    print(f"  {count / STEPS:5.1f} a step {us / 1e3 / STEPS:7.2f} ms a step "
          f"{us / count:8.1f} us each  {name[:150]}")
    if computes:
        print(f"      {computes[:300]}")
