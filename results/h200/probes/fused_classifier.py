"""
Probe: does the fused classifier (GPTConfig.fused_classifier: the head and the loss chunk by
chunk, the B x T x V logits never written) pay for GPT-2 124M on one GPU, and at which chunk
size? One bf16 training step (forward, backward, AdamW) at batch 64 x 1024, vocabulary 50304,
in one micro-step, plain head against the fused head at each chunk size:

  torch: torch.compile of the model, fused AdamW, bf16 autocast (eager on a CPU)
  JAX:   jax.jit of the whole step with donation, bf16 compute dtype, cuDNN attention,
         cuBLAS for every matmul (Triton GEMMs off), autotune level 4: the capstone's best rung

Each row: ms/step (median of the timed steps, [min, max]), the compile (first step) time,
peak memory, and the loss against the plain head's on the same init and batch (first step,
and after all steps). Torch's peak is max_memory_allocated over the timed steps; JAX cannot
reset its peak, so its variants run smallest chunk first, plain last, and XLA's planned
bytes (arguments + outputs + temporaries, from memory_analysis) are printed beside it.

    python results/h200/probes/fused_classifier.py --out fused_classifier.json
    python results/h200/probes/fused_classifier.py --quick --out /tmp/fc.json   # a CPU, tiny
"""

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch runs first
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the model files

import numpy as np
import torch

import model_jax
import model_torch
from model_torch import GPT, GPTConfig


@dataclass
class Sizes:
    preset: str = "gpt2"
    batch: int = 64
    block_size: int = 1024
    chunks: tuple = (4096, 8192, 16384)  # tokens per chunk of the fused head
    warmup: int = 3   # untimed steps: the first compiles
    steps: int = 10   # timed steps


QUICK = Sizes(preset="tiny", batch=1, block_size=32, chunks=(24, 48), warmup=1, steps=2)


def torch_variant(sizes, chunk, init_state, x, y, device):
    """Train steps of one head (chunk None: the plain head): losses, ms per step, compile s,
    peak bytes."""
    fused = chunk is not None
    if fused:
        model_torch.CLASSIFIER_CHUNK = chunk
    config = GPTConfig.preset(sizes.preset, block_size=sizes.block_size, fused_classifier=fused)
    model = GPT(config).to(device)
    model.load_state_dict(init_state)
    optimizer = model.configure_optimizer(fused=device == "cuda")
    step_model = model
    if device == "cuda":
        step_model = torch.compile(model)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = step_model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses = []
    seconds = []
    for i in range(sizes.warmup + sizes.steps):
        if i == sizes.warmup and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses.append(step())
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = None
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    del model, step_model, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(losses=[float(loss) for loss in losses], step_s=seconds[sizes.warmup:],
                compile_s=seconds[0], peak_bytes=peak, planned_bytes=None)


def jax_variant(sizes, chunk, init_state, x, y, gpu):
    """The same for JAX: the capstone's best rung, plain or fused head."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    fused = chunk is not None
    if fused:
        model_jax.CLASSIFIER_CHUNK = chunk
    config = GPTConfig.preset(sizes.preset, block_size=sizes.block_size, fused_classifier=fused)
    dtype = jnp.float32  # a CPU has no bf16 matmul units
    attention = "xla"
    options = None
    if gpu:
        dtype = jnp.bfloat16
        attention = "cudnn"
        options = dict(xla_gpu_autotune_level=4, xla_gpu_enable_triton_gemm=False)
    abstract = nnx.eval_shape(lambda: model_jax.GPT(config, dtype, attn_impl=attention))
    graphdef, shapes = nnx.split(abstract)  # shapes only: torch's weights fill them
    model = nnx.merge(graphdef, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
    model_jax.from_torch(model, init_state)
    optimizer = nnx.Optimizer(model, model_jax.adamw(6e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    x = jnp.asarray(x.cpu().numpy().astype(np.int32))
    y = jnp.asarray(y.cpu().numpy().astype(np.int32))
    start = time.perf_counter()
    train_step = model_jax.make_train_step(graphdef, donate=True)
    program = train_step.lower(state, x, y).compile(options)
    compile_s = time.perf_counter() - start
    memory = program.memory_analysis()
    planned = None
    if memory is not None:
        planned = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                   + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
    losses = []
    seconds = []
    for i in range(sizes.warmup + sizes.steps):
        start = time.perf_counter()
        loss, state = program(state, x, y)
        losses.append(float(loss))  # waits for the step
        seconds.append(time.perf_counter() - start)
    stats = jax.devices()[0].memory_stats() or {}
    del state
    return dict(losses=losses, step_s=seconds[sizes.warmup:], compile_s=compile_s,
                peak_bytes=stats.get("peak_bytes_in_use"), planned_bytes=planned)


def row(framework, chunk, result, plain):
    ms = [s * 1e3 for s in result["step_s"]]
    name = "plain head"
    if chunk is not None:
        name = f"fused, {chunk} tokens/chunk"
    peak = "n/a"
    if result["peak_bytes"] is not None:
        peak = f"{result['peak_bytes'] / 2**30:5.1f} GiB"
    planned = ""
    if result["planned_bytes"] is not None:
        planned = f"  XLA plan {result['planned_bytes'] / 2**30:5.1f} GiB"
    first_gap = result["losses"][0] - plain["losses"][0]
    last_gap = result["losses"][-1] - plain["losses"][-1]
    return (f"{framework:5s} {name:26s} {statistics.median(ms):8.1f} ms/step "
            f"[{min(ms):.1f}, {max(ms):.1f}]  compile {result['compile_s']:5.1f} s  "
            f"peak {peak}{planned}  loss {result['losses'][0]:.5f} -> {result['losses'][-1]:.5f}"
            f"  vs plain {first_gap:+.1e} / {last_gap:+.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON of every measured number")
    parser.add_argument("--quick", action="store_true", help="a tiny model, seconds on a CPU")
    parser.add_argument("--framework", choices=["torch", "jax", "both"], default="both")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = Sizes()
    if args.quick:
        sizes = QUICK
    device = "cpu"
    if torch.cuda.is_available():
        device = "cuda"
    if not args.quick and device == "cpu":
        sys.exit("error: GPT-2 at batch 64 needs a GPU; on a CPU run with --quick")
    config = GPTConfig.preset(sizes.preset, block_size=sizes.block_size)
    torch.manual_seed(0)
    init_state = GPT(config).state_dict()  # one init for every variant
    tokens = torch.randint(0, 50257, (sizes.batch, sizes.block_size + 1))
    x = tokens[:, :-1].to(device)
    y = tokens[:, 1:].to(device)
    name = "CPU"
    if device == "cuda":
        name = torch.cuda.get_device_name()
    print(f"{name} | torch {torch.__version__} | {sizes.preset}, batch {sizes.batch} x "
          f"{sizes.block_size}, vocab {config.vocab_size}, {sizes.warmup} warm-up + "
          f"{sizes.steps} timed steps (measured)", flush=True)
    results = dict(sizes=asdict(sizes), device=name, torch=[], jax=[])
    if args.framework in ("torch", "both"):
        plain = torch_variant(sizes, None, init_state, x, y, device)
        results["torch"].append(dict(chunk=None, **plain))
        print(row("torch", None, plain, plain), flush=True)
        for chunk in sizes.chunks:
            result = torch_variant(sizes, chunk, init_state, x, y, device)
            results["torch"].append(dict(chunk=chunk, **result))
            print(row("torch", chunk, result, plain), flush=True)
    if args.framework in ("jax", "both"):
        import jax
        gpu = jax.devices()[0].platform == "gpu"
        print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
        fused = {}
        for chunk in sorted(sizes.chunks):  # smallest first: JAX's peak only grows
            fused[chunk] = jax_variant(sizes, chunk, init_state, x, y, gpu)
        plain = jax_variant(sizes, None, init_state, x, y, gpu)
        results["jax"].append(dict(chunk=None, **plain))
        print(row("jax", None, plain, plain), flush=True)
        for chunk, result in fused.items():
            results["jax"].append(dict(chunk=chunk, **result))
            print(row("jax", chunk, result, plain), flush=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
