"""
Tests for perf-lessons, on the CPU: the shared models, then every lesson run for real
(`--quick --json`) as a subprocess, asserting on the physics its JSON reports.

    python -m pytest -q test_lessons.py          # the whole file, < 10 minutes on 2 cores
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_torch import GPT, GPTConfig, activation_bytes, flops_per_token, param_count, state_bytes

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------
# Running a lesson as the reader would: a real process, its JSON read back.

def run_lesson(script, *args, nproc=None, devices=None, timeout=300, tmp_path):
    """Run `python script --quick --device cpu --json F *args` (under torchrun with `nproc`
    gloo ranks, or with `devices` simulated JAX CPU devices) and return its JSON."""
    out = tmp_path / f"{Path(script).stem}.json"
    cmd = [script, "--quick", "--device", "cpu", "--json", str(out), "--out", str(tmp_path), *args]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *cmd]
    else:
        cmd = [sys.executable, *cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"
               if nproc else os.environ.get("OMP_NUM_THREADS", "2"))
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------
# model_torch.py

def tiny(**overrides):
    return GPTConfig.preset("tiny", **overrides)


def test_gpt2_parameter_count_is_gpt2_small():
    # GPT-2 small as OpenAI released it (vocab 50257, T=1024): 124,439,808 parameters,
    # 123,653,376 without the position table (nanoGPT prints "123.65M").
    cfg = GPTConfig.preset("gpt2", vocab_size=50257)
    with torch.device("meta"):
        model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808 == param_count(cfg)
    assert param_count(cfg, position=False) == 123_653_376


def test_flops_per_token_matches_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode
    # manual attention: its matmuls are counted on every device (CPU SDPA is not)
    cfg = tiny(attn="manual")
    torch.manual_seed(0)
    model, B, T = GPT(cfg), 2, cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    counted = counter.get_total_flops() / (B * T)
    assert abs(flops_per_token(cfg, T) / counted - 1) < 0.02


def test_state_bytes_are_sixteen_per_parameter():
    cfg = tiny()
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    b = state_bytes(cfg)
    assert b["params"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert b["params"] + b["grads"] + b["optimizer"] == 16 * n


def saved_bytes(model, idx, bf16=False):
    """Bytes autograd saves for backward during one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(idx, idx)
    return sum(seen.values())


@pytest.mark.parametrize("attn", ["sdpa", "manual"])
@pytest.mark.parametrize("bf16", [False, True])
def test_activation_prediction_matches_saved_tensors(attn, bf16):
    cfg = tiny(attn=attn, n_layer=2)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    counted = saved_bytes(GPT(cfg), idx, bf16)
    assert abs(activation_bytes(cfg, 2, bf16=bf16) / counted - 1) < 0.01


def test_manual_attention_equals_sdpa():
    torch.manual_seed(0)
    cfg = tiny(n_layer=2)
    a = GPT(cfg)
    b = GPT(tiny(n_layer=2, attn="manual"))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 64))
    (la, lossa), (lb, lossb) = a(idx, idx), b(idx, idx)
    lossa.backward(), lossb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    a = GPT(tiny(n_layer=2, vocab_size=256))  # a small head, so the blocks dominate
    b = GPT(tiny(n_layer=2, vocab_size=256, checkpoint=True))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, a.config.vocab_size, (2, 64))
    a(idx, idx)[1].backward(), b(idx, idx)[1].backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0, msg=name)
    # and it keeps less: the blocks' insides are not saved
    idx = torch.randint(0, a.config.vocab_size, (2, a.config.block_size))
    assert saved_bytes(b, idx) < 0.5 * saved_bytes(a, idx)


def test_torch_adamw_lowers_the_loss():
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2))
    opt = model.configure_optimizer(lr=1e-3)
    idx = torch.randint(0, 1000, (4, 64))
    losses = []
    for _ in range(5):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


# ---------------------------------------------------------------------------------------
# model_jax.py: the same function as model_torch.py

@pytest.fixture(scope="module")
def jax_highest():
    jax = pytest.importorskip("jax")
    with jax.default_matmul_precision("highest"):  # true fp32 matmuls (GPUs default to TF32)
        yield jax


@pytest.mark.parametrize("attn", ["sdpa", "manual"])
def test_jax_logits_equal_torch_logits(jax_highest, attn):
    import jax.numpy as jnp
    from model_jax import GPT as JaxGPT, from_torch
    cfg = tiny(n_layer=2, attn=attn)
    torch.manual_seed(0)
    tmodel = GPT(cfg)
    jmodel = from_torch(JaxGPT(cfg), tmodel.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    tlogits, tloss = tmodel(idx, idx)
    jlogits, jloss = jmodel(jnp.asarray(idx.numpy()), jnp.asarray(idx.numpy()))
    assert abs(tlogits.detach().numpy() - jlogits).max() < 1e-4
    assert abs(tloss.item() - float(jloss)) < 1e-5


def test_jax_and_torch_train_alike(jax_highest):
    # Same weights, same batches, same AdamW: the two frameworks take the same steps.
    import jax.numpy as jnp
    from flax import nnx
    from model_jax import GPT as JaxGPT, adamw, from_torch, make_train_step
    cfg = tiny(n_layer=2)
    torch.manual_seed(0)
    tmodel = GPT(cfg)
    jmodel = from_torch(JaxGPT(cfg), tmodel.state_dict())
    topt = tmodel.configure_optimizer(lr=1e-3)
    graphdef, state = nnx.split((jmodel, nnx.Optimizer(jmodel, adamw(1e-3), wrt=nnx.Param)))
    train_step = make_train_step(graphdef, donate=True)
    data = torch.randint(0, 1000, (4, 65))
    tlosses, jlosses = [], []
    for _ in range(5):
        _, loss = tmodel(data[:, :-1], data[:, 1:])
        topt.zero_grad()
        loss.backward()
        topt.step()
        tlosses.append(loss.item())
        x = jnp.asarray(data.numpy())
        jloss, state = train_step(state, x[:, :-1], x[:, 1:])
        jlosses.append(float(jloss))
    assert tlosses[-1] < tlosses[0] - 0.5 and jlosses[-1] < jlosses[0] - 0.5, (tlosses, jlosses)
    assert max(abs(a - b) for a, b in zip(tlosses, jlosses)) < 1e-3, (tlosses, jlosses)


def test_jax_checkpointing_gives_the_same_gradients(jax_highest):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from model_jax import GPT as JaxGPT
    x = jnp.asarray(torch.randint(0, 1000, (2, 65)).numpy())
    grads = []
    for checkpointed in (False, True):
        model = JaxGPT(tiny(n_layer=2, checkpoint=checkpointed), rngs=nnx.Rngs(0))
        grads.append(nnx.grad(lambda m: m(x[:, :-1], x[:, 1:])[1])(model))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-7)
