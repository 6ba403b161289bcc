# Probe: does Python's garbage collector run inside compiled training steps, and what does a
# full collection cost once torch.compile has built a few models? Three small GPTs compiled and
# stepped in turn (as the waterfall alternates rungs), 200 steps, every collection logged.
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


def step(model, opt):
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


rungs = []
for _ in range(3):
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model)
    step(compiled, opt)
    step(compiled, opt)
    rungs.append((compiled, opt))
print(f"torch {torch.__version__}, python {sys.version.split()[0]}, gc thresholds {gc.get_threshold()}")
print(f"objects the collector tracks: {len(gc.get_objects()):,}")
for _ in range(3):
    start = time.perf_counter()
    gc.collect()
    print(f"a full collection: {(time.perf_counter() - start) * 1e3:.1f} ms")

collections = []


def log(phase, info):
    if phase == "start":
        collections.append([info["generation"], time.perf_counter()])
    else:
        collections[-1][1] = time.perf_counter() - collections[-1][1]


gc.callbacks.append(log)
for i in range(200):
    step(*rungs[i % 3])
gc.callbacks.remove(log)
for generation in (0, 1, 2):
    ms = sorted(seconds * 1e3 for g, seconds in collections if g == generation)
    if ms:
        print(f"generation {generation}: {len(ms)} collections in 200 steps, "
              f"median {ms[len(ms) // 2]:.2f} ms, longest {ms[-1]:.2f} ms")
    else:
        print(f"generation {generation}: no collection in 200 steps")
