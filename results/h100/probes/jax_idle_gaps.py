# Probe: where is the JAX final step's idle time? Its kernels add up to ~122 ms against a
# timed ~131 ms a step, torch's to ~121 against ~123. The final rung (settings from the file
# given), as the capstone builds and compiles it, and the same with buffer donation: each
# timed in windows of 4 steps as the capstone times it, then 8 steps traced at once (the
# steady state, not one step alone): the gaps between consecutive kernels on the GPU's stream,
# by size, the largest with the kernels on either side, and the host's busiest events.
#   python .probes/jax_idle_gaps.py results/h100/07_capstone_jax_final_rung.json
import collections, importlib, json, statistics, sys, time
sys.path.insert(0, ".")

final_file = sys.argv[1]
sys.argv = sys.argv[:1]
cap = importlib.import_module("07_capstone_jax")
shared, facts = cap.setup(cap.parse_args())
settings = dict(cap.BASELINE, **json.load(open(final_file))["settings"])
print("final rung settings:", settings)
STEPS = 8
trainers = []
for label, donate in (("as run (donate %s)" % settings["donate"], settings["donate"]),
                      ("with buffer donation", True)):
    trainer = cap.build(dict(settings, donate=donate), shared, 1, label)
    cap.compile_step(trainer, shared)
    cap.run_steps(trainer, 2, shared)
    trainers.append(trainer)
start = time.perf_counter()
while time.perf_counter() - start < 2.0:
    for trainer in trainers:
        cap.run_steps(trainer, 4, shared)
calls = []
for trainer in trainers:
    shared.host_batch(len(trainer.losses) + 4 * 8)
    calls.append(lambda t=trainer: cap.run_steps(t, 4, shared))
seconds = cap.interleaved(calls, 8)
for trainer, samples in zip(trainers, seconds):
    ms = [s / 4 * 1e3 for s in samples]
    print(f"{trainer.name}: timed {statistics.median(ms):.1f} ms/step "
          f"[{min(ms):.1f}, {max(ms):.1f}] (8 windows of 4 steps)")

for trainer in trainers:
    shared.host_batch(len(trainer.losses) + STEPS)
    wall, events = cap.trace_events(lambda: cap.run_steps(trainer, STEPS, shared))
    kernels = sorted(cap.device_events(events), key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in kernels) / 1e3 / STEPS
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / 1e3 / STEPS
    print(f"\n{trainer.name}: {STEPS} steps traced at once: {wall * 1e3 / STEPS:.1f} ms a "
          f"step of wall, first kernel to last {span:.1f} ms a step, kernels busy "
          f"{busy:.1f} ms a step, {len(kernels) / STEPS:.0f} kernels a step")
    gaps = []
    for before, after in zip(kernels, kernels[1:]):
        gap = after["ts"] - (before["ts"] + before["dur"])
        gaps.append((gap, before["name"], after["name"]))
    bins = [(0, 5), (5, 20), (20, 100), (100, 1000), (1000, 1e12)]
    for low, high in bins:
        inside = [g for g, _, _ in gaps if low <= g < high]
        print(f"  gaps of {low}-{high:.0f} us: {len(inside) / STEPS:7.1f} a step, "
              f"{sum(inside) / 1e3 / STEPS:6.2f} ms a step")
    print("  the 12 largest gaps (us: the kernel before -> the kernel after)")
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"    {gap:9.1f}: {before[:60]} -> {after[:60]}")
    names = collections.Counter()
    totals = collections.Counter()
    for before, after in zip(kernels, kernels[1:]):
        gap = after["ts"] - (before["ts"] + before["dur"])
        if gap >= 20:
            names[after["name"][:50]] += 1
            totals[after["name"][:50]] += gap
    print("  gaps >= 20 us by the kernel that follows (count a step, ms a step)")
    for name, total in totals.most_common(10):
        print(f"    {names[name] / STEPS:5.1f} {total / 1e3 / STEPS:6.2f}  {name}")
    host = collections.Counter()
    count = collections.Counter()
    device = {(e.get("pid"), e.get("tid")) for e in kernels}
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) not in device:
            host[e["name"][:70]] += e.get("dur", 0)
            count[e["name"][:70]] += 1
    print("  the host's events, by total time (count a step, ms a step)")
    for name, total in host.most_common(15):
        print(f"    {count[name] / STEPS:7.1f} {total / 1e3 / STEPS:7.2f}  {name}")
