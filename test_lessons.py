"""
Tests for perf-lessons, on a CPU. Each lesson runs for real, as a reader runs it: its own
process (`python 04_memory.py --quick --json ...`, or torchrun for the data-parallel
lessons), from a folder holding only the lesson and the model files it imports. The tests
assert on the physics its JSON reports, on its self-checks, and on equality with plain
references; the model's accounting is checked against torch's own counters.

Layout: one class per lesson (and a few for the models). A class runs its lesson once, in a
class-scoped fixture; pytest-xdist's `--dist loadscope` gives each class to one worker, so
each run happens once. To add a test for a lesson, add a method to its class that takes the
fixture. The behaviour every lesson shares (a bad flag, an unwritable --json, a bare folder)
is tested once, over all lessons, in the classes at the end.

    python -m pytest -q -n auto --dist loadscope --timeout 900 test_lessons.py
"""

import argparse
import gc
import importlib.util
import json
import math
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import model_jax
import model_torch
from conftest import FAST_COMPILE
from model_torch import (ALLOCATOR_HEADROOM, GPT, GPTConfig, activation_bytes, activation_terms,
                         block_activation_terms, datasheet_bf16_peak, flops_per_token,
                         floor_seconds, micro_batches, param_count, predicted_peak_bytes,
                         state_bytes, step_floor_terms)

HERE = Path(__file__).resolve().parent
# One torch thread in this process: on 2 cores shared with a second worker, the small models'
# microsecond ops would otherwise wait for a second thread whenever the OS has parked it.
torch.set_num_threads(1)
LESSONS = ["01_roofline.py", "02_hardware.py", "03_compile.py", "04_memory.py",
           "05_ddp_scratch.py", "06_ddp_prod.py", "07_capstone_torch.py", "07_capstone_jax.py"]


def model_files(lesson):
    """The model files a lesson imports: what a reader copies with it."""
    text = (HERE / lesson).read_text()
    files = []
    if "model_torch" in text or "model_jax" in text:  # model_jax imports model_torch
        files.append("model_torch.py")
    if "model_jax" in text:
        files.append("model_jax.py")
    return files


def lesson_folder(lesson, tmp):
    """A folder holding the lesson and only the model files it imports."""
    folder = Path(tmp) / "lesson"
    folder.mkdir(parents=True, exist_ok=True)
    for name in [lesson] + model_files(lesson):
        shutil.copy(HERE / name, folder / name)
    return folder


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    json: dict  # what --json wrote (None: no --json, or the file is empty)
    folder: Path  # where it ran: the figures are under folder / "out"


def run_lesson(lesson, *args, tmp, nproc=None, devices=None, env=None, timeout=600):
    """Run a lesson as a reader does, from a folder of its own under `tmp`: `python lesson
    *args`, or with `nproc` torchrun ranks (gloo on a CPU), or with `devices` simulated JAX
    CPU devices. Adds `--json` (read back into Run.json). One torch thread per process:
    on 2 shared cores a second thread's ops wait whenever the OS has parked it."""
    folder = lesson_folder(lesson, tmp)
    json_path = folder / "result.json"
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
                    OMP_NUM_THREADS="1")
    if devices:
        full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    full_env.update(env or {})
    command = [sys.executable, lesson]
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", lesson]
    command += ["--json", str(json_path), *args]  # a --json in args overrides this one
    done = subprocess.run(command, cwd=folder, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    result = None
    if json_path.exists() and json_path.stat().st_size:
        result = json.loads(json_path.read_text())
    return Run(done.returncode, done.stdout, done.stderr, result, folder)


def expect_ok(run):
    """Fail with the run's output when it did not exit 0."""
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    return run


def load_lesson(lesson):
    """Import a lesson as a module, to call its functions with known inputs (its name
    starts with a digit, so `import` cannot). What it sets in os.environ as it imports
    is undone, so it cannot reach the lessons this worker runs later."""
    spec = importlib.util.spec_from_file_location(Path(lesson).stem, HERE / lesson)
    module = importlib.util.module_from_spec(spec)
    environ = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return module


# ---------------------------------------------------------------------------------------
# model_torch.py: the GPT, its accounting against torch's own counters, the datasheet, the
# micro-batch choice, and the floor of a step


def model_torch_tiny(**overrides):
    return GPTConfig.preset("tiny", **overrides)


def model_torch_flops_counted(config, batch=1):
    """Training FLOPs per token as torch's FlopCounterMode counts one forward + backward."""
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    return counter.get_total_flops() / (batch * config.block_size)


def model_torch_saved_tensors(model, idx, targets, bf16=False):
    """What autograd saves for backward during one forward, parameters excluded: one entry
    per storage (views share one), as (bytes, shape, dtype) of the first tensor seen on it."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in seen:
            seen[s.data_ptr()] = (s.nbytes(), tuple(t.shape), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(idx, targets)
    return list(seen.values())


def model_torch_saved_bytes(model, idx, bf16=False):
    targets = torch.randint(0, model.config.vocab_size, idx.shape)
    return sum(b for b, _, _ in model_torch_saved_tensors(model, idx, targets, bf16))


def model_torch_loss_and_grads(model, idx, targets, bf16=False):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits, loss = model(idx, targets)
    loss.backward()
    return logits, loss.item(), {name: p.grad for name, p in model.named_parameters()}


def model_torch_largest_relative_error(got, expected):
    """The worst parameter's max |got - expected| over its own largest |expected|."""
    errors = {}
    for name, g in expected.items():
        errors[name] = float((got[name] - g).abs().max() / g.abs().max())
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


def model_torch_op_class(name):
    """The floor's class of an aten op, as the capstone's profiler classes name it."""
    if "scaled_dot_product" in name:
        return "attention"
    if name in ("mm", "addmm", "bmm"):
        return "matmul"
    if "adam" in name or "foreach" in name:
        return "optimizer"
    return "elementwise/norm/loss"


def model_torch_eager_bytes(config, batch, bf16, micro_steps):
    """Bytes each class's eager ops read and write in one optimizer step (every input and
    output of every op that is not a view), counted by a dispatch mode: what eager moves,
    which a floor may never exceed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    moved = dict.fromkeys(model_torch.FLOOR_CLASSES, 0)

    def tensors_in(values):
        found = []
        for value in values:
            if isinstance(value, torch.Tensor):
                found.append(value)
            if isinstance(value, (list, tuple)):
                found += [t for t in value if isinstance(t, torch.Tensor)]
        return found

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    class CountBytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.is_view:  # a view reads and writes nothing
                return out
            inputs = tensors_in(list(args) + list(kwargs.values()))
            storages = {t.untyped_storage().data_ptr() for t in inputs}
            written = [t for t in tensors_in([out]) if t.untyped_storage().data_ptr() not in storages]
            for position, argument in enumerate(func._schema.arguments):  # in place: written too
                if argument.alias_info is not None and argument.alias_info.is_write:
                    value = kwargs.get(argument.name)
                    if position < len(args):
                        value = args[position]
                    written += tensors_in([value])
            name = func.__name__.split(".")[0].lstrip("_")
            moved[model_torch_op_class(name)] += nbytes(inputs) + nbytes(written)
            return out

    torch.manual_seed(0)
    model = GPT(config)
    optimizer = model.configure_optimizer(fused=True)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size))
    with CountBytes():
        for x in idx.chunk(micro_steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(x, x)
            (loss / micro_steps).backward()
        optimizer.step()
    return moved


class TestModelTorch:

    def test_checkpointing_recomputes_the_predicted_flops(self):
        # a checkpointed step runs each block's forward again, up to its last matmul:
        # torch's own counter finds recompute_flops_per_token more per token, within 2%
        # (manual attention: the counter does not count the CPU's fused attention)
        config = model_torch_tiny(attn="manual", block_size=64)
        plain = model_torch_flops_counted(config)
        checkpointed = model_torch_flops_counted(replace(config, checkpoint=True))
        extra = model_torch.recompute_flops_per_token(config)
        assert checkpointed - plain == pytest.approx(extra, rel=0.02)
    def test_gpt2_parameter_count_is_gpt2_small(self):
        # GPT-2 small as OpenAI released it (vocab 50257, T=1024): 124,439,808 parameters,
        # 123,653,376 without the position table (nanoGPT prints "123.65M").
        config = GPTConfig.preset("gpt2", vocab_size=50257)
        with torch.device("meta"):
            model = GPT(config)
        assert sum(p.numel() for p in model.parameters()) == 124_439_808 == param_count(config)
        assert param_count(config, position=False) == 123_653_376

    # manual attention: its matmuls are counted on every device (CPU SDPA is not). The two
    # configurations weigh the formula's terms differently: at vocabulary 50304 the head's
    # matmul is most of 6N and attention ~4%; at vocabulary 256, T = 512, d = 64, the 12 L T d
    # term is over half the total, so halving it (6 L T d) misses by ~25%, far outside the 1%
    # tolerance, which only absorbs what the formula counts and the counter does not (biases,
    # LayerNorm gains).
    @pytest.mark.parametrize("config, attention_share", [
        (model_torch_tiny(attn="manual"), (0.03, 0.04)),
        (model_torch_tiny(attn="manual", vocab_size=256, block_size=512, n_layer=2, n_head=2,
                          n_embd=64), (0.5, 0.6)),
    ], ids=["head-heavy", "attention-heavy"])
    def test_flops_per_token_matches_flop_counter(self, config, attention_share):
        T = config.block_size
        share = 12 * config.n_layer * T * config.n_embd / flops_per_token(config)
        assert attention_share[0] < share < attention_share[1]  # the weighting this case tests
        counted = model_torch_flops_counted(config)
        assert abs(flops_per_token(config, T) / counted - 1) < 0.01, (
            f"6N + 12LTd = {flops_per_token(config, T):.0f} FLOPs/token, the counter {counted:.0f}")

    def test_flops_per_token_is_six_n_plus_twelve_l_t_d(self):
        # the formula term by term, exactly: 6 FLOPs per weight per token (N without the
        # position table), and the attention term 12 L T d at the sequence length asked for
        for config in (GPTConfig.preset("gpt2"), model_torch_tiny(),
                       model_torch_tiny(block_size=64, n_layer=3)):
            L, d = config.n_layer, config.n_embd
            six_n = 6 * param_count(config, position=False)
            for T in (config.block_size, config.block_size // 2):
                assert flops_per_token(config, T) - six_n == 12 * L * T * d, "the attention term"
            assert flops_per_token(config) == flops_per_token(config, config.block_size)

    def test_state_bytes_are_sixteen_per_parameter(self):
        config = model_torch_tiny()
        model = GPT(config)
        n = sum(p.numel() for p in model.parameters())
        b = state_bytes(config)
        assert b["params"] == sum(p.numel() * p.element_size() for p in model.parameters())
        assert b["params"] + b["grads"] + b["optimizer"] == 16 * n

    @pytest.mark.parametrize("residual", [False, True], ids=["fp32-residual", "bf16-residual"])
    @pytest.mark.parametrize("fused", [False, True], ids=["head", "fused-head"])
    @pytest.mark.parametrize("checkpointed", [False, True], ids=["", "checkpointed"])
    @pytest.mark.parametrize("attn", ["sdpa", "manual"])
    @pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
    def test_activation_prediction_is_exact_term_by_term(self, attn, bf16, checkpointed,
                                                         fused, residual):
        # the prediction is counted tensor by tensor, so it must equal autograd's saved bytes
        # exactly, in total and in every term that a tensor's shape and dtype identify. Small
        # sizes whose shapes cannot be mistaken for each other: V = 320 is none of d, 3d, 4d, T
        config = model_torch_tiny(attn=attn, n_layer=2, checkpoint=checkpointed,
                                  fused_classifier=fused, vocab_size=320, block_size=64,
                                  bf16_residual=residual)
        B, T, H, V, L = 3, config.block_size, config.n_head, config.vocab_size, config.n_layer
        d = config.n_embd
        idx = torch.randint(0, V, (B, T))
        targets = torch.randint(0, V, (B, T))  # its own storage: the fused head keeps none
        saved = model_torch_saved_tensors(GPT(config), idx, targets, bf16)
        terms = activation_terms(config, B, bf16=bf16)
        total = sum(b for b, _, _ in saved)
        assert total == activation_bytes(config, B, bf16=bf16) == sum(terms.values())

        def counted(shape, dtype):
            return sum(b for b, s, dt in saved if s == shape and dt == dtype)

        f32, half = torch.float32, torch.bfloat16
        inner = 1
        if checkpointed:
            inner = 0  # a checkpointed block keeps none of its insides
        stats = counted((B, T, 1), f32)
        assert stats == inner * terms.get("blocks.layernorm_stats", 0) + terms["ln_f_stats"]
        assert counted((B * T, V), f32) == terms.get("log_softmax", 0)
        assert counted((V, d), f32) == terms.get("classifier_dw", 0)
        assert sum(b for b, _, dt in saved if dt == torch.int64) == (
            terms["token_ids"] + terms.get("targets", 0) + terms["position_ids"])
        assert sum(b for b, _, dt in saved if dt == torch.bool) == terms.get("causal_mask", 0)
        weights = [b for b, s, dt in saved if len(s) == 2 and s[0] != B * T and dt == half]
        assert sum(weights) == terms.get("weight_copies", 0)  # (B T, d) rows are activations
        if attn == "sdpa":
            assert counted((B, H, T), f32) == terms.get("blocks.attention_logsumexp", 0)
        else:
            assert counted((B, H, T, T), f32) == terms.get("blocks.attention_probs", 0)
            probs_bf16 = counted((B, H, T, T), half) + counted((B * H, T, T), half)  # bmm's view
            assert probs_bf16 == terms.get("blocks.attention_probs_bf16", 0)
        # the residual stream under autocast: what the LayerNorms keep (and a checkpointed
        # block's input) is fp32, the only fp32 (B, T, d) tensors; none with bf16_residual
        if bf16:
            stream = terms["ln_f_input"] + terms.get("blocks.layernorm_inputs", 0)
            stream += terms.get("blocks.block_input", 0)
            fp32_stream = counted((B, T, d), f32)
            if residual:
                assert fp32_stream == 0, "an fp32 copy of the bf16 residual stream was kept"
            else:
                assert fp32_stream == stream
        for name, per_token in block_activation_terms(config, T, bf16).items():
            assert terms["blocks." + name] == L * B * T * per_token

    def test_bf16_residual_halves_the_streams_bytes(self):
        # the accounting's one change: each residual-stream term at 2 bytes a value, not 4
        plain = model_torch_tiny()
        residual = model_torch_tiny(bf16_residual=True)
        for checkpointed in (False, True):
            a = block_activation_terms(GPTConfig(**{**plain.__dict__, "checkpoint": checkpointed}), bf16=True)
            b = block_activation_terms(GPTConfig(**{**residual.__dict__, "checkpoint": checkpointed}), bf16=True)
            for name in a:
                factor = 1
                if name in ("layernorm_inputs", "block_input"):
                    factor = 2
                assert a[name] == factor * b[name], name
        # without autocast it changes nothing
        assert activation_terms(plain, 2) == activation_terms(residual, 2)

    def test_bf16_residual_keeps_the_stream_in_bf16_and_tracks_the_loss(self, monkeypatch):
        torch.manual_seed(0)
        plain = GPT(model_torch_tiny(n_layer=2, vocab_size=512))
        residual = GPT(model_torch_tiny(n_layer=2, vocab_size=512, bf16_residual=True))
        residual.load_state_dict(plain.state_dict())
        idx = torch.randint(0, 512, (2, 64))
        seen = []
        hook = residual.transformer.h[1].register_forward_hook(
            lambda module, inputs, output: seen.append((inputs[0].dtype, output.dtype)))
        _, plain_loss, _ = model_torch_loss_and_grads(plain, idx, idx, bf16=True)
        _, residual_loss, grads = model_torch_loss_and_grads(residual, idx, idx, bf16=True)
        hook.remove()
        assert seen == [(torch.bfloat16, torch.bfloat16)]  # a block reads and writes bf16
        assert abs(residual_loss - plain_loss) < 1e-2 * plain_loss
        assert all(g.dtype == torch.float32 for g in grads.values())  # fp32 params, fp32 grads
        # the LayerNorms read the bf16 stream with autocast off: on a GPU autocast would
        # run them on an fp32 copy and keep that copy for backward (a CPU's autocast does
        # not cast layer_norm, so there the saved bytes cannot tell)
        layer_norm = torch.nn.functional.layer_norm
        autocast_on = []

        def spy(x, *args, **kwargs):
            autocast_on.append((x.dtype, torch.is_autocast_enabled("cpu")))
            return layer_norm(x, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "layer_norm", spy)
        model_torch_loss_and_grads(residual, idx, idx, bf16=True)
        monkeypatch.undo()
        assert autocast_on == [(torch.bfloat16, False)] * 5  # ln_1, ln_2 twice, ln_f
        # in fp32 (no autocast) the switch is a no-op: the same loss, bit for bit
        _, a, _ = model_torch_loss_and_grads(plain, idx, idx)
        _, b, _ = model_torch_loss_and_grads(residual, idx, idx)
        assert a == b

    def test_gpt2_init_statistics(self):
        # GPT-2's init: weights N(0, 0.02); the two residual projections of each block N(0,
        # 0.02 / sqrt(2 L)), so the residual stream's variance does not grow with depth;
        # biases 0, LayerNorm gains 1
        config = model_torch_tiny(n_layer=6)
        torch.manual_seed(0)
        params = dict(GPT(config).named_parameters())
        scaled = 0.02 / math.sqrt(2 * config.n_layer)
        for name, p in params.items():
            if name.endswith("c_proj.weight"):
                assert abs(p.std().item() / scaled - 1) < 0.05, name
            elif p.dim() == 2:
                assert abs(p.std().item() / 0.02 - 1) < 0.05, name
            elif name.endswith("bias"):
                assert torch.all(p == 0), name
            else:
                assert torch.all(p == 1), name

    def test_manual_attention_equals_sdpa(self):
        torch.manual_seed(0)
        config = model_torch_tiny(n_layer=2)
        a = GPT(config)
        b = GPT(model_torch_tiny(n_layer=2, attn="manual"))
        b.load_state_dict(a.state_dict())
        idx = torch.randint(0, config.vocab_size, (2, 64))
        logits_a, loss_a = a(idx, idx)
        logits_b, loss_b = b(idx, idx)
        loss_a.backward()
        loss_b.backward()
        torch.testing.assert_close(logits_a, logits_b, rtol=1e-5, atol=1e-5)
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=name)

    def test_checkpointing_gives_the_same_gradients(self):
        torch.manual_seed(0)
        a = GPT(model_torch_tiny(n_layer=2, vocab_size=256))  # a small head: blocks dominate
        b = GPT(model_torch_tiny(n_layer=2, vocab_size=256, checkpoint=True))
        b.load_state_dict(a.state_dict())
        idx = torch.randint(0, a.config.vocab_size, (2, 64))
        a(idx, idx)[1].backward()
        b(idx, idx)[1].backward()
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0, msg=name)
        # and it keeps less: the blocks' insides are not saved
        idx = torch.randint(0, a.config.vocab_size, (2, a.config.block_size))
        assert model_torch_saved_bytes(b, idx) < 0.5 * model_torch_saved_bytes(a, idx)

    def test_torch_adamw_lowers_the_loss(self):
        torch.manual_seed(0)
        model = GPT(model_torch_tiny(n_layer=2, vocab_size=1024))
        optimizer = model.configure_optimizer(lr=1e-3)
        idx = torch.randint(0, 1000, (4, 64))
        losses = []
        for _ in range(5):
            _, loss = model(idx[:, :-1], idx[:, 1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.5, losses

    def test_logits_come_back_detached_when_the_loss_is_computed(self):
        # with targets, the loss carries the gradient: the returned logits must not require
        # grad (a compiled backward would zero-fill a B x T x V gradient for them), yet equal
        # the plain ones
        torch.manual_seed(0)
        model = GPT(model_torch_tiny(n_layer=1))
        idx = torch.randint(0, 1000, (2, 32))
        logits, loss = model(idx, idx)
        plain, none = model(idx)
        assert loss.requires_grad and not logits.requires_grad
        assert plain.requires_grad and none is None
        assert torch.equal(logits, plain)

    # fp32: the same sums in another order, so equal to fp32 rounding (< 1e-5 of the largest
    # gradient of each parameter). bf16: both heads round the logits' gradient to bf16 (2^-9
    # relative) but from fp32 values computed in another order, so an element can round the
    # other way, and the plain head rounds dW to bf16 once where the fused one adds fp32 chunk
    # sums; through one block that is ~0.5% of the largest gradient, so 3e-2. A missing 1/N
    # (150x), the one-hot subtracted twice or a chunk skipped are far outside either. Chunks
    # of 64 tokens over a 3 x 50 batch: two whole chunks and a shorter rest of 22 tokens.
    @pytest.mark.parametrize("bf16, tolerance", [(False, 1e-5), (True, 3e-2)],
                             ids=["fp32", "bf16"])
    def test_fused_classifier_equals_the_plain_head(self, monkeypatch, bf16, tolerance):
        monkeypatch.setattr(model_torch, "CLASSIFIER_CHUNK", 64)
        torch.manual_seed(0)
        plain = GPT(model_torch_tiny(n_layer=1, vocab_size=512))
        fused = GPT(model_torch_tiny(n_layer=1, vocab_size=512, fused_classifier=True))
        fused.load_state_dict(plain.state_dict())
        idx = torch.randint(0, 512, (3, 50))
        targets = torch.randint(0, 512, (3, 50))
        _, plain_loss, plain_grads = model_torch_loss_and_grads(plain, idx, targets, bf16)
        logits, fused_loss, fused_grads = model_torch_loss_and_grads(fused, idx, targets, bf16)
        assert logits is None  # no logits exist
        assert abs(fused_loss - plain_loss) < 1e-5 * plain_loss
        assert fused.lm_head.weight is fused.transformer.wte.weight  # still tied
        name, error = model_torch_largest_relative_error(fused_grads, plain_grads)
        assert error < tolerance, f"{name}: fused differs from plain by {error:.1e}"

    def test_datasheet_by_exact_product(self):
        # the H100's three forms differ by 25%: a substring would give the PCIe the SXM's peak
        assert datasheet_bf16_peak("NVIDIA H100 PCIe") == 756e12
        assert datasheet_bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
        assert datasheet_bf16_peak("NVIDIA GeForce RTX 4090") == 165.2e12
        assert datasheet_bf16_peak("NVIDIA H100") is None  # no such product name
        assert datasheet_bf16_peak("Tesla T4") is None
        assert datasheet_bf16_peak("") is None

    # GPT-2 124M, 64 sequences of 1024 a step: the micro-batch count for 8, 12, 24, 80 and
    # 141 GiB, recomputed by hand from the accounting: the fewest divisors of 64 whose
    # predicted peak, times the allocator's headroom, fits
    @pytest.mark.parametrize("gib", [8, 12, 24, 80, 141])
    @pytest.mark.parametrize("bf16, attn", [(False, "manual"), (True, "sdpa")],
                             ids=["fp32-manual", "bf16-sdpa"])
    def test_micro_batches_by_hand(self, gib, bf16, attn):
        config = GPTConfig.preset("gpt2", attn=attn, vocab_size=50257)
        d, L, V, T, H = 768, 12, 50257, 1024, 12
        n = param_count(config)
        act = 4
        if bf16:
            act = 2
        per_token = L * (2 * 4 * d + 2 * 2 * 4 + 7 * d * act + 3 * d * act)  # blocks
        per_token += L * 4 * d * act
        if attn == "sdpa":
            per_token += L * 4 * H
        else:
            per_token += L * 4 * H * T
            if bf16:
                per_token += L * 2 * H * T
        per_token += 8 + 4 * d + 8 + act * d + 4 * V + 8  # ids, ln_f, head input, log-softmax, targets

        def peak(sequences):
            tokens = sequences * T
            activations = per_token * tokens + 8 * T + 4
            if attn == "manual":
                activations += L * T * T
            if bf16:
                activations += 2 * (12 * L * d * d + V * d)
            start = 4 * n + 8 * n + activations + 8 * V * tokens
            end = 4 * n + 8 * n + 4 * n + 8 * V * d
            return max(start, end)

        expected = None
        for count in (1, 2, 4, 8, 16, 32, 64):
            assert peak(64 // count) == predicted_peak_bytes(config, 64 // count, bf16)
            if expected is None and 1.2 * peak(64 // count) <= gib * 2**30:
                expected = count
        assert micro_batches(config, 64, gib * 2**30, bf16) == expected
        by_hand = {(False, 8): 32, (False, 12): 16, (False, 24): 8, (False, 80): 2,
                   (False, 141): 1, (True, 8): 16, (True, 12): 8, (True, 24): 4,
                   (True, 80): 1, (True, 141): 1}
        assert expected == by_hand[(bf16, gib)]

    def test_micro_batches_none_when_one_sequence_does_not_fit(self):
        config = GPTConfig.preset("gpt2")
        assert micro_batches(config, 64, 2**30) is None  # 1 GiB: not even the state fits

    def test_floor_matmul_flops_are_what_torch_counts(self):
        # the matmul floor's FLOPs are exactly the linear layers' and manual attention's
        # matmuls as FlopCounterMode counts them (3 GEMMs each: forward, dX, dW)
        config = model_torch_tiny(attn="manual", n_layer=2, vocab_size=320, block_size=64)
        counted = model_torch_flops_counted(config, batch=2) * 2 * config.block_size
        terms = step_floor_terms(config, 2 * config.block_size, bf16=False)
        assert terms["matmul"]["flops"] == counted
        # and the sdpa attention's floor is the causal half of manual attention's work
        sdpa = step_floor_terms(model_torch_tiny(n_layer=2, vocab_size=320, block_size=64),
                                2 * 64, bf16=False)
        full_square = 2 * 64 * 2 * (12 * 64 * 128)  # tokens x L x 12 T d
        assert sdpa["attention"]["flops"] == full_square * 65 / 128  # (T + 1) / 2T of it
        assert sdpa["matmul"]["flops"] + full_square == terms["matmul"]["flops"]

    def test_floor_by_hand_for_gpt2_under_autocast(self):
        # GPT-2 124M (vocab 50304), 64 x 1024 tokens, bf16 autocast, sdpa, one micro-step,
        # recomputed term by term
        config = GPTConfig.preset("gpt2")
        d, L, V, T, H = 768, 12, 50304, 1024, 12
        tokens = 64 * 1024
        terms = step_floor_terms(config, tokens, bf16=True)
        linear = 2 * (d * 3 * d + d * d + d * 4 * d + 4 * d * d)  # forward FLOPs a token a block
        assert terms["matmul"]["flops"] == tokens * (3 * L * linear + 6 * d * V)
        weights = 12 * L * d * d + V * d
        assert terms["matmul"]["bytes"] == (tokens * 3 * 2 * (L * 16 * d + d + V)
                                            + 3 * 2 * weights)
        assert terms["attention"]["flops"] == tokens * L * 6 * d * (T + 1)
        assert terms["attention"]["bytes"] == tokens * L * (12 * 2 * d + 8 * H)
        block = (12 * 2 + 4 * 4) * d + (14 * 2 + 6 * 4 + 2 * 2) * d  # forward + backward
        head = 4 * d + 4 * d + 2 * d + (2 + 8 + 2) * d + 2 * 2 * V
        assert terms["elementwise/norm/loss"]["bytes"] == tokens * (L * block + head) + 12 * weights
        assert terms["optimizer"]["bytes"] == 28 * param_count(config)
        # the bf16 residual stream: per token and block, 8 residual values (4 forward, 6
        # backward... less the casts) move at 2 bytes, not 4
        residual = step_floor_terms(GPTConfig.preset("gpt2", bf16_residual=True), tokens, True)
        saved = terms["elementwise/norm/loss"]["bytes"] - residual["elementwise/norm/loss"]["bytes"]
        per_block = (4 + 6) * 2 * d + 2 * 2 * d  # 10 residual values 2 bytes lighter, 2 casts gone
        per_head = 2 * d + 2 * d + (2 * 2 * d + 2 * d)  # embeddings' sum and gradient, ln_f's backward
        assert saved == tokens * (L * per_block + per_head)
        for name in ("matmul", "attention", "optimizer"):
            assert residual[name] == terms[name]
        # seconds: the larger of FLOPs at the roof and bytes at the bandwidth
        seconds = floor_seconds(terms, 775e12, 3.0e12)
        for name, term in terms.items():
            assert seconds[name] == max(term["flops"] / 775e12, term["bytes"] / 3.0e12)
        assert seconds["matmul"] == terms["matmul"]["flops"] / 775e12  # compute-bound
        assert seconds["elementwise/norm/loss"] == terms["elementwise/norm/loss"]["bytes"] / 3.0e12

    @pytest.mark.parametrize("settings", [
        dict(bf16=False, micro=1), dict(bf16=True, micro=1), dict(bf16=True, micro=2),
        dict(bf16=False, micro=2, attn="manual"), dict(bf16=True, micro=1, checkpoint=True),
        dict(bf16=True, micro=1, bf16_residual=True), dict(bf16=True, micro=1, fused_classifier=True),
    ], ids=["fp32", "bf16", "bf16-2-micro", "fp32-manual-2-micro", "bf16-checkpoint",
            "bf16-residual", "bf16-fused-head"])
    def test_floor_bytes_are_below_what_eager_moves(self, settings, monkeypatch):
        # a floor is a lower bound: no class's counted bytes may exceed what eager's ops of
        # that class read and write in the same step (each op's inputs and outputs, counted)
        monkeypatch.setattr(model_torch, "CLASSIFIER_CHUNK", 64)
        settings = dict(settings)
        bf16 = settings.pop("bf16")
        micro = settings.pop("micro")
        config = model_torch_tiny(n_layer=2, vocab_size=320, block_size=64, **settings)
        moved = model_torch_eager_bytes(config, 4, bf16, micro)
        terms = step_floor_terms(config, 4 * 64, bf16, micro)
        for name in model_torch.FLOOR_CLASSES:
            assert terms[name]["bytes"] <= moved[name], (name, terms[name]["bytes"], moved[name])
            assert terms[name]["bytes"] > 0 or name == "attention"


# ---------------------------------------------------------------------------------------
# model_jax.py: the same function as model_torch.py, layer by layer, step by step


def model_jax_tiny(**overrides):
    return GPTConfig.preset("tiny", **overrides)


def model_jax_twin(config, torch_model, dtype=jnp.float32, **options):
    """model_jax.GPT (with `options`) holding torch_model's weights. Built from shapes
    alone: JAX's own random init runs op by op and takes seconds, for values from_torch
    overwrites."""
    abstract = nnx.eval_shape(lambda: model_jax.GPT(config, dtype, **options))
    graphdef, shapes = nnx.split(abstract)
    model = nnx.merge(graphdef, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
    return model_jax.from_torch(model, torch_model.state_dict())


def model_jax_unit_scale(torch_model):
    """Re-draw every weight so each layer's inputs and outputs are of unit scale (weights
    N(0, 1/fan_in), biases and LayerNorm parameters N(0, 0.5)). At GPT-2's init the
    pre-activations are ~0.2 and a layer's nonlinearity is nearly linear there: the tanh and
    erf GELUs differ by < 1e-5 at 0.2 but by up to 5e-4 near 2."""
    with torch.no_grad():
        for p in torch_model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
            else:
                p.normal_(0, 0.5)
    return torch_model


# the fused classifier: chunks of 64 tokens over a 3 x 50 batch, so two whole chunks and a
# shorter rest of 22 tokens
MODEL_JAX_FUSED_CHUNK = 64


def model_jax_fused_config(fused):
    return model_jax_tiny(n_layer=1, vocab_size=512, fused_classifier=fused)


def model_jax_torch_loss_and_grads(model, idx, targets):
    model.zero_grad()
    _, loss = model(idx, targets)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


class TestModelJax:
    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def highest(cls):
        with jax.default_matmul_precision("highest"):  # true fp32 (GPUs default to TF32)
            yield

    @pytest.fixture(scope="class")
    @classmethod
    def fused_heads(cls, highest):
        """One small model's fp32 loss and gradients three ways, on the same weights and
        batch: torch's fused head, JAX's fused head, JAX's plain head."""
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_torch, "CLASSIFIER_CHUNK", MODEL_JAX_FUSED_CHUNK)
            patch.setattr(model_jax, "CLASSIFIER_CHUNK", MODEL_JAX_FUSED_CHUNK)
            torch.manual_seed(0)
            tmodel = GPT(model_jax_fused_config(True))
            idx = torch.randint(0, 512, (3, 50))
            targets = torch.randint(0, 512, (3, 50))
            heads = dict(torch=model_jax_torch_loss_and_grads(tmodel, idx, targets))
            x = jnp.asarray(idx.numpy())
            y = jnp.asarray(targets.numpy())
            for fused in (True, False):
                jmodel = model_jax_twin(model_jax_fused_config(fused), tmodel)
                graphdef, params = nnx.split(jmodel)
                loss_of = lambda params: nnx.merge(graphdef, params)(x, y)[1]
                loss, grads = jax.jit(jax.value_and_grad(loss_of))(params)
                name = "jax_plain"
                if fused:
                    name = "jax_fused"
                heads[name] = (float(loss), jax.tree.map(np.asarray, grads))
        return heads

    def test_cross_entropy_equals_optax_integer_labels(self):
        # the one-hot-mask loss is optax's gather-based loss, value and gradient, on bf16 logits
        logits = 4 * jax.random.normal(jax.random.key(0), (2, 16, 300), jnp.bfloat16)
        targets = jax.random.randint(jax.random.key(1), (2, 16), 0, 300)

        def reference(logits):
            per_token = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), targets)
            return per_token.mean()

        ours, ours_grad = jax.value_and_grad(model_jax.cross_entropy)(logits, targets)
        ref, ref_grad = jax.value_and_grad(reference)(logits)
        assert abs(float(ours) - float(ref)) < 1e-5 * float(ref)
        assert ours_grad.dtype == jnp.bfloat16
        difference = jnp.abs(ours_grad.astype(jnp.float32) - ref_grad.astype(jnp.float32))
        assert float(difference.max()) < 1e-6

    @pytest.mark.parametrize("attn", ["sdpa", "manual"])
    def test_logits_equal_torch_logits(self, attn):
        config = model_jax_tiny(n_layer=2, attn=attn, vocab_size=512, block_size=64)
        torch.manual_seed(0)
        tmodel = GPT(config)
        jmodel = model_jax_twin(config, tmodel)
        idx = torch.randint(0, config.vocab_size, (2, config.block_size))
        tlogits, tloss = tmodel(idx, idx)
        jlogits, jloss = jmodel(jnp.asarray(idx.numpy()), jnp.asarray(idx.numpy()))
        assert abs(tlogits.detach().numpy() - jlogits).max() < 1e-4
        assert abs(tloss.item() - float(jloss)) < 1e-5

    @pytest.mark.parametrize("layer", ["ln_1", "mlp", "attn-sdpa", "attn-manual"])
    def test_layers_equal_torch_layers(self, layer):
        # each layer's function on unit-scale inputs, fp32, relative error < 1e-5. Catches a
        # flipped GELU flavour (tanh vs erf: ~2e-4), nnx's default LayerNorm epsilon (1e-6 vs
        # torch's 1e-5: ~5e-4 on the small-scale rows below), a missing 1/sqrt(hs) or causal
        # mask (order 1)
        name, _, attn = layer.partition("-")
        config = model_jax_tiny(n_layer=1, attn=attn or "sdpa", vocab_size=256, block_size=64)
        torch.manual_seed(0)
        tmodel = model_jax_unit_scale(GPT(config))
        jmodel = model_jax_twin(config, tmodel)
        x = torch.randn(2, config.block_size, config.n_embd)
        x[1] *= 0.01  # small-variance rows: there a LayerNorm's epsilon shows
        expected = getattr(tmodel.transformer.h[0], name)(x).detach().numpy()
        got = np.asarray(getattr(jmodel.h[0], name)(jnp.asarray(x.numpy())))
        for row in range(2):
            error = np.linalg.norm(got[row] - expected[row]) / np.linalg.norm(expected[row])
            assert error < 1e-5, f"{layer}: JAX differs from torch by {error:.1e} (row {row})"

    def test_train_alike(self):
        # same weights, same batches, same AdamW: the two frameworks take the same steps
        config = model_jax_tiny(n_layer=2, vocab_size=1024, block_size=64)
        torch.manual_seed(0)
        tmodel = GPT(config)
        jmodel = model_jax_twin(config, tmodel)
        topt = tmodel.configure_optimizer(lr=1e-3)
        optimizer = nnx.Optimizer(jmodel, model_jax.adamw(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((jmodel, optimizer))
        train_step = model_jax.make_train_step(graphdef, donate=True)
        data = torch.randint(0, 1000, (4, 65))
        x = jnp.asarray(data.numpy())
        tlosses = []
        jlosses = []
        for _ in range(5):
            _, loss = tmodel(data[:, :-1], data[:, 1:])
            topt.zero_grad()
            loss.backward()
            topt.step()
            tlosses.append(loss.item())
            jloss, state = train_step(state, x[:, :-1], x[:, 1:])
            jlosses.append(float(jloss))
        assert tlosses[-1] < tlosses[0] - 0.5 and jlosses[-1] < jlosses[0] - 0.5
        assert max(abs(a - b) for a, b in zip(tlosses, jlosses)) < 1e-3, (tlosses, jlosses)

    def test_checkpointing_gives_the_same_gradients(self):
        x = jnp.asarray(torch.randint(0, 256, (2, 64)).numpy())
        torch.manual_seed(0)
        weights = GPT(model_jax_tiny(n_layer=2, vocab_size=256, block_size=64))
        grads = []
        for checkpointed in (False, True):
            config = model_jax_tiny(n_layer=2, vocab_size=256, block_size=64,
                                    checkpoint=checkpointed)
            graphdef, params = nnx.split(model_jax_twin(config, weights))
            loss_of = lambda params: nnx.merge(graphdef, params)(x[:, :-1], x[:, 1:])[1]
            grads.append(jax.jit(jax.grad(loss_of))(params))
        for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
            assert jnp.allclose(a, b, rtol=1e-5, atol=1e-7)

    def test_fused_classifier_equals_the_plain_head(self, fused_heads):
        fused_loss, fused_grads = fused_heads["jax_fused"]
        plain_loss, plain_grads = fused_heads["jax_plain"]
        assert abs(fused_loss - plain_loss) < 1e-5 * plain_loss
        for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(plain_grads)):
            assert abs(a - b).max() < 1e-5 * abs(b).max(), a.shape

    def test_fused_classifier_equals_torch_fused(self, fused_heads):
        torch_loss, torch_grads = fused_heads["torch"]
        jax_loss, jax_grads = fused_heads["jax_fused"]
        assert abs(jax_loss - torch_loss) < 1e-5 * torch_loss
        pairs = {  # torch name: the JAX gradient (nnx kernels are torch weights transposed)
            "transformer.wte.weight": jax_grads.wte.embedding[...],
            "transformer.wpe.weight": jax_grads.wpe.embedding[...],
            "transformer.ln_f.weight": jax_grads.ln_f.scale[...],
            "transformer.h.0.attn.c_attn.weight": jax_grads.h[0].attn.c_attn.kernel[...].T,
        }
        for name, jax_grad in pairs.items():
            expected = torch_grads[name].numpy()
            error = abs(np.asarray(jax_grad) - expected).max() / abs(expected).max()
            assert error < 1e-5, f"{name}: JAX fused differs from torch fused by {error:.1e}"

    @pytest.mark.parametrize("option", ["recompute_gelu", "split_qkv"])
    def test_option_keeps_the_loss_and_gradients(self, option):
        # the two options change how the step computes, not what: the plain model's fp32
        # loss and gradients on the same weights and batch, up to fp32 rounding (unit-scale
        # weights, so the GELU is far from linear and a swapped q/k/v third would show)
        config = model_jax_tiny(n_layer=2, vocab_size=256, block_size=32)
        torch.manual_seed(0)
        tmodel = model_jax_unit_scale(GPT(config))
        x = jnp.asarray(torch.randint(0, 256, (2, 32)).numpy())
        results = []
        for options in ({}, {option: True}):
            graphdef, params = nnx.split(model_jax_twin(config, tmodel, **options))
            loss_of = lambda params: nnx.merge(graphdef, params)(x, x)[1]
            results.append(jax.jit(jax.value_and_grad(loss_of))(params))
        (plain_loss, plain), (loss, grads) = results
        assert abs(float(loss) - float(plain_loss)) < 1e-6 * float(plain_loss)
        for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(plain)):
            error = float(jnp.abs(got - expected).max() / jnp.abs(expected).max())
            assert error < 1e-5, (option, error)

    def test_bf16_residual_equals_torch_bf16_residual(self):
        # the residual stream in bf16 in both frameworks, the same weights and batch: the
        # same logits and loss as far as bf16 allows. Tolerance: the two frameworks' bf16
        # runs may differ by up to twice what bf16 costs torch against its own fp32 run
        # (they round in other places); a stream cast at another point, a LayerNorm
        # computing in bf16 or a block left out differ by more. (That the stream really is
        # bf16: the next test.)
        config = model_jax_tiny(n_layer=2, vocab_size=512, block_size=64, bf16_residual=True)
        torch.manual_seed(0)
        tmodel = model_jax_unit_scale(GPT(config))
        idx = torch.randint(0, config.vocab_size, (2, config.block_size))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tlogits = tmodel(idx)[0].float().detach().numpy()
            tloss = tmodel(idx, idx)[1].item()
        exact = tmodel(idx)[0].detach().numpy()  # fp32, no autocast
        jmodel = model_jax_twin(config, tmodel, jnp.bfloat16)
        x = jnp.asarray(idx.numpy())
        jlogits, jloss = jmodel(x, x)
        jlogits = np.asarray(jlogits.astype(jnp.float32))

        def error(a, b):
            return np.linalg.norm(a - b) / np.linalg.norm(b)

        bf16_cost = error(tlogits, exact)
        assert 1e-4 < bf16_cost < 5e-2, bf16_cost  # bf16 really acted, and only as rounding
        assert error(jlogits, tlogits) < 2 * bf16_cost, (error(jlogits, tlogits), bf16_cost)
        assert abs(float(jloss) - tloss) < 2 * bf16_cost * tloss

    def test_bf16_residual_carries_the_stream_in_bf16(self):
        # what the switch changes, seen in the program: each block's two residual adds of
        # (B, T, d) values become bf16 (the linear layers' bias adds are bf16 either way)
        bf16_adds = {}
        for residual in (False, True):
            config = model_jax_tiny(n_layer=2, vocab_size=256, block_size=32,
                                    bf16_residual=residual)
            abstract = nnx.eval_shape(lambda: model_jax.GPT(config, jnp.bfloat16))
            graphdef, state = nnx.split(abstract)
            x = jax.ShapeDtypeStruct((2, 32), jnp.int32)
            text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0]).lower(state, x).as_text()
            adds = [line for line in text.splitlines()
                    if "stablehlo.add" in line and line.endswith(": tensor<2x32x128xbf16>")]
            bf16_adds[residual] = len(adds)
        assert bf16_adds[True] == bf16_adds[False] + 2 * 2, bf16_adds

    def test_predicted_peak_counts_the_traced_residuals(self):
        # op by op, JAX keeps what its autodiff traced: residual_bytes is that, counted from
        # the backward's closure without computing anything; a step's peak adds the state
        config = model_jax_tiny(n_layer=1, vocab_size=256, block_size=32, attn="manual")
        saved = model_jax.residual_bytes(config, 4, jnp.float32)
        # at least torch's own count of what its autograd keeps (JAX keeps more: every
        # intermediate of the softmax and the GELU)
        assert saved >= model_torch.activation_bytes(config, 4) - 8 * 4 * 32 - 8 * 32
        # the activations grow with the tokens, the weights kept for the matmuls' backward do not
        two = model_jax.residual_bytes(config, 2, jnp.float32)
        eight = model_jax.residual_bytes(config, 8, jnp.float32)
        assert eight - saved == 2 * (saved - two) > 0
        peak = model_jax.eager_peak_bytes(config, 4)
        logits = 4 * 4 * 32 * 256
        state = 20 * model_torch.param_count(config)
        assert peak == state + saved + model_jax.EAGER_LOSS_TEMPORARIES * logits


# ---------------------------------------------------------------------------------------
# 01_roofline.py
#
# --quick on a CPU: what 01_roofline.py's QUICK row and Sizes give (all fp32)


ROOFLINE_QUICK = dict(vector=2**20, peak_n=512, tiny=16, decode_tokens=1, copy=2**22,
                      sweep=[6, 9, 12, 15, 18], reps=3)
ROOFLINE_EXPERIMENTS = ["roofs", "ops", "overhead", "no_sync", "jax", "fresh_output"]


def roofline_line(stdout, start):
    """The first printed line that starts with `start`."""
    return next(line for line in stdout.splitlines() if line.startswith(start))


def roofline_ratio(a, b):
    """The lesson's rule, written again: the median, min and max of a_i / b_i."""
    ratios = [x / y for x, y in zip(a, b)]
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))


class TestRoofline:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return expect_ok(run_lesson("01_roofline.py", "--quick",
                                    tmp=tmp_path_factory.mktemp("01")))

    @pytest.fixture(scope="class")
    @classmethod
    def lesson(cls):
        return load_lesson("01_roofline.py")

    def test_top_level_json(self, run):
        r = run.json
        assert r["lesson"] == "01_roofline" and r["quick"] is True
        assert r["device"]["type"] == "cpu" and r["device"]["reference"] is None
        assert isinstance(r["machine_busy"], bool)
        assert set(r["predictions"]) == set(ROOFLINE_EXPERIMENTS) | {"first_calls"}
        assert all(isinstance(held, bool) for held in r["predictions"].values())
        for name, result in r.items():
            if name in r["predictions"]:
                assert r["predictions"][name] == result["prediction_held"]
        assert r["checks"] == dict(roofs_positive=True, copy_is_exact=True,
                                   fresh_output_equal=True)
        for name in r["checks"]:
            assert f"check {name}: ok" in run.stdout

    def test_busy_is_what_the_cpu_shares_say(self, run):
        """Each timed experiment is sampled before and after; busy below 0.9 of a core, and
        every busy experiment's measured line carries the mark (whatever the load was)."""
        r = run.json
        shares = r["cpu_shares"]
        assert len(shares) == 2 * len(ROOFLINE_EXPERIMENTS)
        busy = []
        for i, name in enumerate(ROOFLINE_EXPERIMENTS):
            if min(shares[2 * i], shares[2 * i + 1]) < 0.9:
                busy.append(name)
        assert r["busy_experiments"] == busy and r["machine_busy"] == (len(busy) > 0)
        first_lines = {"roofs": "  measured: compute roof", "overhead": "  measured: vector add",
                       "no_sync": "  measured (a)", "jax": "  measured (d): JAX",
                       "fresh_output": "  measured (e)"}
        for name, start in first_lines.items():
            line = roofline_line(run.stdout, start)
            assert line.endswith("(machine busy)") == (name in busy), line
        if busy:
            assert roofline_line(run.stdout, "machine busy:")

    def test_measures_both_ceilings(self, run):
        r = run.json
        roofs = r["roofs"]
        assert roofs["peak_flops"] > 0 and roofs["bandwidth_bytes_per_s"] > 0
        assert roofs["ridge_flop_per_byte"] == pytest.approx(
            roofs["peak_flops"] / roofs["bandwidth_bytes_per_s"])
        n = ROOFLINE_QUICK["peak_n"]
        tried = {f"{n}x{n}x{n}": 2 * n**3, f"{n // 2}x{n // 2}x{n // 2}": 2 * (n // 2)**3,
                 f"{n}x{n // 2}x{2 * n}": 2 * n * (n // 2) * 2 * n}
        assert {shape: t["flops"] for shape, t in roofs["matmuls"].items()} == tried
        rates = {shape: t["flops"] / t["median_s"] for shape, t in roofs["matmuls"].items()}
        assert roofs["matmul_shape"] == max(rates, key=rates.get)  # the fastest is the roof
        assert roofs["peak_flops"] == pytest.approx(max(rates.values()))
        copy = roofs["copy"]
        assert copy["bytes_moved"] == 2 * ROOFLINE_QUICK["copy"] * 4  # read + written, fp32
        assert roofs["bandwidth_bytes_per_s"] == pytest.approx(
            copy["bytes_moved"] / copy["median_s"])
        for timing in list(roofs["matmuls"].values()) + [copy]:  # the medians of the samples
            assert len(timing["samples_s"]) == ROOFLINE_QUICK["reps"]
            assert timing["median_s"] == statistics.median(timing["samples_s"])
            assert timing["min_s"] <= timing["median_s"] <= timing["max_s"]
        assert roofs["of_datasheet"] is None  # a CPU has no datasheet row
        assert (run.folder / "out" / "01_roofline.png").exists()
        assert r["figure"].endswith("01_roofline.png")

    def test_counts_flops_and_bytes_on_paper(self, run):
        ops = run.json["ops"]["rows"]
        n = ROOFLINE_QUICK["vector"]
        p = ROOFLINE_QUICK["peak_n"]
        t = ROOFLINE_QUICK["tiny"]
        m = p // 2          # the medium matmul
        d = 2 * p           # the decode weight
        batch = n // 4096   # the bmm's 64x64 products
        expected = {  # (FLOPs, bytes read, bytes written): 4 bytes an element
            "vector_add_tiny": (1024, 2 * 1024 * 4, 1024 * 4),
            "vector_add": (n, 2 * n * 4, n * 4),
            "scale": (n, n * 4, n * 4),
            "gelu": (8 * n, n * 4, n * 4),
            "softmax": (5 * n, n * 4, n * 4),
            "layernorm": (8 * n, (n + 2 * 1024) * 4, n * 4),  # x, gain and bias in; y out
            "sum": (n, n * 4, 4),
            "matmul_tiny": (2 * t**3, 2 * t * t * 4, t * t * 4),
            "matmul_decode": (2 * d * d, (d + d * d) * 4, d * 4),  # 1 token, d x d weight
            "bmm_small": (2 * batch * 64**3, 2 * batch * 64 * 64 * 4, batch * 64 * 64 * 4),
            "matmul_medium": (2 * m**3, 2 * m * m * 4, m * m * 4),
            "matmul_large": (2 * p * m * d, (p * m + m * d) * 4, p * d * 4),
        }
        counted = {key: (op["flops"], op["reads"], op["writes"]) for key, op in ops.items()}
        assert counted == expected
        assert ops["vector_add"]["intensity"] == pytest.approx(1 / 12)  # 1 FLOP per 3 x 4 B
        assert ops["gelu"]["intensity"] == pytest.approx(1.0)           # 8 FLOPs per 2 x 4 B
        for op in ops.values():
            assert op["bytes"] == op["reads"] + op["writes"]
            assert op["intensity"] == pytest.approx(op["flops"] / op["bytes"])
            assert op["achieved_flops"] == pytest.approx(op["flops"] / op["time_s"])
            assert op["achieved_bytes_per_s"] == pytest.approx(op["bytes"] / op["time_s"])

    def test_predicts_from_the_roofline_on_paper(self, run):
        """Each op's prediction follows from its counts and the two roofs: the roofline's
        regime by intensity, overhead-bound where its roofline time is under a call's ~5 us."""
        roofs = run.json["roofs"]
        peak = roofs["peak_flops"]
        bandwidth = roofs["bandwidth_bytes_per_s"]
        for op in run.json["ops"]["rows"].values():
            by_intensity = "bandwidth-bound"
            if op["intensity"] >= peak / bandwidth:
                by_intensity = "compute-bound"
            assert op["by_intensity"] == by_intensity
            roofline_s = max(op["flops"] / peak, op["bytes"] / bandwidth)
            assert op["roofline_s"] == pytest.approx(roofline_s)
            assert op["bound_flops"] == pytest.approx(min(peak, op["intensity"] * bandwidth))
            expected = by_intensity
            if roofline_s < 5e-6:
                expected = "overhead-bound"
            assert op["predicted"] == expected

    def test_classifies_from_the_measurement(self, run):
        """The labels follow the stated rule from the measured numbers (whatever the load)."""
        r = run.json
        peak = r["roofs"]["peak_flops"]
        bandwidth = r["roofs"]["bandwidth_bytes_per_s"]
        held = []
        for op in r["ops"]["rows"].values():
            size_ratio = roofline_ratio(op["samples_s"], op["tiny_samples_s"])
            assert op["size_ratio"] == pytest.approx(size_ratio)
            assert op["time_s"] == statistics.median(op["samples_s"])
            assert op["fraction_of_bound"] == pytest.approx(op["achieved_flops"]
                                                             / op["bound_flops"])
            if size_ratio["median"] < 2:
                assert op["measured"] == "overhead-bound" and op["near_roof"] is None
            elif op["achieved_flops"] / peak >= op["achieved_bytes_per_s"] / bandwidth:
                assert op["measured"] == "compute-bound"
            else:
                assert op["measured"] == "bandwidth-bound"
            if op["measured"] != "overhead-bound":
                assert op["near_roof"] == (op["fraction_of_bound"] >= 0.5)
            assert op["clear"] == (size_ratio["min"] > 2 or size_ratio["max"] < 2)
            held.append(op["measured"] == op["predicted"] and op["clear"])
        assert r["predictions"]["ops"] == all(held)

    def test_classify_and_noise_rules(self, lesson):
        assert lesson.classify(1.3, 0.01, 0.02) == "overhead-bound"   # flat in size
        assert lesson.classify(50, 0.8, 0.1) == "compute-bound"
        assert lesson.classify(50, 0.1, 0.8) == "bandwidth-bound"
        r = lesson.ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])
        assert r == dict(median=2.0, min=2.0, max=3.0)
        assert lesson.beyond_noise(r) and not lesson.beyond_noise(r, threshold=2.5)
        assert lesson.beyond_noise(dict(median=0.5, min=0.4, max=0.9))
        assert not lesson.beyond_noise(dict(median=1.2, min=0.8, max=1.6))

    def test_held_busy_and_verdicts_rules(self, lesson, capsys):
        row = dict(measured="bandwidth-bound", predicted="bandwidth-bound", clear=True)
        assert lesson.ops_held(dict(a=row, b=row))
        assert not lesson.ops_held(dict(a=row, b=dict(row, clear=False)))  # within noise
        assert not lesson.ops_held(dict(a=row, b=dict(row, measured="compute-bound")))
        assert lesson.was_busy([0.95, 0.5]) and lesson.was_busy([0.5, 0.95])
        assert not lesson.was_busy([0.95, 0.99])
        results = dict(roofs=dict(prediction_held=False), ops=dict(prediction_held=True),
                       jax=None)  # jax not installed
        shares = dict(roofs=[1.0, 0.95], ops=[0.97, 0.5])
        verdicts = lesson.report_verdicts(results, dict(copy_is_exact=False), shares)
        assert verdicts == dict(predictions=dict(roofs=False, ops=True),
                                checks=dict(copy_is_exact=False), machine_busy=True,
                                busy_experiments=["ops"], cpu_shares=[1.0, 0.95, 0.97, 0.5])
        assert "check copy_is_exact: FAILED" in capsys.readouterr().out

    def test_interleaved_calls_in_turn(self, lesson):
        calls = []
        seconds = lesson.interleaved([lambda: calls.append("a"), lambda: calls.append("b")], 3)
        assert calls == ["a", "b", "a", "b", "a", "b"]
        assert [len(s) for s in seconds] == [3, 3]

    def test_write_allocate_limits(self, lesson):
        """What a CPU copy's write-allocate lets an op reach over the copy's roof."""
        assert lesson.write_allocate_limit(reads=8, writes=4) == pytest.approx(1.125)  # add
        assert lesson.write_allocate_limit(reads=4, writes=4) == pytest.approx(1.0)    # scale
        assert lesson.write_allocate_limit(reads=4e6, writes=4) == pytest.approx(1.5, rel=1e-5)

    def test_tables_keep_their_columns(self, run):
        """Neighbouring columns stay apart (a wide FLOP/B once ran into its neighbour)."""
        lines = run.stdout.splitlines()
        paper = next(line for line in lines if "FLOP/byte" in line and "roofline time" in line)
        table = next(line for line in lines if "% of roof" in line and "held" in line)
        for op in run.json["ops"]["rows"].values():
            rows = [line for line in lines if line.startswith(f"  {op['label']:<24} ")]
            assert len(rows) == 2  # on paper, then measured
            checks = [(rows[0], paper, "FLOP/byte", op["intensity"]),
                      (rows[1], table, "% of roof", 100 * op["fraction_of_bound"])]
            for row, header, column, value in checks:
                end = header.index(column) + len(column)
                start = row.rfind(" ", 0, end) + 1
                assert row[end] == " ", row  # separated from the next column
                field = row[start:end].rstrip("%*")
                assert float(field) == pytest.approx(value, rel=0.01, abs=0.6)

    def test_overhead_floor_and_where_time_doubles(self, run, lesson):
        o = run.json["overhead"]
        sweep = o["sweep"]
        assert [point["elements"] for point in sweep] == [2**p for p in ROOFLINE_QUICK["sweep"]]
        for point in sweep:
            assert point["bytes"] == 3 * 4 * point["elements"]  # two read, one written, fp32
        floor = statistics.median(point["time_s"] for point in sweep[:3])
        assert o["floor_s"] == floor > 0
        bandwidth = run.json["roofs"]["bandwidth_bytes_per_s"]
        assert o["predicted_crossover_bytes"] == pytest.approx(floor * bandwidth)
        doubled = lesson.crossing(sweep, 2 * floor)
        assert o["crossover_bytes"] == doubled["bytes"]
        assert o["crossover_clear"] == doubled["clear"]

    def test_crossing_interpolates_and_refuses_noise(self, lesson):
        def point(elements, time_s, spread=0.01):
            return dict(elements=elements, bytes=12 * elements, time_s=time_s,
                        min_s=time_s * (1 - spread), max_s=time_s * (1 + spread))

        sweep = [point(64, 2e-6), point(256, 2e-6), point(1024, 2e-6), point(4096, 8e-6)]
        # 4e-6 lies halfway on a log scale between 2 and 8 us: halfway between 1024 and 4096
        doubled = lesson.crossing(sweep, 4e-6)
        assert doubled["bytes"] == pytest.approx(12 * 2048) and doubled["clear"]
        noisy = sweep[:3] + [point(4096, 8e-6, spread=0.9)]  # its fastest sample under 4 us
        assert lesson.crossing(noisy, 4e-6)["clear"] is False
        assert lesson.crossing(sweep, 1e-3) == dict(bytes=None, clear=False)  # never there
        assert lesson.crossing(sweep, 1e-6) == dict(bytes=None, clear=False)  # starts above

    def test_discipline_shows_both_clocks(self, run):
        r = run.json
        for clocks in (r["no_sync"], r["jax"]):
            returned = clocks["returned_samples_s"]
            ready = clocks["ready_samples_s"]
            assert len(ready) == ROOFLINE_QUICK["reps"] + 1  # the first call, then warm ones
            for at_return, when_ready in zip(returned, ready):  # return never after ready
                assert 0 < at_return <= when_ready
            assert clocks["returned_s"] == statistics.median(returned[1:])
            assert clocks["warm_median_s"] == statistics.median(ready[1:])
            assert clocks["first_s"] == ready[0]
            assert clocks["loop_mean_s"] == pytest.approx(statistics.fmean(ready))
            assert clocks["loop_median_s"] == statistics.median(ready)
            assert clocks["ready_over_returned"] == pytest.approx(
                roofline_ratio(ready[1:], returned[1:]))
            assert clocks["first_over_warm"] == pytest.approx(
                roofline_ratio([ready[0]] * len(ready[1:]), ready[1:]))
        assert r["jax"]["platform"] == "cpu" and r["jax"]["n"] == ROOFLINE_QUICK["peak_n"]
        n = r["no_sync"]["n"]
        claimed = 2 * n**3 / r["no_sync"]["returned_s"] / r["roofs"]["peak_flops"]
        assert r["no_sync"]["claimed_over_roof"] == pytest.approx(claimed)

    def test_first_calls_are_the_roofs_first_calls(self, run):
        r = run.json
        n = ROOFLINE_QUICK["peak_n"]
        timings = {"matmul": r["roofs"]["matmuls"][f"{n}x{n}x{n}"], "copy": r["roofs"]["copy"]}
        for name, timing in timings.items():
            first = r["first_calls"][name]
            assert first["first_s"] == timing["first_s"]  # the very first call, kept apart
            loop = [timing["first_s"]] + timing["samples_s"]
            assert first["loop_mean_s"] == pytest.approx(statistics.fmean(loop))
            assert first["loop_median_s"] == statistics.median(loop)
            assert first["first_over_warm"] == pytest.approx(roofline_ratio(
                [timing["first_s"]] * len(timing["samples_s"]), timing["samples_s"]))

    def test_fresh_output_is_timed_in_turn_and_equal(self, run):
        fresh = run.json["fresh_output"]
        assert fresh["equal"] is True and fresh["bytes"] == 4 * 2**24  # 64 MiB: over 32 MiB
        assert fresh["cost"] == pytest.approx(roofline_ratio(fresh["fresh"]["samples_s"],
                                                             fresh["reused"]["samples_s"]))

    def test_labels_every_number(self, run):
        starts = ["  measured:", "  derived:", "  predicted", "  prediction held:",
                  "  prediction missed:", "  measured (", "  derived ("]
        for start in ["  measured:", "  derived:", "  predicted:"]:
            assert roofline_line(run.stdout, start)
        section = run.stdout.split("\n1. ")[1].split("\n2. ")[0]  # the roofs: all labelled
        for line in section.splitlines()[1:]:
            assert any(line.startswith(start) for start in starts), line

    def test_datasheet_by_exact_product(self, lesson, monkeypatch):
        """describe_gpu takes the datasheet row of the exact product name (model_torch);
        a name not in its table has none, and the run says it measures its roofs only."""
        props = SimpleNamespace(total_memory=80 * 2**30, L2_cache_size=50 * 2**20)
        monkeypatch.setattr(lesson.torch.cuda, "get_device_properties", lambda device: props)
        monkeypatch.setattr(lesson.torch.cuda, "get_device_capability", lambda device: (9, 0))
        gpu = torch.device("cuda", 0)
        expected = {"NVIDIA H100 PCIe": dict(bf16_flops=756e12, bandwidth=2.0e12),
                    "NVIDIA H100 80GB HBM3": dict(bf16_flops=989e12, bandwidth=3.35e12),
                    "NVIDIA GeForce RTX 4090": dict(bf16_flops=165.2e12, bandwidth=1.008e12),
                    "NVIDIA H100": None}  # a substring of three products: no row
        for name, reference in expected.items():
            monkeypatch.setattr(lesson.torch.cuda, "get_device_name", lambda device: name)
            machine = lesson.describe_gpu(gpu)
            assert machine["reference"] == reference and machine["name"] == name
            assert machine["capability"] == "9.0"

    def test_gpu_reports_and_predictions(self, lesson, capsys):
        """The GPU branches of part 1's report and judgement, with known numbers."""
        timing = dict(flops=2 * 8192**3, median_s=1.5e-3, min_s=1.4e-3, max_s=1.6e-3)
        copy = dict(bytes_moved=2**31, median_s=0.6e-3, min_s=0.55e-3, max_s=0.65e-3)
        roofs = dict(matmul=timing, copy=copy, peak_flops=733e12, bandwidth_bytes_per_s=3.6e12,
                     ridge_flop_per_byte=203.6, dtype="bfloat16", matmul_shape="8192x8192x8192",
                     of_datasheet=dict(compute=733 / 989, bandwidth=3.6 / 4.8),
                     prediction_held=True)
        machine = dict(type="cuda", name="NVIDIA H200",
                       reference=dict(bf16_flops=989e12, bandwidth=4.8e12))
        lesson.report_roofs(roofs, machine, busy=False)
        lines = capsys.readouterr().out.splitlines()
        assert [line.split(":")[0].strip() for line in lines] == [
            "measured", "measured", "derived", "reference", "derived", "prediction held"]
        lesson.report_roofs(dict(roofs, of_datasheet=None),
                            dict(machine, name="NVIDIA H300", reference=None), busy=True)
        unknown = capsys.readouterr().out
        assert "reference: no datasheet row for NVIDIA H300" in unknown  # a label line
        assert lesson.roofs_held("cuda", 203.6, dict(compute=0.74, bandwidth=0.75))
        assert not lesson.roofs_held("cuda", 203.6, dict(compute=0.4, bandwidth=0.75))
        assert not lesson.roofs_held("cuda", 20, None)
        assert lesson.roofs_held("cpu", 6.3, None) and not lesson.roofs_held("cpu", 80, None)

    def test_compute_capability_below_8_uses_fp16(self, lesson, monkeypatch):
        gpu = torch.device("cuda", 0)
        machine = dict(type="cuda", name="Tesla T4", memory_bytes=15 * 2**30,
                       cache_bytes=4 * 2**20, capability="7.5", reference=None)
        monkeypatch.setattr(lesson.torch.cuda, "get_device_capability", lambda device: (7, 5))
        assert not lesson.has_bf16_tensor_cores(gpu)
        assert lesson.matmul_dtype(gpu) == torch.float16
        sizes = lesson.sizes_for(gpu, False, machine)
        assert sizes.dtype == torch.float16 and sizes.vector == 2**28  # 32 B each fit
        assert list(sizes.sweep)[-1] == 28 and sizes.copy == sizes.vector
        assert lesson.sizes_for(gpu, True, machine).reps == 5  # --quick: fewer samples only
        monkeypatch.setattr(lesson.torch.cuda, "get_device_capability", lambda device: (8, 0))
        assert lesson.matmul_dtype(gpu) == torch.bfloat16
        assert lesson.matmul_dtype(torch.device("cpu")) == torch.float32

    def test_gpu_vector_fits_the_card(self, lesson):
        # memory as torch reports it: an "8 GB" card has a little less than 8 GiB
        expected = {7.7: 2**27, 12: 2**28, 24: 2**28, 80: 2**28, 141: 2**28, 3.8: 2**26}
        for gib, elements in expected.items():
            assert lesson.gpu_vector(int(gib * 2**30)) == elements


# ---------------------------------------------------------------------------------------
# 02_hardware.py's tests: one --quick CPU run read through its JSON, and the GPU-only
# arithmetic and reports called here with known inputs.


def hardware_spread(samples):
    return dict(median=statistics.median(samples), low=min(samples), high=max(samples))


def hardware_ratio(numerators, denominators):
    """The lesson's ratio of interleaved samples, recomputed: median, min, max of a_i / b_i."""
    return hardware_spread([a / b for a, b in zip(numerators, denominators)])


def hardware_approx(spread, expected):
    for key in ("median", "low", "high"):
        assert spread[key] == pytest.approx(expected[key], rel=1e-9), key


def hardware_gpu_links():
    """A two-GPU interconnect result, shaped as a GPU run's."""
    host_rows = {}
    for name, rate in [("host->GPU pageable", 7.3), ("host->GPU pinned", 55.3),
                       ("GPU->host pageable", 13.2), ("GPU->host pinned", 55.2)]:
        host_rows[name] = dict(gb_per_s=dict(median=rate, low=rate - 0.1, high=rate + 0.1))
    ratios = {"host->GPU": dict(median=7.58, low=7.4, high=7.7),
              "GPU->host": dict(median=4.18, low=4.1, high=4.2)}
    peer = dict(direct_gb_per_s=dict(median=390.1, low=385.0, high=392.0),
                staged_gb_per_s=dict(median=27.5, low=27.4, high=27.6),
                direct_over_staged=dict(median=14.2, low=14.0, high=14.4),
                exact=True, p2p_available=True)
    lesson = load_lesson("02_hardware.py")
    return dict(reference=lesson.link_reference(), host=dict(rows=host_rows,
                pinned_over_pageable=ratios), peer={"0->1": peer, "1->0": peer},
                checks=dict(peer_copies_exact=True), prediction_held=True, busy=False)


class TestHardware:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return expect_ok(run_lesson("02_hardware.py", "--quick",
                                    tmp=tmp_path_factory.mktemp("02")))

    @pytest.fixture(scope="class")
    @classmethod
    def lesson(cls):
        return load_lesson("02_hardware.py")

    def test_json_has_the_shared_keys(self, run):
        out = run.json
        assert out["lesson"] == "02_hardware" and out["quick"] is True
        assert out["device"]["type"] == "cpu"
        assert isinstance(out["machine_busy"], bool)
        assert out["cpu_shares"] and all(isinstance(s, float) for s in out["cpu_shares"])
        assert out["predictions"] and all(isinstance(v, bool) for v in out["predictions"].values())
        # GPU-only parts judge no prediction on a CPU
        assert set(out["predictions"]) == {"memory_hierarchy", "format_ladder",
                                           "prefill_decode", "decode_step"}
        busy = []
        for name in ("memory_hierarchy", "format_ladder", "prefill_decode", "decode_step"):
            shares = out[name]["cpu_shares"]
            assert len(shares) == 2  # before and after
            assert out[name]["busy"] == (min(shares) < 0.9)
            busy.append(out[name]["busy"])
        assert out["machine_busy"] == any(busy)

    def test_checks_are_correctness_only_and_printed(self, run):
        """Three self-checks on a CPU (no peer copy to check); none is a timing."""
        checks = run.json["checks"]
        assert set(checks) == {"ladder_errors_within_format",
                               "ladder_error_grows_as_bits_shrink",
                               "decode_cache_matches_full_forward"}
        assert all(checks.values()), checks
        for name in checks:
            assert f"check {name}: ok" in run.stdout
        for label in ("measured:", "derived:", "reference:"):
            assert label in run.stdout

    def test_figure_is_written(self, run):
        assert (run.folder / "out" / "02_hardware.png").stat().st_size > 10_000
        assert run.json["figure"].endswith("02_hardware.png")

    def test_hierarchy_spans_kb_to_mb_with_the_cpu_caches(self, run):
        h = run.json["memory_hierarchy"]
        points = h["points"]
        sizes = [p["bytes"] for p in points]
        assert len(points) >= 8 and sizes == sorted(sizes)
        assert sizes[0] <= 32 << 10 and sizes[-1] >= 8 << 20
        assert all(math.isfinite(p["gb_per_s"]["median"]) and p["gb_per_s"]["low"] > 0
                   for p in points)
        caches = h["caches"]  # the CPU's data caches, as Linux reports them; no GPU L2
        assert set(caches) <= {"L1", "L2", "L3"}
        assert list(caches.values()) == sorted(caches.values())

    def test_hierarchy_derived_numbers_recomputed(self, run):
        h = run.json["memory_hierarchy"]
        rates = []
        for p in h["points"]:
            assert p["repeats"] == max(1, (32 << 20) // p["bytes"])  # QUICK's bytes a sample
            rate = [p["repeats"] * p["bytes"] / t for t in p["seconds"]]
            hardware_approx(p["gb_per_s"], hardware_spread([r / 1e9 for r in rate]))
            rates.append(rate)
        medians = [p["gb_per_s"]["median"] for p in h["points"]]
        fastest = medians.index(max(medians))
        assert h["fastest"]["bytes"] == h["points"][fastest]["bytes"]
        assert h["largest"]["bytes"] == h["points"][-1]["bytes"]
        hardware_approx(h["cache_over_memory"], hardware_ratio(rates[fastest], rates[-1]))
        assert h["prediction_held"] == (h["cache_over_memory"]["median"] >= 2)
        below = [p["bytes"] for p, m in zip(h["points"][fastest:], medians[fastest:])
                 if m < max(medians) / 2]
        assert h["cliff_bytes"] == (below[0] if below else None)

    def test_ladder_error_grows_as_bits_shrink_with_the_formats_facts(self, run):
        ladder = run.json["format_ladder"]
        formats = ladder["formats"]
        assert list(formats) == ["fp32", "fp16", "bf16", "fp8"]
        assert "tf32" in ladder["skipped"] and ladder["skipped"]["tf32"]  # with its reason
        # fp8 is emulated on a CPU: timed on a smaller matmul, no ratio to fp32's
        assert formats["fp8"]["n"] < ladder["n"] == formats["fp32"]["n"]
        assert formats["fp8"]["x_fp32"] is None
        errors = [formats[name]["rel_error"] for name in ("fp32", "fp16", "bf16", "fp8")]
        assert errors == sorted(errors)
        assert formats["fp32"]["rel_error"] < 1e-5 and formats["bf16"]["rel_error"] < 2e-2
        assert formats["fp32"]["bits"] == 32 and formats["bf16"]["bits"] == 16
        assert formats["bf16"]["eps"] == 2.0**-7 and formats["fp8"]["max"] == 448
        assert formats["fp16"]["max"] == 65504

    def test_ladder_rates_and_ratios_recomputed(self, run):
        ladder = run.json["format_ladder"]
        formats = ladder["formats"]
        for name, row in formats.items():
            flop = 2 * row["n"] ** 3  # one matmul a sample on a CPU
            hardware_approx(row["tflops"], hardware_spread([flop / t / 1e12 for t in row["seconds"]]))
            if row["x_fp32"] is not None:
                expected = hardware_ratio(formats["fp32"]["seconds"], row["seconds"])
                hardware_approx(row["x_fp32"], expected)
        assert formats["fp32"]["x_fp32"]["median"] == 1
        assert ladder["low_precision"] == "bf16"

    def test_prefill_rows_count_their_flops_and_bytes(self, run):
        pd = run.json["prefill_decode"]
        ladder = run.json["format_ladder"]
        hierarchy = run.json["memory_hierarchy"]
        # a CPU's roofs: its fp32 matmul and its largest set, the ridge from the unrounded two
        assert pd["peak_flops"] == ladder["formats"]["fp32"]["tflops"]["median"] * 1e12
        assert pd["bandwidth"] == hierarchy["largest"]["gb_per_s"]["median"] * 1e9
        assert pd["ridge"] == pytest.approx(pd["peak_flops"] / pd["bandwidth"])
        rows = pd["rows"]
        assert [r["tokens"] for r in rows] == [2**k for k in range(len(rows))]
        d = 768
        f = 3072
        for row in rows:
            t = row["tokens"]
            assert row["flop"] == 2 * t * d * f
            assert row["bytes"] == 4 * (d * f + t * d + t * f)  # fp32: W, x and y once each
            assert row["intensity"] == pytest.approx(row["flop"] / row["bytes"])
            hardware_approx(row["time_us"], hardware_spread([s * 1e6 for s in row["seconds"]]))
            hardware_approx(row["tflops"],
                            hardware_spread([row["flop"] / s / 1e12 for s in row["seconds"]]))
            roof = min(pd["peak_flops"], row["intensity"] * pd["bandwidth"])
            assert row["roof_tflops"] == pytest.approx(roof / 1e12)
            regime = "compute-bound" if row["intensity"] >= pd["ridge"] else "bandwidth-bound"
            assert row["roofline_regime"] == regime
        intensity = [r["intensity"] for r in rows]
        assert intensity == sorted(intensity) and intensity[-1] > 10 * intensity[0]
        expected = hardware_ratio([rows[-1]["flop"] / s for s in rows[-1]["seconds"]],
                                  [rows[0]["flop"] / s for s in rows[0]["seconds"]])
        hardware_approx(pd["flops_most_over_one"], expected)

    def test_prefill_crossover_recomputed(self, run):
        pd = run.json["prefill_decode"]
        rows = pd["rows"]
        meet = pd["crossover"]
        flat = statistics.median([r["time_us"]["median"] for r in rows if r["tokens"] <= 8])
        assert meet["flat_us"] == pytest.approx(flat)
        growth = rows[-1]["time_us"]["median"] - rows[-2]["time_us"]["median"]
        if growth <= 0:
            assert meet["tokens"] is None and pd["prediction_held"] is False
            return
        tokens = flat / (growth / rows[-2]["tokens"])
        assert meet["tokens"] == pytest.approx(tokens)
        flop = 2 * tokens * 768 * 3072
        nbytes = 4 * (768 * 3072 + tokens * 768 + tokens * 3072)
        assert meet["intensity"] == pytest.approx(flop / nbytes)
        held = pd["ridge"] / 4 <= meet["intensity"] <= 4 * pd["ridge"]
        assert pd["prediction_held"] == held

    def test_tokens_at_intensity_inverts_the_intensity(self, lesson):
        for itemsize in (2, 4):
            for tokens in (1, 37, 1000):
                intensity = lesson.layer_flop_and_bytes(tokens, itemsize)["intensity"]
                assert lesson.tokens_at_intensity(intensity, itemsize) == pytest.approx(tokens)
        limit = 2 * 768 * 3072 / (2 * (768 + 3072))  # bf16: 614 FLOP/byte at infinitely many
        assert lesson.tokens_at_intensity(limit, 2) is None
        assert lesson.tokens_at_intensity(0.99 * limit, 2) > 10_000

    def test_decode_step_counts_its_bytes_and_matches_a_full_forward(self, run):
        step = run.json["decode_step"]
        config = GPTConfig.preset(step["preset"])
        assert step["cached_vs_full_rel_error"] < 1e-4  # fp32: the KV cache changes nothing
        weights = param_count(config, position=False)  # every matrix once, lm_head tied
        kv = 2 * config.n_layer * (step["context"] + 1) * config.n_embd
        assert step["bytes_per_step"] == 4 * (weights + kv)
        bandwidth = run.json["memory_hierarchy"]["largest"]["gb_per_s"]["median"] * 1e9
        assert step["bandwidth"] == bandwidth
        assert step["ceiling_us"] == pytest.approx(step["bytes_per_step"] / bandwidth * 1e6)
        # a layer: layernorm, qkv, 2 cache writes, attention, head merge, proj, add, ln,
        # 3 MLP, add
        assert 10 * config.n_layer <= step["ops_per_step"] <= 20 * config.n_layer + 20
        ceilings = step["tokens_per_s_ceiling"]
        for preset in ("gpt2", "gpt2-medium"):
            weight_bytes = 2 * param_count(GPTConfig.preset(preset), position=False)
            assert ceilings[preset] == pytest.approx(bandwidth / weight_bytes)
        assert ceilings["gpt2-medium"] < ceilings["gpt2"]

    def test_decode_clocks_and_what_is_derived_from_them(self, run):
        step = run.json["decode_step"]
        clocks = step["clocks"]
        assert len(clocks["issued"]) == len(clocks["finished"]) == len(clocks["tiny"]) == 3
        # the host finishes issuing before the device finishes the work
        assert all(i <= f for i, f in zip(clocks["issued"], clocks["finished"]))
        hardware_approx(step["eager_us"], hardware_spread([t * 1e6 for t in clocks["finished"]]))
        hardware_approx(step["issue_share"], hardware_ratio(clocks["issued"], clocks["finished"]))
        assert step["issue_share"]["high"] <= 1
        dispatch = [step["ops_per_step"] * t for t in clocks["tiny"]]
        hardware_approx(step["dispatch_us"], hardware_spread([t * 1e6 for t in dispatch]))
        hardware_approx(step["dispatch_share"], hardware_ratio(dispatch, clocks["finished"]))
        hardware_approx(step["issue_over_dispatch"], hardware_ratio(clocks["issued"], dispatch))
        over = step["eager_us"]["median"] / step["ceiling_us"]
        assert step["eager_over_ceiling"] == pytest.approx(over)
        held = over <= 3 and step["dispatch_share"]["median"] < 0.1  # a CPU's prediction
        assert step["prediction_held"] == held

    def test_time_decode_reads_two_clocks_and_a_tiny_op(self, lesson, monkeypatch):
        """A clock that ticks one second a reading, and a device that takes a tick to
        synchronise: issuing ends 1 s after the start, the device 3 s after it, and the
        tiny ops take 2 s (their synchronisation included)."""
        ticks = iter(range(1000))
        monkeypatch.setattr(lesson.time, "perf_counter", lambda: float(next(ticks)))
        monkeypatch.setattr(lesson, "sync", lambda device: next(ticks))
        monkeypatch.setattr(lesson, "cached_forward", lambda *args: None)
        sizes = lesson.Sizes(reps=2, steps=4)
        clocks = lesson.time_decode(None, None, 0, None, torch.device("cpu"), sizes)
        assert clocks["issued"] == [1 / 4, 1 / 4]  # a step's
        assert clocks["finished"] == [3 / 4, 3 / 4]
        assert clocks["tiny"] == [2 / lesson.TINY_OPS, 2 / lesson.TINY_OPS]  # an op's

    def test_cached_forward_is_the_model_forward(self, lesson):
        """The KV-cache decode against GPT.forward, token by token (a wrong position, mask
        or cache slot shows at once)."""
        torch.manual_seed(0)
        config = GPTConfig.preset("tiny", n_layer=2, block_size=16)
        model = GPT(config).eval()
        idx = torch.randint(0, 50257, (1, 12))
        cache = lesson.kv_cache(config, 12, torch.device("cpu"))
        with torch.no_grad():
            full = model(idx)[0][0]
            prefill = lesson.cached_forward(model, idx[:, :8], 0, cache)[0]
            steps = [lesson.cached_forward(model, idx[:, t:t + 1], t, cache)[0, 0]
                     for t in range(8, 12)]
        torch.testing.assert_close(prefill, full[:8], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.stack(steps), full[8:], rtol=1e-5, atol=1e-5)

    def test_cpu_parts_without_a_gpu_say_why(self, run):
        links = run.json["interconnect"]
        assert links["skipped"] and links["peer"] == {} and links["checks"] == {}
        energy = run.json["energy"]
        assert energy["unmeasured"] and "pj_per_flop" not in energy
        assert energy["reference"]["fp16_pj_per_flop"] == 0.75  # the references still shown
        table = run.json["spec_table"]
        assert table["of_datasheet"] is None and table["l2"] is None  # a CPU: no datasheet row

    def test_spec_table_rows(self, run):
        rows = run.json["spec_table"]["rows"]
        mine = rows[0]
        formats = run.json["format_ladder"]["formats"]
        assert mine["source"] == "measured"
        assert mine["fp32"] == formats["fp32"]["tflops"]["median"]
        assert mine["bf16"] == formats["bf16"]["tflops"]["median"]
        assert mine["tf32"] is None and mine["fp8"] is None  # none here; fp8 emulated
        largest = run.json["memory_hierarchy"]["largest"]["gb_per_s"]["median"]
        assert mine["tb_per_s"] == pytest.approx(largest / 1e3)
        assert mine["l2_mb"] is None and mine["link"] == "-"
        labels = [row["label"] for row in rows[1:]]
        assert labels == ["RTX 4090", "A100 SXM 80GB", "H100 SXM", "H200 SXM"]

    def test_reference_rows_agree_with_model_torch(self, lesson):
        """The reference table's bf16 peak and bandwidth are model_torch.DATASHEETS' rows of
        the same exact product."""
        machine = dict(name="AMD EPYC", type="cpu")
        ladder = dict(n=4, busy=False, formats={})
        hierarchy = dict(busy=False, caches={}, cliff_bytes=None,
                         largest=dict(gb_per_s=dict(median=20.0)))
        rows = lesson.spec_table(machine, ladder, hierarchy, {})["rows"]
        for row, name in zip(rows[1:], lesson.REFERENCE_ROWS):
            sheet = model_torch.DATASHEETS[name]
            assert row["bf16"] == pytest.approx(sheet.bf16_flops / 1e12)
            assert row["tb_per_s"] == pytest.approx(sheet.bandwidth / 1e12)
        assert rows[1]["bf16"] == pytest.approx(165.2) and rows[4]["tb_per_s"] == 4.8

    def test_this_gpus_datasheet_and_its_l2(self, lesson):
        """A GPU's measured share of its own datasheet (exact product); where its reference
        row's L2 differs from the driver's number (an H200: 50 MB against 60), both."""
        ladder = dict(n=8192, busy=False,
                      formats=dict(bf16=dict(n=8192, tflops=dict(median=780.0))))
        links = dict(host=dict(rows={"host->GPU pinned": dict(gb_per_s=dict(median=55.3))}))

        def table(name, l2_mb):
            machine = dict(name=name, type="cuda")
            hierarchy = dict(busy=False, caches={"L2": l2_mb << 20}, cliff_bytes=64 << 20,
                             largest=dict(gb_per_s=dict(median=4370.0)))
            return lesson.spec_table(machine, ladder, hierarchy, links)

        h200 = table("NVIDIA H200", 60)
        assert h200["of_datasheet"]["bf16"] == pytest.approx(780 / 989)
        assert h200["of_datasheet"]["tb_per_s"] == pytest.approx(4.37 / 4.8)
        assert h200["l2"]["reference_mb"] == 50 and h200["l2"]["reported_mb"] == 60
        assert h200["l2"]["cliff_bytes"] == 64 << 20
        assert h200["rows"][0]["l2_mb"] == 60 and "55.3" in h200["rows"][0]["link"]
        h100 = table("NVIDIA H100 80GB HBM3", 50)
        assert h100["l2"] is None and h100["of_datasheet"]["bf16"] == pytest.approx(780 / 989)
        pcie = table("NVIDIA H100 PCIe", 50)  # not the SXM's 989: its own 756
        assert pcie["of_datasheet"]["bf16"] == pytest.approx(780 / 756) and pcie["l2"] is None
        assert table("NVIDIA Mystery GPU", 40)["of_datasheet"] is None

    def test_report_machine_datasheet_by_exact_name(self, lesson, capsys):
        cpu = torch.device("cpu")
        machine = dict(name="NVIDIA H100 PCIe", type="cpu", memory_gb=80, gpus=1, threads=2,
                       torch="x", capability=None)
        lesson.report_machine(machine, cpu)
        lesson.report_machine(dict(machine, name="NVIDIA Mystery GPU"), cpu)
        lines = capsys.readouterr().out.splitlines()
        assert lines[1].startswith("reference:") and "756" in lines[1] and "2 TB/s" in lines[1]
        assert lines[3].startswith("reference: no datasheet row for NVIDIA Mystery GPU")

    def test_capability_decides_what_runs(self, lesson, monkeypatch, capsys):
        """Faked compute capabilities: a T4 (7.5) or V100 has no bf16 tensor cores (fp16
        stands in; tf32, bf16, fp8 skipped with the reason); an A100 (8.0) no fp8; an RTX
        4090 (8.9) or H100 (9.0) all."""
        cuda = torch.device("cuda")
        capability = [(7, 5)]
        monkeypatch.setattr(lesson.torch.cuda, "get_device_capability",
                            lambda device=None: capability[0])
        assert not lesson.has_bf16_tensor_cores(cuda)
        assert lesson.working_dtype(cuda) == torch.float16
        skipped = lesson.formats_skipped(cuda)
        assert set(skipped) == {"tf32", "bf16", "fp8"}
        assert all("(7, 5)" in why for why in skipped.values())
        machine = dict(name="Tesla T4", type="cuda", memory_gb=16, gpus=1, threads=8,
                       torch="x", capability="7.5")
        lesson.report_machine(machine, cuda)
        assert "7.5" in capsys.readouterr().out
        # what a T4 runs still passes the checks: fp32, fp16 (fp8 and bf16 absent)
        assert all(lesson.ladder_checks(dict(fp32=2e-7, fp16=3.6e-4)).values())
        capability[0] = (8, 0)
        assert lesson.has_bf16_tensor_cores(cuda)
        assert lesson.working_dtype(cuda) == torch.bfloat16
        assert set(lesson.formats_skipped(cuda)) == {"fp8"}
        for newer in [(8, 9), (9, 0)]:
            capability[0] = newer
            assert lesson.formats_skipped(cuda) == {}
        cpu = torch.device("cpu")
        assert not lesson.has_bf16_tensor_cores(cpu)
        assert lesson.working_dtype(cpu) == torch.float32
        assert set(lesson.formats_skipped(cpu)) == {"tf32"}

    def test_error_bounds_catch_the_rung_below(self, lesson):
        """Each format's bound fails the error of the next coarser format computed in its
        place; the order check fails a swap."""
        measured = dict(fp32=2e-7, tf32=2.9e-4, fp16=3.6e-4, bf16=2.9e-3, fp8=3.8e-2)
        assert all(lesson.ladder_checks(measured).values())
        for name, wrong in [("fp32", 2.9e-4), ("tf32", 2.9e-3), ("fp16", 2.9e-3),
                            ("bf16", 3.8e-2)]:
            checks = lesson.ladder_checks(dict(measured, **{name: wrong}))
            assert not checks["ladder_errors_within_format"], name
        swapped = dict(measured, fp16=3e-3, bf16=1e-3)
        assert not lesson.ladder_checks(swapped)["ladder_error_grows_as_bits_shrink"]
        assert lesson.DECODE_BOUND == 1e-4

    def test_horowitz_references_per_flop_and_per_byte(self, lesson):
        """A DRAM byte costs 217-433x an fp16 FLOP (an FMA is 2 FLOPs, a word 8 bytes), and
        ~100x only against fp32."""
        r = lesson.horowitz_per_flop_and_byte(lesson.HOROWITZ_PJ)
        assert r["fp16_pj_per_flop"] == pytest.approx((0.4 + 1.1) / 2)
        assert r["fp32_pj_per_flop"] == pytest.approx((0.9 + 3.7) / 2)
        assert r["cache_8kb_pj_per_byte"] == 1.25 and r["cache_1mb_pj_per_byte"] == 12.5
        assert r["dram_pj_per_byte"] == [162.5, 325.0]
        assert r["dram_byte_over_fp16_flop"] == pytest.approx([216.67, 433.33], rel=1e-4)
        assert r["dram_byte_over_fp32_flop"] == pytest.approx([70.65, 141.30], rel=1e-3)

    def test_energy_arithmetic_per_flop_and_per_byte(self, lesson, monkeypatch):
        """The GPU's watts into pJ: a bf16 8192^3 matmul at 659 TFLOP/s under 691 W, a copy
        of 4251 GB/s (read + written) under 656 W."""
        assert lesson.matmul_flop(8192) == 2 * 8192**3
        assert lesson.copy_traffic(1 << 30) == 2 << 30
        figures = lesson.energy_figures(691.0, 659e12, 656.0, 4251e9)
        assert figures["pj_per_flop"] == pytest.approx(1.0486, rel=1e-4)
        assert figures["pj_per_byte"] == pytest.approx(154.32, rel=1e-4)
        assert figures["byte_over_flop"] == pytest.approx(154.32 / 1.0486, rel=1e-3)
        monkeypatch.setattr(lesson.torch.cuda, "power_draw", lambda device=None: 691_000)
        assert lesson.board_watts(torch.device("cuda")) == 691.0  # NVML's milliwatts
        assert "no GPU" in lesson.power_unreadable(torch.device("cpu"))

    def test_sustained_power_reads_only_after_settling(self, lesson):
        cpu = torch.device("cpu")
        x = torch.ones(1000)
        readings = []

        def read_watts(device):
            readings.append(len(readings))
            return 100.0 + len(readings)

        out = lesson.sustained_power(lambda: x.sum(), 0.3, cpu, read_watts, settle_s=0.15)
        assert out["readings"] and len(out["readings"]) == len(readings)
        assert out["mean_watts"] == pytest.approx(statistics.mean(out["readings"]))
        assert out["watts"]["low"] == 101.0 and out["calls_per_s"] > 0

    def test_link_reference_and_ratios(self, lesson):
        """NVLink 4 (450 GB/s a direction) against PCIe 4.0 x16 (31.5) staged twice: 14x
        overlapped, 29x in turn."""
        r = lesson.link_reference()
        assert r["nvlink_over_staged_overlapped"] == pytest.approx(450 / 31.5)
        assert r["nvlink_over_staged_in_turn"] == pytest.approx(2 * 450 / 31.5)
        hardware_approx(lesson.ratio([2, 4, 9], [1, 2, 3]), dict(median=2, low=2, high=3))
        assert lesson.noise_mark(dict(median=1.1, low=0.9, high=1.3), False) == " (within noise)"
        assert lesson.noise_mark(dict(median=14, low=13, high=15), True) == " (machine busy)"
        assert lesson.noise_mark(dict(median=14, low=13, high=15), False) == ""
        assert lesson.number(17068.1) == "17068" and lesson.number(0.001333) == "0.00133"

    def test_gpu_reports_print_every_number(self, lesson, capsys):
        """The GPU-only report paths, fed GPU-shaped results: they run here, never else
        before a GPU."""
        lesson.report_links(hardware_gpu_links())
        one_gpu = dict(hardware_gpu_links(), peer={}, checks={},
                       peer_skipped="1 GPU visible: a peer copy needs two")
        lesson.report_links(one_gpu)
        matmul = dict(watts=dict(median=691.0, low=680.0, high=700.0))
        copy = dict(watts=dict(median=656.0, low=650.0, high=660.0))
        lesson.report_energy(dict(
            reference_pj=lesson.HOROWITZ_PJ,
            reference=lesson.horowitz_per_flop_and_byte(lesson.HOROWITZ_PJ),
            dtype="bfloat16", seconds=4.0, matmul=matmul, copy=copy, flops_per_s=659e12,
            bytes_per_s=4251e9, prediction_held=True, busy=False,
            **lesson.energy_figures(691.0, 659e12, 656.0, 4251e9)))
        text = capsys.readouterr().out
        assert text.count("measured: GPU 0->1") == 1 and "390" in text and "27.5" in text
        assert "14.2 [14, 14.4]x" in text and "10^1.2" in text and "needs two" in text
        assert "7.58 [7.4, 7.7]x" in text and "check peer_copies_exact: ok" in text
        assert ">= 14x staged" in text
        assert "691 [680, 700] W" in text and "659 TFLOP/s" in text and "4251 GB/s" in text
        assert "1.05 pJ per FLOP" in text and "154 pJ per byte" in text and "147x" in text
        assert "217-433x an fp16 FLOP" in text and "71-141x an fp32 FLOP" in text

    def test_gpu_decode_and_table_reports(self, lesson, capsys):
        clocks = dict(issued=[3e-3], finished=[5e-3], tiny=[7e-6])
        spread1 = dict(median=1.0, low=1.0, high=1.0)
        step = dict(device="cuda", preset="gpt2", dtype="bfloat16", context=512,
                    bytes_per_step=266e6, bandwidth=4.37e12, bandwidth_busy=False,
                    ceiling_us=60.9, ops_per_step=151, cached_vs_full_rel_error=2e-6,
                    clocks=clocks, eager_us=dict(median=5236.0, low=5200.0, high=5300.0),
                    issued_us=dict(median=3274.0, low=3200.0, high=3300.0),
                    tiny_op_us=dict(median=7.49, low=7.4, high=7.6),
                    dispatch_us=dict(median=1131.0, low=1117.0, high=1148.0),
                    eager_over_ceiling=86.0, issue_share=dict(spread1, median=0.625),
                    dispatch_share=dict(spread1, median=0.216),
                    issue_over_dispatch=dict(median=2.89, low=2.8, high=3.0),
                    tokens_per_s_ceiling=dict(gpt2=17668.0, **{"gpt2-medium": 6176.0}),
                    checks=dict(decode_cache_matches_full_forward=True),
                    prediction_held=True, busy=False)
        lesson.report_decode_step(step)
        table = dict(rows=[dict(label="NVIDIA H200", source="measured", bf16=780.0,
                                tf32=402.0, fp8=1453.0, fp32=51.1, tb_per_s=4.37, l2_mb=60.0,
                                link="host->GPU pinned 55.3 GB/s")],
                     of_datasheet=dict(bf16=780 / 989, tb_per_s=4.37 / 4.8), busy=True,
                     l2=dict(label="H200 SXM", reference_mb=50, source="x", reported_mb=60,
                             cliff_bytes=64 << 20))
        lesson.report_spec_table(table)
        text = capsys.readouterr().out
        assert "5236 [5200, 5300] us" in text and "86x the ceiling" in text
        assert "62.5%" in text and "21.6%" in text and "151 ops" in text
        assert "2.89 [2.8, 3]x a bare add_" in text
        assert "17668 tokens/s" in text and "6176 tokens/s" in text
        assert "prediction held" in text
        assert "1453" in text and "55.3 GB/s" in text and "(machine busy)" in text
        assert "79% of its datasheet's bf16 peak" in text and "91%" in text
        assert "50 MB" in text and "60 MB" in text and "64 MB" in text

    def test_a_report_from_busy_or_flat_numbers_says_so(self, lesson, capsys):
        """A ridge from busy roofs, a crossover that could not be derived: said, not hidden."""
        row = dict(tokens=1, intensity=1.0, time_us=dict(median=5.0, low=5.0, high=5.0),
                   tflops=dict(median=1.0), gb_per_s=dict(median=1.0), roof_tflops=4.0,
                   roofline_regime="bandwidth-bound")
        lesson.report_prefill_decode(dict(
            peak_flops=800e12, bandwidth=4e12, ridge=200.0, roofs_busy=True, busy=False,
            dtype="bfloat16", rows=[row, dict(row, tokens=2)],
            crossover=dict(flat_us=5.0, tokens=None, intensity=None),
            flops_most_over_one=dict(median=1.0, low=0.9, high=1.1), prediction_held=False))
        lines = capsys.readouterr().out.splitlines()
        assert "200 FLOP/byte" in lines[0] and lines[0].endswith("(machine busy)")
        assert any("no crossover" in line for line in lines)
        assert any("(within noise)" in line for line in lines)
        assert lines[-1].startswith("  prediction missed")

    def test_a_wrong_result_fails_the_run_after_the_json(self, lesson, tmp_path, monkeypatch,
                                                         capsys):
        """The KV-cache decode given a wrong position: the check fails, the JSON is still
        written, the exit is non-zero."""
        right = lesson.cached_forward

        def wrong_position(model, idx, start, cache):
            if idx.size(1) == 1:
                start = start - 1  # the new token's keys over the last cached token's
            return right(model, idx, start, cache)

        monkeypatch.setattr(lesson, "cached_forward", wrong_position)
        path = tmp_path / "r.json"
        monkeypatch.setattr("sys.argv", ["02_hardware.py", "--quick", "--device", "cpu",
                                         "--json", str(path), "--out", str(tmp_path)])
        with pytest.raises(SystemExit) as stop:
            lesson.main()
        assert "decode_cache_matches_full_forward" in str(stop.value.code)
        out = json.loads(path.read_text())
        assert out["decode_step"]["cached_vs_full_rel_error"] > 1e-2
        assert out["checks"]["decode_cache_matches_full_forward"] is False
        assert out["checks"]["ladder_errors_within_format"] is True
        assert "check decode_cache_matches_full_forward: FAILED" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# 03_compile.py


def compile_ratio(numerators, denominators):
    """03's rule for a ratio of two timings, written out again: the median of the per-pair
    ratios, with their min and max."""
    pairs = []
    for a, b in zip(numerators, denominators):
        pairs.append(a / b)
    return dict(median=statistics.median(pairs), min=min(pairs), max=max(pairs))


def compile_summary(samples):
    return dict(median=statistics.median(samples), min=min(samples), max=max(samples))


COMPILE_BASELINES = dict(torch_compile="eager", jax_jit="jax_eager")  # no CUDA graphs on a CPU
COMPILE_SECTIONS = ("overhead", "bandwidth", "compute")
COMPILE_EXPERIMENTS = ("overhead", "bandwidth", "compute", "capture_torch", "capture_jax")


class TestCompile:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return expect_ok(run_lesson("03_compile.py", "--quick", tmp=tmp_path_factory.mktemp("03")))

    @pytest.fixture(scope="class")
    @classmethod
    def lesson(cls):
        before = dict(os.environ)
        module = load_lesson("03_compile.py")
        os.environ.clear()  # its setdefaults (before jax, torch) stay out of later lessons' runs
        os.environ.update(before)
        return module

    # The run: physics and equality

    def test_compiled_equals_eager(self, run):
        r = run.json
        checks = r["checks"]
        for name in ["overhead_torch_compile_equals_eager", "overhead_jax_jit_equals_jax_eager",
                     "overhead_jax_equals_torch_eager", "bandwidth_torch_compile_equals_eager",
                     "bandwidth_jax_jit_equals_jax_eager", "bandwidth_jax_equals_torch_eager",
                     "matmul_torch_compile_equals_eager", "matmul_jax_jit_equals_jax_eager",
                     "matmul_jax_equals_torch_eager"]:
            assert checks[name] is True, name
        assert all(checks.values()), checks
        # each check is its measured error against a tolerance tight enough that bf16 or the
        # tanh GELU would fail it (fp32 on the CPU: 1e-5), with room above fp32 rounding
        for section, prefix in [("overhead", "overhead"), ("bandwidth", "bandwidth"),
                                ("compute", "matmul")]:
            errors = r[section]["error"]
            tol = r[section]["tolerance"]
            assert tol == 1e-5
            assert set(errors) == {f"{prefix}_torch_compile_equals_eager",
                                   f"{prefix}_jax_jit_equals_jax_eager",
                                   f"{prefix}_jax_equals_torch_eager"}
            for check, error in errors.items():
                assert checks[check] == (error <= tol)
                assert error < tol / 3, (section, check, error)

    def test_check_lines_printed(self, run):
        for name, passed in run.json["checks"].items():
            assert passed
            assert f"check {name}: ok" in run.stdout, name

    def test_fusion_one_dispatch_instead_of_48(self, run):
        r = run.json["overhead"]
        per_call = r["per_call"]
        assert per_call["eager"]["dispatched"] == r["n_ops"] == 48
        assert per_call["torch_compile"]["dispatched"] <= 2  # its guard check and one region
        assert per_call["jax_eager"] == {"jaxpr_equations": 48}
        assert per_call["jax_jit"] == {"jaxpr_equations": 1}

    def test_times_and_speedups_recomputed_from_the_samples(self, run):
        r = run.json
        reps = dict(overhead=5, bandwidth=3, compute=3)  # --quick
        variants = dict(overhead=["eager", "torch_compile", "jax_eager", "jax_jit"],
                        bandwidth=["eager", "torch_compile", "jax_eager", "jax_jit", "copy",
                                   "fp32_matmul"],
                        compute=["eager", "torch_compile", "jax_eager", "jax_jit", "copy"])
        for section in COMPILE_SECTIONS:
            samples = r[section]["samples_s"]
            assert list(samples) == variants[section]
            assert list(r[section]["time"]) == variants[section]
            for name, seconds in samples.items():
                assert len(seconds) == reps[section]
                assert min(seconds) > 0
                assert r[section]["time"][name] == pytest.approx(compile_summary(seconds))
            speedup = r[section]["speedup"]
            assert set(speedup) == set(COMPILE_BASELINES)
            for name, baseline in COMPILE_BASELINES.items():
                expected = compile_ratio(samples[baseline], samples[name])
                assert speedup[name] == pytest.approx(expected), (section, name)
            assert set(r[section]["first_call_s"]) == set(COMPILE_BASELINES)

    def test_compile_repaid_after_calls_recomputed(self, run):
        r = run.json["overhead"]
        for name, baseline in COMPILE_BASELINES.items():
            calls = r["pays_back_after_calls"][name]
            if r["speedup"][name]["min"] <= 1:  # not faster in every pair: no such number
                assert calls is None
                continue
            compiled_s = r["time"][name]["median"]
            saved_s = r["time"][baseline]["median"] - compiled_s
            assert calls == pytest.approx((r["first_call_s"][name] - compiled_s) / saved_s)

    def test_bytes_on_paper(self, run, lesson):
        bw = run.json["bandwidth"]
        n = bw["rows"] * bw["width"]
        width = bw["width"]
        # eager: 5 ops, each reads its inputs and writes its output; fused: one pass
        assert bw["bytes_eager"] == 4 * (11 * n + 3 * width)
        assert bw["bytes_fused"] == 4 * (3 * n + 3 * width)
        assert lesson.chain_bytes(2, 3) == dict(eager=4 * (66 + 9), fused=4 * (18 + 9))
        # XLA counts ~5.7 FLOP/B for the exact-erf chain, and the bytes of one fused pass
        assert 4 < bw["intensity_flop_per_byte"] < 8
        assert bw["intensity_flop_per_byte"] == pytest.approx(bw["xla_flops"] / bw["xla_bytes"])
        assert abs(bw["xla_bytes"] / bw["bytes_fused"] - 1) < 0.1

    def test_fused_chain_regime_follows_from_its_numbers(self, run):
        bw = run.json["bandwidth"]
        samples = bw["samples_s"]
        n = bw["rows"] * bw["width"]
        assert bw["ridge_n"] == 512  # --quick
        # round by round: a copy reads and writes N fp32 values, the square matmul does
        # 2 n^3 FLOPs; the ridge is their ratio; the floor is the fused bytes at the copy's
        # bandwidth; the bound the slower of the floor and the chain's FLOPs at the roof
        bandwidth = []
        flops = []
        floor = []
        bound = []
        for copy_s, matmul_s in zip(samples["copy"], samples["fp32_matmul"]):
            bandwidth.append(2 * n * 4 / copy_s)
            flops.append(2 * 512**3 / matmul_s)
            floor.append(bw["bytes_fused"] / bandwidth[-1])
            bound.append(max(floor[-1], bw["xla_flops"] / flops[-1]))
        assert bw["copy_bandwidth_Bps"] == pytest.approx(compile_summary(bandwidth))
        assert bw["fp32_matmul_flops"] == pytest.approx(compile_summary(flops))
        assert bw["floor_s"] == pytest.approx(compile_summary(floor))
        assert bw["bound_s"] == pytest.approx(compile_summary(bound))
        ridge = compile_ratio(flops, bandwidth)
        assert bw["ridge_flop_per_byte"] == pytest.approx(ridge)
        for name in ("eager", "torch_compile", "jax_eager", "jax_jit"):
            assert bw["x_bound"][name] == pytest.approx(compile_ratio(samples[name], bound))
        # the classification follows from the numbers: above the ridge compute-bound; a
        # finding only when the intensity lies outside the ridge's whole range. Which regime
        # it is depends on the measured ridge, a timing: reported, never asserted here
        intensity = bw["intensity_flop_per_byte"]
        assert (bw["regime"] == "compute-bound") == (intensity > ridge["median"])
        assert bw["regime"] in ("compute-bound", "bandwidth-bound")
        outside = intensity > ridge["max"] or intensity < ridge["min"]
        assert bw["regime_is_finding"] == outside

    def test_matmul_regime_and_rate_recomputed(self, run):
        mm = run.json["compute"]
        samples = mm["samples_s"]
        n = mm["n"]
        assert n == 512 and mm["dtype"] == "torch.float32"  # --quick, on a CPU
        assert mm["intensity_flop_per_byte"] == pytest.approx(2 * n / (3 * 4))
        bytes_s = []  # the matmul's 3 n^2 values at the bandwidth of a copy of n^2 values
        for copy_s in samples["copy"]:
            bytes_s.append(copy_s * 3 / 2)
        x_bytes = compile_ratio(samples["eager"], bytes_s)
        assert mm["eager_x_bytes_time"] == pytest.approx(x_bytes)
        assert (mm["regime"] == "compute-bound") == (x_bytes["median"] > 1)
        for name, rate in mm["flops_per_s"].items():
            assert rate == pytest.approx(2 * n**3 / mm["time"][name]["median"])

    def test_graph_breaks_and_recompiles(self, run):
        cap = run.json["capture_torch"]
        # bytecode capture: .item() and print break the graph, the clean function does not
        assert cap["dirty"]["graph_break_count"] > 0 and cap["dirty"]["graph_count"] > 1
        assert cap["clean"]["graph_break_count"] == 0 and cap["clean"]["graph_count"] == 1
        assert len(cap["break_reasons"]["dirty"]) == cap["dirty"]["graph_break_count"]
        # recompiles: one per new shape when static, none for a repeated shape, one in all
        # when dynamic
        shapes = cap["compiles_for_shapes"]
        assert cap["shapes"] == [8, 16, 8, 32]
        assert shapes["dynamic=False"] == [1, 2, 2, 3]
        assert shapes["dynamic=True"] == [1, 1, 1, 1]
        assert shapes["dynamic=None"][2] == shapes["dynamic=None"][1]

    def test_jax_traces_and_cost(self, run):
        jx = run.json["capture_jax"]
        # tracing: the Python counter inside the jitted function counts traces
        assert jx["traces_for_shapes"]["traces_after_each"] == [1, 2, 2, 3]
        assert jx["traces_for_static_args"]["traces_after_each"] == [1, 2, 2]
        assert jx["nonstatic_loop_bound_error"] == "TracerIntegerConversionError"
        # the jaxpr: one equation per primitive of the chain, the exact erf's erfc among them
        assert "erfc" in jx["jaxpr"] and "\x1b" not in jx["jaxpr"]
        # XLA's cost model sees one fused pass: bytes accessed ~ the floor on paper
        aot = jx["aot"]
        assert aot["bytes_floor"] == run.json["bandwidth"]["bytes_fused"]
        assert abs(aot["bytes_accessed"] / aot["bytes_floor"] - 1) < 0.1
        assert aot["lower_s"] > 0 and aot["compile_s"] > 0

    def test_predictions_follow_from_the_numbers(self, run):
        r = run.json
        assert set(r["predictions"]) == set(COMPILE_EXPERIMENTS)
        for name in COMPILE_EXPERIMENTS:
            assert r["predictions"][name] == r[name]["prediction_held"]
        # held only when the speed-up reaches the predicted value AND is faster in every pair
        overhead = r["overhead"]
        held = True
        for name, least in overhead["predicted_least"].items():
            speedup = overhead["speedup"][name]
            if speedup["median"] < least or speedup["min"] <= 1:
                held = False
        assert overhead["prediction_held"] == held
        assert set(overhead["predicted_least"]) == set(COMPILE_BASELINES)  # no CUDA graphs
        bw = r["bandwidth"]
        speedup = bw["speedup"]["torch_compile"]
        held = (speedup["median"] >= bw["predicted"]["speedup"] and speedup["min"] > 1
                and bw["x_bound"]["torch_compile"]["median"] <= bw["predicted"]["most_x_bound"])
        assert bw["prediction_held"] == held
        held = all(s["median"] <= 1.1 for s in r["compute"]["speedup"].values())
        assert r["compute"]["prediction_held"] == held
        cap = r["capture_torch"]
        held = (cap["clean"] == dict(graph_count=1, graph_break_count=0)
                and cap["dirty"] == dict(graph_count=3, graph_break_count=2)
                and cap["compiles_for_shapes"] == {"dynamic=False": [1, 2, 2, 3],
                                                   "dynamic=None": [1, 2, 2, 2],
                                                   "dynamic=True": [1, 1, 1, 1]})
        assert cap["prediction_held"] == held
        jx = r["capture_jax"]
        held = (jx["traces_for_shapes"]["traces_after_each"] == [1, 2, 2, 3]
                and jx["traces_for_static_args"]["traces_after_each"] == [1, 2, 2]
                and jx["nonstatic_loop_bound_error"] is not None
                and abs(jx["aot"]["bytes_accessed"] / jx["aot"]["bytes_floor"] - 1) < 0.1)
        assert jx["prediction_held"] == held
        held_lines = run.stdout.count("\n  prediction held: ")
        missed_lines = run.stdout.count("\n  prediction missed: ")
        assert held_lines == sum(r["predictions"].values())
        assert held_lines + missed_lines == len(COMPILE_EXPERIMENTS)

    def test_busy_bookkeeping(self, run):
        r = run.json
        assert r["lesson"] == "03_compile" and r["quick"] is True
        assert r["device"]["type"] == "cpu"
        assert isinstance(r["machine_busy"], bool)
        for key in ("checks", "predictions"):
            assert all(isinstance(value, bool) for value in r[key].values()), key
        shares = []
        busy = []
        for name in COMPILE_EXPERIMENTS:
            experiment = r[name]
            shares.extend(experiment["cpu_shares"])
            busy.append(experiment["busy"])
            if name == "capture_torch":  # counts only, nothing timed
                assert experiment["cpu_shares"] == [] and experiment["busy"] is False
                continue
            assert len(experiment["cpu_shares"]) == 2  # before and after
            assert experiment["busy"] == (min(experiment["cpu_shares"]) < 0.9)
        assert r["cpu_shares"] == shares
        assert all(0 < share < 1.5 for share in shares)
        assert r["machine_busy"] == any(busy)
        # a busy run marks its numbers and says so at the end; an idle one marks none
        assert ("(machine busy)" in run.stdout) == r["machine_busy"]
        assert ("\nmachine busy: other programs" in run.stdout) == r["machine_busy"]

    def test_labels_and_quiet_output(self, run):
        assert "measured:" in run.stdout and "derived:" in run.stdout
        # no terminal colour codes (the jaxpr), no profiler start/stop lines, no tracebacks
        assert "\x1b" not in run.stdout + run.stderr
        assert "USDT" not in run.stdout + run.stderr and "profiler_start" not in run.stderr
        assert "Traceback" not in run.stderr
        # no stray files: the lesson draws no figure, and writes only its JSON
        assert sorted(p.name for p in run.folder.iterdir()) == ["03_compile.py", "result.json"]

    # The rules, as functions, on known inputs

    def test_ratio_is_the_median_of_pairs(self, lesson):
        # pairs 2, 4, 3: the median pair 3, not the ratio of the medians 4 / 1
        assert lesson.ratio([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == dict(median=3.0, min=2.0, max=4.0)
        assert lesson.summary([3.0, 1.0, 2.0]) == dict(median=2.0, min=1.0, max=3.0)

    def test_noise_and_busy_marks(self, lesson):
        assert lesson.beyond_noise(dict(median=2.0, min=1.2, max=3.0))
        assert lesson.beyond_noise(dict(median=0.5, min=0.2, max=0.9))
        assert not lesson.beyond_noise(dict(median=2.0, min=0.8, max=3.0))
        assert not lesson.beyond_noise(dict(median=1.0, min=1.0, max=1.0))
        assert lesson.mark(True, False) == ""
        assert lesson.mark(False, False) == " (within noise)"
        assert lesson.mark(True, True) == " (machine busy)"
        assert lesson.mark(False, True) == " (machine busy)"
        assert lesson.is_busy([0.95, 0.99]) is False
        assert lesson.is_busy([0.95, 0.5]) is True
        assert lesson.is_busy([0.9, 1.0]) is False  # BUSY_SHARE itself is not busy
        assert lesson.BUSY_SHARE == 0.9

    def test_gather_names_the_busy_experiments(self, lesson):
        results = dict(a=dict(checks=dict(x=True), prediction_held=True, cpu_shares=[1.0, 0.95],
                              busy=False),
                       b=dict(checks=dict(y=False), prediction_held=False, cpu_shares=[0.5, 0.9],
                              busy=True))
        run = lesson.gather(results)
        assert run == dict(checks=dict(x=True, y=False), predictions=dict(a=True, b=False),
                           cpu_shares=[1.0, 0.95, 0.5, 0.9], busy_during=["b"])

    def test_a_speedup_made_by_noise_is_not_a_held_prediction(self, lesson):
        # the busy laptop: one compiled sample 34 ms among 60 us ones. The median pair says
        # 3x, but one pair says 0.006x: within noise, so the prediction is not held
        eager = [190e-6, 200e-6, 210e-6]
        compiled = [60e-6, 34e-3, 65e-6]
        speedup = lesson.ratio(eager, compiled)
        assert speedup["median"] == pytest.approx(190e-6 / 60e-6)  # pairs 3.17, 0.006, 3.23
        assert not lesson.beyond_noise(speedup)
        assert lesson.mark(lesson.beyond_noise(speedup), False) == " (within noise)"
        least = dict(torch_compile=2.0)
        assert not lesson.speedups_held(dict(torch_compile=speedup), least)
        quiet = lesson.ratio(eager, [60e-6, 70e-6, 65e-6])
        assert lesson.speedups_held(dict(torch_compile=quiet), least)

    def test_gpu_predictions_from_known_numbers(self, lesson):
        # a GPU's run (CUDA graphs included), from numbers like an H200's; the CPU cannot run it
        least = lesson.OVERHEAD_LEAST["cuda"]
        assert set(least) == {"torch_compile", "reduce_overhead", "jax_jit"}
        speedups = dict(torch_compile=dict(median=8.9, min=7.5, max=11.0),
                        reduce_overhead=dict(median=4.6, min=3.9, max=5.7),
                        jax_jit=dict(median=143.0, min=95.0, max=180.0))
        assert lesson.speedups_held(speedups, least)
        speedups["reduce_overhead"] = dict(median=1.5, min=1.2, max=1.9)  # graphs below 2x
        assert not lesson.speedups_held(speedups, least)
        predicted = lesson.BANDWIDTH_PREDICTED["cuda"]
        fast = dict(median=4.04, min=3.8, max=4.2)
        assert lesson.bandwidth_held(fast, dict(median=1.15, min=1.1, max=1.3), predicted)
        assert not lesson.bandwidth_held(fast, dict(median=1.7, min=1.6, max=1.8), predicted)
        slow = dict(median=2.0, min=1.8, max=2.2)  # fused, but not 3x: missed
        assert not lesson.bandwidth_held(slow, dict(median=1.15, min=1.1, max=1.3), predicted)
        assert lesson.compute_held(dict(torch_compile=dict(median=0.90),
                                        jax_jit=dict(median=1.01)))
        assert not lesson.compute_held(dict(torch_compile=dict(median=1.3),
                                            jax_jit=dict(median=1.0)))

    def test_compile_repaid_arithmetic(self, lesson):
        # a 2.66 s compile, 585 us eager against 65 us compiled: (2.66 - 65e-6) / 520e-6 calls
        calls = lesson.calls_to_pay_back(2.66, 585e-6, 65e-6)
        assert calls == pytest.approx((2.66 - 65e-6) / 520e-6)
        assert 5000 < calls < 5200

    def test_on_roofline_from_known_samples(self, lesson):
        # two rounds: the copy of N = 1000 fp32 values takes 1 us, then 2 us (8 and 4 GB/s);
        # a 10^3 matmul (2000 FLOPs) 1 us both times (2 GFLOP/s): ridges 0.25, 0.5 FLOP/B
        samples = dict(copy=[1e-6, 2e-6], fp32_matmul=[1e-6, 1e-6], eager=[6e-6, 6e-6],
                       torch_compile=[3e-6, 3e-6], jax_eager=[9e-6, 9e-6], jax_jit=[3e-6, 6e-6])
        r = lesson.on_roofline(samples, 1000, 10, 12000, 1000.0, 100.0)
        assert r["copy_bandwidth_Bps"] == pytest.approx(dict(median=6e9, min=4e9, max=8e9))
        assert r["ridge_flop_per_byte"] == pytest.approx(dict(median=0.375, min=0.25, max=0.5))
        assert r["floor_s"] == pytest.approx(dict(median=2.25e-6, min=1.5e-6, max=3e-6))
        assert r["bound_s"] == r["floor_s"]  # 1000 FLOPs at 2 GFLOP/s: 0.5 us, below the floor
        assert r["intensity_flop_per_byte"] == 10.0
        assert r["regime"] == "compute-bound" and r["regime_is_finding"]
        assert r["x_bound"]["torch_compile"] == pytest.approx(dict(median=1.5, min=1.0, max=2.0))
        assert r["x_bound"]["jax_jit"] == pytest.approx(dict(median=2.0, min=2.0, max=2.0))
        # the same chain at 0.3 FLOP/B: inside the ridge's range, bandwidth-bound by the
        # median but not a finding
        r = lesson.on_roofline(samples, 1000, 10, 12000, 30.0, 100.0)
        assert r["regime"] == "bandwidth-bound" and not r["regime_is_finding"]

    def test_dispatches_counted_by_the_profiler(self, lesson):
        import torch
        x = torch.randn(16)
        counts = lesson.dispatches_per_call(lambda: torch.sin(x) * 2 + 1, "cpu", calls=3)
        assert counts == dict(dispatched=3.0)  # sin, mul, add: three calls into torch

    def test_gpu_sizes_follow_the_card(self, lesson):
        # 1 GiB chain tensors where 12 of them fit in half the card, smaller below 24 GiB;
        # rows a multiple of 1024, and always far past a GPU's L2 (tens of MB)
        gib = 2**30
        expected = {8: 21504, 12: 32768, 24: 65536, 80: 65536, 141: 65536}
        for memory_gib, rows in expected.items():
            sizes = lesson.gpu_sizes(memory_gib * gib)
            assert sizes.rows == rows, memory_gib
            tensor_bytes = sizes.rows * sizes.width * 4
            assert lesson.HELD_AT_PEAK * tensor_bytes <= memory_gib * gib / 2
            assert tensor_bytes <= gib and tensor_bytes > 256 * 2**20
            assert sizes.matmul_dtype == lesson.GPU.matmul_dtype and sizes.reps == lesson.GPU.reps


# ---------------------------------------------------------------------------------------
# 04_memory.py


MEMORY_GiB = 2**30


def memory_config(run):
    """The model the run's experiments 1-4 used."""
    return GPTConfig(**run.json["sizes"]["model"])


def memory_rows(run):
    """Experiments 2 and 3's rows, one per configuration."""
    return dict(run.json["mixed_precision"]["rows"], **run.json["checkpointing"]["rows"])


def memory_hand_largest_batch(config, budget, bf16):
    """By hand from model_torch's accounting: the peak is affine in the batch B on each side,
      backward's start: 12 N + act(B) + max(8 V T B, recompute(B))
      backward's end:   16 N + max(recompute(B), 8 V d)
    with recompute(B) = B T x (one block's insides per token) under checkpointing, else 0."""
    state, T, V, d = state_bytes(config), config.block_size, config.vocab_size, config.n_embd
    act0 = activation_bytes(config, 0, bf16=bf16)
    act_per_seq = activation_bytes(config, 1, bf16=bf16) - act0
    start0 = state["params"] + state["optimizer"] + act0
    end0 = sum(state.values())
    if not config.checkpoint:
        if end0 + 8 * V * d > budget or start0 + act_per_seq + 8 * V * T > budget:
            return 0
        return int((budget - start0) // (act_per_seq + 8 * V * T))
    inside = block_activation_terms(replace(config, checkpoint=False), bf16=bf16)
    recompute_per_seq = T * sum(inside.values())
    copies = 2 * 12 * d * d if bf16 else 0
    best = 0
    for batch in range(1, 10_000):  # the peak grows with the batch: stop at the first miss
        start = start0 + batch * act_per_seq + max(8 * V * T * batch, recompute_per_seq * batch + copies)
        end = end0 + max(recompute_per_seq * batch + copies, 8 * V * d)
        if max(start, end) > budget:
            return best
        best = batch
    return best


class TestMemory:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return expect_ok(run_lesson("04_memory.py", "--quick", tmp=tmp_path_factory.mktemp("04")))

    def test_json_has_the_shared_keys(self, run):
        r = run.json
        assert r["lesson"] == "04_memory" and r["quick"] is True
        assert isinstance(r["machine_busy"], bool) and isinstance(r["device"], dict)
        assert all(isinstance(s, float) for s in r["cpu_shares"]) and len(r["cpu_shares"]) >= 4
        assert r["checks"] and all(ok is True for ok in r["checks"].values()), r["checks"]
        assert r["predictions"] and all(isinstance(held, bool) for held in r["predictions"].values())
        for name in r["checks"]:
            assert f"check {name}: ok" in run.stdout
        for label in ("measured:", "derived:", "predicted:"):
            assert label in run.stdout

    def test_accounting_is_exact(self, run):
        # params / grads / AdamW moments: predicted from the config = counted numel x element_size
        # of the live parameters, their .grad and the optimizer's exp_avg + exp_avg_sq tensors
        a = run.json["anatomy"]
        cfg = memory_config(run)
        for k in ("params", "grads", "optimizer"):
            assert a["predicted"][k] == a["counted"][k], k
        assert all(a["counted"][k] == v for k, v in state_bytes(cfg).items())
        assert a["counted"]["params"] + a["counted"]["grads"] + a["counted"]["optimizer"] == 16 * param_count(cfg)
        # activations too, to the byte on a CPU: each tensor saved for backward is in the accounting
        assert a["predicted"]["activations"] == a["counted"]["activations"]
        assert a["activations_ratio"] == 1.0 and a["measured"] == {}  # no allocator counter on a CPU
        # the anatomy is shown term by term, and the terms add up to the total
        assert sum(a["activation_terms"].values()) == a["predicted"]["activations"]
        # the logits, the largest single term at a 50304 vocabulary, under the name a reader knows
        logits = a["activation_terms"]["logits (fp32 log-softmax, V per token)"]
        assert logits == 4 * cfg.vocab_size * run.json["sizes"]["batch"] * cfg.block_size

    def test_autocast_keeps_state_fp32(self, run):
        dtypes = run.json["mixed_precision"]["rows"]["bf16 autocast"]["dtypes"]
        assert dtypes == {k: ["torch.float32"] for k in ("params", "grads", "optimizer")}
        assert run.json["mixed_precision"]["rows"]["fp32"]["dtypes"] == dtypes

    def test_checkpointing_lowers_activations_same_grads(self, run):
        c = run.json["checkpointing"]
        rows = memory_rows(run)
        for prec, plain in (("fp32", "fp32"), ("bf16 autocast", "bf16 autocast")):
            assert rows[f"{prec} + checkpoint"]["activations_counted"] < rows[plain]["activations_counted"]
        assert c["grad_max_rel_error"] <= 1e-6 and run.json["checks"]["checkpoint_grads_equal"]
        # AdamW with lr=0 leaves the weights alone, and every experiment builds the same model
        # from the same seed: the checkpointed losses equal the plain ones, bf16's is close to fp32's
        assert rows["fp32 + checkpoint"]["loss"] == rows["fp32"]["loss"]
        assert rows["bf16 autocast + checkpoint"]["loss"] == rows["bf16 autocast"]["loss"]
        assert abs(rows["bf16 autocast"]["loss"] / rows["fp32"]["loss"] - 1) < 1e-3
        # the FLOPs it adds: 16 L d^2 + 4 L T d per token (each block's forward again, up to
        # its last matmul: TestModelTorch counts it), over 6N + 12 L T d
        cfg = memory_config(run)
        L, d, T = cfg.n_layer, cfg.n_embd, cfg.block_size
        extra = (16 * L * d * d + 4 * L * T * d) / (6 * param_count(cfg, position=False) + 12 * L * T * d)
        assert c["extra_flops"] == pytest.approx(extra, rel=1e-12)

    def test_predictions_in_the_rows_are_the_accounting(self, run):
        lesson_configurations = {"fp32": (False, False), "bf16 autocast": (True, False),
                                 "fp32 + checkpoint": (False, True),
                                 "bf16 autocast + checkpoint": (True, True)}
        cfg = memory_config(run)
        batch = run.json["sizes"]["batch"]
        rows = memory_rows(run)
        assert set(rows) == set(lesson_configurations)
        for name, (bf16, ckpt) in lesson_configurations.items():
            row, config = rows[name], replace(cfg, checkpoint=ckpt)
            assert row["activations_predicted"] == activation_bytes(config, batch, bf16=bf16), name
            assert row["peak_predicted"] == predicted_peak_bytes(config, batch, bf16), name
            assert row["activations_counted"] == row["activations_measured"], name  # CPU: the count
            assert row["activations_predicted"] == row["activations_counted"], name  # to the byte

    def test_timings_are_interleaved_pairs_and_their_ratios(self, run):
        # derived numbers recomputed from the raw samples: each ratio is the median of the
        # pair-by-pair ratios, with their min and max
        mp = run.json["mixed_precision"]
        fp32 = mp["rows"]["fp32"]["seconds"]
        bf16 = mp["rows"]["bf16 autocast"]["seconds"]
        reps = run.json["sizes"]["reps"]
        assert len(fp32) == len(bf16) == reps
        ratios = [a / b for a, b in zip(fp32, bf16)]
        assert mp["speed"] == {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        timings = run.json["checkpointing"]["timings"]
        assert set(timings) == {"fp32 + checkpoint"}  # a CPU times bf16 in [2] only
        for timing in timings.values():
            ratios = [a / b for a, b in zip(timing["checkpointed"], timing["plain"])]
            assert timing["cost"]["median"] == statistics.median(ratios)
            assert timing["held"] == (min(ratios) > 1)

    def test_accumulated_grads_equal_full_batch(self, run):
        acc = run.json["accumulation"]
        assert run.json["checks"]["accumulated_grads_equal_full_batch"] is True
        assert acc["grad_max_rel_error"] < 1e-5
        assert acc["k"] * acc["micro_batch"] == acc["batch"] == run.json["sizes"]["batch"]
        assert acc["k"] > 1
        assert acc["activations_counted_micro"] < acc["activations_counted_full"]
        assert acc["activations_counted_micro"] == acc["activations_predicted_micro"]
        assert acc["activations_counted_full"] == acc["activations_predicted_full"]
        assert acc["peak_rise_micro"] < acc["peak_rise_full"]

    def test_accumulation_peak_is_the_accounting(self, run):
        # by hand: one batch peaks at backward's start (activations + two fp32 V-wide gradients
        # per token) or its end (grads + the tied embedding's two V x d); micro-batches add the
        # gradients kept from the first one, and a third V x d at the end (their sum)
        acc = run.json["accumulation"]
        cfg = memory_config(run)
        V, d, T, grads = cfg.vocab_size, cfg.n_embd, cfg.block_size, 4 * param_count(cfg)
        full = max(activation_bytes(cfg, acc["batch"]) + 8 * V * T * acc["batch"], grads + 8 * V * d)
        micro = max(grads + activation_bytes(cfg, acc["micro_batch"]) + 8 * V * T * acc["micro_batch"],
                    grads + 12 * V * d)
        assert acc["peak_rise_predicted_full"] == full
        assert acc["peak_rise_predicted_micro"] == micro
        assert acc["peak_rise_full"] == pytest.approx(full, rel=0.05)  # the profiler's trace
        assert acc["peak_rise_micro"] == pytest.approx(micro, rel=0.05)

    def test_peak_predicted_matches_the_profiler(self, run):
        # the CPU's profiler trace records every allocation and free: the step's measured peak
        cfg = memory_config(run)
        tokens = run.json["sizes"]["batch"] * cfg.block_size
        for name, row in memory_rows(run).items():
            assert abs(row["peak_predicted"] / row["peak_measured"] - 1) < 0.05, name
            # below the sum of state, activations and the head's gradients: backward frees each
            # layer's activations as it writes that layer's gradients
            naive = 16 * param_count(cfg) + row["activations_counted"] + 8 * cfg.vocab_size * tokens
            assert row["peak_measured"] < naive, name

    def test_fit_rows_are_the_accounting_and_predicted_only(self, run):
        fit = run.json["what_fits"]
        assert fit["memories"] == {"24.0 GiB": 24 * MEMORY_GiB}  # a CPU: the book's card, no context
        assert run.json["memory"] == {"gb": 24, "outside": 0, "tensors": 24 * MEMORY_GiB, "fraction": None}
        gpt2 = GPTConfig.preset("gpt2")
        bf16_of = {"fp32": False, "bf16 autocast": True, "fp32 + checkpoint": False,
                   "bf16 autocast + checkpoint": True}
        for name, row in fit["rows"].items():
            config = replace(gpt2, checkpoint=name.endswith("checkpoint"))
            bf16 = bf16_of[name]
            assert row["predicted"] == {"24.0 GiB": memory_hand_largest_batch(config, 24 * MEMORY_GiB, bf16)}
            safe = memory_hand_largest_batch(config, 24 * MEMORY_GiB / ALLOCATOR_HEADROOM, bf16)
            assert row["predicted_with_headroom"] == {"24.0 GiB": safe}
            assert row["measured"] is None  # no GPU here: prediction only
        assert fit["rows"]["fp32"]["predicted"]["24.0 GiB"] == 19
        for key in ("fit_between_predictions", "fit_each_technique_raises", "big_model_fits_as_predicted"):
            assert key not in run.json["predictions"]  # nothing tried, nothing judged

    def test_big_model_fits_only_with_the_techniques(self, run):
        lesson = load_lesson("04_memory.py")
        big = lesson.BIG_MODEL
        fits = {}
        for c in lesson.CONFIGURATIONS:
            fits[c.name] = lesson.predicted_largest_batch(replace(big, checkpoint=c.checkpoint), 24 * MEMORY_GiB, c.bf16)
        assert fits["fp32"] == fits["bf16 autocast"] == 0  # at no batch size without checkpointing
        assert fits["fp32 + checkpoint"] >= 1 and fits["bf16 autocast + checkpoint"] >= 1
        assert sum(state_bytes(big).values()) < 24 * MEMORY_GiB  # the state alone fits: activations do not
        rows = run.json["big_model"]["rows"]
        assert {name: row["predicted"]["24.0 GiB"] for name, row in rows.items()} == fits
        for c in lesson.CONFIGURATIONS:  # batch 1's predicted peak, printed beside each row
            assert rows[c.name]["peak_predicted"] == predicted_peak_bytes(replace(big, checkpoint=c.checkpoint), 1, c.bf16)
            assert rows[c.name]["peak_measured"] is None  # no GPU here: prediction only

    def test_figure(self, run):
        assert (run.folder / "out" / "04_memory.png").stat().st_size > 10_000
        assert "USDT" not in run.stdout + run.stderr  # the profiler's start/stop log lines


class TestMemoryArithmetic:
    """What only a GPU runs, and the pure arithmetic, called with known inputs."""

    @pytest.fixture(scope="class")
    @classmethod
    def lesson(cls):
        return load_lesson("04_memory.py")

    @pytest.mark.parametrize("name, bf16, switches", [
        ("fp32", False, {}), ("bf16", True, {}), ("fp32, manual attn", False, dict(attn="manual")),
        ("fp32 + checkpoint", False, dict(checkpoint=True)), ("bf16 + checkpoint", True, dict(checkpoint=True))])
    def test_fit_prediction_is_the_accounting(self, lesson, name, bf16, switches):
        gpt2 = replace(GPTConfig.preset("gpt2"), **switches)
        for budget in (24 * MEMORY_GiB, 80 * MEMORY_GiB, 3 * MEMORY_GiB, 1 * MEMORY_GiB):
            expected = memory_hand_largest_batch(gpt2, budget, bf16)
            assert lesson.predicted_largest_batch(gpt2, budget, bf16) == expected, (name, budget)
            expected = memory_hand_largest_batch(gpt2, budget / ALLOCATOR_HEADROOM, bf16)
            assert lesson.predicted_largest_batch(gpt2, budget, bf16, ALLOCATOR_HEADROOM) == expected
        # fp32 at 24 GiB: hand arithmetic once more, in numbers (state 16 B x N, act 817 MB, 412 MB head)
        if name == "fp32":
            assert lesson.predicted_largest_batch(gpt2, 24 * MEMORY_GiB, False) == 19
        # budgets just above the state, where backward's end binds (the tied embedding's two V x d
        # gradients; under checkpointing one block recomputed, with its bf16 weight copies): a
        # narrow-vocabulary, wide model makes the recomputed block the larger term
        wide = GPTConfig(n_layer=2, n_head=8, n_embd=1024, block_size=1024, vocab_size=256, **switches)
        for config in (gpt2, wide):
            state = sum(state_bytes(config).values())
            for budget in range(state, state + 2**30, 2**30 // 97):
                expected = memory_hand_largest_batch(config, budget, bf16)
                assert lesson.predicted_largest_batch(config, budget, bf16) == expected, budget

    @pytest.mark.parametrize("largest", [0, 1, 2, 7, 111, 207, 1000])
    def test_search_finds_the_largest_batch_from_any_guesses(self, lesson, largest):
        for fit, miss in ((0, 1), (largest, largest + 1), (largest // 2, largest + 9),
                          (2 * largest + 3, 3 * largest + 5), (1, 2), (50, 60)):
            tried = []

            def fits(batch):
                assert batch >= 1
                tried.append(batch)
                return batch <= largest

            assert lesson.search_largest_batch(fits, fit, miss) == largest, (fit, miss)
            assert len(tried) <= 2 * (largest + 2).bit_length() + 4
        # from the accounting's two predictions a search tries a handful of steps
        tried = []

        def fits_111(batch):
            tried.append(batch)
            return batch <= 111

        assert lesson.search_largest_batch(fits_111, 100, 121) == 111
        assert len(tried) <= 7

    # one GPU's memory as torch reports it (an H100 80GB HBM3, an H200): total, and what the CUDA
    # context takes outside torch's allocator
    H100_TOTAL = 85_029_158_912  # 79.2 GiB
    H200_TOTAL = 150_109_978_624  # 139.8 GiB
    CONTEXT = 537_919_488  # 513 MiB

    @pytest.mark.parametrize("memory_gb, batch", [(8, 4), (12, 4), (24, 8), (80, 8), (141, 8)])
    def test_sizes_follow_the_card(self, lesson, memory_gb, batch):
        tensors = lesson.tensor_bytes(memory_gb, self.CONTEXT)
        assert tensors == memory_gb * MEMORY_GiB - self.CONTEXT
        if memory_gb * MEMORY_GiB < self.H200_TOTAL:  # a larger card is not emulated: the whole card
            fraction = lesson.cap_fraction(memory_gb, self.H200_TOTAL, self.CONTEXT)
            # the allocator's cap plus the context the cap does not count: the emulated card
            assert fraction * self.H200_TOTAL + self.CONTEXT == pytest.approx(memory_gb * MEMORY_GiB, abs=1)
        gpt2 = GPTConfig.preset("gpt2")
        assert lesson.step_batch(gpt2, 8, tensors) == batch
        # the batch chosen fits with the headroom, and twice it (or 8's largest) would not
        assert ALLOCATOR_HEADROOM * predicted_peak_bytes(gpt2, batch) <= tensors
        if batch < 8:
            assert ALLOCATOR_HEADROOM * predicted_peak_bytes(gpt2, 2 * batch) > tensors
        # fp32 without checkpointing peaks highest of the four configurations: all of them fit
        for bf16 in (False, True):
            for checkpoint in (False, True):
                config = replace(gpt2, checkpoint=checkpoint)
                assert predicted_peak_bytes(config, batch, bf16) <= predicted_peak_bytes(gpt2, batch)
        sizes = lesson.sized_for(lesson.SIZES["cuda"], tensors)
        assert sizes.batch == batch and sizes.model == gpt2
        memories = lesson.fit_memories(dict(gb=memory_gb, tensors=tensors, outside=self.CONTEXT))
        assert memories[f"{memory_gb:.1f} GiB"] == tensors
        assert memories["24.0 GiB"] == 24 * MEMORY_GiB - self.CONTEXT
        assert len(memories) == 1 + (memory_gb != 24)

    def test_a_card_too_small_for_two_sequences_stops(self, lesson):
        with pytest.raises(SystemExit):
            lesson.sized_for(lesson.SIZES["cuda"], 4 * MEMORY_GiB)
        assert lesson.step_batch(GPTConfig.preset("gpt2"), 8, 1 * MEMORY_GiB) is None

    @pytest.fixture
    def fake_gpu(self, lesson, monkeypatch):
        """torch.cuda's memory calls answering as an 80 GB H100 with a 513 MiB context."""
        capped = []

        class Properties:
            total_memory = self.H100_TOTAL

        monkeypatch.setattr(lesson, "warm_up_cuda", lambda bf16_skipped: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
        reserved = 20 * 2**20  # the warm-up's cached blocks: torch's, inside the allocator
        free = self.H100_TOTAL - self.CONTEXT - reserved
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, self.H100_TOTAL))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: reserved)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", capped.append)
        return capped

    @pytest.mark.parametrize("memory_gb", [8, 12, 24])
    def test_memory_gb_caps_the_allocator_for_the_context(self, lesson, fake_gpu, memory_gb):
        memory = lesson.device_memory("cuda", memory_gb, None)
        assert memory["outside"] == self.CONTEXT
        assert memory["tensors"] == memory_gb * MEMORY_GiB - self.CONTEXT
        assert fake_gpu == [memory["fraction"]]
        assert fake_gpu[0] * self.H100_TOTAL == pytest.approx(memory["tensors"], abs=1)

    @pytest.mark.parametrize("memory_gb", [None, 80, 141])
    def test_the_whole_card_is_not_capped(self, lesson, fake_gpu, memory_gb):
        memory = lesson.device_memory("cuda", memory_gb, None)  # 80 and 141 GiB: more than 79.2
        assert fake_gpu == [] and memory["fraction"] is None
        assert memory["tensors"] == self.H100_TOTAL - self.CONTEXT
        assert memory["gb"] == self.H100_TOTAL / MEMORY_GiB

    @pytest.mark.parametrize("text, ok", [("6", True), ("24", True), ("1024", True), ("12.5", True),
                                          ("1e9", False), ("5.9", False), ("0", False), ("-24", False),
                                          ("nan", False), ("inf", False), ("lots", False)])
    def test_memory_gb_is_a_range(self, lesson, text, ok):
        if ok:
            assert lesson.memory_gb(text) == float(text)
        else:
            with pytest.raises((argparse.ArgumentTypeError, ValueError)):
                lesson.memory_gb(text)

    @pytest.mark.parametrize("capability, skipped", [((7, 0), True), ((7, 5), True), ((8, 0), False),
                                                     ((8, 9), False), ((9, 0), False)])
    def test_bf16_needs_compute_capability_8(self, lesson, monkeypatch, capability, skipped):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
        reason = lesson.bf16_unsupported("cuda")
        assert (reason is not None) == skipped
        if skipped:
            assert f"{capability[0]}.{capability[1]}" in reason
        assert lesson.bf16_unsupported("cpu") is None  # a CPU runs bf16 autocast, slowly

    def test_without_bf16_the_fp32_rows_run_and_the_checks_pass(self, lesson, monkeypatch, tmp_path, capsys):
        # a GPU without bf16 tensor cores, faked on the CPU: the bf16 rows are skipped with their
        # reason, everything else runs, and the run ends with its checks, exit 0
        monkeypatch.setattr(lesson, "bf16_unsupported", lambda device: "compute capability 7.5 < 8.0")
        monkeypatch.setattr(sys, "argv", ["04_memory.py", "--quick", "--device", "cpu",
                                          "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "out")])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as run_lesson's processes: one thread on the shared cores
        try:
            lesson.main()  # a failed check would raise SystemExit
        finally:
            torch.set_num_threads(threads)
        r = json.loads((tmp_path / "r.json").read_text())
        assert r["mixed_precision"]["skipped"] == "compute capability 7.5 < 8.0"
        assert list(r["mixed_precision"]["rows"]) == ["fp32"]
        assert list(r["checkpointing"]["rows"]) == ["fp32 + checkpoint"]
        assert list(r["what_fits"]["rows"]) == ["fp32", "fp32 + checkpoint"]
        assert list(r["big_model"]["rows"]) == ["fp32", "fp32 + checkpoint"]
        assert r["checks"] and all(r["checks"].values())
        assert "autocast_keeps_state_fp32" not in r["checks"]
        assert "mixed_precision_speed" not in r["predictions"]
        assert "compute capability 7.5 < 8.0" in capsys.readouterr().out

    def test_what_fits_on_a_gpu_with_the_tries_faked(self, lesson, monkeypatch, capsys):
        # [5]'s GPU branch without a GPU: each try answered by the accounting, as if the card's
        # allocator needed 10% on top of the tensors
        def measured_largest_batch(config, bf16, fit, miss):
            assert fit <= miss - 1  # from the accounting's two predictions
            return lesson.predicted_largest_batch(config, memory, bf16, headroom=1.1)

        def measured_peak_batch1(config, bf16):
            peak = predicted_peak_bytes(config, 1, bf16)
            if 1.1 * peak > memory:
                return None  # out of memory
            return peak

        monkeypatch.setattr(lesson, "measured_largest_batch", measured_largest_batch)
        monkeypatch.setattr(lesson, "measured_peak_batch1", measured_peak_batch1)
        for memory_gb in (12, 24, 80):
            memory = memory_gb * MEMORY_GiB - self.CONTEXT
            memories = lesson.fit_memories(dict(gb=memory_gb, tensors=memory, outside=self.CONTEXT))
            fit = lesson.what_fits(memories, True, lesson.CONFIGURATIONS)
            lesson.report_what_fits(fit)
            assert fit["predictions"] == {"fit_between_predictions": True, "fit_each_technique_raises": True}
            for row in fit["rows"].values():
                assert row["predicted_with_headroom"][fit["here"]] <= row["measured"] <= row["predicted"][fit["here"]]
            big = lesson.big_model(memories, True, lesson.CONFIGURATIONS)
            lesson.report_big_model(big)
            assert big["predictions"] == {"big_model_fits_as_predicted": True}
            fits = {name: row["peak_measured"] is not None for name, row in big["rows"].items()}
            if memory_gb == 24:  # the book's card: GPT-2 large at T=8192 only checkpointed
                assert fits == {"fp32": False, "bf16 autocast": False, "fp32 + checkpoint": True,
                                "bf16 autocast + checkpoint": True}
        assert "prediction held" in capsys.readouterr().out
        assert torch.get_float32_matmul_precision() == "highest"  # TF32 only while trying


# ---------------------------------------------------------------------------------------
# 05_ddp_scratch.py: one real torchrun run on 3 gloo ranks (N = 3: uneven chunks), one plain
# `python` run (a group of one), and the all-reduce code itself on 2, 3 and 4 ranks as
# threads of the test process (DdpScratchThreadedDist): every world size the SPEC names,
# in seconds of CPU.


DDP_SCRATCH = "05_ddp_scratch.py"


def ddp_scratch_quick_config(lesson):
    """The GPT of a --quick run, as the lesson builds it."""
    sizes = lesson.QUICK
    return lesson.GPTConfig.preset(sizes.preset, n_layer=sizes.n_layer,
                                   vocab_size=sizes.vocab_size)


class TestDdpScratch:
    """A --quick run on 3 gloo ranks under torchrun, as a reader launches it."""

    WORLD = 3

    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return expect_ok(run_lesson(DDP_SCRATCH, "--quick", tmp=tmp_path_factory.mktemp("05"),
                                    nproc=cls.WORLD))

    def test_every_check_ok(self, run):
        r = run.json
        assert r["checks"] and all(r["checks"].values()), r["checks"]
        for name in r["checks"]:
            assert f"check {name}: ok" in run.stdout

    def test_json_keys_and_types(self, run):
        r = run.json
        assert r["lesson"] == "05_ddp_scratch" and r["quick"] is True
        assert isinstance(r["device"], dict) and r["device"]["backend"] == "gloo"
        assert r["device"]["world_size"] == self.WORLD and r["device"]["nodes"] == 1
        assert isinstance(r["machine_busy"], bool)
        assert all(isinstance(share, float) for share in r["cpu_shares"])
        for group in ("checks", "predictions"):
            assert r[group] and all(isinstance(v, bool) for v in r[group].values()), group
        for label in ("measured:", "derived:", "predicted:", "prediction "):
            assert label in run.stdout

    def test_machine_busy_follows_the_cpu_shares(self, run):
        """Every share is sampled beside a timed experiment: the run is busy exactly when
        one of them fell below BUSY_SHARE (whatever their values on this machine)."""
        r = run.json
        lesson = load_lesson(DDP_SCRATCH)
        below = any(share < lesson.BUSY_SHARE for share in r["cpu_shares"])
        assert r["machine_busy"] == below
        assert r["machine_busy"] == any(r["busy"].values())

    def test_training_equals_one_process_on_the_whole_batch(self, run):
        d = run.json["training"]
        assert d["replicas_identical"] and d["grad_max_rel_err"] <= 1e-5
        assert d["param_gap_over_distance_moved"] <= 1e-3
        assert d["losses"] == pytest.approx(d["one_process_losses"], rel=1e-5)

    def test_all_reduce_equals_the_library_on_awkward_lengths(self, run):
        a = run.json["all_reduce"]
        assert any(n % self.WORLD for n in a["lengths"]) and min(a["lengths"]) < self.WORLD
        assert a["ring_max_rel_err"] <= 1e-6 and a["naive_max_rel_err"] <= 1e-6

    def test_bytes_sent_counted_match_the_formulas(self, run):
        """The ring's busiest rank sends 2(N-1)/N S (one fp32 a step of uneven chunks);
        naive's rank 0 sends (N-1) S."""
        world = self.WORLD
        b = run.json["bytes_sent"]
        assert len(b["sizes_bytes"]) >= 2 and any((s // 4) % world for s in b["sizes_bytes"])
        for size, ring, naive in zip(b["sizes_bytes"], b["ring"], b["naive"]):
            assert abs(ring - 2 * (world - 1) / world * size) <= 2 * (world - 1) * 4
            assert ring >= 2 * (world - 1) / world * size  # the busiest rank: never below
            assert naive == (world - 1) * size

    def test_sweep_numbers_recomputed_from_the_samples(self, run):
        """Medians, nccl-tests' algbw and busbw, and the ratios of interleaved pairs."""
        world = self.WORLD
        sweep = run.json["sweep"]
        sizes = sweep["sizes_bytes"]
        assert len(sweep["busy"]) == len(sizes) >= 2
        for name in ("naive", "ring", "library"):
            d = sweep[name]
            assert len(d["samples_s"]) == len(sizes)
            for size, samples, median, algbw, busbw in zip(sizes, d["samples_s"], d["median_s"],
                                                           d["algbw_GBps"], d["busbw_GBps"]):
                assert min(samples) > 0 and median == pytest.approx(statistics.median(samples))
                assert algbw == pytest.approx(size / median / 1e9)
                assert busbw == pytest.approx(algbw * 2 * (world - 1) / world)
        for j in range(len(sizes)):
            pairs = [(sweep["ring"], sweep["library"], sweep["ring_over_library"][j]),
                     (sweep["naive"], sweep["ring"], sweep["naive_over_ring"][j])]
            for a, b, ratio in pairs:
                ratios = [x / y for x, y in zip(a["samples_s"][j], b["samples_s"][j])]
                assert ratio["median"] == pytest.approx(statistics.median(ratios))
                assert ratio["low"] == pytest.approx(min(ratios))
                assert ratio["high"] == pytest.approx(max(ratios))

    def test_fits_are_the_model_of_their_parameters(self, run):
        """T = 2(N-1) alpha + k S beta, with k = 2(N-1)/N for a ring, 2(N-1) for naive."""
        world = self.WORLD
        sweep = run.json["sweep"]
        for name, fit in run.json["fits"].items():
            k = 2 * (world - 1) / world
            if name == "naive":
                k = 2 * (world - 1)
            assert fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] > 0
            assert fit["link_GBps"] == pytest.approx(1 / fit["beta_s_per_byte"] / 1e9)
            for size, predicted in zip(sweep["sizes_bytes"], fit["predicted_s"]):
                model = 2 * (world - 1) * fit["alpha_s"] + k * size * fit["beta_s_per_byte"]
                assert predicted == pytest.approx(model)
            errors = [abs(p - t) / t for p, t in zip(fit["predicted_s"], sweep[name]["median_s"])]
            assert fit["worst_rel_err"] == pytest.approx(max(errors))

    def test_gradient_bill_counts(self, run):
        """Every fp32 parameter once (the tied matrix once); bucketed sums equal per-tensor
        sums; the calls counted, the buckets at least the lower bound."""
        lesson = load_lesson(DDP_SCRATCH)
        config = ddp_scratch_quick_config(lesson)
        g = run.json["gradients"]
        assert g["grad_bytes"] == 4 * lesson.param_count(config)
        tensors = len(list(lesson.GPT(config).parameters()))
        assert g["calls_per_parameter"] == g["tensors"] == tensors
        assert g["fewest_buckets"] <= g["calls_bucketed"] < g["tensors"]
        assert g["max_rel_err"] <= 1e-6
        ratios = [a / b for a, b in zip(g["per_parameter_s"], g["bucketed_s"])]
        median = statistics.median(ratios)
        assert g["per_parameter_over_bucketed"]["median"] == pytest.approx(median)

    def test_scaling_derived_from_its_samples(self, run):
        s = run.json["scaling"]
        compute = statistics.median(s["step_s"])
        comm = statistics.median(run.json["gradients"]["bucketed_s"])
        assert s["predicted_efficiency"] == pytest.approx(compute / (compute + comm))
        assert s["predicted_efficiency_full_overlap"] == pytest.approx(compute / max(compute, comm))
        ratios = [a / b for a, b in zip(s["step_s"], s["data_parallel_step_s"])]
        assert s["efficiency"]["median"] == pytest.approx(statistics.median(ratios))
        assert 0 < s["predicted_efficiency"] <= s["predicted_efficiency_full_overlap"] <= 1

    def test_figure_written(self, run):
        assert (run.folder / "out" / "05_ddp_scratch.png").exists()


class TestDdpScratchOneRank:
    """`python 05_ddp_scratch.py`: a group of one rank, nothing to send."""

    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return expect_ok(run_lesson(DDP_SCRATCH, "--quick", tmp=tmp_path_factory.mktemp("05one")))

    def test_one_rank_equals_one_process_exactly(self, run):
        r = run.json
        assert r["device"]["world_size"] == 1 and all(r["checks"].values())
        assert "sweep" not in r and "gradients" not in r
        assert r["training"]["max_abs_param_gap"] == 0  # a CPU: the same ops in the same order
        assert r["training"]["losses"] == r["training"]["one_process_losses"]
        assert r["all_reduce"]["ring_max_rel_err"] == 0 == r["all_reduce"]["naive_max_rel_err"]


class TestDdpScratchHalfSetEnvironment:
    def test_rank_without_world_size_fails_before_the_work(self, tmp_path):
        """RANK set but not the rest of torchrun's variables: torch's own error names what
        is missing, before anything is measured."""
        run = run_lesson(DDP_SCRATCH, "--quick", tmp=tmp_path, env={"RANK": "0"})
        assert run.returncode != 0
        assert "WORLD_SIZE expected" in run.stderr, run.stderr[-2000:]
        assert "measured" not in run.stdout


# ---------------------------------------------------------------------------------------
# The all-reduce on 2, 3, 4 (and 5) ranks without processes.

def ddp_scratch_simulate_ring(lesson, data):
    """The lesson's ring schedule run on N ranks' lists of integers in plain Python: each
    step, every rank sends its chunk to the right and the right neighbour adds it (reduce-
    scatter) or keeps it (all-gather). Returns every rank's chunks at the end."""
    world = len(data)
    lengths = lesson.chunk_lengths(len(data[0]), world)
    assert sum(lengths) == len(data[0]), f"N={world}: chunk lengths {lengths} miss elements"
    assert lengths == sorted(lengths, reverse=True) and lengths[0] - lengths[-1] <= 1, lengths
    starts = np.cumsum([0] + lengths)
    chunks = []
    for values in data:
        chunks.append([values[starts[c]:starts[c + 1]] for c in range(world)])
    phases = [("reduce-scatter", lesson.reduce_scatter_step),
              ("all-gather", lesson.all_gather_step)]
    for phase, schedule in phases:
        for step in range(world - 1):
            sent = [schedule(rank, step, world)[0] for rank in range(world)]
            messages = [chunks[rank][sent[rank]] for rank in range(world)]  # before any add
            for rank in range(world):
                left = (rank - 1) % world
                received = schedule(rank, step, world)[1]
                assert received == sent[left], (
                    f"N={world}, {phase} step {step}: rank {rank} receives into chunk "
                    f"{received}, but rank {left} sends it chunk {sent[left]}")
                if phase == "reduce-scatter":
                    mine = chunks[rank][received]
                    chunks[rank][received] = [a + b for a, b in zip(mine, messages[left])]
                else:
                    chunks[rank][received] = messages[left]
    return chunks, starts


@dataclass
class DdpScratchOp:
    op: object
    tensor: torch.Tensor
    peer: int


class DdpScratchRequest:
    def __init__(self, finish):
        self.finish = finish

    def wait(self):
        self.finish()


class DdpScratchThreadedDist:
    """Just enough of torch.distributed for the lesson's naive and ring all-reduce: ranks
    are threads of this process, messages go through one FIFO queue per (sender, receiver),
    as gloo and NCCL match them. The lesson's own code then runs on any number of ranks."""

    P2POp = DdpScratchOp

    def __init__(self, world):
        self.world = world
        self.local = threading.local()
        self.queues = {}
        for source in range(world):
            for destination in range(world):
                self.queues[(source, destination)] = queue.Queue()

    def get_rank(self):
        return self.local.rank

    def get_world_size(self):
        return self.world

    def send(self, tensor, dst):
        assert dst != self.get_rank()
        self.queues[(self.get_rank(), dst)].put(tensor.clone())

    def recv(self, tensor, src):
        message = self.queues[(src, self.get_rank())].get(timeout=20)
        assert message.shape == tensor.shape, (message.shape, tensor.shape)
        tensor.copy_(message)

    def isend(self, tensor, dst):
        self.send(tensor, dst)
        return DdpScratchRequest(lambda: None)

    def irecv(self, tensor, src):
        return DdpScratchRequest(lambda: self.recv(tensor, src))

    def batch_isend_irecv(self, ops):
        return [op.op(op.tensor, op.peer) for op in ops]

    def run(self, fn, tensors):
        """fn(tensors[rank]) on every rank at once; what each returned."""
        returned = [None] * self.world
        errors = []

        def rank_main(rank):
            self.local.rank = rank
            try:
                returned[rank] = fn(tensors[rank])
            except Exception as error:  # reported by the test, not lost in a thread
                errors.append((rank, error))

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        return returned


class TestDdpScratchAllReduceAnyWorld:
    def test_ring_schedule_sums_on_every_rank(self):
        """The ring's chunk lengths and schedule, without processes: for N = 2..5 and lengths
        below, at and not divisible by N, every rank ends with every chunk's sum."""
        lesson = load_lesson(DDP_SCRATCH)
        for world in range(2, 6):
            for length in sorted({1, world - 1, world, world + 1, 2 * world + 1, 97}):
                data = [[1000 * (rank + 1) + i for i in range(length)] for rank in range(world)]
                total = [sum(column) for column in zip(*data)]
                chunks, starts = ddp_scratch_simulate_ring(lesson, data)
                for rank in range(world):
                    for c in range(world):
                        want = total[starts[c]:starts[c + 1]]
                        assert chunks[rank][c] == want, (
                            f"N={world}, length {length}: rank {rank} ends with chunk {c} = "
                            f"{chunks[rank][c]}, not the sum {want}")

    @pytest.mark.parametrize("world", [2, 3, 4])
    def test_naive_and_ring_code_sum_and_count_bytes(self, world):
        """The lesson's naive_all_reduce and ring_all_reduce themselves, on `world` ranks as
        threads: every rank ends with the sum, at lengths below, at and not divisible by N;
        the bytes each rank says it sent are what its chunks hold."""
        lesson = load_lesson(DDP_SCRATCH)
        for length in sorted({1, world - 1, world, world + 1, 2 * world + 1, 97, 1000}):
            generator = torch.Generator().manual_seed(length)
            data = [torch.randn(length, generator=generator) for _ in range(world)]
            total = torch.stack(data).sum(0)
            for name in ("naive", "ring"):
                fake = DdpScratchThreadedDist(world)
                lesson.dist = fake
                tensors = [d.clone() for d in data]
                sent = fake.run(lesson.ALGORITHMS[name], tensors)
                for rank in range(world):
                    where = f"{name}, N={world}, length {length}, rank {rank}"
                    torch.testing.assert_close(tensors[rank], total, rtol=1e-6, atol=1e-6,
                                               msg=where)
                chunks = lesson.chunk_lengths(length, world)
                for rank in range(world):
                    want = 4 * length  # naive: a rank > 0 sends its tensor once
                    if name == "naive" and rank == 0:
                        want = 4 * length * (world - 1)
                    if name == "ring":  # every chunk twice, less the two it only receives
                        kept = chunks[(rank + 1) % world] + chunks[(rank + 2) % world]
                        want = 4 * (2 * length - kept)
                    assert sent[rank] == want, (name, world, length, rank, sent[rank], want)
                for queue_left in fake.queues.values():
                    assert queue_left.empty()  # every message sent was received


class TestDdpScratchArithmetic:
    """The lesson's plain functions with known inputs, the GPU-only ones included."""

    def test_fit_recovers_alpha_and_beta(self):
        lesson = load_lesson(DDP_SCRATCH)
        for world in (2, 3, 8):
            for k in (2 * (world - 1) / world, 2 * (world - 1)):
                sizes = [2**j for j in range(12, 31, 2)]
                alpha = 15e-6
                beta = 1 / 300e9
                seconds = [2 * (world - 1) * alpha + k * s * beta for s in sizes]
                fit = lesson.fit_alpha_beta(sizes, seconds, world, k)
                assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
                assert fit["link_GBps"] == pytest.approx(300, rel=1e-6)
                assert fit["worst_rel_err"] < 1e-9 and not fit["clamped"]

    def test_bytes_moved_per_byte(self):
        lesson = load_lesson(DDP_SCRATCH)
        assert lesson.bytes_moved_per_byte("ring", 4) == 1.5
        assert lesson.bytes_moved_per_byte("library", 2) == 1.0
        assert lesson.bytes_moved_per_byte("naive", 4) == 6

    def test_gpt2_buckets_counted_beside_their_lower_bound(self):
        """GPT-2's 148 gradient tensors: its 147 MiB embedding alone and the other 327 MiB in
        25 MiB buckets is at least 15 calls; greedy packing in parameter order makes 17."""
        lesson = load_lesson(DDP_SCRATCH)
        with torch.device("meta"):
            model = lesson.GPT(lesson.GPTConfig.preset("gpt2"))
        params = list(model.parameters())
        bucket = lesson.BUCKET_MB * 2**20
        buckets = lesson.buckets_of(params, bucket)
        assert len(params) == 148
        assert [t for b in buckets for t in b] == params  # every tensor once, in order
        assert lesson.fewest_buckets([p.nbytes for p in params], bucket) == 15
        assert len(buckets) == 17
        for b in buckets:
            assert len(b) == 1 or sum(t.nbytes for t in b) <= bucket

    def test_buckets_on_made_up_sizes(self):
        lesson = load_lesson(DDP_SCRATCH)
        tensors = [torch.empty(n) for n in (3, 3, 10, 1, 1, 4)]  # 4 bytes each element
        buckets = lesson.buckets_of(tensors, 16)
        assert [[t.numel() for t in b] for b in buckets] == [[3], [3], [10], [1, 1], [4]]
        # 40 bytes alone, the other 48 in 16-byte buckets
        assert lesson.fewest_buckets([t.nbytes for t in tensors], 16) == 1 + 3

    def test_step_plan_sizes_the_gpu_step_from_the_accounting(self):
        """The GPU step (64 x 1024 tokens over N ranks) in micro-batches that fit the card
        by model_torch's accounting, beside the bill's two gradient copies."""
        lesson = load_lesson(DDP_SCRATCH)
        config = lesson.GPTConfig.preset("gpt2")
        extra = 2 * 4 * lesson.param_count(config)
        gib = 2**30
        for world, memory_gib in [(1, 80), (2, 24), (2, 80), (4, 24), (8, 8), (3, 24)]:
            plan = lesson.step_plan(config, lesson.GPU, world, memory_gib * gib, extra, True)
            assert plan["rows"] == 64 // world
            assert plan["rows"] % plan["micro_batches"] == 0
            assert model_torch.ALLOCATOR_HEADROOM * (plan["predicted_peak_bytes"] - extra) + extra \
                <= memory_gib * gib + 1
        assert lesson.step_plan(config, lesson.GPU, 2, 80 * gib, extra, True)["micro_batches"] == 1
        assert lesson.step_plan(config, lesson.GPU, 2, 24 * gib, extra, True)["micro_batches"] > 1
        assert lesson.step_plan(config, lesson.GPU, 2, 2 * gib, extra, True) is None

    def test_bf16_tensor_cores_by_capability(self, monkeypatch):
        lesson = load_lesson(DDP_SCRATCH)
        for capability, has in [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)]:
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
            assert lesson.has_bf16_tensor_cores(torch.device("cuda", 0)) is has

    def test_naive_over_ring_expected(self, monkeypatch):
        lesson = load_lesson(DDP_SCRATCH)
        monkeypatch.setattr(lesson.os, "cpu_count", lambda: 2)
        assert lesson.naive_over_ring_expected(torch.device("cuda", 0), 4) == 4
        assert lesson.naive_over_ring_expected(torch.device("cpu"), 4) == 2
        assert lesson.naive_over_ring_expected(torch.device("cpu"), 1) == 1

    def test_nccl_transports_from_its_log(self):
        lesson = load_lesson(DDP_SCRATCH)
        log = ("host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
               "host:1:2 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
               "host:1:3 [1] NCCL INFO Channel 00 : 1[1] -> 0[0] via SHM/direct/direct\n")
        assert lesson.nccl_transports(log) == "P2P/CUMEM/read, SHM/direct/direct"
        assert lesson.nccl_transports("NCCL INFO Bootstrap\n") == "not reported"


# ---------------------------------------------------------------------------------------
# 06_ddp_prod.py: the PyTorch half under torchrun with 2 gloo ranks, the JAX half on 3
# simulated CPU devices, the docstring's multi-process JAX recipe, and what only a GPU or a
# wrong launch runs (backward's kernels in a profile, the rows that fit a card, the
# refusals, the device count the JAX half asks for) called here with known inputs.


def ddp_prod_lesson():
    """06 imported here, this process's environment put back as it was (the lesson sets
    KINETO_LOG_LEVEL as it imports, and later lessons' runs must not inherit it)."""
    before = dict(os.environ)
    lesson = load_lesson("06_ddp_prod.py")
    os.environ.clear()
    os.environ.update(before)
    return lesson


def ddp_prod_timings_add_up(timing, c, slow, fast):
    """A comparison is what its samples give: the median of the per-pair ratios, their range,
    the difference of the medians, a finding only when the range is on one side of 1 and
    the machine was idle."""
    ratios = [a / b for a, b in zip(timing["ms"][slow], timing["ms"][fast])]
    assert c["ratio"] == pytest.approx(statistics.median(ratios))
    assert c["low"] == pytest.approx(min(ratios)) and c["high"] == pytest.approx(max(ratios))
    saves = statistics.median(timing["ms"][slow]) - statistics.median(timing["ms"][fast])
    assert c["saves_ms"] == pytest.approx(saves)
    one_side = min(ratios) > 1 or max(ratios) < 1
    assert c["finding"] == (one_side and not timing["busy"])
    assert timing["busy"] == (min(timing["shares"]) < 0.9)


def ddp_prod_common(r, framework):
    """What every run of 06 writes, whatever the machine did."""
    assert r["lesson"] == "06_ddp_prod" and r["framework"] == framework
    assert r["quick"] is True
    assert isinstance(r["machine_busy"], bool) and isinstance(r["device"], dict)
    assert all(isinstance(share, float) for share in r["cpu_shares"])
    assert all(isinstance(ok, bool) for ok in r["predictions"].values())
    assert all(r["checks"].values()), r["checks"]


class TestDdpProdTorch:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return expect_ok(run_lesson("06_ddp_prod.py", "--quick", nproc=2,
                                    tmp=tmp_path_factory.mktemp("06_torch")))

    def test_runs_on_two_gloo_ranks(self, run):
        r = run.json
        ddp_prod_common(r, "torch")
        assert r["world_size"] == 2 and r["device"]["kind"] == "cpu"
        assert set(r["checks"]) == {"ddp_equals_handrolled", "no_sync_grads_equal",
                                    "fsdp_equals_ddp"}
        for label in ("measured:", "derived:", "check ddp_equals_handrolled: ok"):
            assert label in run.stdout
        assert run.stdout.count("the PyTorch half") == 1  # rank 0 speaks for both

    def test_ddp_ends_where_handrolled_ends(self, run):
        # 2 ranks: a + b = b + a, and / 2 is exact: bit for bit
        assert run.json["same_result"]["max_abs_param_diff"] == 0.0

    def test_calls_counted_as_predicted(self, run):
        # hand-rolled: one all-reduce per parameter tensor; DDP: one per bucket, as the
        # lesson's predicted_buckets and this test's own count of the model say
        r = run.json
        lesson = ddp_prod_lesson()
        model = GPT(GPTConfig.preset(r["model"]["preset"], n_layer=r["model"]["n_layer"],
                                     block_size=r["model"]["seq_len"],
                                     vocab_size=r["model"]["vocab_size"]))
        tensors = len(list(model.parameters()))
        profiles = r["step_time"]["profiles"]
        assert profiles["hand-rolled"]["calls_per_step"] == tensors
        assert profiles["DDP"]["calls_per_step"] == lesson.predicted_buckets(model, None)
        assert r["predicted_calls"] == {"hand-rolled": tensors,
                                        "DDP": lesson.predicted_buckets(model, None)}
        for row in r["bucket_sweep"]:
            assert row["calls_per_step"] == row["predicted_calls"]
            assert row["predicted_calls"] == lesson.predicted_buckets(model, row["bucket_cap_mb"])
        assert r["predictions"]["buckets_as_predicted"] is True

    def test_overlap_is_a_share_of_the_all_reduce_time(self, run):
        profiles = run.json["step_time"]["profiles"]
        assert profiles["hand-rolled"]["overlap"] < 0.01  # it starts after backward returns
        for row in list(profiles.values()) + run.json["bucket_sweep"]:
            assert row["comm_ms_per_step"] > 0 and 0 <= row["overlap"] <= 1
        several = [row for row in run.json["bucket_sweep"] if row["predicted_calls"] > 1]
        assert several and all(row["overlap"] > 0 for row in several)  # early buckets

    def test_no_sync_all_reduces_once(self, run):
        ns = run.json["no_sync"]
        buckets = run.json["predicted_calls"]["DDP"]
        assert ns["calls"]["no_sync"] == buckets  # one backward's buckets, once
        assert ns["calls"]["trap"] == ns["k"] * buckets  # forward outside no_sync: every time
        assert ns["max_abs_grad_diff"] <= 1e-5 * ns["max_abs_grad"]

    def test_fsdp_keeps_one_over_n(self, run):
        r = run.json
        s = r["sharded_state"]
        tensors = r["predicted_calls"]["hand-rolled"]
        # params, grads and two moments in fp32, and AdamW's step counter per tensor
        assert s["replicated_bytes"] == 16 * r["model"]["params"] + 4 * tensors
        assert s["sharded_bytes"] / s["replicated_bytes"] == pytest.approx(1 / 2, rel=0.05)
        assert s["max_abs_param_diff"] < 1e-4

    def test_comparisons_add_up(self, run):
        r = run.json
        step_time = r["step_time"]
        ddp_prod_timings_add_up(step_time["timing"], step_time["compared"], "hand-rolled", "DDP")
        ddp_prod_timings_add_up(r["no_sync"]["timing"], r["no_sync"]["compared"], "trap",
                                "no_sync")
        for row in r["bucket_sweep"]:
            ddp_prod_timings_add_up(row["timing"], row["against_default"], "default", "swept")
        busy = step_time["timing"]["busy"] or r["no_sync"]["timing"]["busy"]
        for row in r["bucket_sweep"]:
            busy = busy or row["timing"]["busy"]
        assert r["machine_busy"] == busy

    def test_trace_holds_the_counted_all_reduces(self, run):
        trace = run.folder / "out" / "06_ddp_prod_torch_trace.json"
        events = json.loads(trace.read_text())["traceEvents"]
        calls = sum(e.get("name") == "gloo:all_reduce" for e in events)
        assert calls == 2 * run.json["step_time"]["profiles"]["DDP"]["calls_per_step"]
        assert trace.stat().st_size < 16 * 2**20


class TestDdpProdJaxThreeDevices:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        # the user's own XLA_FLAGS (fast compiles), and a device count named in the
        # environment: the lesson asks for none of its own
        env = {"XLA_FLAGS": FAST_COMPILE, "JAX_NUM_CPU_DEVICES": "3"}
        return expect_ok(run_lesson("06_ddp_prod.py", "--quick", env=env,
                                    tmp=tmp_path_factory.mktemp("06_jax3")))

    def test_jit_inserts_the_all_reduce(self, run):
        r = run.json
        ddp_prod_common(r, "jax")
        assert r["n_devices"] == 3
        same = r["same_result"]
        assert sum(same["one_device_collectives"].values()) == 0
        assert same["collectives"]["all-reduce"] > 0
        assert "all-reduce" in same["allreduce_example"]
        assert same["max_rel_loss_diff"] < 1e-4
        for label in ("measured:", "derived:", "check allreduce_in_compiled_text: ok"):
            assert label in run.stdout

    def test_shards_what_three_divides(self, run):
        # 3 divides few of this model's shapes: what cannot be split stays whole, and the
        # bytes per device say so
        s = run.json["sharded_state"]
        assert s["sharded_bytes"] == s["predicted_bytes"]
        assert 0 < s["split_share"] < 1
        ratio = s["sharded_bytes"] / s["replicated_bytes"]
        assert ratio == pytest.approx(1 - s["split_share"] * 2 / 3, rel=1e-3)
        assert s["max_rel_loss_diff"] < 1e-4

    def test_users_flags_kept(self, run):
        assert run.json["device"]["xla_flags"] == FAST_COMPILE

    def test_comparison_adds_up(self, run):
        step_time = run.json["step_time"]
        ddp_prod_timings_add_up(step_time["timing"], step_time["compared"], "one device",
                                "data parallel")
        assert run.json["machine_busy"] == step_time["timing"]["busy"]


JAX_PROCESS = """
import os, sys
# XLA:CPU's fastest compile (conftest.py's): the same HLO, collectives, shardings
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 " + sys.argv[3]
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes: gloo
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding
from model_jax import GPT, adamw, make_train_step
from model_torch import GPTConfig
cfg = GPTConfig.preset("tiny", n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=256)
model = GPT(cfg, rngs=nnx.Rngs(0))
graphdef, state = nnx.split((model, nnx.Optimizer(model, adamw(1e-3), wrt=nnx.Param)))
step = make_train_step(graphdef)
data = np.random.default_rng(0).integers(0, 256, (2, 8, 17), dtype=np.int32)
mesh = jax.make_mesh((jax.device_count(),), ("data",), (AxisType.Auto,))  # all processes'
one = SingleDeviceSharding(jax.local_devices()[0])  # the reference: one device, whole batch
global_mesh = (NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data")))
placements = [("global", *global_mesh)]
if jax.process_index() == 0:  # the reference once: process 1 must print process 0's losses
    placements.append(("one", one, one))
for name, params, rows in placements:
    now, losses = jax.device_put(state, params), []
    for batch in data:
        loss, now = step(now, *(jax.device_put(a, rows) for a in (batch[:, :-1], batch[:, 1:])))
        losses.append(float(loss))
    print(name, jax.device_count(), *losses, flush=True)
"""


class TestDdpProdJaxMultiProcess:
    @pytest.fixture(scope="class")
    @classmethod
    def outputs(cls, tmp_path_factory):
        """The docstring's past-one-machine JAX recipe as two processes of two CPU devices
        each, joined by jax.distributed.initialize: [(exit code, stdout, stderr)] of each."""
        folder = tmp_path_factory.mktemp("06_multi")
        for name in ("model_torch.py", "model_jax.py"):
            shutil.copy(HERE / name, folder / name)
        (folder / "job.py").write_text(JAX_PROCESS)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        procs = [subprocess.Popen([sys.executable, "job.py", address, str(i), FAST_COMPILE],
                                  cwd=folder, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in (0, 1)]
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=400)  # 2 busy cores: minutes
            outputs.append((proc.returncode, out, err))
        return outputs

    def test_two_processes_train_as_one_device(self, outputs):
        # one global mesh of 4 devices, gloo collectives between the processes; two
        # data-parallel AdamW steps equal one device's on the whole batch
        printed = []
        for returncode, out, err in outputs:
            assert returncode == 0, err[-2000:]
            lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()
                     if line.startswith(("global ", "one "))}  # gloo prints its own lines too
            assert lines["global"][0] == "4"  # 2 processes x 2 devices in one mesh
            printed.append(lines)
        global_losses = [float(loss) for loss in printed[0]["global"][1:]]
        one_device = [float(loss) for loss in printed[0]["one"][1:]]
        assert len(global_losses) == 2 and global_losses == pytest.approx(one_device, rel=1e-5)
        assert printed[1]["global"] == printed[0]["global"]  # process 1 sees the same losses


class TestDdpProdArithmetic:
    """What only a GPU or a wrong launch runs, called here with known inputs."""

    @pytest.fixture(scope="class")
    @classmethod
    def lesson(cls):
        return ddp_prod_lesson()

    def test_backward_kernels_on_a_gpu_profile(self, lesson):
        cuda = torch.autograd.DeviceType.CUDA
        cpu = torch.autograd.DeviceType.CPU

        def event(name, start_us, end_us, device=cuda, annotation=False):
            return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                                   time_range=SimpleNamespace(start=start_us, end=end_us))

        events = [event("forward", 0, 10, annotation=True),   # the ranges as the GPU ran them
                  event("optimizer", 40, 50, annotation=True),
                  event("forward", 0, 11, device=cpu, annotation=True),  # the CPU's: ignored
                  event("ampere_sgemm", 0, 10),                  # forward's kernel
                  event("ampere_sgemm", 10, 20),                 # backward's
                  event("elementwise_kernel", 20, 30),           # backward's
                  event("ncclDevKernel_AllReduce_Sum_f32", 25, 40),
                  event("multi_tensor_apply_kernel", 40, 45),    # the optimizer's
                  event("nccl:all_reduce", 20, 21, device=cpu)]  # the CPU's call: not a kernel
        comm, backward = lesson.gpu_spans(events)
        assert comm == [(25_000, 40_000)]
        assert sorted(backward) == [(10_000, 20_000), (20_000, 30_000)]
        overlap = lesson.overlap_of(comm, backward, steps=1)
        assert overlap["calls_per_step"] == 1
        assert overlap["comm_ms_per_step"] == pytest.approx(15e-3)
        assert overlap["overlap"] == pytest.approx(5 / 15)  # 25-30 of 25-40

    def test_covered_counts_overlaps_once(self, lesson):
        assert lesson.covered([(0, 10), (5, 15), (20, 30)]) == 25
        assert lesson.covered([]) == 0

    def test_predicted_buckets_match_ddp(self, lesson):
        # counted by DDP: GPT-2 on two H200s (results/h200x2/06_ddp_prod_torch_nvlink.txt),
        # the CPU's model on four gloo ranks (results/cpu/06_ddp_prod_torch.txt)
        with torch.device("meta"):
            gpt2 = GPT(lesson.GPU.config())
            cpu_model = GPT(lesson.CPU.config())
        counted = {1: 50, 5: 37, 25: 13, None: 13, 100: 4, 1000: 1}
        for cap, calls in counted.items():
            assert lesson.predicted_buckets(gpt2, cap) == calls
        counted = {0.25: 13, 1: 4, None: 2, 25: 1}  # DDP's default: a first bucket of 1 MiB
        for cap, calls in counted.items():
            assert lesson.predicted_buckets(cpu_model, cap) == calls

    @pytest.mark.parametrize("gib, rows", [(8, 1), (12, 2), (16, 4), (24, 8), (80, 8), (141, 8)])
    def test_rows_that_fit_a_card(self, lesson, gib, rows):
        # the GPU default: GPT-2's fp32 check model (T x T scores) with 8 rows at most,
        # beside a second replica and two models' weights
        config = lesson.GPU.config(attn="manual")
        held = 28 * param_count(config)
        got = lesson.rows_that_fit(config, 8, gib * 2**30, held)
        assert got == rows
        need = lesson.ALLOCATOR_HEADROOM * predicted_peak_bytes(config, got) + held
        assert need <= gib * 2**30 or got == 1
        if got < 8:  # twice the rows would not have fitted
            twice = lesson.ALLOCATOR_HEADROOM * predicted_peak_bytes(config, 2 * got) + held
            assert twice > gib * 2**30

    def test_jax_reference_rows_on_one_card(self, lesson):
        # JAX's one-device reference runs every device's rows: 4 x 4090 (18 GiB for JAX)
        config = lesson.GPU.config(attn="manual")
        held = 24 * param_count(config)
        assert lesson.rows_that_fit(config, 8, 18 * 2**30, held, devices=4) == 1
        assert lesson.rows_that_fit(config, 8, 105 * 2**30, held, devices=2) == 8

    def test_bf16_tensor_cores_from_capability(self, lesson, monkeypatch):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))
        assert lesson.has_bf16_tensor_cores("cuda:0") is False
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
        assert lesson.has_bf16_tensor_cores("cuda:0") is True

    def test_staged_from_flag_or_nccl_transport(self, lesson):
        args = SimpleNamespace(interconnect="default")
        assert lesson.staged(args, "P2P/CUMEM/read") is False
        assert lesson.staged(args, "SHM/direct/direct") is True  # a PCIe box without P2P
        assert lesson.staged(args, "not reported") is False
        assert lesson.staged(SimpleNamespace(interconnect="staged"), "P2P/CUMEM") is True

    def test_one_rank_says_what_to_run(self, lesson, monkeypatch, tmp_path):
        for name, value in [("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                            ("LOCAL_RANK", "0")]:
            monkeypatch.setenv(name, value)
        args = SimpleNamespace(device="cpu", interconnect="default", out=tmp_path)
        with pytest.raises(SystemExit) as stop:
            lesson.torch_start(args)
        assert "torchrun --standalone --nproc_per_node=2 06_ddp_prod.py" in str(stop.value.code)

    def test_fewer_gpus_than_ranks_with_device_cuda(self, lesson, monkeypatch, tmp_path):
        # NCCL refuses two ranks on one GPU: rank 0 says what to run, rank 1 just stops
        for name, value in [("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]:
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        args = SimpleNamespace(device="cuda", interconnect="default", out=tmp_path)
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(SystemExit) as stop:
            lesson.torch_start(args)
        assert "--nproc_per_node" in str(stop.value.code) and "--device cpu" in str(stop.value.code)
        monkeypatch.setenv("RANK", "1")
        with pytest.raises(SystemExit) as stop:
            lesson.torch_start(args)
        assert stop.value.code == 1

    def test_jax_refuses_one_device(self, lesson, monkeypatch, tmp_path):
        # this process's JAX has its one CPU device; the user's XLA_FLAGS name that count
        monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
        monkeypatch.setenv("NCCL_DEBUG", "WARN")  # put back afterwards
        monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.log"))
        args = SimpleNamespace(device="cpu", interconnect="default", out=tmp_path)
        with pytest.raises(SystemExit) as stop:
            lesson.jax_start(args)
        message = str(stop.value.code)  # sys.exit(text): the text on stderr, exit 1
        assert message.startswith("error: ") and "JAX sees 1 CPU device" in message
        assert "device_count=4" in message

    def test_jax_asks_for_four_devices_keeping_the_users_flags(self, lesson, monkeypatch,
                                                               tmp_path):
        # no count named: jax_num_cpu_devices is set, XLA_FLAGS left as the user wrote them
        asked = []
        monkeypatch.setattr(lesson.jax.config, "update", lambda *a: asked.append(a))
        monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE)
        monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
        monkeypatch.setenv("NCCL_DEBUG", "WARN")
        monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.log"))
        args = SimpleNamespace(device="cpu", interconnect="default", out=tmp_path)
        with pytest.raises(SystemExit):  # this process's JAX started long ago, with 1 device
            lesson.jax_start(args)
        assert ("jax_num_cpu_devices", 4) in asked
        assert os.environ["XLA_FLAGS"] == FAST_COMPILE


# ---------------------------------------------------------------------------------------
# 07_capstone_torch.py: a --quick waterfall, a --quick --headline and the DDP rungs on 2 gloo
# ranks, each its own process; every derived number recomputed from the raw ones in the
# JSON; the mutations (broken math the checks must catch) in this process.


CAPSTONE_TORCH = "07_capstone_torch.py"
CAPSTONE_TORCH_SINGLE = ["fp32 eager", "+ TF32", "+ bf16 autocast", "+ flash attention (SDPA)",
                         "+ torch.compile", "+ fused AdamW", "+ vocab 50304",
                         "+ no host sync per step", "+ fused classifier (logits never written)",
                         "+ activation checkpointing", "+ bf16 residual stream"]
CAPSTONE_TORCH_DDP = ["final rung, each GPU alone", "+ DDP", "+ bf16 gradient all-reduce"]
CAPSTONE_TORCH_CLASSES = ["communication", "attention", "optimizer", "matmul",
                          "elementwise/norm/loss", "idle"]
CAPSTONE_SET_ASIDE_FROM = 6  # both capstones' SET_ASIDE_FROM (capstone_rule_with_known_ratios)


def capstone_rule_with_known_ratios(lesson):
    faster = lesson.ratio_summary([130.0, 131.0, 129.0], [100.0, 100.0, 100.0])
    assert faster["ratio"] == 1.3 and faster["low"] == 1.29 and faster["high"] == 1.31
    assert lesson.decide(faster, busy=False) == (True, "kept: 1.30x [1.29, 1.31] over the incumbent")
    slower = lesson.ratio_summary([78.0, 77.0, 80.0], [100.0, 100.0, 100.0])
    assert lesson.decide(slower, busy=False) == (False, "dropped: 0.78x [0.77, 0.80], slower")
    noise = lesson.ratio_summary([101.0, 97.0, 104.0], [100.0, 100.0, 100.0])
    kept, verdict = lesson.decide(noise, busy=True)
    assert not kept and verdict == "dropped: 1.01x [0.97, 1.04], within noise (machine busy)"
    assert lesson.SET_ASIDE_FROM == CAPSTONE_SET_ASIDE_FROM
    # six pairs, 5% faster, and in the fourth both calls slow, the candidate's more: the
    # machine's slowest pair is set aside, the five others decide
    incumbent = [105.0, 105.0, 105.0, 120.0, 105.0, 105.0]
    candidate = [100.0, 100.0, 100.0, 125.0, 100.0, 100.0]
    slow_pair = lesson.ratio_summary(incumbent, candidate)
    assert slow_pair["set_aside"] == 3 and slow_pair["decisive_low"] == 1.05
    assert lesson.decide(slow_pair, busy=False) == (
        True, "kept: 1.05x [0.96, 1.05] (pair 4, the slowest, set aside) over the incumbent")
    # the same low ratio in a pair that is not the slowest decides: dropped
    incumbent = [105.0, 105.0, 105.0, 96.0, 105.0, 130.0]
    candidate = [100.0, 100.0, 100.0, 100.0, 100.0, 125.0]
    other_pair = lesson.ratio_summary(incumbent, candidate)
    assert other_pair["set_aside"] == 5 and other_pair["decisive_low"] == 0.96
    assert not lesson.decide(other_pair, busy=False)[0]
    # fewer than six pairs: none set aside
    five = lesson.ratio_summary(incumbent[:5], candidate[:5])
    assert five["set_aside"] is None and five["decisive_low"] == five["low"]


def capstone_decisive_ratios(row, set_aside_from):
    """The per-pair ratios the keep rule reads, recomputed from the raw step times: every
    pair's, or from set_aside_from pairs on every pair's but the one whose two calls took
    longest together. (A result made before that rule has no "ratio_set_aside": none.)"""
    ratios = [a / b for a, b in zip(row["incumbent_step_ms"], row["step_ms"])]
    if "ratio_set_aside" not in row or len(ratios) < set_aside_from:
        return ratios
    totals = [a + b for a, b in zip(row["incumbent_step_ms"], row["step_ms"])]
    slowest = totals.index(max(totals))
    decisive = ratios[:slowest] + ratios[slowest + 1:]
    assert row["ratio_set_aside"] == slowest, row["name"]
    assert row["ratio_decisive_low"] == min(decisive), row["name"]
    return decisive


CAPSTONE_TORCH_ROW_KEYS = {
    "name": str, "why": str, "settings": dict, "predicted": list, "prediction_held": bool,
    "micro_batches": int, "micro_batch_size": int, "step_ms": list, "incumbent_step_ms": list,
    "ratios": list, "kept": bool, "verdict": str, "speedup": float, "speedup_low": float,
    "speedup_high": float, "ms_per_step": float, "tokens_per_step": int,
    "tokens_per_s": float, "mfu_measured_peak": float, "losses": list,
    "loss_rel_gap": float, "warmup_steps": int, "timed_steps": int, "profiled_steps": int,
    "profile": dict, "profile_step_s": float, "busy": bool, "world": int, "acts": dict,
    "activation_bytes": int, "cpu_shares": list}
# what a final rung may be on the CPU: the tests write it where --headline and torchrun read it
CAPSTONE_TORCH_FINAL = dict(tf32=False, bf16=False, attn="sdpa", compile=True, fused=True,
                            pad_vocab=True, host_sync=False, fused_classifier=True,
                            checkpoint=False, bf16_residual=False, ddp=False, bf16_grads=False)


def capstone_collector_off_while_timing(lesson):
    """Both capstones' interleaved(): the collector off inside every timed call, back on
    after, also when a call raises."""
    seen = []
    seconds = lesson.interleaved([lambda: seen.append(gc.isenabled())] * 2, 3)
    assert seen == [False] * 6 and [len(s) for s in seconds] == [3, 3]
    assert gc.isenabled()

    def fails():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        lesson.interleaved([fails], 1)
    assert gc.isenabled()


def capstone_settled_compare(lesson, monkeypatch, gpu, jit=True):
    """Both capstones' compare() on stand-in trainers and a stand-in device ("cuda" and
    shared.gpu for a GPU), a clock that moves only in a step, 0.3 s a step: the calls in
    order (each trainer's steps, "timed" where the timed pairs start, each batch drawn,
    "collected" for each full garbage collection)."""
    clock = [0.0]
    calls = []
    real_interleaved = lesson.interleaved

    def run_steps(trainer, count, shared):
        calls.append((trainer.name, count))
        trainer.losses.extend([0.0] * count)
        clock[0] += 0.3 * count

    def interleaved(fns, reps):
        calls.append("timed")
        return real_interleaved(fns, reps)

    monkeypatch.setattr(lesson.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(lesson, "cpu_share", lambda: 1.0)
    monkeypatch.setattr(lesson, "run_steps", run_steps)
    monkeypatch.setattr(lesson, "interleaved", interleaved)
    monkeypatch.setattr(lesson.gc, "collect", lambda: calls.append("collected"))
    device = torch.device("cpu")
    if gpu:
        device = torch.device("cuda", 0)
    shared = SimpleNamespace(device=device, world=1, gpu=gpu,
                             host_batch=lambda step: calls.append(("drawn", step)))
    settings = dict(lesson.BASELINE, jit=jit)
    incumbent, candidate = [SimpleNamespace(name=name, settings=settings, losses=[],
                                            warmup_steps=0, timed_steps=0)
                            for name in ("incumbent", "candidate")]
    timing = lesson.compare(incumbent, candidate, shared, pairs=2)
    return calls, incumbent, candidate, timing, shared


def capstone_settles_a_gpu(lesson, monkeypatch):
    """A GPU left idle by a compile: untimed steps of both in turn until SETTLE_S of work,
    none inside the timed pairs. A first step of 0.3 s: ceil((2.0 - 0.3) / (2 x 0.3)) = 3
    more pairs, 2.1 s in all. The full garbage collection comes before those steps, so the
    GPU does not idle between them and the first timed pair. The floor's single trainer:
    the same, pairs of itself. A CPU: one untimed step of the incumbent, as before."""
    assert lesson.SETTLE_S == 2.0
    calls, incumbent, candidate, timing, shared = capstone_settled_compare(lesson, monkeypatch,
                                                                           gpu=True)
    pair = [("incumbent", 1), ("candidate", 1)]
    steps = [call for call in calls if call[0] != "drawn"]
    assert steps == ["collected", ("incumbent", 1)] + pair * 3 + ["timed"] + pair * 2
    assert incumbent.warmup_steps == 1 + 3 and candidate.warmup_steps == 3
    assert incumbent.timed_steps == candidate.timed_steps == 2
    assert timing["incumbent_ms"] == timing["candidate_ms"] == pytest.approx([300.0, 300.0])
    assert "drawn" not in [call[0] for call in calls[calls.index("timed"):]]  # JAX's batches
    final = SimpleNamespace(name="final", settings=incumbent.settings, losses=[],
                            warmup_steps=0)
    calls.clear()
    lesson.settle(final, final, shared, 1)
    assert [call for call in calls if call[0] != "drawn"] == [("final", 1)] * 7
    assert final.warmup_steps == 7
    calls, incumbent, candidate, _, _ = capstone_settled_compare(lesson, monkeypatch, gpu=False)
    steps = [call for call in calls if call[0] != "drawn"]
    assert steps == ["collected", ("incumbent", 1), "timed"] + pair * 2
    assert incumbent.warmup_steps == 1 and candidate.warmup_steps == 0


def capstone_torch_text(folder):
    """A few KB of real text: enough tokens for the toy model, read in no time."""
    path = folder / "small.txt"
    path.write_text((HERE / "README.md").read_text()[:20000])
    return path


def capstone_torch_run(tmp, *args, nproc=None, final=None):
    """The capstone as a reader runs it, --quick on the CPU; `final`: a final rung written
    first where --headline and torchrun read it (out/07_capstone_torch_final_rung.json)."""
    folder = tmp / "lesson"
    if final is not None:
        (folder / "out").mkdir(parents=True)
        saved = dict(rung="a final rung", settings=final, device="a CPU")
        (folder / "out" / "07_capstone_torch_final_rung.json").write_text(json.dumps(saved))
    data = capstone_torch_text(tmp)
    return expect_ok(run_lesson(CAPSTONE_TORCH, "--quick", "--device", "cpu", "--data",
                                str(data), *args, tmp=tmp, nproc=nproc))


def capstone_torch_incumbents(rows):
    """Each row's incumbent: the last kept row before it (the first row has none)."""
    incumbents = [None]
    incumbent = rows[0]
    for row in rows[1:]:
        incumbents.append(incumbent)
        if row["kept"]:
            incumbent = row
    return incumbents


def capstone_torch_rederive(result):
    """Recompute every derived number of a capstone JSON from its raw measurements, and hold
    each row to the rule."""
    rows = result["rungs"]
    roofs = result["roofs"]
    base = rows[0]
    assert roofs["matmul_flops"] == pytest.approx(statistics.median(roofs["matmul_samples"]))
    assert roofs["matmul_flops_best"] == max(roofs["matmul_samples"])
    assert roofs["copy_bytes_per_s"] == pytest.approx(statistics.median(roofs["copy_samples"]))
    assert roofs["copy_bytes_per_s_best"] == max(roofs["copy_samples"])
    for row, incumbent in zip(rows, capstone_torch_incumbents(rows)):
        name = row["name"]
        for key, kind in CAPSTONE_TORCH_ROW_KEYS.items():
            assert isinstance(row[key], kind), (name, key)
        ms = statistics.median(row["step_ms"])
        assert row["ms_per_step"] == pytest.approx(ms, rel=1e-12), name
        tokens_per_s = row["tokens_per_step"] / (ms / 1e3)
        assert row["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-12), name
        flops = tokens_per_s * result["flops_per_token"] / row["world"]  # one device's
        assert row["mfu_measured_peak"] == pytest.approx(flops / roofs["matmul_flops"],
                                                         rel=1e-12), name
        if roofs["datasheet_flops"] is None:
            assert row["mfu_datasheet"] is None, name
        else:
            assert row["mfu_datasheet"] == pytest.approx(flops / roofs["datasheet_flops"],
                                                         rel=1e-12), name
        gaps = [abs(a - b) / b for a, b in zip(row["losses"][:10], base["losses"][:10])]
        assert row["loss_rel_gap"] == pytest.approx(max(gaps), rel=1e-9, abs=1e-15), name
        assert sum(row["profile"].values()) == pytest.approx(row["profile_step_s"], rel=1e-6)
        if incumbent is None:  # the first incumbent: its MFU predicted, timed beside rung 2
            assert row["ratio"] is None and row["speedup"] == 1.0, name
            assert row["step_ms"] == rows[1]["incumbent_step_ms"], name
            low, high = row["predicted"]
            assert row["prediction_held"] == (low <= row["mfu_measured_peak"] <= high), name
            continue
        ratios = [a / b for a, b in zip(row["incumbent_step_ms"], row["step_ms"])]
        assert row["ratios"] == pytest.approx(ratios, rel=1e-12), name
        assert len(ratios) == len(row["step_ms"]) == len(row["incumbent_step_ms"]) >= 2
        assert row["ratio"] == pytest.approx(statistics.median(ratios), rel=1e-12), name
        assert row["ratio_low"] == min(ratios) and row["ratio_high"] == max(ratios), name
        # the speed-up over the baseline: the kept rungs' ratios multiplied
        assert row["speedup"] == pytest.approx(incumbent["speedup"] * row["ratio"], rel=1e-12)
        assert row["speedup_low"] == pytest.approx(incumbent["speedup_low"] * min(ratios))
        assert row["speedup_high"] == pytest.approx(incumbent["speedup_high"] * max(ratios))
        low, high = row["predicted"]
        assert row["prediction_held"] == (low <= row["ratio"] <= high), name
        if "timed against" in row["verdict"]:  # the headline: no rule, only the ratio
            continue
        # the rule: kept when every pair ran faster than the incumbent (the slowest pair
        # set aside from SET_ASIDE_FROM pairs on), else dropped
        decisive = capstone_decisive_ratios(row, CAPSTONE_SET_ASIDE_FROM)
        assert row["kept"] == (min(decisive) > 1), name
        if row["kept"]:
            assert row["verdict"].startswith(f"kept: {row['ratio']:.2f}x"), name
        elif max(ratios) < 1:
            assert row["verdict"].startswith(f"dropped: {row['ratio']:.2f}x"), name
            assert "slower" in row["verdict"], name
        else:
            assert "within noise" in row["verdict"], name
        assert ("(machine busy)" in row["verdict"]) == row["busy"], name
    predictions = {row["name"]: row["prediction_held"] for row in rows}
    for row in rows:
        if "floor" in row:
            floor = row["floor"]
            low, high = floor["predicted"]
            if high is None:  # a CPU: over low
                high = float("inf")
            ratio = floor["step_ms"] / floor["floor_ms"]
            assert floor["prediction_held"] == (low <= ratio <= high)
            predictions[f"the floor table of {row['name']}"] = floor["prediction_held"]
    assert result["predictions"] == predictions
    busy = any(row["busy"] for row in rows) or roofs["busy"]
    busy = busy or any(row["floor"]["busy"] for row in rows if "floor" in row)
    assert result["machine_busy"] == busy
    assert roofs["busy"] == (min(roofs["cpu_shares"]) < 0.9)


def capstone_torch_check_floor(floor, result):
    """A floor table: its classes add up to the step, every floor at most its measured time,
    each floor recomputed from model_torch's accounting at the best measured roofs."""
    sizes = result["sizes"]
    settings = floor["settings"]
    vocab = sizes["vocab"]
    if settings["pad_vocab"]:
        vocab = sizes["padded_vocab"]
    config = GPTConfig(block_size=sizes["block_size"], n_layer=sizes["n_layer"],
                       n_head=sizes["n_head"], n_embd=sizes["n_embd"], vocab_size=vocab,
                       attn=settings["attn"], checkpoint=settings["checkpoint"],
                       fused_classifier=settings["fused_classifier"],
                       bf16_residual=settings["bf16_residual"])
    terms = step_floor_terms(config, floor["tokens"], settings["bf16"], floor["micro_batches"])
    seconds = floor_seconds(terms, result["roofs"]["matmul_flops_best"],
                            result["roofs"]["copy_bytes_per_s_best"])
    assert floor["matmul_flops"] == result["roofs"]["matmul_flops_best"]
    assert sorted(floor["classes"]) == sorted(CAPSTONE_TORCH_CLASSES)
    measured = sum(c["measured_ms"] for c in floor["classes"].values())
    assert measured == pytest.approx(floor["step_ms"], rel=1e-6)  # idle is the rest
    for name, c in floor["classes"].items():
        assert c["floor_ms"] == pytest.approx(seconds.get(name, 0.0) * 1e3, rel=1e-12), name
    assert floor["floor_ms"] == pytest.approx(sum(c["floor_ms"] for c in floor["classes"].values()))
    excess = {name: c["measured_ms"] - c["floor_ms"] for name, c in floor["classes"].items()}
    assert floor["largest_excess"] == max(excess, key=excess.get)


class TestCapstoneTorch:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return capstone_torch_run(tmp_path_factory.mktemp("07_torch"))

    @pytest.fixture(scope="class")
    @classmethod
    def lesson(cls):
        return load_lesson(CAPSTONE_TORCH)

    def test_every_rung_runs_and_reports(self, run):
        r = run.json
        assert r["lesson"] == "07_capstone_torch" and r["quick"] and r["world"] == 1
        assert isinstance(r["machine_busy"], bool) and isinstance(r["device"], dict)
        assert all(isinstance(held, bool) for held in r["predictions"].values())
        assert r["flops_per_token"] > 0 and r["roofs"]["matmul_flops"] > 0
        measured = [row["name"] for row in r["rungs"]]
        assert measured == [n for n in CAPSTONE_TORCH_SINGLE if n not in r["skipped"]]
        for name in CAPSTONE_TORCH_DDP[1:]:  # one process: it says how to start several
            assert "torchrun" in r["skipped"][name]
        if "+ bf16 residual stream" in r["skipped"]:  # bf16 dropped on this CPU
            assert not [row for row in r["rungs"] if row["name"] == "+ bf16 autocast"][0]["kept"]
        for row in r["rungs"]:
            assert row["tokens_per_s"] > 0 and row["ms_per_step"] > 0, row["name"]
            assert row["settings"].keys() == CAPSTONE_TORCH_FINAL.keys()
        assert sorted(p.name for p in (run.folder / "out").glob("*.png")) == [
            "07_capstone_torch.png"]
        assert all(r["checks"].values()), r["checks"]
        for check in r["checks"]:
            assert f"check {check}: ok" in run.stdout
        assert "measured:" in run.stdout and "derived:" in run.stdout

    def test_derived_numbers_recomputed(self, run):
        capstone_torch_rederive(run.json)

    def test_final_rung_is_the_last_kept_and_is_written(self, run):
        r = run.json
        kept = [row for row in r["rungs"] if row["kept"]]
        assert r["final_rung"] == kept[-1]["name"]
        saved = json.loads((run.folder / "out" / "07_capstone_torch_final_rung.json").read_text())
        assert saved["rung"] == r["final_rung"] and saved["settings"] == kept[-1]["settings"]
        # each rung builds on its incumbent: its settings are the incumbent's plus its change
        lesson_rungs = dict((name, change) for name, change, _ in load_lesson(CAPSTONE_TORCH).RUNGS)
        for row, incumbent in zip(r["rungs"][1:], capstone_torch_incumbents(r["rungs"])[1:]):
            assert row["settings"] == dict(incumbent["settings"], **lesson_rungs[row["name"]])

    def test_floor_table(self, run):
        r = run.json
        [final] = [row for row in r["rungs"] if row["name"] == r["final_rung"]]
        floors = [row["floor"] for row in r["rungs"] if "floor" in row]
        assert final["floor"]["rung"] == r["final_rung"] and 1 <= len(floors) <= 2
        for floor in floors:
            capstone_torch_check_floor(floor, r)
            assert floor["classes"]["communication"]["measured_ms"] == 0
        # checked on a GPU that was not busy; on a CPU the floors are estimates
        assert not any(floor["checked"] for floor in floors)
        assert "floor_below_measured" not in r["checks"]
        assert "on its own roofline" in run.stdout

    def test_losses_track_the_baseline(self, run):
        tolerance = 0.0015  # the lesson's LOSS_TOLERANCE, over the first 10 steps
        assert all(row["loss_rel_gap"] <= tolerance for row in run.json["rungs"])
        assert run.json["checks"]["losses_track_baseline"]

    def test_rungs_count_their_steps_and_their_compile(self, run):
        # every step is in the losses; a compile lands in the warm-up, never in a timed step
        rows = run.json["rungs"]
        for row in rows[1:]:
            name = row["name"]
            steps = row["warmup_steps"] + row["profiled_steps"] + row["timed_steps"]
            assert len(row["losses"]) == steps, f"{name}: losses of steps not run or lost"
            assert row["warmup_steps"] >= 1 and row["profiled_steps"] == 1, name
            window = row["timed_steps"] // len(row["step_ms"])
            assert window in (1, 4) and window * len(row["step_ms"]) == row["timed_steps"]
            if not row["settings"]["host_sync"]:
                assert window == 4, name
            assert (row["compile_s"] is None) == (not row["settings"]["compile"]), name
            if row["settings"]["compile"]:
                assert row["warmup_steps"] == 2, f"{name}: the compile lands in a timed step"
        # "compiling" is said before each compiled rung's first step, and only then
        compiled = [row for row in rows if row["settings"]["compile"]]
        assert run.stdout.count("compiling (the first step) ...") == len(compiled)
        assert run.stdout.count("measured: compile ") == len(compiled)

    def test_each_technique_acts(self, run):
        rows = {row["name"]: row for row in run.json["rungs"]}
        for row in rows.values():
            acts, settings = row["acts"], row["settings"]
            assert acts["fused_adamw_ran"] == settings["fused"], row["name"]
            assert acts["logits_written"] == (not settings["fused_classifier"]), row["name"]
            dtype = "torch.float32"
            if settings["bf16"]:
                dtype = "torch.bfloat16"
            assert acts["logits_dtype"] == dtype, row["name"]
            residual = "torch.float32"
            if settings["bf16"] and settings["bf16_residual"]:
                residual = "torch.bfloat16"
            assert acts["residual_dtype"] == residual, row["name"]
        # TF32 on a CPU: the flag is set, and fp32 matmuls stay fp32 (no TF32 units)
        assert rows["+ TF32"]["settings"]["tf32"]
        assert rows["+ TF32"]["acts"]["fp32_matmul_rel_error"] < 1e-5
        # reading the loss less often, and the fused classifier, change when the host waits
        # and how the logits are formed, not what is computed: the incumbent's losses, step
        # for step (each trains batch i at its step i from the one init)
        incumbents = capstone_torch_incumbents(run.json["rungs"])
        for row, incumbent in zip(run.json["rungs"], incumbents):
            if row["name"] == "+ no host sync per step":
                steps = min(len(row["losses"]), len(incumbent["losses"]))
                assert np.allclose(row["losses"][:steps], incumbent["losses"][:steps],
                                   rtol=1e-5, atol=0), row["name"]
            if row["name"] == "+ fused classifier (logits never written)":
                # the first step's loss: one forward, rounding alone; then each AdamW step
                # amplifies rounding (chaos), still far below a wrong loss's gap (bf16 logits
                # in the loss: ~3e-3)
                assert row["losses"][0] == pytest.approx(incumbent["losses"][0], rel=1e-5)
                early = min(len(row["losses"]), len(incumbent["losses"]), 10)
                assert np.allclose(row["losses"][:early], incumbent["losses"][:early],
                                   rtol=3e-4, atol=0), row["name"]
        fused = rows["+ fused classifier (logits never written)"]
        plain = dict(fused["settings"], fused_classifier=False)
        config = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32,
                           vocab_size=4096 if plain["pad_vocab"] else 4095,
                           attn=plain["attn"], fused_classifier=False)
        assert fused["activation_bytes"] < activation_bytes(config, fused["micro_batch_size"])

    def test_checkpointing_lowers_activation_memory(self, run):
        rows = {row["name"]: row for row in run.json["rungs"]}
        checkpointed = rows["+ activation checkpointing"]
        plain = dict(checkpointed["settings"], checkpoint=False)
        config = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32,
                           vocab_size=4096 if plain["pad_vocab"] else 4095, attn=plain["attn"],
                           fused_classifier=plain["fused_classifier"])
        assert checkpointed["activation_bytes"] < activation_bytes(
            config, checkpointed["micro_batch_size"], bf16=plain["bf16"])
        assert run.json["checks"]["checkpointing_lowers_memory"]

    def test_time_split_adds_up_to_the_step(self, run):
        # the classes (and idle) partition the profiled step: they sum to its wall time
        for row in run.json["rungs"]:
            split = row["profile"]
            assert sorted(split) == sorted(CAPSTONE_TORCH_CLASSES)
            assert all(seconds >= 0 for seconds in split.values()), row["name"]
            assert sum(split.values()) == pytest.approx(row["profile_step_s"], rel=1e-6)
            assert split["matmul"] > 0 and split["optimizer"] > 0, row["name"]
        assert run.json["checks"]["time_split_adds_up"]

    def test_accumulated_gradient_equals_full_batch(self, run, lesson, tmp_path, monkeypatch):
        assert run.json["accumulation_rel_diff"] < 1e-4
        assert run.json["checks"]["accumulated_gradient_equals_full_batch"]
        # the check can fail: a step that forgets to divide by the micro-batch count is caught
        shared = capstone_torch_shared(lesson, tmp_path, monkeypatch)
        assert lesson.accumulation_error(shared) < lesson.ACCUM_TOLERANCE

        def forgets_to_divide(model, x, y, micro_batches, bf16, no_sync=None):
            total = torch.zeros(())
            for x_micro, y_micro in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
                _, loss = model(x_micro, y_micro)
                loss.backward()
                total += loss.detach() / micro_batches
            return total

        monkeypatch.setattr(lesson, "accumulate", forgets_to_divide)
        assert lesson.accumulation_error(shared) > 1.0  # off by 3x

    def test_no_garbage_collection_inside_timed_calls(self, lesson):
        capstone_collector_off_while_timing(lesson)

    def test_a_gpu_settles_before_the_timed_pairs(self, lesson, monkeypatch):
        capstone_settles_a_gpu(lesson, monkeypatch)

    def test_the_rule_with_known_ratios(self, lesson):
        capstone_rule_with_known_ratios(lesson)

    def test_bf16_needs_compute_capability_eight(self, lesson, monkeypatch):
        gpu = torch.device("cuda", 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
        ok, why = lesson.has_bf16_tensor_cores(gpu)
        assert not ok and "7.5 < 8.0" in why
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert lesson.has_bf16_tensor_cores(gpu) == (True, "")
        assert lesson.has_bf16_tensor_cores(torch.device("cpu")) == (True, "")
        # a card without them: the bf16 rungs are skipped with the reason, the rest runs
        shared = lesson.Shared(gpu, lesson.QUICK, [], {}, "eager", None, None, 1.0, False,
                               "compute capability 7.5 < 8.0: no bf16 tensor cores")
        settings = dict(lesson.BASELINE, bf16=True)
        assert lesson.skip_reason(settings, shared) == shared.bf16_why
        assert lesson.skip_reason(dict(lesson.BASELINE, tf32=True), shared) is None
        residual = dict(lesson.BASELINE, bf16_residual=True)
        assert "without bf16 autocast" in lesson.skip_reason(residual, shared)
        assert "torchrun" in lesson.skip_reason(dict(lesson.BASELINE, ddp=True), shared)

    def test_memory_budget_caps_the_allocator(self, lesson, monkeypatch):
        # a GPU's arithmetic with known inputs: 80 GiB, of which 1 GiB is the CUDA context
        total = 80 * 2**30
        free = 79 * 2**30
        capped = []
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda fraction, device=None: capped.append(fraction))
        gpu = torch.device("cuda", 0)
        assert lesson.memory_budget(gpu, None) == free and capped == []
        assert lesson.memory_budget(gpu, 24) == 23 * 2**30  # 24 GiB less the context
        assert capped == [23 / 80]
        assert lesson.memory_budget(gpu, 4096) == free  # more than the card: the card
        assert lesson.memory_budget(torch.device("cpu"), None) is None
        assert lesson.memory_budget(torch.device("cpu"), 12) == 12 * 2**30

    def test_sizing_against_what_is_held(self, lesson):
        # GPT-2 124M on 24 GiB beside an incumbent holding 2 GiB and the next rung's
        # weights and AdamW moments (12 bytes a parameter): model_torch's choice for what
        # is left, its predicted peak for that micro-batch
        sizes = lesson.GPU
        shared = lesson.Shared(torch.device("cuda", 0), sizes, [], {}, "inductor",
                               24 * 2**30, None, 1.0, True, "")
        settings = dict(lesson.BASELINE, bf16=True, attn="sdpa")
        count, predicted, available = lesson.size_rung(settings, shared, 2 * 2**30, 64)
        config = lesson.model_config(sizes, settings)
        next_rung = 12 * model_torch.param_count(config)
        assert available == 22 * 2**30 - next_rung
        assert count == model_torch.micro_batches(config, 64, available, True) == 4
        assert predicted == model_torch.predicted_peak_bytes(config, 16, True)
        fp32 = lesson.size_rung(lesson.BASELINE, shared, 2 * 2**30, 64)
        assert fp32[0] == 8  # fp32, the T x T scores: twice the micro-batches
        assert lesson.more_micro_batches(64, 4) == 8
        assert lesson.more_micro_batches(6, 2) == 6
        assert lesson.more_micro_batches(64, 64) is None
        cpu = lesson.Shared(torch.device("cpu"), sizes, [], {}, "eager", None, None, 1.0,
                            True, "")
        assert lesson.size_rung(settings, cpu, 0, 64)[0] == 1  # a CPU is not sized

    def test_tokens_per_joule_from_the_energy_counter(self, lesson, tmp_path, monkeypatch):
        # NVML's counter faked: 2.5 J more at every read. The stretch is whole steps lasting
        # ENERGY_MIN_SECONDS at the rung's step time, the counter read before and after it
        # (never inside a timed step): tokens/J = its tokens / 2.5 J
        shared = capstone_torch_shared(lesson, tmp_path, monkeypatch)
        reads = []

        def meter():
            reads.append(None)
            return 2.5 * len(reads)

        shared.meter = meter
        incumbent = lesson.build(lesson.BASELINE, shared, 1, "incumbent")
        candidate = lesson.build(dict(lesson.BASELINE, host_sync=False), shared, 1, "candidate")
        lesson.compare(incumbent, candidate, shared, pairs=3)
        assert reads == []  # no read inside the timed calls
        assert len(incumbent.losses) == 1 + 3 * 4 and len(candidate.losses) == 3 * 4
        monkeypatch.setattr(lesson, "ENERGY_MIN_SECONDS", 0.35)
        per_joule = lesson.tokens_per_joule(candidate, shared, step_ms=100.0)  # 4 steps
        assert len(reads) == 2
        assert per_joule == pytest.approx(4 * 16 * 4 / 2.5)  # 4 x 16 tokens a step
        assert len(candidate.losses) == 3 * 4 + 4
        shared.world = 2  # under torchrun every rank would need the same count: none
        assert lesson.tokens_per_joule(candidate, shared, step_ms=100.0) is None

    def test_the_floor_profiles_a_step_after_an_untimed_one(self, lesson, tmp_path, monkeypatch):
        # the later rungs' memory came and went: the profiled step is not the first after them
        shared = capstone_torch_shared(lesson, tmp_path, monkeypatch)
        trainer = lesson.build(lesson.BASELINE, shared, 1, "final")
        profile_split = lesson.profile_split
        before = []

        def recording(fn, device):
            before.append(len(trainer.losses))
            return profile_split(fn, device)

        monkeypatch.setattr(lesson, "profile_split", recording)
        roofs = dict(matmul_flops_best=1e11, copy_bytes_per_s_best=1e10, busy=False)
        floor = lesson.step_floor(trainer, 100.0, shared, roofs)
        assert before == [1] and len(trainer.losses) == 2
        assert trainer.warmup_steps == 1 and trainer.profiled_steps == 1
        assert floor["step_ms"] > 0

    def test_the_fix_predicted_from_the_floor_table(self, lesson):
        # known floors: what bf16_residual saves at the floor, and at the rate each class
        # runs now, over a 100 ms step
        shared = lesson.Shared(torch.device("cuda", 0), lesson.GPU, [], {}, "inductor",
                               None, None, 1.0, True, "")
        roofs = dict(matmul_flops_best=800e12, copy_bytes_per_s_best=4e12)
        settings = dict(lesson.BASELINE, bf16=True, attn="sdpa", compile=True, pad_vocab=True)
        tokens = 64 * 1024
        before = lesson.floor_ms(settings, 1, tokens, shared, roofs)
        after = lesson.floor_ms(dict(settings, bf16_residual=True), 1, tokens, shared, roofs)
        classes = {}
        for name, ms in before.items():
            classes[name] = dict(measured_ms=2 * ms, floor_ms=ms)  # every class at 2x its floor
        floor = dict(settings=settings, micro_batches=1, tokens=tokens, step_ms=100.0,
                     classes=classes)
        (low, high), words = lesson.predict_from_floor(floor, dict(settings, bf16_residual=True),
                                                       shared, roofs)
        saved = before["elementwise/norm/loss"] - after["elementwise/norm/loss"]
        assert saved > 0 and before["matmul"] == after["matmul"]
        assert low == pytest.approx(100 / (100 - saved / 2))
        assert high == pytest.approx(100 / (100 - 1.5 * 2 * saved))
        config = lesson.model_config(lesson.GPU, settings)
        bytes_saved = (step_floor_terms(config, tokens, True)["elementwise/norm/loss"]["bytes"]
                       - step_floor_terms(GPTConfig(**{**config.__dict__, "bf16_residual": True}),
                                          tokens, True)["elementwise/norm/loss"]["bytes"])
        assert saved == pytest.approx(bytes_saved / 4e12 * 1e3)

    def test_bad_data_refused_without_a_cache(self, lesson, tmp_path):
        for content in ["missing", "folder", b"", b"0123456789",
                        b"\x7fELF\x02\x01" + bytes(range(256)) * 4]:
            path = tmp_path / "data"
            if content == "folder":
                path.mkdir()
            elif content != "missing":
                path.write_bytes(content)
            with pytest.raises(SystemExit) as refusal:
                lesson.load_tokens(str(path), "bytes", 18, cache_dir=tmp_path / "cache")
            code = refusal.value.code
            assert isinstance(code, str) and code.startswith("error: --data"), content
            assert "\n" not in code  # one line
            assert not list(tmp_path.glob("cache/*"))  # nothing left behind
            if content == "folder":
                path.rmdir()
            elif content != "missing":
                path.unlink()

    def test_empty_cache_is_treated_as_absent(self, lesson, tmp_path):
        data = capstone_torch_text(tmp_path)
        cache = tmp_path / "cache"
        tokens, _ = lesson.load_tokens(str(data), "bytes", 18, cache_dir=cache)
        [cached] = cache.glob("tokens-*.npy")
        cached.write_bytes(b"")  # what a Ctrl-C during the first run could leave
        again, _ = lesson.load_tokens(str(data), "bytes", 18, cache_dir=cache)
        assert np.array_equal(again, tokens) and cached.stat().st_size > 0

    def test_tokenizer_without_network(self, lesson, tmp_path, monkeypatch, capsys):
        """No cached BPE files, no network: one line saying how to cache them, then bytes;
        --tokenizer bytes never looks; --tokenizer gpt2 refuses. No test opens a socket."""

        def no_network(*args, **kwargs):
            raise OSError("no network in the tests")

        monkeypatch.setattr(lesson.socket, "create_connection", no_network)
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
        assert lesson.gpt2_encoding("bytes") is None and capsys.readouterr().out == ""
        assert lesson.gpt2_encoding("auto") is None
        said = capsys.readouterr().out.splitlines()
        assert len(said) == 1 and "TIKTOKEN_CACHE_DIR" in said[0] and "UTF-8 bytes" in said[0]
        with pytest.raises(SystemExit) as refusal:
            lesson.load_tokens(str(capstone_torch_text(tmp_path)), "gpt2", 18,
                               cache_dir=tmp_path / "cache")
        assert refusal.value.code.startswith("error: --tokenizer gpt2")

    def test_no_final_rung_yet_is_said(self, lesson, tmp_path):
        with pytest.raises(SystemExit) as refusal:
            lesson.read_final_rung(tmp_path)
        assert "run the waterfall first" in refusal.value.code

    def test_gpu_results_recompute(self):
        """Committed GPU results of this format: their derived numbers follow from their raw
        ones, their floors from model_torch, and on a GPU TF32 and bf16 act."""
        paths = sorted(HERE.glob("results/*/07_capstone_torch*.json"))
        checked = 0
        for path in paths:
            result = json.loads(path.read_text())
            if "matmul_flops_best" not in result.get("roofs", {}) or result["device"]["type"] == "cpu":
                continue  # an older format, or a CPU run
            checked += 1
            capstone_torch_rederive(result)
            assert all(result["checks"].values()), (path.name, result["checks"])
            for row in result["rungs"]:
                if "floor" in row:
                    capstone_torch_check_floor(row["floor"], result)
                if row["settings"]["tf32"] and not row["settings"]["bf16"]:
                    assert row["acts"]["fp32_matmul_rel_error"] > 1e-4, path.name
                if row["settings"]["fused"]:
                    assert row["acts"]["fused_adamw_ran"], path.name
        if checked == 0:
            pytest.skip("no GPU results of this format committed yet")


def capstone_torch_shared(lesson, tmp_path, monkeypatch):
    """The --quick run's shared state, made in this process (its batches, its init)."""
    data = capstone_torch_text(tmp_path)
    monkeypatch.chdir(tmp_path)  # the token cache goes there
    monkeypatch.setattr(sys, "argv", [CAPSTONE_TORCH, "--quick", "--device", "cpu", "--data",
                                      str(data)])
    shared, _ = lesson.setup(lesson.parse_args())
    monkeypatch.setattr(lesson, "sync", lambda device: None)
    return shared


def capstone_torch_early_gap(lesson, shared, settings, base_losses, micro_batches=1):
    """A configuration's first losses (as the waterfall records them) against the baseline's."""
    trainer = lesson.build(settings, shared, micro_batches)
    lesson.run_steps(trainer, lesson.EARLY_STEPS, shared)
    return lesson.loss_gap(trainer.losses, base_losses)


class TestCapstoneTorchHeadline:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return capstone_torch_run(tmp_path_factory.mktemp("07_torch_headline"), "--headline",
                                  final=CAPSTONE_TORCH_FINAL)

    def test_headline(self, run):
        lesson = load_lesson(CAPSTONE_TORCH)
        h = run.json
        base, final = h["rungs"]
        assert base["settings"] == lesson.BASELINE and final["settings"] == CAPSTONE_TORCH_FINAL
        assert len(base["losses"]) == len(final["losses"]) == h["headline"]["steps"]
        assert base["losses"][-1] < base["losses"][0]  # it trains
        window = np.ones(20) / 20  # the lesson's SMOOTH
        smooth = np.convolve(final["losses"], window, mode="valid")
        smooth_base = np.convolve(base["losses"], window, mode="valid")
        curve = np.max(np.abs(smooth - smooth_base) / smooth_base)
        assert h["headline"]["curve_gap"] == pytest.approx(curve, rel=1e-9, abs=1e-15)
        assert h["headline"]["early_gap"] == final["loss_rel_gap"]
        ratios = [a / b for a, b in zip(final["incumbent_step_ms"], final["step_ms"])]
        assert h["headline"]["time_ratio"] == pytest.approx(statistics.median(ratios))
        assert h["headline"]["time_ratio_low"] == min(ratios)
        capstone_torch_rederive(h)
        assert h["checks"] == {"headline_starts_the_same": True, "headline_same_curve": True,
                               "accumulated_gradient_equals_full_batch": True}
        assert sorted(p.name for p in (run.folder / "out").glob("*.png")) == [
            "07_capstone_torch_headline.png"]

    def test_headline_check_fails_on_broken_math(self, tmp_path, monkeypatch):
        """The headline's 'starts the same' check: honest runs pass it; a loss computed on
        bf16 logits, or a reported loss not divided by its micro-step count, fail it."""
        lesson = load_lesson(CAPSTONE_TORCH)
        shared = capstone_torch_shared(lesson, tmp_path, monkeypatch)
        base = lesson.build(lesson.BASELINE, shared, 1)
        lesson.run_steps(base, lesson.EARLY_STEPS, shared)
        fused = dict(CAPSTONE_TORCH_FINAL, compile=False)  # the math, without the compile
        plain = dict(fused, fused_classifier=False)
        for final in (fused, plain):
            assert capstone_torch_early_gap(lesson, shared, final, base.losses) <= lesson.LOSS_TOLERANCE
        cross_entropy = torch.nn.functional.cross_entropy

        def chunk_on_bf16_logits(logits, targets, n):  # the fused classifier's, all in bf16
            logits = logits.bfloat16()
            logsumexp = torch.logsumexp(logits, dim=1, keepdim=True)
            loss = (logsumexp - logits.gather(1, targets[:, None])).sum()
            grad = torch.exp(logits - logsumexp)
            grad[torch.arange(len(targets)), targets] -= 1.0
            return loss.float(), grad.float() / n

        def on_bf16_logits(logits, targets, **kwargs):
            return cross_entropy(logits.bfloat16(), targets, **kwargs).float()

        # the loss, fused or plain, on bf16 logits: the toy's loss, ~8.3, sits where bf16's
        # steps are 2**-4: rounding moves it up to ~0.4%
        monkeypatch.setattr(model_torch, "chunk_cross_entropy", chunk_on_bf16_logits)
        monkeypatch.setattr(torch.nn.functional, "cross_entropy", on_bf16_logits)
        for final in (fused, plain):
            assert capstone_torch_early_gap(lesson, shared, final, base.losses) > lesson.LOSS_TOLERANCE
        monkeypatch.undo()
        shared = capstone_torch_shared(lesson, tmp_path, monkeypatch)

        def forgets_to_divide(model, x, y, micro_batches, bf16, no_sync=None):
            total = torch.zeros(())
            for x_micro, y_micro in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
                _, loss = model(x_micro, y_micro)
                (loss / micro_batches).backward()
                total += loss.detach()
            return total

        monkeypatch.setattr(lesson, "accumulate", forgets_to_divide)
        gap = capstone_torch_early_gap(lesson, shared, lesson.BASELINE, base.losses, micro_batches=4)
        assert gap > 1.0  # 4 micro-steps: 4x the loss


class TestCapstoneTorchDdp:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        final = dict(CAPSTONE_TORCH_FINAL, host_sync=True)
        return capstone_torch_run(tmp_path_factory.mktemp("07_torch_ddp"), nproc=2, final=final)

    def test_ddp_rungs(self, run):
        r = run.json
        rows = {row["name"]: row for row in r["rungs"]}
        assert list(rows) == CAPSTONE_TORCH_DDP and r["world"] == 2
        alone, ddp, bf16 = (rows[name] for name in CAPSTONE_TORCH_DDP)
        assert ddp["world"] == 2 and alone["world"] == 1
        assert ddp["settings"]["ddp"] and bf16["settings"]["ddp"] and bf16["settings"]["bf16_grads"]
        # alone: the batch in twice the micro-batches, each one rank's share: the same work
        assert alone["micro_batches"] == 2 * ddp["micro_batches"]
        assert alone["micro_batch_size"] == ddp["micro_batch_size"]
        assert alone["tokens_per_step"] == ddp["tokens_per_step"]  # one global batch
        # DDP computes what one process computes on the whole batch: the same losses
        steps = len(ddp["losses"])
        assert np.allclose(ddp["losses"], alone["losses"][:steps], rtol=1e-5, atol=0)
        assert bf16["loss_rel_gap"] <= 0.0015  # fp16 on gloo: the same bytes as bf16
        for row in (ddp, bf16):  # against 2 x one GPU alone
            assert row["scaling"] == pytest.approx(row["speedup"] / 2, rel=1e-12)
        capstone_torch_rederive(r)
        assert r["interconnect"] == "default"
        assert all(r["checks"].values()), r["checks"]
        figures = sorted(p.name for p in (run.folder / "out").glob("*.png"))
        assert figures == ["07_capstone_torch_ddp.png"]  # its own name, rank 0 alone

    def test_the_hook_sends_16_bit_gradients(self, run):
        # 2 bytes a parameter a step (fp16 on gloo: no bf16 there)
        rows = {row["name"]: row for row in run.json["rungs"]}
        hook = rows["+ bf16 gradient all-reduce"]["acts"]
        config = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, vocab_size=4096)
        assert hook["allreduced_dtype"] == "torch.float16"
        assert hook["allreduced_bytes_per_step"] == 2 * param_count(config)
        assert "allreduced_bytes_per_step" not in rows["+ DDP"]["acts"]  # DDP's own fp32 path


# ---------------------------------------------------------------------------------------
# 07_capstone_jax.py


CAPSTONE_JAX = "07_capstone_jax.py"
GIB = 2**30


def capstone_jax_run(tmp, *args, devices=None):
    """A --quick CPU run on a few KB of real text (the README), XLA:CPU compiling fast."""
    text = tmp / "small.txt"
    text.write_text((HERE / "README.md").read_text()[:20000])
    flags = FAST_COMPILE
    if devices:
        flags = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
    return expect_ok(run_lesson(CAPSTONE_JAX, "--quick", "--device", "cpu", "--tokenizer",
                                "bytes", "--data", str(text), *args, tmp=tmp, devices=devices,
                                env=dict(XLA_FLAGS=flags)))


def capstone_jax_rows(result):
    return {row["name"]: row for row in result["rungs"]}


def capstone_jax_rederive(result):
    """Every derived number of a JSON recomputed from its raw measurements."""
    roofs = result["roofs"]
    base = result["rungs"][0]
    tokens = result["tokens_per_step"]
    for row in result["rungs"]:
        ms = statistics.median(row["step_ms"])
        assert row["ms_per_step"] == pytest.approx(ms, rel=1e-12)
        assert row["tokens_per_step"] == tokens
        assert row["tokens_per_s"] == pytest.approx(tokens / (ms / 1e3), rel=1e-12)
        per_device = row["tokens_per_s"] * result["flops_per_token"] / row["world"]
        assert row["mfu_measured_peak"] == pytest.approx(per_device / roofs["matmul_flops"])
        assert row["mfu_datasheet"] is None and roofs["datasheet_flops"] is None  # a CPU
        steps = row["loss_gap_steps"]  # the steps both had trained when it was measured
        assert steps <= 10
        gaps = [abs(a - b) / b for a, b in zip(row["losses"][:steps], base["losses"][:steps])]
        assert row["loss_rel_gap"] == pytest.approx(max(gaps), rel=1e-9, abs=1e-15)
        assert len(row["losses"]) >= row["warmup_steps"] + row["timed_steps"]
        if row is base:
            assert row["verdict"] == "the first incumbent" and row["ratio"] is None
            assert row["speedup"] == 1 and row["incumbent_step_ms"] == []
            low, high = row["predicted"]  # a first incumbent's MFU of the measured peak
            assert row["prediction_held"] == (low <= row["mfu_measured_peak"] <= high)
            continue
        ratios = [a / b for a, b in zip(row["incumbent_step_ms"], row["step_ms"])]
        assert row["ratios"] == pytest.approx(ratios, rel=1e-9)
        assert row["ratio"] == pytest.approx(statistics.median(ratios), rel=1e-9)
        assert (row["ratio_low"], row["ratio_high"]) == pytest.approx((min(ratios), max(ratios)))
        low, high = row["predicted"]
        assert row["prediction_held"] == (low <= row["ratio"] <= high)
        assert result["predictions"][row["name"]] == row["prediction_held"]


def capstone_jax_speedups(result):
    """The speed-up over the baseline: the product of the kept rungs' ratios; a dropped
    rung's is its incumbent's times its own ratio."""
    incumbent = 1.0
    for row in result["rungs"][1:]:
        assert row["speedup"] == pytest.approx(incumbent * row["ratio"], rel=1e-9), row["name"]
        if row["kept"] and not row["settings"]["shard"]:
            incumbent = row["speedup"]


def capstone_jax_toy_shared(lesson, budget=None, batch=4, sizes=None):
    """The state a --quick rung shares, on one CPU device, made without describe_machine
    (other sizes: for arithmetic only, no init)."""
    init = None
    if sizes is None:
        sizes = lesson.QUICK
        torch.manual_seed(0)
        init_config = lesson.model_config(sizes, dict(lesson.BASELINE, pad_vocab=True))
        init = lesson.model_torch.GPT(init_config).state_dict()
    tokens = np.arange(1000, dtype=np.uint16) % 256
    flops = lesson.flops_per_token(lesson.model_config(sizes, lesson.BASELINE))
    return lesson.Shared(lesson.jax.devices("cpu")[:1], False, "cpu", sizes, batch, tokens,
                         init, budget, None, flops, True, "")


def capstone_jax_settings(lesson, up_to):
    """BASELINE with every rung's change up to and including `up_to`."""
    settings = dict(lesson.BASELINE)
    for name, change, _ in lesson.RUNGS:
        settings.update(change)
        if name == up_to:
            return settings
    raise KeyError(up_to)


def capstone_jax_bf16_loss_acts(lesson, monkeypatch, hook):
    """The evidence of a bf16 rung's program whose loss (model_jax's `hook`) takes the
    logits as they come, in bf16: the plain loss or the fused classifier's."""
    jnp = lesson.jnp
    jax = lesson.jax

    def no_upcast(logits, targets):  # model_jax.cross_entropy without its astype(float32)
        is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
        target_logit = jnp.sum(jnp.where(is_target, logits, 0), axis=-1)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logit)

    def chunk_no_upcast(logits, targets, n):  # model_jax.chunk_cross_entropy without it
        is_target = jnp.arange(logits.shape[-1]) == targets[:, None]
        logsumexp = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        target_logit = jnp.sum(jnp.where(is_target, logits, 0), axis=-1, keepdims=True)
        grad = jnp.exp(logits - logsumexp) - is_target
        return jnp.sum(logsumexp - target_logit).astype(jnp.float32), grad / n

    broken = dict(cross_entropy=no_upcast, chunk_cross_entropy=chunk_no_upcast)
    monkeypatch.setattr(lesson.model_jax, hook, broken[hook])
    settings = capstone_jax_settings(lesson, "+ cuBLAS for every matmul")  # bf16 compute
    if hook == "chunk_cross_entropy":
        settings["fused_classifier"] = True
    shared = capstone_jax_toy_shared(lesson)
    trainer = lesson.build(settings, shared, 1, "broken loss")
    lesson.compile_step(trainer, shared)
    return lesson.evidence(trainer, shared)


class TestCapstoneJax:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        return capstone_jax_run(tmp_path_factory.mktemp("07jax"), devices=4)

    @pytest.fixture(scope="class")
    @classmethod
    def lesson(cls):
        return load_lesson(CAPSTONE_JAX)

    def test_every_rung_runs_and_reports(self, run, lesson):
        result = run.json
        assert result["lesson"] == "07_capstone_jax" and result["quick"]
        assert result["device"]["count"] == 4 and result["world"] == 4
        names = [name for name, _, _ in lesson.RUNGS]
        ran = [row["name"] for row in result["rungs"]]
        assert ran == [name for name in names if name in ran]  # in the file's order
        assert set(ran) | set(result["skipped"]) == set(names)  # each one ran or says why
        assert set(result["skipped"]) <= {lesson.FLOOR_FIX}  # (a CPU drops bf16: no stream)
        for key in ("checks", "predictions", "machine_busy", "cpu_shares", "roofs"):
            assert key in result
        assert isinstance(result["machine_busy"], bool) and result["cpu_shares"]
        assert all(isinstance(held, bool) for held in result["predictions"].values())
        incumbent = result["rungs"][0]
        assert incumbent["settings"] == lesson.BASELINE and incumbent["compile_s"] is None
        for row in result["rungs"][1:]:  # each rung: the incumbent's settings and its change
            change = dict(lesson.RUNGS[names.index(row["name"])][1])
            assert row["settings"] == dict(incumbent["settings"], **change), row["name"]
            assert row["xla_plan_bytes"] > 0
            changed = {key for key, value in row["settings"].items()
                       if value != incumbent["settings"][key]}
            if changed <= {"host_sync", "triton_gemm"}:  # a CPU: the incumbent's program
                assert row["compile_s"] is None, row["name"]
            else:
                assert row["compile_s"] > 0, row["name"]
            assert row["verdict"].startswith(("kept: ", "dropped: "))
            window = 1
            if not row["settings"]["host_sync"]:
                window = lesson.WINDOW  # steps per timed call
            assert row["timed_steps"] == len(row["step_ms"]) * window, row["name"]
            if row["kept"] and not row["settings"]["shard"]:
                incumbent = row
        assert result["final_rung"] == incumbent["name"]
        assert all(result["checks"].values()), result["checks"]
        assert (run.folder / "out" / "07_capstone_jax.png").exists()
        assert (run.folder / "out" / "07_capstone_jax_final_rung.json").exists()
        for label in ("measured: ", "derived: ", "check "):
            assert label in run.stdout
        capstone_jax_rederive(result)
        capstone_jax_speedups(result)

    def test_kept_or_dropped_by_the_rule(self, run, lesson):
        for row in run.json["rungs"][1:]:
            decisive = capstone_decisive_ratios(row, CAPSTONE_SET_ASIDE_FROM)
            assert row["kept"] == (min(decisive) > 1), row["name"]
            prefix = "dropped: "
            if row["kept"]:
                prefix = "kept: "
            assert row["verdict"].startswith(prefix)

    def test_losses_track_the_baseline(self, run, lesson):
        assert run.json["checks"]["losses_track_baseline"]
        for row in run.json["rungs"]:
            assert row["loss_rel_gap"] <= lesson.LOSS_TOLERANCE, row["name"]

    def test_each_technique_acts(self, run, lesson):
        # not only configured: seen in the compiled programs and the buffers
        for row in run.json["rungs"]:
            acts = row["acts"]
            settings = row["settings"]
            assert acts["donated_inputs_deleted"] == settings["donate"], row["name"]
            if not settings["jit"]:
                continue
            assert (acts["bf16_dots"] > 0) == settings["bf16"], row["name"]
            assert (acts["highest_dots"] > 0) == (settings["precision"] == "highest")
            assert (acts["all_reduces"] > 0) == settings["shard"], row["name"]
            assert (acts["full_logits"] == 0) == settings["fused_classifier"], row["name"]
            if settings["attn"] == "manual":  # (a CPU's fused attention is XLA's: T x T too)
                assert acts["scores"] > 0, row["name"]
            layers = run.json["sizes"]["n_layer"]
            forwards = 1
            if settings["checkpoint"]:  # checkpointing runs each block's forward again
                forwards = 2
            slices = 3 * forwards * layers
            if settings["split_qkv"]:
                slices = 0
            assert acts["qkv_slices"] == slices, row["name"]
            tanhs = forwards
            if settings["recompute_gelu"]:  # and once more in backward
                tanhs += 1
            assert acts["gelu_tanhs"] == tanhs * layers, row["name"]
            assert acts["f32_vocab_exps"] > 0, f"{row['name']}: the loss is not in fp32"
        assert run.json["checks"]["checkpointing_lowers_memory"]

    def test_same_program_same_losses(self, run):
        # a rung that changes only when Python waits (no host sync), or only a GPU's kernel
        # choice (cuBLAS on a CPU), trains the same numbers as its incumbent; other
        # arrangements of the same math (the fused classifier, the rows sharded over 4
        # devices) the same to rounding
        rows = run.json["rungs"]
        for index, row in enumerate(rows[1:], start=1):
            incumbent = [r for r in rows[:index] if r["kept"] and not r["settings"]["shard"]][-1]
            common = min(len(row["losses"]), len(incumbent["losses"]))
            changed = {k for k in row["settings"] if row["settings"][k] != incumbent["settings"][k]}
            if changed <= {"host_sync", "triton_gemm"}:
                assert row["losses"][:common] == incumbent["losses"][:common], row["name"]
            if changed <= {"fused_classifier", "shard"}:
                # the first step's loss: one forward, rounding alone; then each AdamW step
                # amplifies rounding (chaos), still far below a wrong loss's gap (bf16 logits
                # in the loss: ~3e-3)
                assert row["losses"][0] == pytest.approx(incumbent["losses"][0], rel=1e-5)
                early = min(common, 10)
                assert np.allclose(row["losses"][:early], incumbent["losses"][:early],
                                   rtol=3e-4, atol=0), row["name"]

    def test_profile_splits_the_step(self, run):
        # the kernel classes plus idle add up to the profiled step; the un-jitted rung, which
        # dispatches every op from Python, is bound by idle time; a jitted step's classes
        # are found in its program
        # (a step, of a profiled call holding the steps the rung's timed calls hold)
        rows = capstone_jax_rows(run.json)
        for row in run.json["rungs"]:
            split = row["profile"]
            assert sum(split.values()) == pytest.approx(row["profile_step_s"], rel=1e-6)
            assert min(split.values()) >= 0 and sum(split.values()) > split["idle"]
            window = row["timed_steps"] // len(row["step_ms"])
            assert row["profile_window"] == window == row["profiled_steps"], row["name"]
        base = rows["un-jitted (op-by-op)"]["profile"]
        assert max(base, key=base.get) == "idle"
        jitted = rows["+ jax.jit (whole step)"]["profile"]
        assert jitted["matmul"] > 0 and jitted["optimizer"] > 0
        assert jitted["elementwise/norm/loss"] > 0

    def test_floor_table_adds_up(self, run, lesson):
        # the final rung's floor: its classes add up to the profiled step, each floor is
        # model_torch's count at the roofs the table names, the largest excess is named
        floors = [row for row in run.json["rungs"] if "floor" in row]
        assert floors and floors[-1]["name"] == run.json["final_rung"]
        for row in floors:
            floor = row["floor"]
            classes = floor["classes"]
            assert set(classes) == set(lesson.CLASSES)
            measured = sum(c["measured_ms"] for c in classes.values())
            assert measured == pytest.approx(floor["step_ms"], rel=1e-6)
            for name, c in classes.items():
                expected = max(c["flops"] / floor["matmul_flops"],
                               c["bytes"] / floor["copy_bytes_per_s"])
                assert c["floor_ms"] == pytest.approx(expected * 1e3, rel=1e-9, abs=1e-12)
            excess = {n: c["measured_ms"] - c["floor_ms"] for n, c in classes.items()}
            assert floor["largest_excess"] == max(excess, key=excess.get)
            assert floor["technique"] == lesson.TECHNIQUE[floor["largest_excess"]]
            assert floor["matmul_flops"] == run.json["roofs"]["matmul_flops_best"]
            assert floor["copy_bytes_per_s"] == run.json["roofs"]["copy_bytes_per_s_best"]
            assert floor["settings"] == row["settings"]
            assert not floor["checked"]  # a CPU: its roofs are one op's speed
        assert "floor_below_measured" not in run.json["checks"]

    def test_floor_counts_what_model_torch_counts(self, lesson):
        # the floor's arithmetic with known inputs: the final rung's settings on a toy, roofs
        # of 1e14 FLOP/s and 1e12 bytes/s; on a GPU attention is its own class (cuDNN's
        # kernel), elsewhere its matmuls count as matmul and its softmax as elementwise
        shared = capstone_jax_toy_shared(lesson)
        roofs = dict(matmul_flops_best=1e14, copy_bytes_per_s_best=1e12)
        settings = capstone_jax_settings(lesson, "+ cuBLAS for every matmul")
        config = lesson.model_config(shared.sizes, settings)
        terms = lesson.model_torch.step_floor_terms(config, 64, True, 2)
        shared.gpu = True
        _, floors = lesson.floor_ms(settings, 2, 64, shared, roofs)
        for name, term in terms.items():
            expected = max(term["flops"] / 1e14, term["bytes"] / 1e12) * 1e3
            assert floors[name] == pytest.approx(expected)
        shared.gpu = False
        moved, floors = lesson.floor_ms(settings, 2, 64, shared, roofs)
        assert moved["attention"] == dict(flops=0, bytes=0) and floors["attention"] == 0
        assert moved["matmul"]["flops"] == terms["matmul"]["flops"] + terms["attention"]["flops"]
        elementwise = terms["elementwise/norm/loss"]["bytes"] + terms["attention"]["bytes"]
        assert moved["elementwise/norm/loss"]["bytes"] == elementwise

    def test_the_floors_fix_is_predicted_from_the_table(self, lesson):
        # the bf16 residual stream's range: the bytes it saves, at the floors (half of it)
        # and at the rate each class runs now (1.5 times it), off a 100 ms step
        shared = capstone_jax_toy_shared(lesson)
        shared.gpu = True
        roofs = dict(matmul_flops_best=1e14, copy_bytes_per_s_best=1e12)
        settings = capstone_jax_settings(lesson, "+ cuBLAS for every matmul")
        _, before = lesson.floor_ms(settings, 1, 64, shared, roofs)
        fixed = dict(settings, bf16_residual=True)
        _, after = lesson.floor_ms(fixed, 1, 64, shared, roofs)
        classes = {}
        for name, ms in before.items():
            classes[name] = dict(measured_ms=3 * ms)  # every class at 3x its floor
        floor = dict(settings=settings, micro_batches=1, tokens=64, step_ms=100.0,
                     classes=classes)
        (low, high), _ = lesson.predict_from_floor(floor, fixed, shared, roofs)
        saved = sum(before[name] - after[name] for name in before)
        assert saved > 0  # fewer bytes: the stream in bf16
        assert low == pytest.approx(100 / (100 - saved / 2))
        assert high == pytest.approx(100 / (100 - 1.5 * 3 * saved))

    def test_accumulated_gradient_is_the_full_batch_gradient(self, run, lesson, monkeypatch):
        # the check that catches a lost "/ micro_batches", which the losses do not see
        # (AdamW's update is scale-free); the lesson exits 1 if it fails
        assert run.json["accumulation_rel_diff"] < 1e-4
        assert run.json["checks"]["accumulated_gradient_equals_full_batch"]
        right = lesson.accumulate

        def forgets_to_divide(model, x, y, micro_batches, jitted=True):
            loss, grads = right(model, x, y, micro_batches, jitted)
            return loss, lesson.jax.tree.map(lambda g: g * micro_batches, grads)

        monkeypatch.setattr(lesson, "accumulate", forgets_to_divide)
        assert lesson.accumulation_error() > 1  # 4x the gradient: error 3

    @pytest.mark.parametrize("hook", ["cross_entropy", "chunk_cross_entropy"])
    def test_bf16_logits_in_the_loss_fail_the_check(self, lesson, monkeypatch, hook):
        # broken math that the loss's value barely shows (bf16 rounds it by ~0.3%, within
        # the honest spread of a long run): the compiled program shows it
        acts = capstone_jax_bf16_loss_acts(lesson, monkeypatch, hook)
        assert acts["bf16_dots"] > 0 and acts["f32_vocab_exps"] == 0, acts
        row = dict(settings=dict(jit=True), acts=acts)
        assert not lesson.loss_in_fp32([row])

    def test_memory_fraction_follows_the_card(self, lesson):
        # --memory-gb N: N GiB of the card for JAX's allocator, whatever the card; else the
        # environment's share (the current name, or the deprecated one), else the default
        h200 = 150_031_335_424  # bytes torch reports for a 141 GB H200 (139.7 GiB)
        for gb in (8, 12, 24, 80):
            fraction = lesson.allocator_fraction(gb, h200, {})
            assert fraction == gb * GIB / h200
            assert fraction * h200 == pytest.approx(gb * GIB)
        assert lesson.allocator_fraction(None, h200, {}) == lesson.MEMORY_FRACTION
        environ = {"XLA_CLIENT_MEM_FRACTION": "0.5"}
        assert lesson.allocator_fraction(None, h200, environ) == 0.5
        environ = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}
        assert lesson.allocator_fraction(None, h200, environ) == 0.6
        assert lesson.allocator_fraction(24, h200, environ) == 24 * GIB / h200
        with pytest.raises(SystemExit):  # more than the card has
            lesson.allocator_fraction(141, h200, {})
        for text in ("0", "1e9", "-24", "100000"):
            with pytest.raises(Exception):
                lesson.memory_gb(text)
        assert lesson.memory_gb("24") == 24

    def test_micro_batches_follow_the_budget(self, lesson):
        # the final rung's step, 64 x 1024 tokens of GPT-2: the fewest micro-batches whose
        # predicted peak (model_jax's accounting, with the allocator's headroom) fits the
        # budget; the same tokens per step on every card
        shared = capstone_jax_toy_shared(lesson, batch=64, sizes=lesson.GPU)
        settings = capstone_jax_settings(lesson, "+ cuBLAS for every matmul")
        counts = {}
        for gb in (8, 12, 24, 80, 141):
            shared.budget = gb * GIB
            count, predicted, available = lesson.size_rung(settings, shared, GIB, 64)
            config = lesson.model_config(shared.sizes, settings)
            next_rung = 12 * lesson.model_torch.param_count(config)  # weights, moments
            assert available == gb * GIB - GIB - next_rung  # and what the incumbent holds
            config = lesson.model_config(shared.sizes, settings)
            peak = lesson.model_jax.predicted_peak_bytes(config, 64 // count, True)
            assert predicted == peak
            assert lesson.model_torch.ALLOCATOR_HEADROOM * peak <= available
            fewer = [c for c in range(1, count) if 64 % c == 0]
            for c in fewer:  # no smaller count fits
                more = lesson.model_jax.predicted_peak_bytes(config, 64 // c, True)
                assert lesson.model_torch.ALLOCATOR_HEADROOM * more > available
            counts[gb] = count
        assert counts[141] == counts[80] == 1 and counts[8] > counts[24] > 1
        assert list(counts.values()) == sorted(counts.values(), reverse=True)
        shared.budget = None  # a CPU without --memory-gb: nothing sized
        assert lesson.size_rung(settings, shared, 0, 64) == (1, None, None)

    def test_op_by_op_sizing_counts_the_traced_residuals(self, lesson):
        # op by op, JAX keeps every residual its autodiff traced: model_jax.eager_peak_bytes
        shared = capstone_jax_toy_shared(lesson, batch=8)
        config = lesson.model_config(shared.sizes, lesson.BASELINE)
        whole = lesson.model_jax.eager_peak_bytes(config, 8)
        half = lesson.model_jax.eager_peak_bytes(config, 4)
        next_rung = 12 * lesson.model_torch.param_count(config)  # its weights, moments
        shared.budget = int(lesson.model_torch.ALLOCATOR_HEADROOM * (whole + half) / 2)
        shared.budget += next_rung
        count, predicted, _ = lesson.size_rung(lesson.BASELINE, shared, 0, 8)
        assert (count, predicted) == (2, half)
        shared.budget = 1000  # not one sequence
        assert lesson.size_rung(lesson.BASELINE, shared, 0, 8)[0] is None

    def test_torch_sees_a_gpu_jax_cannot_use(self, lesson, monkeypatch):
        # one line and a stop, not a CPU run on a GPU machine
        assert lesson.jax_misses_gpu(True, "cpu").startswith("error: torch sees a CUDA GPU")
        assert lesson.jax_misses_gpu(True, "gpu") is None
        assert lesson.jax_misses_gpu(False, "cpu") is None
        monkeypatch.setattr(lesson.torch.cuda, "is_available", lambda: True)
        card = SimpleNamespace(total_memory=80 * GIB)
        monkeypatch.setattr(lesson.torch.cuda, "get_device_properties", lambda index: card)
        monkeypatch.setenv("XLA_FLAGS", "")
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
        args = SimpleNamespace(device="auto", memory_gb=24)
        with pytest.raises(SystemExit) as stop:
            lesson.memory_budget(args)  # this process's JAX runs on the CPU
        assert str(stop.value.code).startswith("error: torch sees a CUDA GPU")
        assert lesson.os.environ["XLA_CLIENT_MEM_FRACTION"] == f"{24 / 80:.4f}"
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in lesson.os.environ  # never both

    def test_no_bf16_below_compute_capability_8(self, lesson):
        t4 = SimpleNamespace(platform="gpu", compute_capability="7.5")
        h100 = SimpleNamespace(platform="gpu", compute_capability="9.0")
        ok, reason = lesson.has_bf16_tensor_cores(t4)
        assert not ok and "7.5" in reason
        assert lesson.has_bf16_tensor_cores(h100) == (True, "")
        shared = capstone_jax_toy_shared(lesson)
        shared.gpu = True
        shared.bf16_ok = ok
        shared.bf16_why = reason
        for rung in ("+ bf16 compute dtype", "+ fused attention (cuDNN)"):
            settings = capstone_jax_settings(lesson, rung)
            assert lesson.skip_reason(settings, shared) is not None, rung
        assert lesson.skip_reason(capstone_jax_settings(lesson, "+ TF32 (default precision)"),
                                  shared) is None

    def test_the_floor_profiles_a_step_after_an_untimed_one(self, lesson, monkeypatch):
        # the later rungs ran since: the profiled step is not the first after them
        shared = capstone_jax_toy_shared(lesson)
        trainer = lesson.build(dict(lesson.BASELINE, jit=True), shared, 1, "final")
        profile_split = lesson.profile_split
        before = []

        def recording(fn, *args):
            before.append(len(trainer.losses))
            return profile_split(fn, *args)

        monkeypatch.setattr(lesson, "profile_split", recording)
        roofs = dict(matmul_flops_best=1e11, copy_bytes_per_s_best=1e10, busy=False)
        steps = len(trainer.losses)
        floor = lesson.step_floor(trainer, shared, roofs)
        assert before == [steps + 1] and len(trainer.losses) == steps + 2
        assert floor["step_ms"] > 0 and floor["steps_profiled"] == 1

    def test_a_rung_without_host_sync_is_profiled_as_it_is_timed(self, lesson, monkeypatch):
        # its timed calls hold WINDOW steps, queued one behind the other: so does the one
        # profiled call, and the split is a step's (a lone step would add its launch's idle)
        shared = capstone_jax_toy_shared(lesson)
        settings = dict(lesson.BASELINE, jit=True, host_sync=False)
        trainer = lesson.build(settings, shared, 1, "final")
        lesson.compile_step(trainer, shared)
        profile_split = lesson.profile_split
        calls = []

        def recording(fn, *args):
            steps = len(trainer.losses)
            batches = len(shared.host_batches)
            split, wall, unmatched = profile_split(fn, *args)
            calls.append(dict(steps=len(trainer.losses) - steps, split=split, wall=wall,
                              drawn=len(shared.host_batches) - batches))
            return split, wall, unmatched

        monkeypatch.setattr(lesson, "profile_split", recording)
        split, wall, unmatched, window = lesson.profile_as_timed(trainer, shared)
        assert window == lesson.WINDOW == 4 and calls[0]["steps"] == 4
        assert calls[0]["drawn"] == 0  # the batches drawn before the profiled call
        assert wall == pytest.approx(calls[0]["wall"] / 4)
        for cls, seconds in calls[0]["split"].items():
            assert split[cls] == pytest.approx(seconds / 4)
        assert trainer.profiled_steps == 4
        roofs = dict(matmul_flops_best=1e11, copy_bytes_per_s_best=1e10, busy=False)
        floor = lesson.step_floor(trainer, shared, roofs)
        assert floor["steps_profiled"] == 4 and calls[-1]["steps"] == 4
        assert floor["step_ms"] == pytest.approx(calls[-1]["wall"] * 1e3 / 4)
        measured = sum(c["measured_ms"] for c in floor["classes"].values())
        assert measured == pytest.approx(floor["step_ms"], rel=1e-6)

    def test_tokens_per_joule_from_nvml_readings(self, lesson, monkeypatch):
        # NVML's energy read before and after whole steps lasting ENERGY_MIN_SECONDS at the
        # rung's step time, after the timed pairs (never inside a timed step). A fake
        # counter that moves 5 J between two readings
        shared = capstone_jax_toy_shared(lesson)
        readings = iter(range(0, 10000, 5))
        reads = []

        def meter():
            reads.append(None)
            return next(readings)

        shared.meter = meter
        settings = dict(lesson.BASELINE, jit=True)
        incumbent = lesson.build(settings, shared, 1, "incumbent")
        candidate = lesson.build(settings, shared, 1, "candidate")
        for trainer in (incumbent, candidate):
            lesson.compile_step(trainer, shared)
        lesson.compare(incumbent, candidate, shared, 3)
        assert reads == []  # no read inside the timed calls
        monkeypatch.setattr(lesson, "ENERGY_MIN_SECONDS", 0.25)
        steps_before = len(candidate.losses)
        per_joule = lesson.tokens_per_joule(candidate, shared, step_ms=100.0)  # 3 steps
        assert len(candidate.losses) == steps_before + 3
        tokens = 4 * lesson.QUICK.block_size
        assert per_joule == pytest.approx(3 * tokens / 5)

    def test_no_garbage_collection_inside_timed_calls(self, lesson):
        capstone_collector_off_while_timing(lesson)

    def test_a_gpu_settles_before_the_timed_pairs(self, lesson, monkeypatch):
        capstone_settles_a_gpu(lesson, monkeypatch)
        # every batch the steps take, settle's and the timed pairs', drawn before the clock
        calls, incumbent, candidate, _, _ = capstone_settled_compare(lesson, monkeypatch,
                                                                     gpu=True)
        drawn = [call[1] for call in calls if call[0] == "drawn"]
        assert len(incumbent.losses) == 1 + 3 + 2 and len(candidate.losses) == 3 + 2
        assert max(drawn) >= len(incumbent.losses) - 1
        # an op-by-op incumbent on a CPU: no untimed step (its step takes seconds)
        calls, incumbent, _, _, _ = capstone_settled_compare(lesson, monkeypatch, gpu=False,
                                                             jit=False)
        assert [call for call in calls if call[0] != "drawn"][:2] == ["collected", "timed"]
        assert incumbent.warmup_steps == 0

    def test_the_rule_with_known_ratios(self, lesson):
        capstone_rule_with_known_ratios(lesson)

    def test_kernel_classes(self, lesson):
        # by the kernel's name (libraries name their own kernels), else by what the XLA
        # instruction it computes does; the rest is elementwise/norm/loss
        text = "\n".join([
            "%fused_dot (p0: f32[4,4]) -> f32[4,4] {",
            "  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p0), metadata={op_name=\"jit(step)/dot_general\"}",
            "}",
            "%fused_adam (p0: f32[4]) -> f32[4] {",
            "  ROOT %m = f32[4]{0} multiply(%p0, %p0), metadata={op_name=\"jit(step)/optimizer/mul\"}",
            "}",
            "%fused_gelu_grad (p0: f32[4,4]) -> f32[4,4] {",  # its path names a dot_general
            "  ROOT %g = f32[4,4]{1,0} multiply(%p0, %p0), metadata={op_name=\"jit(step)/transpose(jvp(dot_general))/mul\"}",
            "}",
            "ENTRY %main {",
            "  %loop_dot_fusion.3 = f32[4,4]{1,0} fusion(%a), kind=kLoop, calls=%fused_dot",
            "  %input_add_reduce_fusion = f32[4,4]{1,0} fusion(%d), kind=kInput, calls=%fused_gelu_grad",
            "  %loop_multiply_fusion.7 = f32[4]{0} fusion(%b), kind=kLoop, calls=%fused_adam",
            "  %all-reduce.2 = f32[4]{0} all-reduce(%c), replica_groups={}",
            "}"])
        instructions = lesson.program_instructions(text)
        assert "loop_dot_fusion_3" in instructions  # the name a GPU gives its kernel
        cases = {"loop_dot_fusion_3": "matmul", "loop_multiply_fusion.7": "optimizer",
                 "all-reduce.2": "communication",
                 "input_add_reduce_fusion": "elementwise/norm/loss"}
        for name, cls in cases.items():
            assert lesson.kernel_class(name, instructions[name]) == cls
        assert lesson.kernel_class("nvjet_sm90_tst_128x160", "") == "matmul"
        assert lesson.kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "") \
            == "attention"
        assert lesson.kernel_class("loop_add_fusion_9", "") == "elementwise/norm/loss"
        # op by op: the module of a jnp matmul names it
        assert lesson.kernel_class("transpose_copy_fusion", "transpose_copy_fusion jit__einsum") \
            == "matmul"
        assert lesson.kernel_class("dot", "dot jit_dot_general") == "matmul"


class TestCapstoneJaxHeadline:
    @pytest.fixture(scope="class")
    @classmethod
    def run(cls, tmp_path_factory):
        # the final rung as a waterfall on a CPU might keep it (every rung but the detours
        # that a CPU drops), written where --headline reads it
        tmp = tmp_path_factory.mktemp("07jax_headline")
        lesson = load_lesson(CAPSTONE_JAX)
        settings = capstone_jax_settings(lesson, "+ cuBLAS for every matmul")
        settings.update(bf16=False, donate=True)
        out = tmp / "out"
        out.mkdir()
        final = dict(rung="+ cuBLAS for every matmul", settings=settings, device="x86_64")
        (out / "07_capstone_jax_final_rung.json").write_text(json.dumps(final))
        return capstone_jax_run(tmp, "--headline", "--out", str(out))

    @pytest.fixture(scope="class")
    @classmethod
    def lesson(cls):
        return load_lesson(CAPSTONE_JAX)

    def test_headline(self, run, lesson):
        # the first jitted rung and the final rung, the same steps from one init on the same
        # batches: their smoothed loss curves agree; every number recomputed from the losses
        result = run.json
        h = result["headline"]
        base, final = result["rungs"]
        assert (base["name"], final["name"]) == (lesson.FIRST_JITTED, lesson.HEADLINE)
        assert base["settings"] == dict(lesson.BASELINE, jit=True)
        assert final["verdict"].startswith(f"timed against {lesson.FIRST_JITTED}")
        early = h["early_steps"]
        steps = min(len(base["losses"]), len(final["losses"]))
        assert h["steps"] == steps
        gaps = np.abs(np.subtract(final["losses"][:steps], base["losses"][:steps]))
        gaps = gaps / np.array(base["losses"][:steps])
        assert h["early_gap"] == pytest.approx(max(gaps[:early]), rel=1e-9)
        kernel = np.ones(h["smooth"]) / h["smooth"]
        smooth_base = np.convolve(base["losses"][:steps], kernel, "valid")
        smooth_final = np.convolve(final["losses"][:steps], kernel, "valid")
        curve = max(np.abs(smooth_final - smooth_base) / smooth_base)
        assert h["curve_gap"] == pytest.approx(curve, rel=1e-9)
        assert h["time_ratio"] == pytest.approx(final["ratio"])
        assert h["loss_tolerance"] == lesson.LOSS_TOLERANCE and h["curve_tolerance"] == 0.04
        assert result["checks"] == {
            "headline_starts_the_same": h["early_gap"] <= h["loss_tolerance"],
            "headline_same_curve": curve <= h["curve_tolerance"],
            "loss_softmax_in_fp32": True, "accumulated_gradient_equals_full_batch": True}
        assert (run.folder.parent / "out" / "07_capstone_jax_headline.png").exists()
        capstone_jax_rederive(result)

    def test_headline_needs_the_waterfall_first(self, tmp_path):
        # --headline reads the final rung the waterfall kept; without it, one line
        run = run_lesson(CAPSTONE_JAX, "--quick", "--device", "cpu", "--headline",
                         "--out", str(tmp_path / "empty"), tmp=tmp_path,
                         env=dict(XLA_FLAGS=FAST_COMPILE))
        assert run.returncode == 1 and "run the waterfall first" in run.stderr


# ---------------------------------------------------------------------------------------
# What every lesson shares: a bad flag, an unwritable --json, a bare folder


class TestEveryLessonRefusesABadFlag:
    @pytest.mark.parametrize("lesson", LESSONS)
    def test_exit_2_before_the_work(self, lesson, tmp_path):
        run = run_lesson(lesson, "--no-such-flag", tmp=tmp_path)
        assert run.returncode == 2, run.stderr[-2000:]
        assert "measured" not in run.stdout


class TestEveryLessonRefusesAnUnwritableJson:
    @pytest.mark.parametrize("lesson", LESSONS)
    def test_non_zero_before_the_work(self, lesson, tmp_path):
        folder = tmp_path / "a folder, not a file"
        folder.mkdir()
        run = run_lesson(lesson, "--quick", "--json", str(folder), tmp=tmp_path)
        assert run.returncode != 0
        assert "measured" not in run.stdout
        assert run.json is None


class TestEveryLessonRunsFromABareFolder:
    @pytest.mark.parametrize("lesson", LESSONS)
    def test_help_with_only_its_model_files(self, lesson, tmp_path):
        run = run_lesson(lesson, "--help", tmp=tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
        assert sorted(p.name for p in run.folder.iterdir()) == sorted([lesson] + model_files(lesson))


class TestTokenCacheSurvivesCtrlC:
    @pytest.mark.parametrize("lesson", ["07_capstone_torch.py", "07_capstone_jax.py"])
    def test_interrupted_while_writing_leaves_no_half_file(self, lesson, tmp_path, monkeypatch):
        """Ctrl-C lands while the token cache is being written: no file under the cache's
        name is ever half-written, and the next run tokenizes again and caches it whole."""
        capstone = load_lesson(lesson)
        data = tmp_path / "text.txt"
        data.write_text("the same few words, again and again; " * 1000)
        cache = tmp_path / "cache"
        real_save = np.save

        def interrupted_save(file, array):
            real_save(file, array[: len(array) // 2])  # half the tokens reach the disk
            raise KeyboardInterrupt

        monkeypatch.setattr(capstone.np, "save", interrupted_save)
        with pytest.raises(KeyboardInterrupt):
            capstone.load_tokens(str(data), "bytes", 64, cache_dir=cache)
        finished = [p for p in cache.glob("tokens-*.npy") if ".tmp" not in p.name]
        assert finished == []
        monkeypatch.setattr(capstone.np, "save", real_save)
        ids, tokenizer = capstone.load_tokens(str(data), "bytes", 64, cache_dir=cache)
        assert tokenizer == "utf8-bytes"
        assert len(ids) == len(data.read_bytes())
        [cached] = [p for p in cache.glob("tokens-*.npy") if ".tmp" not in p.name]
        assert np.array_equal(np.load(cached), ids)
