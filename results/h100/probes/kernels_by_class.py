# Probe: a capstone's final rung, class by class and kernel by kernel, with the capstone's
# classes (JAX's as of the commit that stopped booking a GELU's backward as matmul). Each
# rung (its settings from the file given), built and compiled as its capstone does, runs
# ~2 s untimed, then 4 steps are profiled at once; for each class its ms a step and its
# largest kernels by name: count and ms a step, and (JAX) the start of the XLA instruction.
# JAX's compiled program is written to jax_final_rung_hlo.txt (its fusions, read offline).
#   python .probes/kernels_by_class.py torch results/h100/probes/torch_final_rung_fused_adamw.json
#   python .probes/kernels_by_class.py jax results/h100/07_capstone_jax_final_rung.json
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

kernels = collections.defaultdict(lambda: [0, 0.0, ""])  # (class, name): count, us, computes
if framework == "jax":
    instructions = cap.program_instructions(trainer.compiled)
    with open("jax_final_rung_hlo.txt", "w") as f:  # the compiled program, to read offline
        f.write(trainer.compiled)
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
        key = (cap.kernel_class(e["name"], computes), e["name"])
        kernels[key][0] += 1
        kernels[key][1] += e["dur"]
        kernels[key][2] = computes.split("\n")[0].strip()
else:
    from torch.profiler import profile, ProfilerActivity, DeviceType
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        cap.run_steps(trainer, STEPS, shared)
        cap.sync(shared.device)
        wall = time.perf_counter() - start
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            key = (cap.kernel_class(e.name), e.name)
            kernels[key][0] += 1
            kernels[key][1] += e.time_range.elapsed_us()
busy = sum(us for count, us, computes in kernels.values())
print(f"{STEPS} steps profiled at once: {wall * 1e3 / STEPS:.2f} ms a step, kernels "
      f"{busy / 1e3 / STEPS:.2f} ms a step, idle {(wall * 1e6 - busy) / 1e3 / STEPS:.2f}")
for cls in cap.CLASSES:
    mine = [(name, v) for (c, name), v in kernels.items() if c == cls]
    if not mine:
        continue
    total = sum(v[1] for name, v in mine)
    print(f"{cls}: {total / 1e3 / STEPS:.2f} ms a step, {len(mine)} kernel names; the largest:")
    for name, (count, us, computes) in sorted(mine, key=lambda kv: -kv[1][1])[:30]:
        print(f"  {count / STEPS:5.1f} a step {us / 1e3 / STEPS:7.2f} ms a step "
              f"{us / count:8.1f} us each  {name[:110]}")
        if computes:
            print(f"      {computes[:230]}")
