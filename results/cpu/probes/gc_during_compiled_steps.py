# Probe: does Python's garbage collector run inside compiled training steps, and what does a
# collection cost there? As in the waterfall: an incumbent compiled and stepped, then a
# candidate compiled, then the two stepped in turn (A, B, A, B, ...) with every collection
# logged: first straight after the candidate's compile, as the capstones timed until now; then
# again after one full collection, as they time now (gc.collect(), then the collector off).
#   python results/cpu/probes/gc_during_compiled_steps.py   (from the repository root)
import gc
import sys
import time

import torch

sys.path.insert(0, ".")
from model_torch import GPT, GPTConfig

torch.manual_seed(0)
config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=512)
x = torch.randint(0, 512, (4, 128))
y = torch.randint(0, 512, (4, 128))
collections = []


def log(phase, info):
    if phase == "start":
        collections.append([info["generation"], time.perf_counter()])
    else:
        collections[-1][1] = time.perf_counter() - collections[-1][1]


def rung():
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return torch.compile(model), opt


def step(model, opt):
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def in_turn(incumbent, candidate, pairs, label):
    collections.clear()
    gc.callbacks.append(log)
    slowest = 0.0
    for _ in range(pairs):
        for trainer in (incumbent, candidate):
            start = time.perf_counter()
            step(*trainer)
            slowest = max(slowest, time.perf_counter() - start)
    gc.callbacks.remove(log)
    print(f"{label}: {pairs} pairs, the slowest step {slowest * 1e3:.1f} ms")
    for generation in (0, 1, 2):
        ms = sorted(seconds * 1e3 for g, seconds in collections if g == generation)
        if ms:
            print(f"  generation {generation}: {len(ms)} collections, median {ms[len(ms) // 2]:.2f} ms, "
                  f"longest {ms[-1]:.2f} ms")
        else:
            print(f"  generation {generation}: none")


print(f"torch {torch.__version__}, python {sys.version.split()[0]}, gc thresholds {gc.get_threshold()}")
incumbent = rung()
for _ in range(3):
    step(*incumbent)
candidate = rung()
step(*candidate)  # its compile
step(*candidate)
in_turn(incumbent, candidate, 20, "straight after the candidate's compile")
print(f"objects the collector tracks: {len(gc.get_objects()):,}")
start = time.perf_counter()
gc.collect()
print(f"a full collection: {(time.perf_counter() - start) * 1e3:.1f} ms")
in_turn(incumbent, candidate, 20, "after a full collection")
