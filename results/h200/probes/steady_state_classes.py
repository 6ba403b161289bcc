# Probe: the final rungs of both capstones, class by class, in the steady state. The
# capstones' floor tables profile one step alone (after ~2 s of untimed steps); a step timed
# in a run of steps may not match it: the host's work before a lone step's first kernel shows
# as idle, and a card at its power cap sets its clock by how busy it has been. Here each
# framework's final rung (its settings from the file given), built and compiled as its
# capstone does, runs ~2 s untimed, is timed as its capstone times it (8 calls of 4 steps),
# then 8 steps are profiled at once and split by class as the capstone splits them, per step.
#   python .probes/steady_state_classes.py torch results/h100/07_capstone_torch_final_rung.json
#   python .probes/steady_state_classes.py jax results/h100/07_capstone_jax_final_rung.json
import contextlib, importlib, json, statistics, sys, threading, time
sys.path.insert(0, ".")


class Clocks:
    """NVML's SM clock (MHz) and power (W), sampled every 10 ms while inside `with`."""
    def __init__(self):
        import pynvml
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def __enter__(self):
        self.samples = []
        self.running = True
        self.thread = threading.Thread(target=self.sample)
        self.thread.start()
        return self

    def sample(self):
        while self.running:
            mhz = self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)
            watts = self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3
            self.samples.append((mhz, watts))
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        reasons = self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle)
        mhz = [m for m, w in self.samples]
        watts = [w for m, w in self.samples]
        print(f"  NVML over {len(self.samples)} samples: SM clock median "
              f"{statistics.median(mhz):.0f} MHz [{min(mhz)}, {max(mhz)}], power median "
              f"{statistics.median(watts):.0f} W [{min(watts):.0f}, {max(watts):.0f}], "
              f"throttle reasons at the end {reasons:#x}")


def clocks():
    try:
        return Clocks()
    except Exception as error:  # no NVML (a CPU)
        print("no NVML:", error)
        return contextlib.nullcontext()

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
if framework == "jax":
    shared.host_batch(len(trainer.losses) + 4 * 8 + 8)
with clocks():
    seconds = cap.interleaved([lambda: cap.run_steps(trainer, 4, shared)], 8)[0]
ms = [s / 4 * 1e3 for s in seconds]
print(f"timed: {statistics.median(ms):.1f} ms/step [{min(ms):.1f}, {max(ms):.1f}] "
      f"(8 calls of 4 steps)")
STEPS = 8
with clocks():
    if framework == "jax":
        instructions = cap.program_instructions(trainer.compiled)
        split, wall, unmatched = cap.profile_split(
            lambda: cap.run_steps(trainer, STEPS, shared), instructions, 1)
    else:
        split, wall, ops = cap.profile_split(lambda: cap.run_steps(trainer, STEPS, shared),
                                             shared.device)
print(f"{STEPS} steps profiled at once: {wall * 1e3 / STEPS:.2f} ms a step; by class, "
      f"ms a step:")
for cls, seconds in split.items():
    print(f"  {cls:24s} {seconds * 1e3 / STEPS:7.2f}")
print(f"  kernels (all but idle)   {(wall - split['idle']) * 1e3 / STEPS:7.2f}")
