"""
Tests for perf-lessons, on the CPU: the shared models, then every lesson run for real
(`--quick --json`) as a subprocess, from a folder holding only the lesson and the model
files it imports (as a reader who copies it), asserting on the physics its JSON reports;
then every bad input each lesson must refuse, in milliseconds, through its `parse_args`.

    python -m pytest -q test_lessons.py
"""

import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from model_torch import (GPT, GPTConfig, activation_bytes, activation_terms,
                         block_activation_terms, flops_per_token, param_count, state_bytes)

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------
# Running a lesson as the reader would: a copy of it alone, a real process, its JSON read back.

def lesson_folder(script, tmp_path):
    """An empty folder holding the lesson and only the model files it imports."""
    folder = tmp_path / "lesson"
    folder.mkdir(exist_ok=True)
    text = (HERE / script).read_text()
    needs = {"model_jax.py": "model_jax" in text, "model_torch.py": "model_" in text}
    for name in [script] + [f for f, needed in needs.items() if needed]:
        shutil.copy(HERE / name, folder / name)
    return folder


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, *args, tmp_path, nproc=None, nnodes=1, devices=None, env=None):
    """Start `python script *args` from a lesson folder: alone, under torchrun with `nproc`
    gloo ranks per node (`nnodes` > 1: one torchrun agent per "node", all on this machine,
    joined through a c10d rendezvous), or with `devices` simulated JAX CPU devices."""
    folder = lesson_folder(script, tmp_path)
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    full_env["OMP_NUM_THREADS"] = "1" if nproc else full_env.get("OMP_NUM_THREADS", "2")
    if devices:
        full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    full_env.update(env or {})
    if not nproc:
        return [subprocess.Popen([sys.executable, script, *args], cwd=folder, env=full_env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)]
    if nnodes == 1:
        rdzv = ["--standalone"]
    else:
        rdzv = [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=test"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, f"--nproc_per_node={nproc}",
           script, *args]
    return [subprocess.Popen(cmd, cwd=folder, env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
            for _ in range(nnodes)]


def run_process(script, *args, timeout=240, **kwargs):
    """Run a lesson to the end; the CompletedProcess of the first (or only) launcher."""
    procs = launch(script, *args, **kwargs)
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    for r in results[1:]:
        assert r.returncode == 0, f"another node exited {r.returncode}\n{r.stderr[-3000:]}"
    return results[0]


def interrupt(script, *args, after, timeout=60, **kwargs):
    """Press Ctrl-C `after` seconds into a run: SIGINT to the launcher's whole process group,
    as a terminal does. Returns the CompletedProcess of the first launcher."""
    procs = launch(script, *args, **kwargs)
    time.sleep(after)
    for p in procs:
        os.killpg(p.pid, signal.SIGINT)
    results = [(p, *p.communicate(timeout=timeout)) for p in procs]
    p, out, err = results[0]
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_lesson(script, *args, tmp_path, **kwargs):
    """Run `script --quick --device cpu --json F --out DIR *args` and return its JSON."""
    out = tmp_path / f"{Path(script).stem}.json"
    proc = run_process(script, "--quick", "--device", "cpu", "--json", str(out),
                       "--out", str(tmp_path / "out"), *args, tmp_path=tmp_path, **kwargs)
    assert proc.returncode == 0, (f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def load_lesson(script):
    """Import a lesson file as a module (its name starts with a digit), without running it."""
    spec = importlib.util.spec_from_file_location("lesson_" + Path(script).stem, HERE / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(parse_args, argv):
    """The exit code parse_args(argv) stops with (None if it accepts the arguments)."""
    try:
        parse_args(argv)
    except SystemExit as e:
        return 1 if isinstance(e.code, str) else e.code
    return None


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


def saved_tensors(model, idx, targets, bf16=False):
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


def saved_bytes(model, idx, bf16=False):
    targets = torch.randint(0, model.config.vocab_size, idx.shape)
    return sum(b for b, _, _ in saved_tensors(model, idx, targets, bf16))


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "manual"])
@pytest.mark.parametrize("bf16", [False, True])
def test_activation_prediction_is_exact_term_by_term(attn, bf16, checkpointed):
    # the prediction is counted tensor by tensor, so it must equal autograd's saved bytes
    # exactly, in total and in every term that a tensor's shape and dtype identify
    cfg = tiny(attn=attn, n_layer=2, checkpoint=checkpointed)
    B, T, H, V, L = 3, cfg.block_size, cfg.n_head, cfg.vocab_size, cfg.n_layer  # B T != 4 d
    idx, targets = torch.randint(0, V, (2, B, T))
    saved = saved_tensors(GPT(cfg), idx, targets, bf16)
    terms = activation_terms(cfg, B, bf16=bf16)
    assert sum(b for b, _, _ in saved) == activation_bytes(cfg, B, bf16=bf16) == sum(terms.values())

    def counted(shape, dtype):
        return sum(b for b, s, d in saved if s == shape and d == dtype)

    f32, half = torch.float32, torch.bfloat16
    inner = 0 if checkpointed else 1  # a checkpointed block keeps none of its insides
    assert counted((B, T, 1), f32) == inner * terms.get("blocks.layernorm_stats", 0) + terms["ln_f_stats"]
    assert counted((B * T, V), f32) == terms["log_softmax"]
    assert sum(b for b, _, d in saved if d == torch.int64) == (
        terms["token_ids"] + terms["targets"] + terms["position_ids"])
    assert sum(b for b, _, d in saved if d == torch.bool) == terms.get("causal_mask", 0)
    weights = [b for b, s, d in saved if len(s) == 2 and s[0] != B * T and d == half]
    assert sum(weights) == terms.get("weight_copies", 0)  # (B T, d) rows are activations
    if attn == "sdpa":
        assert counted((B, H, T), f32) == terms.get("blocks.attention_logsumexp", 0)
    else:
        assert counted((B, H, T, T), f32) == terms.get("blocks.attention_probs", 0)
        probs_bf16 = counted((B, H, T, T), half) + counted((B * H, T, T), half)  # bmm's view
        assert probs_bf16 == terms.get("blocks.attention_probs_bf16", 0)
    for name, per_token in block_activation_terms(cfg, T, bf16).items():
        assert terms["blocks." + name] == L * B * T * per_token


def test_gpt2_init_statistics():
    # GPT-2's init: weights N(0, 0.02); the two residual projections of each block N(0,
    # 0.02 / sqrt(2 L)), so the residual stream's variance does not grow with depth; biases 0,
    # LayerNorm gains 1. The same in the JAX model.
    import jax
    from flax import nnx
    from model_jax import GPT as JaxGPT
    cfg = tiny(n_layer=6)
    torch.manual_seed(0)
    params = dict(GPT(cfg).named_parameters())
    scaled = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, p in params.items():
        if name.endswith("c_proj.weight"):
            assert abs(p.std().item() / scaled - 1) < 0.05, name
        elif p.dim() == 2:
            assert abs(p.std().item() / 0.02 - 1) < 0.05, name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            assert torch.all(p == 1), name
    jmodel = JaxGPT(cfg, rngs=nnx.Rngs(0))
    for block in jmodel.h[:2]:
        for lin in (block.attn.c_proj, block.mlp.c_proj):
            assert abs(float(lin.kernel[...].std()) / scaled - 1) < 0.05
        assert abs(float(block.mlp.c_fc.kernel[...].std()) / 0.02 - 1) < 0.05
    assert abs(float(jmodel.wte.embedding[...].std()) / 0.02 - 1) < 0.05
    assert jax.numpy.all(jmodel.h[0].attn.c_attn.bias[...] == 0)


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


def test_logits_come_back_detached_when_the_loss_is_computed():
    # with targets, the loss carries the gradient: the returned logits must not require grad (a
    # compiled backward would zero-fill a B x T x V gradient for them), yet equal the plain ones
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=1))
    idx = torch.randint(0, 1000, (2, 32))
    logits, loss = model(idx, idx)
    plain, none = model(idx)
    assert loss.requires_grad and not logits.requires_grad and plain.requires_grad and none is None
    assert torch.equal(logits, plain)


# ---------------------------------------------------------------------------------------
# model_jax.py: the same function as model_torch.py

def test_jax_cross_entropy_equals_optax_integer_labels(jax_highest):
    # the one-hot-mask loss is optax's gather-based loss, value and gradient, on bf16 logits
    import jax, jax.numpy as jnp, optax
    from model_jax import cross_entropy
    logits = 4 * jax.random.normal(jax.random.key(0), (2, 16, 300), jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(1), (2, 16), 0, 300)
    reference = lambda l: optax.softmax_cross_entropy_with_integer_labels(l.astype(jnp.float32), targets).mean()
    ours, ours_grad = jax.value_and_grad(cross_entropy)(logits, targets)
    ref, ref_grad = jax.value_and_grad(reference)(logits)
    assert abs(float(ours) - float(ref)) < 1e-5 * float(ref) and ours_grad.dtype == jnp.bfloat16
    assert float(jnp.abs(ours_grad.astype(jnp.float32) - ref_grad.astype(jnp.float32)).max()) < 1e-6


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


# ---------------------------------------------------------------------------------------
# 01_roofline.py

@pytest.fixture(scope="module")
def roofline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("roofline")
    return run_lesson("01_roofline.py", tmp_path=tmp), tmp


def test_roofline_measures_both_ceilings(roofline):
    r, tmp = roofline
    c = r["ceilings"]
    assert c["peak_flops"] > 0 and c["bandwidth_bytes_per_s"] > 0
    assert c["ridge_flop_per_byte"] == pytest.approx(c["peak_flops"] / c["bandwidth_bytes_per_s"])
    assert all(r["checks"].values()) and not r["errors"]
    assert (tmp / "01_roofline.png").exists()


def test_roofline_classifies_from_the_measurement(roofline):
    ops = roofline[0]["ops"]
    assert ops["matmul_large"]["measured"] == "compute"
    assert ops["vector_add"]["measured"] != "compute"
    assert ops["vector_add"]["predicted"] == "bandwidth" and ops["matmul_large"]["predicted"] == "compute"
    assert {op["measured"] for op in ops.values()} <= {"compute", "bandwidth", "overhead"}
    assert roofline[0]["overhead"]["floor_s"] > 0


def test_roofline_unsynchronised_timing_shown_or_skipped_with_reason(roofline):
    r = roofline[0]
    unsync = r["discipline"]["unsynchronised"]
    if r["device"]["type"] == "cuda":  # the wrong clock reads only the launch
        assert unsync["no_sync_s"] < unsync["sync_s"]
    else:  # no async dispatch in PyTorch on a CPU: skipped, never silently
        assert "skipped" in unsync and len(unsync["skipped"]) > 20
    jax_part = r["discipline"]["jax"]  # JAX dispatches asynchronously on a CPU too
    assert "skipped" in jax_part or jax_part["dispatch_is_async"]


@pytest.mark.parametrize("flags", [["--device", "tpu"], ["--no-such-flag"]])
def test_roofline_bad_flags_exit_2(flags):
    proc = subprocess.run([sys.executable, "01_roofline.py", *flags], cwd=HERE,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_roofline_cuda_without_gpu_says_so():
    proc = subprocess.run([sys.executable, "01_roofline.py", "--device", "cuda"], cwd=HERE,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "no CUDA GPU" in proc.stderr


# ---------------------------------------------------------------------------------------
# 02_hardware.py

def test_02_hardware_quick_cpu(tmp_path):
    out = run_lesson("02_hardware.py", tmp_path=tmp_path)
    assert out["lesson"] == "02_hardware" and out["quick"] is True
    assert all(out["checks"].values()), out["checks"]
    # 1. the bandwidth-vs-size curve is there, positive, and spans KB to MB
    points = out["hierarchy"]["points"]
    assert len(points) >= 8
    assert all(math.isfinite(p["gb_per_s"]) and p["gb_per_s"] > 0 for p in points)
    assert points[0]["bytes"] <= 32 << 10 and points[-1]["bytes"] >= 8 << 20
    # 2. the ladder: error grows as bits shrink, format facts from torch.finfo
    formats = out["ladder"]["formats"]
    assert formats["fp32"]["rel_error"] < formats["bf16"]["rel_error"]
    assert formats["fp32"]["rel_error"] < 1e-5 and formats["bf16"]["rel_error"] < 2e-2
    assert formats["fp32"]["bits"] == 32 and formats["bf16"]["bits"] == 16
    assert formats["bf16"]["eps"] == 2.0 ** -7
    assert all(f["tflops"] > 0 for f in formats.values())
    assert "tf32" in out["ladder"]["skipped"]  # a GPU tensor-core mode, stated why
    # 5. prefill: intensity rises with the token count; decode ceiling = bandwidth / weight bytes
    pd = out["prefill_decode"]
    intensity = [r["intensity"] for r in pd["rows"]]
    assert intensity == sorted(intensity) and intensity[-1] > 10 * intensity[0]
    # measured: the same weights serve more tokens per read, so the achieved FLOP/s climbs
    assert pd["rows"][-1]["tflops"] > 3 * pd["rows"][0]["tflops"]
    assert pd["rows"][0]["tokens"] == 1
    gpt2 = pd["decode"]["gpt2"]
    assert abs(gpt2["tokens_per_s_ceiling"] * gpt2["weight_bytes_bf16"] / 1e9 / pd["bandwidth_gb_per_s_used"] - 1) < 1e-6
    assert pd["decode"]["gpt2-medium"]["tokens_per_s_ceiling"] < gpt2["tokens_per_s_ceiling"]
    # 3, 4: GPU-only parts carry a reason on the CPU (energy still lists the references)
    assert out["interconnect"]["skipped"]
    assert out["energy"]["skipped"] and out["energy"]["reference_pj_horowitz_2014"]
    # 6. the spec table carries the reference rows beside this machine
    assert {"RTX 4090", "A100 SXM 80GB", "H100 SXM", "H200 SXM"} <= set(out["spec_table"]["reference"])
    assert out["spec_table"]["this_machine"]["fp32"] > 0


# ---------------------------------------------------------------------------------------
# 03_compile.py

def test_compile_lesson(tmp_path):
    r = run_lesson("03_compile.py", tmp_path=tmp_path)
    checks = r["checks"]
    # every compiled result equals eager (torch.compile, jax.jit) within the stated tolerance
    for name in ["overhead_torch_compile_equals_eager", "overhead_jax_jit_equals_jax_eager",
                 "overhead_jax_equals_torch_eager", "bandwidth_torch_compile_equals_eager",
                 "bandwidth_jax_jit_equals_jax_eager", "bandwidth_jax_equals_torch_eager",
                 "matmul_torch_compile_equals_eager", "matmul_jax_jit_equals_torch_eager"]:
        assert checks[name] is True, name
    assert all(checks.values()) and not r["errors"], (checks, r["errors"])
    # fusion: eager dispatches one op per op, the compiled chain is one call
    launches = r["overhead"]["launches_per_call"]
    assert launches["eager"]["ops_dispatched"] == r["overhead"]["n_ops"] == 48
    assert launches["torch_compile"]["ops_dispatched"] <= 2
    # bytecode capture: .item() and print break the graph, the clean function does not
    cap = r["capture_torch"]
    assert cap["dirty"]["graph_break_count"] > 0 and cap["dirty"]["graph_count"] > 1
    assert cap["clean"]["graph_break_count"] == 0 and cap["clean"]["graph_count"] == 1
    # recompiles: one per new shape when static, none for a repeated shape, one in all when dynamic
    shapes = cap["compiles_for_shapes"]
    assert shapes["shapes"] == [8, 16, 8, 32]
    assert shapes["dynamic=False"] == [1, 2, 2, 3]
    assert shapes["dynamic=True"] == [1, 1, 1, 1]
    # tracing: the Python counter inside the jitted function counts traces
    jx = r["capture_jax"]
    assert jx["traces_for_shapes"]["traces_after_each"] == [1, 2, 2, 3]
    assert jx["traces_for_static_args"]["traces_after_each"] == [1, 2, 2]
    assert jx["nonstatic_loop_bound_error"] is not None
    # XLA's cost model sees one fused pass: bytes accessed ~ the one-read-one-write floor
    if jx["aot"]["bytes_accessed"]:
        assert abs(jx["aot"]["bytes_accessed"] / jx["aot"]["bytes_floor"] - 1) < 0.1
    # the bandwidth accounting: eager moves 11 N values, fused 3 N
    bw = r["bandwidth"]
    assert bw["bytes_eager"] * 3 == bw["bytes_floor"] * 11


# ---------------------------------------------------------------------------------------
# 04_memory.py

@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    """One quick CPU run of 04_memory.py shared by the tests below (~10 s on 2 cores)."""
    return run_lesson("04_memory.py", tmp_path=tmp_path_factory.mktemp("04_memory"))


def test_memory_accounting_is_exact(memory):
    # params / grads / AdamW moments: predicted from the config = counted numel x element_size
    # of the live parameters, their .grad and the optimizer's exp_avg + exp_avg_sq tensors
    a = memory["anatomy"]
    cfg = GPTConfig(**{k: v for k, v in memory["config"].items() if k not in ("batch_size", "seq_len")})
    for k in ("params", "grads", "optimizer"):
        assert a["predicted"][k] == a["counted"][k], k
    assert all(a["counted"][k] == v for k, v in state_bytes(cfg).items())
    assert a["counted"]["params"] + a["counted"]["grads"] + a["counted"]["optimizer"] == 16 * param_count(cfg)
    assert abs(a["predicted"]["activations"] / a["counted"]["activations"] - 1) < 0.01
    assert all(memory["checks"][f"anatomy_{k}_exact"] for k in ("params", "grads", "optimizer"))


def test_memory_autocast_keeps_state_fp32(memory):
    dtypes = memory["mixed_precision"]["rows"]["bf16 autocast"]["dtypes"]
    assert dtypes == {k: ["torch.float32"] for k in ("params", "grads", "optimizer")}


def test_memory_checkpointing_lowers_activations_same_grads(memory):
    c = memory["checkpointing"]
    for prec, plain in (("fp32", "fp32"), ("bf16", "bf16 autocast")):
        assert c["rows"][f"{prec} + checkpoint"]["activations_counted"] < c["rows"][plain]["activations_counted"]
    assert c["grad_max_rel_error"] <= 1e-6 and memory["checks"]["checkpoint_grads_equal"]


def test_memory_accumulated_grads_equal_full_batch(memory):
    acc = memory["accumulation"]
    assert memory["checks"]["accumulated_grads_equal_full_batch"] is True
    assert acc["grad_max_rel_error"] < 1e-5
    assert acc["activations_counted_micro"] < acc["activations_counted_full"]
    assert all(memory["checks"].values()), memory["checks"]


# ---------------------------------------------------------------------------------------
# 05_ddp_scratch.py

@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_ddp_scratch_under_torchrun(nproc, tmp_path):
    r = run_lesson("05_ddp_scratch.py", nproc=nproc, tmp_path=tmp_path)
    assert r["lesson"] == "05_ddp_scratch" and r["world_size"] == nproc and r["backend"] == "gloo"
    assert all(r["checks"].values()), r["checks"]
    # hand-rolled data parallelism: identical replicas, same as one process on the whole batch
    d = r["ddp"]
    assert d["replicas_identical"] and d["grad_max_rel_err_vs_single"] <= 1e-5
    assert d["param_diff_over_distance_moved"] <= 1e-3
    # ring and naive all-reduce from send/recv equal dist.all_reduce on awkward lengths
    a = r["allreduce_correctness"]
    assert any(n % nproc for n in a["lengths"]) and min(a["lengths"]) < nproc + 1
    assert a["ring_max_rel_err"] <= 1e-6 and a["naive_max_rel_err"] <= 1e-6
    # the bill: each rank sends 2(N-1)/N S in the ring (counted), rank 0 sends (N-1) S in naive
    b = r["bill"]
    for S, ring, naive in zip(b["sizes_bytes"], b["ring"]["bytes_sent_max_rank"], b["naive"]["bytes_sent_max_rank"]):
        assert abs(ring - 2 * (nproc - 1) / nproc * S) <= 2 * (nproc - 1) * 4
        assert naive == (nproc - 1) * S
    for k in ("naive", "ring", "library"):
        assert len(b[k]["median_s"]) == len(b["sizes_bytes"]) and min(b[k]["median_s"]) > 0
        assert b["fit"][k]["beta_s_per_byte"] >= 0 and b["fit"][k]["alpha_s"] >= 0
    g = r["gradients"]
    assert g["bucketed_vs_per_param_max_rel_err"] <= 1e-6 and g["n_buckets"] < g["grad_tensors"]
    assert 0 < g["predicted_efficiency_library_no_overlap"] <= 1
    assert (tmp_path / "05_ddp_scratch_allreduce.png").exists()


def test_ddp_scratch_runs_as_one_rank(tmp_path):
    r = run_lesson("05_ddp_scratch.py", tmp_path=tmp_path)
    assert r["world_size"] == 1 and all(r["checks"].values()) and "bill" not in r
    assert r["ddp"]["max_abs_param_diff_vs_single"] == 0


def test_ddp_scratch_half_set_environment_fails_clearly():
    env = dict(os.environ, RANK="0", CUDA_VISIBLE_DEVICES="")
    for v in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    proc = subprocess.run([sys.executable, "05_ddp_scratch.py", "--quick", "--device", "cpu"], cwd=HERE,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "half-set" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------
# 06_ddp_prod.py

@pytest.mark.parametrize("nproc", [2, 4])
def test_06_ddp_equals_handrolled_and_no_sync(nproc, tmp_path):
    r = run_lesson("06_ddp_prod.py", nproc=nproc, tmp_path=tmp_path)
    assert r["framework"] == "torch" and r["world_size"] == nproc and r["backend"] == "gloo"
    assert all(r["checks"].values()), r["checks"]
    assert r["equivalence"]["max_abs_param_diff"] < 1e-4
    if nproc == 2:  # a + b == b + a: two ranks agree bit for bit
        assert r["equivalence"]["max_abs_param_diff"] == 0
    ns = r["no_sync"]
    k = ns["k"]
    assert ns["sync_every"]["allreduce_calls"] == k * ns["no_sync"]["allreduce_calls"]
    # the trap: no_sync around backward only, forward outside -> no saving at all
    assert ns["backward_only_in_no_sync"]["allreduce_calls"] == ns["sync_every"]["allreduce_calls"]
    assert ns["max_abs_grad_diff"] <= 1e-5 * ns["max_abs_grad"]
    # hand-rolled: one call per tensor; DDP: a few buckets, fewer with bigger buckets
    sweep = r["bucket_sweep"]
    assert sweep[0]["allreduce_calls_per_step"] >= sweep[-1]["allreduce_calls_per_step"] >= 1
    assert r["step_time"]["handrolled"]["allreduce_calls_per_step"] > sweep[-1]["allreduce_calls_per_step"]
    # FSDP2: params + grads + AdamW state per rank ~ 1/N of DDP's replica
    assert abs(r["fsdp"]["sharded_over_replicated"] * nproc - 1) < 0.05


def test_06_jax_mesh_inserts_allreduce_and_matches_one_device(tmp_path):
    r = run_lesson("06_ddp_prod.py", "--framework", "jax", devices=4, tmp_path=tmp_path)
    assert r["framework"] == "jax" and r["n_devices"] == 4
    assert all(r["checks"].values()), r["checks"]
    assert r["single_device"]["collectives"]["all-reduce"] == 0
    assert r["data_parallel"]["collectives"]["all-reduce"] > 0
    assert "all-reduce" in r["data_parallel"]["allreduce_example"]
    assert r["data_parallel"]["max_rel_loss_diff"] < 1e-4
    assert r["sharded_params"]["max_rel_loss_diff"] < 1e-4
    assert abs(r["sharded_over_replicated"] * 4 - 1) < 0.05


def test_06_wrong_launches_say_what_to_run():
    # the torch half without torchrun: exit 2, saying how to launch it
    p = subprocess.run([sys.executable, "06_ddp_prod.py", "--framework", "torch"], cwd=HERE,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "torchrun --nproc_per_node" in p.stderr


# ---------------------------------------------------------------------------------------
# 07_capstone_torch.py

RUNG_KEYS = {"name", "ms_per_step", "tokens_per_s", "mfu_datasheet", "mfu_measured_peak", "peak_mem_bytes",
             "activation_bytes", "loss", "loss_rel_diff", "compile_s", "speedup", "tokens_per_step"}


@pytest.fixture(scope="module")
def capstone_torch(tmp_path_factory):
    return run_lesson("07_capstone_torch.py", tmp_path=tmp_path_factory.mktemp("capstone_torch"))


def test_capstone_torch_every_rung_runs_and_reports(capstone_torch):
    r = capstone_torch
    assert r["lesson"] == "07_capstone_torch" and r["quick"]
    assert r["flops_per_token"] > 0 and r["peaks"]["measured_bf16_matmul"] > 0 and r["mfu_definition"]
    single, ddp = r["rungs"][:-1], r["rungs"][-1]
    assert [x["name"] for x in single] == ["fp32 eager", "+ TF32", "+ bf16 autocast", "+ flash attention (SDPA)",
                                           "+ torch.compile", "+ fused AdamW", "+ vocab 50304, 1 micro-step",
                                           "+ no host sync per step", "+ activation checkpointing"]
    for rung in single:
        assert RUNG_KEYS <= rung.keys(), rung["name"]
        assert rung["tokens_per_s"] > 0 and rung["ms_per_step"] > 0, rung["name"]
        assert rung["tokens_per_step"] == single[0]["tokens_per_step"]  # same math on every rung
    # reading the loss less often changes when the host waits, not what is computed
    vocab, nosync = single[6], single[7]
    assert vocab["settings"]["host_sync"] and not nosync["settings"]["host_sync"]
    assert np.allclose(nosync["losses"], vocab["losses"], rtol=1e-6, atol=0)
    assert not single[-1]["kept"]  # checkpointing is measured, then dropped
    assert "skipped" in ddp  # one CPU device: the DDP rung says why it did not run
    assert r["checks"]["all_single_device_rungs_ran"]


def test_capstone_torch_losses_track_the_baseline(capstone_torch):
    r = capstone_torch
    assert r["checks"]["losses_track_baseline"]
    tol = r["loss_check"]["rel_tolerance"]
    assert all(x["loss_rel_diff"] <= tol for x in r["rungs"][:-1])


def test_capstone_torch_checkpointing_lowers_activation_memory(capstone_torch):
    rungs = {x["name"]: x for x in capstone_torch["rungs"]}
    ckpt = rungs["+ activation checkpointing"]
    before = rungs[ckpt["builds_on"]]  # the configuration checkpointing was added to
    assert ckpt["activation_bytes"] < before["activation_bytes"]
    assert capstone_torch["checks"]["checkpointing_lowers_activation_memory"]


# ---------------------------------------------------------------------------------------
# 07_capstone_jax.py

def test_capstone_jax_waterfall(tmp_path):
    # every rung of the JAX waterfall, 2 steps each, the last one sharded over 4 simulated devices
    out = run_lesson("07_capstone_jax.py", devices=4, timeout=400, tmp_path=tmp_path)
    assert out["lesson"] == "07_capstone_jax" and out["quick"] and out["device"]["count"] == 4
    rungs = {r["name"]: r for r in out["rungs"]}
    assert len(rungs) == 10
    for r in out["rungs"]:  # every rung ran and reported (no skip, no failure)
        assert "failed" not in r and "skipped" not in r, r
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and r["mfu_measured_peak"] > 0
        assert r["loss_rel_diff"] <= out["loss_check"]["rel_tolerance"]  # the math did not change
    names = [r["name"] for r in out["rungs"]]
    base, jit = out["rungs"][0], out["rungs"][1]
    vocab, nosync = rungs["+ vocab 50304, 1 micro-step"], rungs["+ no host sync per step"]
    assert not nosync["settings"]["host_sync"]  # waiting less often must not change the numbers
    assert np.allclose(nosync["losses"], vocab["losses"], rtol=1e-6, atol=0)
    cublas = rungs["+ cuBLAS for every matmul"]  # a kernel choice: same math (on a CPU, the same kernels)
    assert cublas["settings"]["triton_gemm"] is False and out["rungs"][-1]["settings"]["triton_gemm"] is False
    assert np.allclose(cublas["losses"], nosync["losses"], rtol=1e-6, atol=0)
    assert base["settings"]["jit"] is False and base["compile_s"] == 0 and jit["compile_s"] > 0
    assert base["settings"]["precision"] == "highest" and base["settings"]["vocab"] == 50257
    # the sharded rung used all 4 devices, each with its slice of the same global batch
    shard = out["rungs"][-1]
    assert shard["world_size"] == 4 and shard["tokens_per_step"] == base["tokens_per_step"]
    # checkpointing saves activations: fewer bytes kept for backward than the rung before
    ck = next(i for i, n in enumerate(names) if n.startswith("+ activation checkpointing"))
    assert out["rungs"][ck]["activation_bytes"] < out["rungs"][ck - 1]["activation_bytes"]
    assert out["flops_per_token"] > 0 and out["peaks"]["measured_bf16_matmul"] > 0
    assert all(out["checks"].values()), out["checks"]
    assert (tmp_path / "07_capstone_jax.png").exists()
