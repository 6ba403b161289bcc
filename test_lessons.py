"""
Tests for perf-lessons, on the CPU: the shared models, then every lesson run for real
(`--quick --json`) from a folder holding only the lesson and the model files it imports (as
a reader who copies it), asserting on the physics its JSON reports; then every bad input
each lesson must refuse, in milliseconds, through its `parse_args`.

On 2 cores the suite's time is its CPU, and a third of that was lessons importing torch and
JAX. So a lesson runs as a fork of one process that has imported them (ZYGOTE_CODE), and
most runs start with the session, beside the tests that run here (`early`). Gloo ranks are
forked from this process with the variables torchrun gives them; one test runs torchrun
itself, and the tests of Ctrl-C during imports start real interpreters.

    python -m pytest -q test_lessons.py
"""

import importlib.util
import itertools
import json
import math
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import FAST_COMPILE
from model_torch import (GPT, GPTConfig, activation_bytes, activation_terms,
                         block_activation_terms, flops_per_token, param_count, state_bytes)

HERE = Path(__file__).resolve().parent
# One torch thread here and in every lesson the tests start: the toy models' ops take
# microseconds, and on 2 cores shared by two busy processes each op with a second thread
# would wait for it whenever the OS has parked it
torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------
# Running a lesson as the reader would: a copy of it alone, its own process, its JSON read back.

def lesson_folder(script, tmp_path):
    """An empty folder holding the lesson and only the model files it imports."""
    folder = tmp_path / "lesson"
    folder.mkdir(parents=True, exist_ok=True)
    text = (HERE / script).read_text()
    needs = {"model_jax.py": "model_jax" in text, "model_torch.py": "model_" in text}
    for name in [script] + [f for f, needed in needs.items() if needed]:
        shutil.copy(HERE / name, folder / name)
    return folder


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, *args, tmp_path, nproc=None, devices=None, env=None, environ=None,
           forked=False):
    """Start `python script *args` from a lesson folder: alone (`forked`: a fork of ZYGOTE),
    under torchrun with `nproc` gloo ranks, or with `devices` simulated JAX CPU devices.
    `env` is added to `environ` (default: this process's environment). A list of the
    launched processes (of one)."""
    folder = lesson_folder(script, tmp_path)
    full_env = dict(environ or os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    full_env["OMP_NUM_THREADS"] = "1"  # one thread, as in this process (see HERE)
    if devices:
        full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    full_env.update(env or {})
    if forked:
        return [ZYGOTE.start(folder, [script, *args], full_env)]
    if not nproc:
        return [subprocess.Popen([sys.executable, script, *args], cwd=folder, env=full_env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", script, *args]
    return [subprocess.Popen(cmd, cwd=folder, env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)]


# A lesson started as a reader starts it spends 4-7 s of CPU importing numpy, matplotlib,
# torch and JAX before its first line; on 2 cores, a third of the suite. So most runs are
# forks of one process that has imported them once (ZYGOTE_CODE). Each fork then runs the
# lesson file as `python lesson.py` does: its own session, environment, folder, argv, its
# output to files, a normal interpreter exit. The runs that test the imports themselves
# (Ctrl-C while importing, a missing model file) start real interpreters, as does torchrun.

ZYGOTE_CODE = """
import json, os, runpy, signal, sys
import numpy, matplotlib.pyplot, torch, jax, flax.nnx, optax  # once, for every fork

def reap(signum, frame):  # an ended fork's exit code, into its file
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rc = CODE_FILES.pop(pid)
        with open(rc + ".part", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.rename(rc + ".part", rc)  # whole, or not there

CODE_FILES = {}
signal.signal(signal.SIGCHLD, reap)
for line in sys.stdin:
    job = json.loads(line)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # no reap before it is known
    pid = os.fork()
    if pid == 0:  # the lesson, as `python script *args` runs it
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(job["out"], os.O_WRONLY), 1)
        os.dup2(os.open(job["err"], os.O_WRONLY), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # PYTHONUNBUFFERED's lines
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = job["argv"]
        sys.path[0] = job["cwd"]
        runpy.run_path(job["argv"][0], run_name="__main__")
        sys.exit()
    CODE_FILES[pid] = job["rc"]
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    print(pid, flush=True)
"""


ZYGOTE = None  # the session's Zygote, started by `early`


class Zygote:
    """The process of ZYGOTE_CODE, started from the session's environment; `start` forks a
    lesson from it (from any thread)."""

    def __init__(self, environ):
        self.process = subprocess.Popen([sys.executable, "-c", ZYGOTE_CODE],
                                        env=dict(environ, OMP_NUM_THREADS="1"),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, start_new_session=True)
        self.lock = threading.Lock()
        self.forks = itertools.count()

    def start(self, folder, argv, env):
        """`python *argv` in `folder` with `env`, forked: a Forked. Its output goes to
        files beside the folder, which holds the lesson alone."""
        name = folder.parent / f"forked{next(self.forks)}"
        out = Path(f"{name}.out")
        err = Path(f"{name}.err")
        out.touch()
        err.touch()
        job = dict(cwd=str(folder), argv=argv, env=env, out=str(out), err=str(err),
                   rc=f"{name}.rc")
        with self.lock:
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
            pid = int(self.process.stdout.readline())
        return Forked(argv, pid, out, err, Path(job["rc"]))

    def close(self):
        self.process.stdin.close()  # its loop ends; forks still running finish on their own
        self.process.wait(timeout=60)


class Forked:
    """A lesson forked from the zygote, with what the tests use of subprocess.Popen: args,
    pid, returncode, stdout read line by line as it is written, communicate(), kill()."""

    def __init__(self, args, pid, out, err, rc):
        self.args = args
        self.pid = pid
        self.returncode = None
        self.reader = open(out)
        self.err = err
        self.rc = rc
        self.stdout = self  # its lines as they are written, as from a pipe

    def poll(self):
        if self.returncode is None and self.rc.exists():
            self.returncode = int(self.rc.read_text())
        return self.returncode

    def readline(self, timeout=300):
        """The next whole line; at the end, what is left ("" once all is read)."""
        deadline = time.monotonic() + timeout
        line = ""
        while not line.endswith("\n"):
            ended = self.poll() is not None  # then all it wrote is in the file
            line += self.reader.readline()
            if ended:
                return line
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if not line.endswith("\n"):
                time.sleep(0.02)
        return line

    def __iter__(self):
        return self

    def __next__(self):
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def communicate(self, timeout=300):
        """Wait for the exit: (the stdout not yet read, all of stderr)."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.reader.read(), self.err.read_text()

    def kill(self):
        os.killpg(self.pid, signal.SIGKILL)


@dataclass
class Rank:
    """A rank forked from this process: its process id, and its stdout and stderr as files."""
    pid: int
    out: Path
    err: Path


def fork_ranks(script, *args, tmp_path, world, nodes=1):
    """`torchrun --nnodes=<nodes> --nproc_per_node=<world/nodes> script *args` without
    torchrun: `world` gloo ranks forked from this process (torch already imported: no
    interpreter to start), each given the variables torchrun gives a rank and run as
    `__main__` from a lesson folder. Their Ranks, for wait_ranks."""
    folder = lesson_folder(script, tmp_path)
    local = world // nodes
    env = dict(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    ranks = []
    # JAX warns that a fork may deadlock: the ranks run torch alone, and wait_ranks kills a
    # rank still running after its timeout, which fails the test
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        for rank in range(world):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank % local),
                            GROUP_RANK=str(rank // local))
            out = folder / f"rank{rank}.out"
            err = folder / f"rank{rank}.err"
            pid = os.fork()
            if pid == 0:  # the rank: the lesson, then out at once, past pytest's exit handlers
                os._exit(run_as_main(folder / script, args, rank_env, out, err))
            ranks.append(Rank(pid, out, err))
    return ranks


def run_as_main(path, args, env, out, err):
    """In a forked child: `python path *args > out 2> err` with `env` added; its exit code."""
    code = 1
    try:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.update(env)
        os.chdir(path.parent)
        torch.set_num_threads(1)  # as under torchrun; OpenMP's threads do not survive a fork
        sys.argv = [path.name, *args]
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code
        if isinstance(code, str):  # sys.exit("error: ..."): the text on stderr, exit 1
            print(code, file=sys.stderr)
            code = 1
        if code is None:
            code = 0
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def wait_ranks(ranks, timeout=120):
    """The forked ranks' exit codes; a rank still running after `timeout` s is killed."""
    deadline = time.monotonic() + timeout
    codes = []
    for rank in ranks:
        while True:
            done, status = os.waitpid(rank.pid, os.WNOHANG)
            if done:
                codes.append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                for other in ranks:
                    os.kill(other.pid, signal.SIGKILL)
                raise TimeoutError(f"a forked rank ran past {timeout} s")
            time.sleep(0.05)
    return codes


def stderr_tails(ranks):
    """Each rank's last lines of stderr: what an assertion on its exit code shows."""
    tails = []
    for number, rank in enumerate(ranks):
        tails.append(f"rank {number}: {rank.err.read_text()[-2000:]}")
    return "\n".join(tails)


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


def ctrl_c_after_first_line(script, *args, tmp_path, environ=None):
    """Press Ctrl-C once the lesson prints its first line ("device: ..."), i.e. once its
    imports are done and the measurements begin. Returns (exit code, stderr)."""
    proc = launch(script, *args, tmp_path=tmp_path, environ=environ, forked=True)[0]
    first = proc.stdout.readline()
    assert first.startswith("device:"), first
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err


def quick_run(script, *args, json_path, tmp_path, **kwargs):
    """Run `script --quick --device cpu --json json_path --out DIR *args` to the end; the
    CompletedProcess, its exit code checked."""
    proc = run_process(script, "--quick", "--device", "cpu", "--json", str(json_path),
                       "--out", str(tmp_path / "out"), *args, tmp_path=tmp_path, forked=True,
                       **kwargs)
    assert proc.returncode == 0, (f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return proc


# The lessons' runs that need nothing from this process start with the session, in two
# queues (the long runs, the short ones), each a thread that runs one at a time: the tests
# here take one core, the runs the rest. A run's fixture waits for it. EARLY_RUNS, at the end
# of this file, names them in the order the tests need them.

@pytest.fixture(scope="session", autouse=True)
def early(request, tmp_path_factory):
    """{fixture name: the Future of its run}, for the runs a selected test needs; and the
    session's ZYGOTE. Each run starts from the environment the session began with: no
    test's monkeypatched variable reaches it."""
    global ZYGOTE
    environ = dict(os.environ)
    ZYGOTE = Zygote(environ)
    needed = set()
    for item in request.session.items:
        needed.update(item.fixturenames)
    pools = []
    runs = {}
    for queue in EARLY_RUNS.values():
        pool = ThreadPoolExecutor(max_workers=1)
        for name, start in queue.items():
            if name in needed:
                runs[name] = pool.submit(start, tmp_path_factory.mktemp(name), environ)
        pools.append(pool)
    yield runs
    for pool in pools:
        pool.shutdown(cancel_futures=True)
    ZYGOTE.close()


def waits_for(name):
    """The fixture `name`: the result of the early run of that name, once it has ended."""
    @pytest.fixture(scope="module", name=name)
    def result(early):
        return early[name].result()
    return result


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


def counted_flops_per_token(cfg, B=1):
    """Training FLOPs per token as torch's FlopCounterMode counts one forward + backward."""
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (B, cfg.block_size))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    return counter.get_total_flops() / (B * cfg.block_size)


# manual attention: its matmuls are counted on every device (CPU SDPA is not). The two
# configurations weigh the formula's terms differently: at vocabulary 50304 the head's matmul
# is most of 6N and attention ~4%; at vocabulary 256, T = 512, d = 64, the 12 L T d term is over
# half the total, so halving it (6 L T d) misses by ~25%, far outside the 1% tolerance, which
# only has to absorb what the formula counts and the counter does not (biases, LayerNorm gains).
@pytest.mark.parametrize("cfg, attention_share", [
    (tiny(attn="manual"), (0.03, 0.04)),
    (tiny(attn="manual", vocab_size=256, block_size=512, n_layer=2, n_head=2, n_embd=64),
     (0.5, 0.6)),
], ids=["head-heavy", "attention-heavy"])
def test_flops_per_token_matches_flop_counter(cfg, attention_share):
    T = cfg.block_size
    share = 12 * cfg.n_layer * T * cfg.n_embd / flops_per_token(cfg)
    assert attention_share[0] < share < attention_share[1]  # the weighting this case tests
    counted = counted_flops_per_token(cfg)
    assert abs(flops_per_token(cfg, T) / counted - 1) < 0.01, (
        f"6N + 12LTd = {flops_per_token(cfg, T):.0f} FLOPs/token, the counter {counted:.0f}")


def test_flops_per_token_is_six_n_plus_twelve_l_t_d():
    # the formula term by term, exactly: 6 FLOPs per weight per token (N without the position
    # table), and the attention term 12 L T d at the sequence length asked for
    for cfg in (GPTConfig.preset("gpt2"), tiny(), tiny(block_size=64, n_layer=3)):
        L, d = cfg.n_layer, cfg.n_embd
        six_n = 6 * param_count(cfg, position=False)
        for T in (cfg.block_size, cfg.block_size // 2):
            assert flops_per_token(cfg, T) - six_n == 12 * L * T * d, "the attention term"
        assert flops_per_token(cfg) == flops_per_token(cfg, cfg.block_size), "T defaults to block"


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


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "manual"])
@pytest.mark.parametrize("bf16", [False, True])
def test_activation_prediction_is_exact_term_by_term(attn, bf16, checkpointed, fused):
    # the prediction is counted tensor by tensor, so it must equal autograd's saved bytes
    # exactly, in total and in every term that a tensor's shape and dtype identify. Small
    # sizes whose shapes cannot be mistaken for each other: V = 320 is none of d, 3d, 4d, T
    cfg = tiny(attn=attn, n_layer=2, checkpoint=checkpointed, fused_classifier=fused,
               vocab_size=320, block_size=64)
    B, T, H, V, L = 3, cfg.block_size, cfg.n_head, cfg.vocab_size, cfg.n_layer  # B T != 4 d
    idx = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))  # its own storage: the fused head keeps none
    saved = saved_tensors(GPT(cfg), idx, targets, bf16)
    terms = activation_terms(cfg, B, bf16=bf16)
    assert sum(b for b, _, _ in saved) == activation_bytes(cfg, B, bf16=bf16) == sum(terms.values())

    def counted(shape, dtype):
        return sum(b for b, s, d in saved if s == shape and d == dtype)

    f32, half = torch.float32, torch.bfloat16
    inner = 0 if checkpointed else 1  # a checkpointed block keeps none of its insides
    assert counted((B, T, 1), f32) == inner * terms.get("blocks.layernorm_stats", 0) + terms["ln_f_stats"]
    assert counted((B * T, V), f32) == terms.get("log_softmax", 0)
    assert counted((V, cfg.n_embd), f32) == terms.get("classifier_dw", 0)
    assert sum(b for b, _, d in saved if d == torch.int64) == (
        terms["token_ids"] + terms.get("targets", 0) + terms["position_ids"])
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
    model = GPT(tiny(n_layer=2, vocab_size=1024))
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


def jax_twin(cfg, torch_model):
    """model_jax.GPT holding torch_model's weights. Built from shapes alone: JAX's own random
    init runs op by op and takes seconds, for values from_torch overwrites."""
    import jax
    from flax import nnx
    from model_jax import GPT as JaxGPT, from_torch
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: JaxGPT(cfg)))
    model = nnx.merge(graphdef, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
    return from_torch(model, torch_model.state_dict())


@pytest.mark.parametrize("attn", ["sdpa", "manual"])
def test_jax_logits_equal_torch_logits(jax_highest, attn):
    import jax.numpy as jnp
    cfg = tiny(n_layer=2, attn=attn, vocab_size=512, block_size=64)
    torch.manual_seed(0)
    tmodel = GPT(cfg)
    jmodel = jax_twin(cfg, tmodel)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    tlogits, tloss = tmodel(idx, idx)
    jlogits, jloss = jmodel(jnp.asarray(idx.numpy()), jnp.asarray(idx.numpy()))
    assert abs(tlogits.detach().numpy() - jlogits).max() < 1e-4
    assert abs(tloss.item() - float(jloss)) < 1e-5


def unit_scale(torch_model):
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


@pytest.mark.parametrize("layer", ["ln_1", "mlp", "attn-sdpa", "attn-manual"])
def test_jax_layers_equal_torch_layers(jax_highest, layer):
    # each layer's function on unit-scale inputs, fp32, relative error < 1e-5. Catches a flipped
    # GELU flavour (tanh vs erf: ~2e-4), nnx's default LayerNorm epsilon (1e-6 vs torch's 1e-5:
    # ~5e-4 on the small-scale rows below), a missing 1/sqrt(hs) or causal mask (order 1)
    import jax.numpy as jnp
    name, _, attn = layer.partition("-")
    cfg = tiny(n_layer=1, attn=attn or "sdpa", vocab_size=256, block_size=64)
    torch.manual_seed(0)
    tmodel = unit_scale(GPT(cfg))
    jmodel = jax_twin(cfg, tmodel)
    x = torch.randn(2, cfg.block_size, cfg.n_embd)
    x[1] *= 0.01  # small-variance rows: there a LayerNorm's epsilon shows
    expected = getattr(tmodel.transformer.h[0], name)(x).detach().numpy()
    got = np.asarray(getattr(jmodel.h[0], name)(jnp.asarray(x.numpy())))
    for row in range(2):
        error = np.linalg.norm(got[row] - expected[row]) / np.linalg.norm(expected[row])
        assert error < 1e-5, f"{layer}: JAX differs from torch by {error:.1e} (row {row})"


def test_jax_and_torch_train_alike(jax_highest):
    # Same weights, same batches, same AdamW: the two frameworks take the same steps.
    import jax.numpy as jnp
    from flax import nnx
    from model_jax import adamw, make_train_step
    cfg = tiny(n_layer=2, vocab_size=1024, block_size=64)
    torch.manual_seed(0)
    tmodel = GPT(cfg)
    jmodel = jax_twin(cfg, tmodel)
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
    x = jnp.asarray(torch.randint(0, 256, (2, 64)).numpy())
    torch.manual_seed(0)
    weights = GPT(tiny(n_layer=2, vocab_size=256, block_size=64))
    grads = []
    for checkpointed in (False, True):
        cfg = tiny(n_layer=2, vocab_size=256, block_size=64, checkpoint=checkpointed)
        graphdef, params = nnx.split(jax_twin(cfg, weights))
        loss_of = lambda params: nnx.merge(graphdef, params)(x[:, :-1], x[:, 1:])[1]
        grads.append(jax.jit(jax.grad(loss_of))(params))  # op by op, remat's replay takes seconds
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-7)


# the fused classifier (config.fused_classifier): the head and the loss chunk by chunk. Chunks
# of 64 tokens over a 3 x 50 batch: two whole chunks and a shorter rest of 22 tokens.
FUSED_CHUNK = 64


def fused_test_config(fused):
    return tiny(n_layer=1, vocab_size=512, fused_classifier=fused)


def loss_and_grads(model, idx, targets, bf16=False):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits, loss = model(idx, targets)
    loss.backward()
    return logits, loss.item(), {name: p.grad for name, p in model.named_parameters()}


def largest_relative_error(got, expected):
    """The worst parameter's max |got - expected| over its own largest |expected|."""
    errors = {name: float((got[name] - g).abs().max() / g.abs().max()) for name, g in expected.items()}
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


# fp32: the same sums in another order, so equal to fp32 rounding (< 1e-5 of the largest
# gradient of each parameter). bf16: both heads round the logits' gradient to bf16 (2^-9
# relative) but from fp32 values computed in another order, so an element can round the other
# way, and the plain head rounds dW to bf16 once where the fused one adds fp32 chunk sums;
# through one block that is ~0.5% of the largest gradient, so 3e-2. A missing 1/N (150x), the
# one-hot subtracted twice or a chunk skipped are far outside either.
@pytest.mark.parametrize("bf16, tolerance", [(False, 1e-5), (True, 3e-2)], ids=["fp32", "bf16"])
def test_fused_classifier_equals_the_plain_head(monkeypatch, bf16, tolerance):
    import model_torch
    monkeypatch.setattr(model_torch, "CLASSIFIER_CHUNK", FUSED_CHUNK)
    torch.manual_seed(0)
    plain = GPT(fused_test_config(False))
    fused = GPT(fused_test_config(True))
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 512, (3, 50))
    targets = torch.randint(0, 512, (3, 50))
    _, plain_loss, plain_grads = loss_and_grads(plain, idx, targets, bf16)
    logits, fused_loss, fused_grads = loss_and_grads(fused, idx, targets, bf16)
    assert logits is None  # no logits exist
    assert abs(fused_loss - plain_loss) < 1e-5 * plain_loss
    assert fused.lm_head.weight is fused.transformer.wte.weight  # still tied
    name, error = largest_relative_error(fused_grads, plain_grads)
    assert error < tolerance, f"{name}: fused differs from plain by {error:.1e}"


@pytest.fixture(scope="module")
def fused_heads(jax_highest):
    """One small model's fp32 loss and gradients three ways, on the same weights and batch:
    torch's fused head, JAX's fused head, JAX's plain head."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    import model_jax
    import model_torch
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_torch, "CLASSIFIER_CHUNK", FUSED_CHUNK)
        patch.setattr(model_jax, "CLASSIFIER_CHUNK", FUSED_CHUNK)
        torch.manual_seed(0)
        tmodel = GPT(fused_test_config(True))
        idx = torch.randint(0, 512, (3, 50))
        targets = torch.randint(0, 512, (3, 50))
        _, torch_loss, torch_grads = loss_and_grads(tmodel, idx, targets)
        x = jnp.asarray(idx.numpy())
        y = jnp.asarray(targets.numpy())
        heads = dict(torch=(torch_loss, torch_grads))
        for fused in (True, False):
            jmodel = jax_twin(fused_test_config(fused), tmodel)
            graphdef, params = nnx.split(jmodel)
            loss_of = lambda params: nnx.merge(graphdef, params)(x, y)[1]
            loss, grads = jax.jit(jax.value_and_grad(loss_of))(params)  # op by op: a minute
            name = "jax_plain"
            if fused:
                name = "jax_fused"
            heads[name] = (float(loss), jax.tree.map(np.asarray, grads))
    return heads


def test_jax_fused_classifier_equals_the_plain_head(fused_heads):
    import jax
    fused_loss, fused_grads = fused_heads["jax_fused"]
    plain_loss, plain_grads = fused_heads["jax_plain"]
    assert abs(fused_loss - plain_loss) < 1e-5 * plain_loss
    for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(plain_grads)):
        assert abs(a - b).max() < 1e-5 * abs(b).max(), a.shape


def test_jax_fused_classifier_equals_torch_fused(fused_heads):
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


# ---------------------------------------------------------------------------------------
# 01_roofline.py


def start_roofline(tmp, environ):
    """One --quick CPU run for the whole module: (its JSON, its stdout, its folder)."""
    out = tmp / "01_roofline.json"
    proc = quick_run("01_roofline.py", json_path=out, tmp_path=tmp, environ=environ)
    return json.loads(out.read_text()), proc.stdout, tmp


roofline = waits_for("roofline")


def test_roofline_measures_both_ceilings(roofline):
    r, _, tmp = roofline
    c = r["ceilings"]
    assert c["peak_flops"] > 0 and c["bandwidth_bytes_per_s"] > 0
    assert c["ridge_flop_per_byte"] == pytest.approx(c["peak_flops"] / c["bandwidth_bytes_per_s"])
    assert c["copy"]["bytes_moved"] == 2 * 2 * 2**21 * 4  # 2x the vector elements, read + written
    assert r["checks"] == dict(ceilings_positive=True, copy_is_exact=True)
    assert (tmp / "out" / "01_roofline.png").exists()


def test_roofline_runs_from_a_folder_holding_it_alone(roofline):
    """The lesson uses no model, so a reader can copy 01_roofline.py and nothing else."""
    folder = roofline[2] / "lesson"
    assert sorted(path.name for path in folder.iterdir()) == ["01_roofline.py"]


def test_roofline_counts_flops_and_bytes_on_paper(roofline):
    ops = roofline[0]["ops"]
    n, p, t = 2**21, 512, 16  # --quick on a CPU: vector, peak_n, tiny; everything fp32
    m, d, batch = p // 2, 2 * p, n // 4096  # medium matmul, decode weight, bmm batch
    expected = {  # (FLOPs, bytes): inputs read once, outputs written once, 4 bytes each
        "vector_add_tiny": (1024, 3 * 1024 * 4),
        "vector_add": (n, 3 * n * 4),
        "scale": (n, 2 * n * 4),
        "gelu": (8 * n, 2 * n * 4),
        "softmax": (5 * n, 2 * n * 4),
        "layernorm": (8 * n, (2 * n + 2 * 1024) * 4),  # x in, y out, gain and bias in
        "sum": (n, (n + 1) * 4),
        "matmul_tiny": (2 * t**3, 3 * t * t * 4),
        "matmul_decode": (2 * d * d, (2 * d + d * d) * 4),  # 1 token against a d x d weight
        "bmm_small": (2 * batch * 64**3, 3 * batch * 64 * 64 * 4),
        "matmul_medium": (2 * m**3, 3 * m * m * 4),
        "matmul_large": (2 * p * m * d, (p * m + m * d + p * d) * 4),
    }
    assert {key: (op["flops"], op["bytes"]) for key, op in ops.items()} == expected
    assert ops["vector_add"]["intensity"] == pytest.approx(1 / 12)  # 1 FLOP per 3 x 4 bytes
    assert ops["gelu"]["intensity"] == pytest.approx(1.0)            # 8 FLOPs per 2 x 4 bytes
    for op in ops.values():
        assert op["intensity"] == pytest.approx(op["flops"] / op["bytes"])
        assert op["achieved_flops"] == pytest.approx(op["flops"] / op["time_s"])


def test_roofline_classifies_from_the_measurement(roofline):
    """The labels follow the stated rule from the measured numbers (whatever the load was)."""
    r = roofline[0]
    peak, bandwidth = r["ceilings"]["peak_flops"], r["ceilings"]["bandwidth_bytes_per_s"]
    for op in r["ops"].values():
        assert op["predicted"] == ("compute" if op["intensity"] >= peak / bandwidth else "bandwidth")
        assert op["bound_flops"] == pytest.approx(min(peak, op["intensity"] * bandwidth))
        if op["time_s"] < 2 * op["toy_time_s"]:
            assert op["measured"] == "overhead" and op["near_roof"] is None
        elif op["achieved_flops"] / peak >= op["achieved_bytes_per_s"] / bandwidth:
            assert op["measured"] == "compute"
        else:
            assert op["measured"] == "bandwidth"
    assert r["overhead"]["floor_s"] > 0
    assert r["overhead"]["predicted_crossover_bytes"] == pytest.approx(
        r["overhead"]["floor_s"] * bandwidth)


def test_roofline_table_columns_do_not_run_together(roofline):
    """Neighbouring columns stay apart (a wide FLOP/B once ran into the x toy column)."""
    r, stdout, _ = roofline
    lines = stdout.splitlines()
    header = next(line for line in lines if "FLOP/B" in line and "x toy" in line)
    for key in ("matmul_large", "matmul_medium", "vector_add", "bmm_small"):
        op = r["ops"][key]
        row = next(line for line in lines if line.startswith(f"  {op['label']:<24} "))
        for column, width, value in [("FLOP/B", 8, op["intensity"]),
                                     ("x toy", 8, op["time_s"] / op["toy_time_s"])]:
            end = header.index(column) + len(column)
            field = row[end - width:end]
            assert row[end - width - 1] == " " and row[end] == " ", row  # separated
            assert float(field) == pytest.approx(value, rel=0.01, abs=0.06)


def test_roofline_marks_what_is_unreliable_and_what_derives_from_it(roofline):
    r, stdout, _ = roofline
    lines = stdout.splitlines()
    for op in r["ops"].values():
        if op["max_s"] - op["min_s"] > op["time_s"] or r["ceilings"]["unreliable"]:
            assert op["unreliable"]  # its own spread, or the roofs its fractions divide by
        row = next(line for line in lines if line.startswith(f"  {op['label']:<24} "))
        assert row.endswith("   unreliable (machine busy)") == op["unreliable"], row


def test_roofline_discipline_shows_both_clocks(roofline):
    d = roofline[0]["discipline"]
    for clocks in (d["torch"], d["jax"]):  # the clock at return never exceeds the clock when ready
        assert 0 < clocks["returned_s"] <= clocks["warm_median_s"]
        assert clocks["first_s"] > 0 and clocks["loop_mean_s"] > 0
    assert d["jax"]["platform"] == "cpu"
    for name in ("matmul", "copy"):  # the loop timed from the ceilings' first calls
        assert d["first"][name]["first_s"] == roofline[0]["ceilings"][name]["first_s"]


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--no-such-flag"], ["--quick", "3"]])
def test_roofline_bad_flags_exit_2(argv):
    assert refused(load_lesson("01_roofline.py").parse_args, argv) == 2


def test_roofline_cuda_without_gpu_says_so(monkeypatch):
    lesson = load_lesson("01_roofline.py")
    monkeypatch.setattr(lesson.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        lesson.parse_args(["--device", "cuda"])
    assert "no CUDA GPU" in str(stop.value.code)


def test_roofline_refuses_unusable_outputs_before_work(tmp_path):
    parse_args = load_lesson("01_roofline.py").parse_args
    (tmp_path / "a_file").write_text("")
    assert refused(parse_args, ["--json", ""]) == 2
    assert refused(parse_args, ["--out", ""]) == 2
    assert refused(parse_args, ["--json", str(tmp_path)]) == 1  # a folder, not a file
    assert refused(parse_args, ["--out", str(tmp_path / "a_file")]) == 1
    assert refused(parse_args, ["--json", "/proc/r.json", "--out", str(tmp_path)]) == 1
    assert refused(parse_args, ["--out", "/proc/figures"]) == 1
    missing = tmp_path / "missing" / "deeper"
    argv = ["--json", str(missing / "r.json"), "--out", str(tmp_path / "figures")]
    assert refused(parse_args, argv) is None
    assert missing.is_dir() and (tmp_path / "figures").is_dir()  # made before the work


def test_roofline_flags_what_the_machine_cannot_have_done():
    unreliable = load_lesson("01_roofline.py").unreliable
    assert not unreliable(dict(median_s=1.0, min_s=0.9, max_s=1.2), rate=1.05, ceiling=1.0)
    assert unreliable(dict(median_s=1.0, min_s=0.5, max_s=2.0))  # spread wider than the median
    assert unreliable(dict(median_s=1.0, min_s=0.9, max_s=1.1), rate=1.2, ceiling=1.0)


def start_roofline_ctrl_c(tmp_path, environ):
    return ctrl_c_after_first_line("01_roofline.py", "--device", "cpu", tmp_path=tmp_path,
                                   environ=environ)


roofline_ctrl_c = waits_for("roofline_ctrl_c")


def test_roofline_ctrl_c_is_one_line_and_130(roofline_ctrl_c):
    returncode, err = roofline_ctrl_c
    assert returncode == 130, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------
# 02_hardware.py


def start_hardware(tmp, environ):
    """One --quick CPU run for the whole module: its JSON, its folder, what it printed."""
    path = tmp / "02_hardware.json"
    proc = quick_run("02_hardware.py", json_path=path, tmp_path=tmp, environ=environ)
    return json.loads(path.read_text()), tmp, proc.stdout


hardware = waits_for("hardware")


def test_02_hardware_quick_cpu(hardware):
    out, tmp, printed = hardware
    assert out["lesson"] == "02_hardware" and out["quick"] is True
    assert all(out["checks"].values()), out["checks"]
    assert (tmp / "out" / "02_hardware.png").exists()
    # 1. the bandwidth-vs-size curve is there, positive, and spans KB to MB; no L2 on a CPU
    hierarchy = out["hierarchy"]
    points = hierarchy["points"]
    assert len(points) >= 8 and [p["bytes"] for p in points] == sorted(p["bytes"] for p in points)
    assert all(math.isfinite(p["gb_per_s"]) and p["gb_per_s"] > 0 for p in points)
    assert points[0]["bytes"] <= 32 << 10 and points[-1]["bytes"] >= 8 << 20
    assert hierarchy["main_memory_gb_per_s"] == points[-1]["gb_per_s"]
    assert hierarchy["fastest_gb_per_s"] == max(p["gb_per_s"] for p in points)
    assert hierarchy["gpu_l2_bytes"] is None
    caches = hierarchy["caches"]  # the CPU's data caches, as Linux reports them
    assert set(caches) <= {"L1", "L2", "L3"} and list(caches.values()) == sorted(caches.values())
    # 2. the ladder: error grows as bits shrink, format facts from torch.finfo
    formats = out["ladder"]["formats"]
    # fp8 is emulated on a CPU: timed on a smaller matmul, and the run says so
    assert formats["fp8"]["n"] < out["ladder"]["n"] == formats["fp32"]["n"]
    assert f"fp8: emulated (no fp8 unit on a CPU), so timed at {formats['fp8']['n']}^3" in printed
    assert formats["fp32"]["rel_error"] < formats["bf16"]["rel_error"] < formats["fp8"]["rel_error"]
    assert formats["fp32"]["rel_error"] < 1e-5 and formats["bf16"]["rel_error"] < 2e-2
    assert formats["fp32"]["bits"] == 32 and formats["bf16"]["bits"] == 16
    assert formats["bf16"]["eps"] == 2.0 ** -7 and formats["fp8"]["max"] == 448
    assert all(f["tflops"] > 0 for f in formats.values())
    assert formats["fp32"]["speedup_vs_fp32"] == 1
    assert formats["fp8"]["speedup_vs_fp32"] is None  # a smaller matmul: no ratio to fp32's
    assert "tf32" in out["ladder"]["skipped_formats"]  # a GPU tensor-core mode, stated why
    # 5. prefill: intensity rises with the token count, from 1 token
    pd = out["prefill_decode"]
    intensity = [r["intensity"] for r in pd["rows"]]
    assert intensity == sorted(intensity) and intensity[-1] > 10 * intensity[0]
    assert pd["rows"][0]["tokens"] == 1
    assert pd["ridge_flop_per_byte"] == pytest.approx(
        pd["peak_tflops_used"] * 1e3 / pd["bandwidth_gb_per_s_used"])
    assert pd["peak_tflops_used"] == formats["fp32"]["tflops"]  # a CPU's roof: fp32
    # 3, 4: GPU-only parts carry a reason on the CPU (energy still lists the references)
    assert out["interconnect"]["skipped"]
    assert out["energy"]["unmeasured"] and len(out["energy"]["reference_pj_horowitz_2014"]) == 6
    assert "skipped: no GPU: no link to measure" in printed
    assert "measured: nothing - no GPU power reading here" in printed
    # 6. the spec table carries the reference rows beside this machine
    table = out["spec_table"]["rows"]
    assert {"RTX 4090 (ref.)", "A100 SXM 80GB (ref.)", "H100 SXM (ref.)", "H200 SXM (ref.)"} <= set(table)
    mine = table[f"{out['device']['name'][:16]} (measured)"]
    assert mine[3] == formats["fp32"]["tflops"] and mine[1] is None  # fp32 measured, no tf32
    assert mine[4] == pytest.approx(hierarchy["main_memory_gb_per_s"] / 1e3)


def test_02_timing_is_reported_never_checked(hardware):
    """A timing decides no exit code (a loaded machine must not fail the run); a number derived
    from an unreliable one is marked unreliable too."""
    out = hardware[0]
    pd = out["prefill_decode"]
    rows = pd["rows"]
    assert pd["throughput_ratio_last_over_first"] == pytest.approx(
        rows[-1]["tflops"] / rows[0]["tflops"])
    assert set(out["checks"]) == {"ladder_errors_within_format", "ladder_error_grows_as_bits_shrink",
                                  "decode_cache_matches_full_forward", "peer_copies_exact"}
    for row in rows:  # the roof each point is compared against, and the flag beside it
        assert row["roof_tflops"] == pytest.approx(min(
            pd["peak_tflops_used"], row["intensity"] * pd["bandwidth_gb_per_s_used"] / 1e3))
        assert isinstance(row["unreliable"], bool)
    hierarchy = out["hierarchy"]
    fp32 = out["ladder"]["formats"]["fp32"]
    memory_unreliable = hierarchy["main_memory_unreliable"]
    assert memory_unreliable == hierarchy["points"][-1]["unreliable"]
    assert pd["ridge_unreliable"] == (fp32["unreliable"] or memory_unreliable)
    assert out["decode_step"]["ceiling_unreliable"] == memory_unreliable
    used = [r["unreliable"] for r in rows if r["tokens"] <= 8] + [r["unreliable"] for r in rows[-2:]]
    assert pd["crossover_unreliable"] == any(used)
    assert pd["throughput_ratio_unreliable"] == (rows[0]["unreliable"] or rows[-1]["unreliable"])
    assert out["spec_table"]["measured_row_unreliable"] >= memory_unreliable


def test_02_decode_step_counts_its_bytes_and_matches_a_full_forward(hardware):
    out = hardware[0]
    step = out["decode_step"]
    config = GPTConfig.preset(step["preset"])
    assert step["cached_vs_full_rel_error"] < 1e-4  # fp32: the KV cache changes nothing
    weights = param_count(config, position=False)  # every matrix once, the tied lm_head once
    kv = 2 * config.n_layer * (step["context"] + 1) * config.n_embd
    assert step["bytes_per_step"] == 4 * (weights + kv)
    bandwidth = out["hierarchy"]["main_memory_gb_per_s"] * 1e9
    assert step["ceiling_us"] == pytest.approx(step["bytes_per_step"] / bandwidth * 1e6)
    # a layer: layernorm, qkv, 2 cache writes, attention, head merge, proj, add, ln, 3 MLP, add
    assert 10 * config.n_layer <= step["ops_per_step"] <= 20 * config.n_layer + 20
    assert step["eager_us"] > 0 and step["launch_floor_us"] > 0
    assert step["dispatch_us"] == pytest.approx(step["ops_per_step"] * step["launch_floor_us"])
    # the batch-1 ceiling of the presets: bandwidth / bf16 weight bytes (the lm_head counted once)
    ceilings = step["bf16_tokens_per_s_ceiling"]
    for preset in ("gpt2", "gpt2-medium"):
        weight_bytes = 2 * param_count(GPTConfig.preset(preset), position=False)
        assert ceilings[preset] == pytest.approx(bandwidth / weight_bytes)
    assert ceilings["gpt2-medium"] < ceilings["gpt2"]


def test_02_cached_forward_is_the_model_forward():
    """The lesson's KV-cache decode against GPT.forward, token by token (a wrong position, mask
    or cache slot shows at once)."""
    lesson = load_lesson("02_hardware.py")
    torch.manual_seed(0)
    config = GPTConfig.preset("tiny", n_layer=2, block_size=16)
    model, idx = GPT(config).eval(), torch.randint(0, 50257, (1, 12))
    cache = lesson.kv_cache(config, 12, torch.device("cpu"))
    with torch.no_grad():
        full = model(idx)[0][0]
        prefill = lesson.cached_forward(model, idx[:, :8], 0, cache)[0]
        steps = [lesson.cached_forward(model, idx[:, t:t + 1], t, cache)[0, 0] for t in range(8, 12)]
    torch.testing.assert_close(prefill, full[:8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(steps), full[8:], rtol=1e-5, atol=1e-5)


def test_02_gpu_reports_print_every_number(capsys):
    """The GPU-only report paths, fed a GPU-shaped result: they run here, never else before the GPU."""
    lesson = load_lesson("02_hardware.py")
    host = {name: dict(gb_per_s=50.0, unreliable=False)
            for name in ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned")}
    peer = dict(direct_gb_per_s=400.0, staged_gb_per_s=25.0, direct_over_staged=16.0, exact=True,
                p2p_available=True, unreliable=True)
    lesson.report_links(dict(host=host, peer={"0->1": peer, "1->0": peer}))
    lesson.report_links(dict(host=host, peer={}, peer_skipped="1 GPU: a peer copy needs two"))
    lesson.report_energy(dict(reference_pj_horowitz_2014=lesson.HOROWITZ_PJ, seconds=4,
                              matmul_watts=690.0, matmul_flops_per_s=6e14, pj_per_flop=1.15,
                              copy_watts=400.0, copy_bytes_per_s=4e12, pj_per_byte=100.0))
    lesson.report_hierarchy(dict(points=[dict(bytes=16 << 10, gb_per_s=1e4, unreliable=False)],
                                 caches={"L2": 60 << 20}, gpu_l2_bytes=60 << 20,
                                 main_memory_gb_per_s=4e3, main_memory_unreliable=False,
                                 fastest_gb_per_s=1e4, fastest_unreliable=False))
    text = capsys.readouterr().out
    assert text.count("GPU 0->1") == 1 and "16.0x" in text and "needs two" in text
    assert "unreliable (machine busy)" in text and "two orders of magnitude" in text
    assert "690 W" in text and "1.15 pJ/FLOP" in text and "100.0 pJ/byte" in text
    assert "L2: 60 MB" in text and "16 KB" in text
    # the spec table names the GPU's link and L2 (a CPU prints - for both)
    formats = {"bf16": dict(tflops=800.0, unreliable=False)}
    table = lesson.spec_table("NVIDIA H200", formats, lesson.Rate(4.4e12, False), 60 << 20,
                              host["h2d_pinned"])
    mine = table["rows"]["NVIDIA H200 (measured)"]
    assert mine[:6] == (800.0, None, None, None, 4.4, 60.0) and "50" in mine[6]
    assert not table["measured_row_unreliable"]


def test_02_derived_from_an_unreliable_number_carries_the_mark(capsys):
    """A ridge from a busy bandwidth, a crossover that could not be derived: said, not hidden."""
    lesson = load_lesson("02_hardware.py")
    row = dict(tokens=1, intensity=1.0, time_us=5.0, tflops=1.0, gb_per_s=1.0, unreliable=False)
    lesson.report_prefill(dict(
        peak_tflops_used=800.0, bandwidth_gb_per_s_used=4000.0, ridge_flop_per_byte=200.0,
        ridge_unreliable=True, rows=[row, row], crossover_tokens=None, crossover_intensity=None,
        flat_time_us=5.0, crossover_unreliable=True, throughput_ratio_last_over_first=1.0,
        throughput_ratio_unreliable=False))
    text = capsys.readouterr().out.splitlines()
    assert "200.0 FLOP/byte (derived)  unreliable (machine busy)" in text[0]
    assert "crossover: not derived" in text[-2] and "unreliable" not in text[-1]


def test_02_a_wrong_result_fails_the_run_after_the_json(tmp_path, monkeypatch):
    lesson = load_lesson("02_hardware.py")
    result = dict(ladder=dict(formats={}), interconnect=dict(skipped="no GPU"),
                  decode_step=dict(cached_vs_full_rel_error=0.5))
    monkeypatch.setattr(lesson, "run_experiments", lambda *_: result)
    monkeypatch.setattr("sys.argv", ["02_hardware.py", "--device", "cpu", "--json",
                                     str(tmp_path / "r.json"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        lesson.main()
    assert "decode_cache_matches_full_forward" in str(stop.value.code)
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["decode_step"]["cached_vs_full_rel_error"] == 0.5
    assert out["checks"]["peer_copies_exact"] and not out["checks"]["decode_cache_matches_full_forward"]


def test_02_error_bounds_catch_the_rung_below():
    """Each format's bound fails the error of the next coarser format computed in its place."""
    checks = load_lesson("02_hardware.py").self_checks
    measured = dict(fp32=2e-7, tf32=2.9e-4, fp16=3.6e-4, bf16=2.9e-3, fp8=3.8e-2)  # a CPU, an H200
    formats = {name: dict(rel_error=error) for name, error in measured.items()}
    assert all(checks(formats, {}, 1e-6).values())
    for name, wrong in [("fp32", 2.9e-4), ("tf32", 2.9e-3), ("fp16", 2.9e-3), ("bf16", 3.8e-2)]:
        swapped = dict(formats, **{name: dict(rel_error=wrong)})
        assert not checks(swapped, {}, 1e-6)["ladder_errors_within_format"], name
    assert not checks(formats, {}, 1e-3)["decode_cache_matches_full_forward"]
    assert not checks(formats, {"0->1": dict(exact=False)}, 1e-6)["peer_copies_exact"]


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--no-such-flag"]])
def test_02_bad_flags_exit_2(argv):
    assert refused(load_lesson("02_hardware.py").parse_args, argv) == 2


def test_02_cuda_without_gpu_says_so(monkeypatch, tmp_path):
    lesson = load_lesson("02_hardware.py")
    monkeypatch.setattr(lesson.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        lesson.parse_args(["--device", "cuda", "--out", str(tmp_path)])
    assert "no CUDA GPU" in str(stop.value.code)


def test_02_refuses_unusable_outputs_before_work(tmp_path):
    parse_args = load_lesson("02_hardware.py").parse_args
    (tmp_path / "a_file").write_text("")
    out = ["--out", str(tmp_path)]
    assert refused(parse_args, ["--json", "", *out]) == 2
    assert refused(parse_args, ["--out", ""]) == 2
    assert refused(parse_args, ["--json", str(tmp_path), *out]) == 2  # a folder
    assert refused(parse_args, ["--out", str(tmp_path / "a_file")]) == 2
    assert refused(parse_args, ["--json", "/proc/02_hardware.json", *out]) == 2
    assert refused(parse_args, ["--out", "/proc/02_hardware"]) == 2
    new = tmp_path / "new" / "deeper"  # missing folders are made
    assert refused(parse_args, ["--json", str(new / "r.json"), "--out", str(new / "out")]) is None
    assert (new / "out").is_dir() and (new / "r.json").parent.is_dir()


def test_02_flags_what_the_machine_cannot_have_done():
    lesson = load_lesson("02_hardware.py")
    unreliable = lesson.unreliable
    assert not unreliable(lesson.Timing(1.0, 0.9, 1.2), rate=1.05, ceiling=1.0)
    assert unreliable(lesson.Timing(1.0, 0.5, 2.0))  # a spread wider than the median
    assert unreliable(lesson.Timing(1.0, 0.9, 1.1), rate=1.2, ceiling=1.0)  # above the roof
    assert lesson.mark(True) == "  unreliable (machine busy)" and lesson.mark(False) == ""


def start_hardware_ctrl_c(tmp_path, environ):
    """While torch imports (the first second), then once the measurements have begun."""
    importing = interrupt("02_hardware.py", "--device", "cpu", "--out", str(tmp_path / "out"),
                          after=0.5, tmp_path=tmp_path, environ=environ)
    at_work = ctrl_c_after_first_line("02_hardware.py", "--device", "cpu", "--out",
                                      str(tmp_path / "out"), tmp_path=tmp_path, environ=environ)
    return importing, at_work


hardware_ctrl_c = waits_for("hardware_ctrl_c")


def test_02_ctrl_c_is_one_line_and_130(hardware_ctrl_c):
    proc, (returncode, err) = hardware_ctrl_c
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip() == "interrupted", proc.stderr[-2000:]
    assert returncode == 130 and err.strip() == "interrupted", err[-2000:]


def test_02_without_the_model_file_says_which_to_copy(tmp_path):
    shutil.copy(HERE / "02_hardware.py", tmp_path / "02_hardware.py")
    proc = subprocess.run([sys.executable, "02_hardware.py", "--quick"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "needs model_torch.py" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------
# 03_compile.py


def start_compile_run(tmp_path, environ):
    """One quick CPU run of 03_compile.py shared by the tests below: (process, JSON, folder)."""
    out = tmp_path / "missing" / "03_compile.json"  # the lesson makes the missing folder
    proc = quick_run("03_compile.py", json_path=out, tmp_path=tmp_path, environ=environ)
    return proc, json.loads(out.read_text()), tmp_path


compile_run = waits_for("compile_run")


@pytest.fixture(scope="module")
def compile_lesson():
    return load_lesson("03_compile.py")


def test_compile_lesson(compile_run):
    r = compile_run[1]
    checks = r["checks"]
    # every compiled result equals eager (torch.compile, jax.jit) within the stated tolerance
    for name in ["overhead_torch_compile_equals_eager", "overhead_jax_jit_equals_jax_eager",
                 "overhead_jax_equals_torch_eager", "bandwidth_torch_compile_equals_eager",
                 "bandwidth_jax_jit_equals_jax_eager", "bandwidth_jax_equals_torch_eager",
                 "matmul_torch_compile_equals_eager", "matmul_jax_jit_equals_jax_eager",
                 "matmul_jax_equals_torch_eager"]:
        assert checks[name] is True, name
    assert all(checks.values()), checks
    # each check is its measured error against a tolerance tight enough that bf16 or the tanh
    # GELU would fail it (fp32 on the CPU: 1e-5), with room left above fp32 rounding
    for section, prefix in [("overhead", "overhead"), ("bandwidth", "bandwidth"), ("compute", "matmul")]:
        errors, tol = r[section]["error"], r[section]["tolerance"]
        assert tol == 1e-5
        assert set(errors) == {"torch_compile_equals_eager", "jax_jit_equals_jax_eager",
                               "jax_equals_torch_eager"}
        for check, error in errors.items():
            assert checks[f"{prefix}_{check}"] == (error <= tol)
            assert error < tol / 3, (section, check, error)
    # fusion: eager dispatches one op per op, the compiled chain is one call
    launches = r["overhead"]["launches_per_call"]
    assert launches["eager"]["ops_dispatched"] == r["overhead"]["n_ops"] == 48
    assert launches["torch_compile"]["ops_dispatched"] <= 2
    assert r["overhead"]["jax_ops_per_call"] == {"jax_eager": 48, "jax_jit": 1}
    # every section times the same four ways (CUDA graphs only on a GPU); speedups derived from them
    for section in ("overhead", "bandwidth", "compute"):
        times, speedup = r[section]["time"], r[section]["speedup_vs_eager"]
        assert list(times) == ["eager", "torch_compile", "jax_eager", "jax_jit"]
        assert speedup["torch_compile"] == pytest.approx(
            times["eager"]["median_s"] / times["torch_compile"]["median_s"])
        assert speedup["jax_jit"] == pytest.approx(times["jax_eager"]["median_s"] / times["jax_jit"]["median_s"])
        assert set(r[section]["compile_first_call_s"]) == {"torch_compile", "jax_jit"}
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


def test_compile_fused_chain_regime_follows_from_its_numbers(compile_run, compile_lesson):
    bw = compile_run[1]["bandwidth"]
    # the roofs from their best repetition: a copy reads and writes N fp32 values, a square
    # n x n matmul does 2 n^3 FLOPs; the ridge is their ratio
    n = bw["rows"] * bw["d"]
    assert bw["copy_best_s"] == min(t["min_s"] for t in bw["roof_times"]["copy"])
    assert bw["copy_bandwidth_Bps"] == pytest.approx(2 * n * 4 / bw["copy_best_s"])
    assert bw["floor_s"] == pytest.approx(bw["bytes_floor"] / bw["copy_bandwidth_Bps"])
    assert bw["fp32_peak_flops"] == pytest.approx(2 * 512**3 / bw["fp32_matmul_best_s"])  # --quick: n=512
    assert bw["ridge_flop_per_byte"] == pytest.approx(bw["fp32_peak_flops"] / bw["copy_bandwidth_Bps"])
    # XLA counts ~5.7 FLOP/B for the exact-erf chain, and the bytes of one fused pass
    assert 4 < bw["intensity_flop_per_byte"] < 8
    assert abs(bw["xla_bytes"] / bw["bytes_floor"] - 1) < 0.1
    # the classification follows from the numbers. The roofs (and floor, ridge, regime, bound)
    # are unreliable by the one rule: their best run's samples spread wider than its median, or
    # the fastest fused chain moved bytes (did FLOPs) more than 10% faster than the roof allows
    assert (bw["regime"] == "compute-bound") == (bw["intensity_flop_per_byte"] > bw["ridge_flop_per_byte"])
    copy = min(bw["roof_times"]["copy"], key=lambda t: t["min_s"])
    matmul = min(bw["roof_times"]["fp32_matmul"], key=lambda t: t["min_s"])
    fused_s = min(bw["time"]["torch_compile"]["median_s"], bw["time"]["jax_jit"]["median_s"])
    copy_doubt = (copy["max_s"] - copy["min_s"] > copy["median_s"]
                  or bw["bytes_floor"] / fused_s > 1.1 * bw["copy_bandwidth_Bps"])
    matmul_doubt = (matmul["max_s"] - matmul["min_s"] > matmul["median_s"]
                    or bw["xla_flops"] / fused_s > 1.1 * bw["fp32_peak_flops"])
    assert bw["unreliable"] == (copy_doubt or matmul_doubt)
    # the roofline bound is the larger of the two roofs' times. Which one it is depends on the
    # measured ridge, a timing: reported by the lesson, never asserted here
    assert bw["roofline_bound_s"] == pytest.approx(max(bw["floor_s"], bw["xla_flops"] / bw["fp32_peak_flops"]))


def test_compile_quiet_output_and_no_stray_files(compile_run):
    proc, r, tmp_path = compile_run
    assert not (tmp_path / "out").exists()  # this lesson draws no figure, so --out stays uncreated
    assert not list(tmp_path.rglob("*.tmp*"))  # no stray files beside the JSON
    assert [p.name for p in (tmp_path / "missing").iterdir()] == ["03_compile.json"]
    # no stray profiler lines (kineto's USDT profiler_start / profiler_stop), no tracebacks
    assert "USDT" not in proc.stdout + proc.stderr and "profiler_start" not in proc.stderr
    assert "Traceback" not in proc.stderr


def compile_sections(stdout):
    """The printed lines of the overhead, bandwidth and compute experiments, by section."""
    lines = {"overhead": [], "bandwidth": [], "compute": []}
    current = None
    for line in stdout.splitlines():
        for number, section in [("1.", "overhead"), ("2.", "bandwidth"), ("3.", "compute")]:
            if line.startswith(number + " "):
                current = section
        if line.startswith("4a."):
            current = None
        if current is not None:
            lines[current].append(line)
    return lines


def test_compile_marks_every_number_derived_from_an_unreliable_timing(compile_run, compile_lesson):
    proc, r, _ = compile_run
    busy = compile_lesson.BUSY
    # the one rule, as a function
    assert compile_lesson.unreliable(dict(median_s=1.0, min_s=0.5, max_s=2.0))  # spread > median
    assert not compile_lesson.unreliable(dict(median_s=1.0, min_s=0.9, max_s=1.2), 1.05, 1.0)
    assert compile_lesson.unreliable(dict(median_s=1.0, min_s=0.9, max_s=1.1), 1.2, 1.0)
    lines = compile_sections(proc.stdout)
    for section in ("overhead", "bandwidth", "compute"):
        times = r[section]["time"]
        for name, t in times.items():
            assert t["unreliable"] == (t["max_s"] - t["min_s"] > t["median_s"])
            [line] = [l for l in lines[section] if l.startswith(f"  {name:16s} ")]
            measured = line.split(";")[0]  # the timing; its note after the ";" may be derived
            assert (busy in measured) == t["unreliable"], line
        # a speedup is marked when either of its two timings is
        for name, baseline in [("torch_compile", "eager"), ("jax_jit", "jax_eager")]:
            [line] = [l for l in lines[section] if f"{name} speedup over {baseline}:" in l]
            doubt = times[name]["unreliable"] or times[baseline]["unreliable"]
            assert line.endswith(busy) == doubt, line
    # the bandwidth experiment's floor, ridge and regime carry the roofs' mark
    [regime] = [l for l in lines["bandwidth"] if "so the fused chain is" in l]
    assert regime.endswith(busy) == r["bandwidth"]["unreliable"]


@pytest.mark.parametrize("argv, code", [
    (["--device", "tpu"], 2),
    (["--json", ""], 2),
    (["--out", ""], 2),
    (["--json", "/proc/03_compile.json"], 1),  # a folder nobody can write to
    (["--json", "."], 1),
    (["--out", "03_compile.py"], 1),
    (["--device", "cuda"], None if torch.cuda.is_available() else 1),  # no GPU: one line, exit 1
    (["--quick", "--device", "cpu"], None),
])
def test_compile_bad_input_refused_before_the_work(compile_lesson, argv, code, monkeypatch):
    monkeypatch.chdir(compile_lesson.__file__.rsplit("/", 1)[0])
    assert refused(compile_lesson.parse_args, argv) == code


def start_compile_ctrl_c(tmp_path, environ):
    return ctrl_c_after_first_line("03_compile.py", "--quick", "--device", "cpu",
                                   tmp_path=tmp_path, environ=environ)


compile_ctrl_c = waits_for("compile_ctrl_c")


def test_compile_ctrl_c_one_line_exit_130(compile_ctrl_c):
    returncode, err = compile_ctrl_c
    assert returncode == 130
    assert err.strip() == "interrupted"


def test_compile_json_folder_made_at_the_start(compile_lesson, tmp_path):
    path = tmp_path / "a" / "b" / "r.json"
    assert refused(compile_lesson.parse_args, ["--json", str(path)]) is None
    assert path.parent.is_dir() and not path.exists()


# ---------------------------------------------------------------------------------------
# 04_memory.py


GiB = 2**30


def start_memory_run(tmp_path, environ):
    """One quick CPU run of 04_memory.py shared by the tests below: (process, JSON, folder)."""
    out = tmp_path / "04_memory.json"
    proc = quick_run("04_memory.py", json_path=out, tmp_path=tmp_path, environ=environ)
    return proc, json.loads(out.read_text()), tmp_path


memory_run = waits_for("memory_run")


@pytest.fixture(scope="module")
def memory(memory_run):
    return memory_run[1]


@pytest.fixture(scope="module")
def memory_lesson():
    return load_lesson("04_memory.py")


def test_memory_accounting_is_exact(memory):
    # params / grads / AdamW moments: predicted from the config = counted numel x element_size
    # of the live parameters, their .grad and the optimizer's exp_avg + exp_avg_sq tensors
    a = memory["anatomy"]
    cfg = GPTConfig(**{k: v for k, v in memory["config"].items() if k not in ("batch_size", "seq_len")})
    for k in ("params", "grads", "optimizer"):
        assert a["predicted"][k] == a["counted"][k], k
    assert all(a["counted"][k] == v for k, v in state_bytes(cfg).items())
    assert a["counted"]["params"] + a["counted"]["grads"] + a["counted"]["optimizer"] == 16 * param_count(cfg)
    # activations too, to the byte on a CPU: each tensor saved for backward is in the accounting
    assert a["predicted"]["activations"] == a["counted"]["activations"]
    assert all(memory["checks"][f"anatomy_{k}_exact"] for k in ("params", "grads", "optimizer"))
    # the anatomy is shown term by term, and the terms add up to the total
    assert sum(a["activation_terms"].values()) == a["predicted"]["activations"]
    # the logits, the largest single term at a 50304 vocabulary, under the name a reader knows
    logits = a["activation_terms"]["logits (fp32 log-softmax, V per token)"]
    assert logits == 4 * cfg.vocab_size * memory["config"]["batch_size"] * cfg.block_size


def test_memory_autocast_keeps_state_fp32(memory):
    dtypes = memory["configurations"]["rows"]["bf16 autocast"]["dtypes"]
    assert dtypes == {k: ["torch.float32"] for k in ("params", "grads", "optimizer")}


def test_memory_checkpointing_lowers_activations_same_grads(memory):
    c = memory["configurations"]
    for prec, plain in (("fp32", "fp32"), ("bf16", "bf16 autocast")):
        assert c["rows"][f"{prec} + checkpoint"]["activations_counted"] < c["rows"][plain]["activations_counted"]
    assert c["grad_max_rel_error"] <= 1e-6 and memory["checks"]["checkpoint_grads_equal"]
    # AdamW with lr=0 leaves the weights alone: every configuration sees the same weights, so the
    # checkpointed losses equal the plain ones and bf16's is close to fp32's
    rows = c["rows"]
    assert rows["fp32 + checkpoint"]["loss"] == rows["fp32"]["loss"]
    assert rows["bf16 + checkpoint"]["loss"] == rows["bf16 autocast"]["loss"]
    assert abs(rows["bf16 autocast"]["loss"] / rows["fp32"]["loss"] - 1) < 1e-3


def test_memory_predictions_in_the_rows_are_the_accounting(memory, memory_lesson):
    cfg = GPTConfig(**{k: v for k, v in memory["config"].items() if k not in ("batch_size", "seq_len")})
    batch = memory["config"]["batch_size"]
    for name, bf16, ckpt in memory_lesson.CONFIGURATIONS:
        row, config = memory["configurations"]["rows"][name], replace(cfg, checkpoint=ckpt)
        assert row["activations_predicted"] == activation_bytes(config, batch, bf16=bf16), name
        assert row["peak_predicted"] == memory_lesson.predicted_peak(config, batch, bf16), name
        assert row["activations_counted"] == row["activations_measured"], name  # CPU: the count
        assert row["activations_predicted"] == row["activations_counted"], name  # to the byte


def test_memory_accumulated_grads_equal_full_batch(memory):
    acc = memory["accumulation"]
    assert memory["checks"]["accumulated_grads_equal_full_batch"] is True
    assert acc["grad_max_rel_error"] < 1e-5
    assert acc["activations_counted_micro"] < acc["activations_counted_full"]
    assert acc["activations_counted_micro"] == acc["activations_predicted_micro"]
    assert acc["activations_counted_full"] == acc["activations_predicted_full"]
    assert acc["peak_rise_micro"] < acc["peak_rise_full"]
    assert all(memory["checks"].values()), memory["checks"]


def test_memory_peak_predicted_matches_the_profiler(memory):
    # the CPU's profiler records every allocation and free: the step's measured peak
    cfg = GPTConfig(**{k: v for k, v in memory["config"].items() if k not in ("batch_size", "seq_len")})
    tokens = memory["config"]["batch_size"] * cfg.block_size
    for name, row in memory["configurations"]["rows"].items():
        assert abs(row["peak_predicted"] / row["peak_measured"] - 1) < 0.05, name
        # below the sum of state, activations and the head's gradients: backward frees each
        # layer's activations as it writes that layer's gradients
        naive = 16 * param_count(cfg) + row["activations_counted"] + 8 * cfg.vocab_size * tokens
        assert row["peak_measured"] < naive, name


def hand_largest_batch(config, budget, bf16):
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


@pytest.mark.parametrize("name, bf16, switches", [
    ("fp32", False, {}), ("bf16", True, {}), ("fp32, manual attn", False, dict(attn="manual")),
    ("fp32 + checkpoint", False, dict(checkpoint=True)), ("bf16 + checkpoint", True, dict(checkpoint=True))])
def test_memory_fit_prediction_is_the_accounting(memory_lesson, name, bf16, switches):
    gpt2 = replace(GPTConfig.preset("gpt2"), **switches)
    for budget in (24 * GiB, 80 * GiB, 3 * GiB, 1 * GiB):
        expected = hand_largest_batch(gpt2, budget, bf16)
        assert memory_lesson.predicted_largest_batch(gpt2, budget, bf16) == expected, (name, budget)
    # fp32 at 24 GiB: hand arithmetic once more, in numbers (state 16 B x N, act 817 MB, 412 MB head)
    if name == "fp32":
        assert memory_lesson.predicted_largest_batch(gpt2, 24 * GiB, False) == 19
    # budgets just above the state, where backward's end binds (the tied embedding's two V x d
    # gradients; under checkpointing one block recomputed, with its bf16 weight copies): a
    # narrow-vocabulary, wide model makes the recomputed block the larger term
    wide = GPTConfig(n_layer=2, n_head=8, n_embd=1024, block_size=1024, vocab_size=256, **switches)
    for config in (gpt2, wide):
        state = sum(state_bytes(config).values())
        for budget in range(state, state + 2**30, 2**30 // 97):
            expected = hand_largest_batch(config, budget, bf16)
            assert memory_lesson.predicted_largest_batch(config, budget, bf16) == expected, budget


def test_memory_big_model_fits_only_with_the_techniques(memory, memory_lesson):
    big = memory_lesson.BIG_MODEL
    fits = {name: memory_lesson.predicted_largest_batch(replace(big, checkpoint=ckpt), 24 * GiB, bf16)
            for name, bf16, ckpt in memory_lesson.CONFIGURATIONS}
    assert fits["fp32"] == fits["bf16 autocast"] == 0  # at no batch size without checkpointing
    assert fits["fp32 + checkpoint"] >= 1 and fits["bf16 + checkpoint"] >= 1
    assert sum(state_bytes(big).values()) < 24 * GiB  # the state alone fits: activations do not
    rows = {name: row["predicted"]["budget"] for name, row in memory["fit"]["big"]["rows"].items()}
    assert rows == fits
    assert all(row["measured"] == {} for row in memory["fit"]["big"]["rows"].values())
    assert memory["fit"]["big"]["measured"] is False  # no GPU here: prediction only
    # batch 1's predicted peak, printed beside each row, is predicted_peak's
    for name, bf16, ckpt in memory_lesson.CONFIGURATIONS:
        peak = memory_lesson.predicted_peak(replace(big, checkpoint=ckpt), 1, bf16)
        assert memory["fit"]["big"]["rows"][name]["peak_batch1"] == peak
    # the gpt2 fit table: predictions for the 24 GiB budget, the same function
    for name, bf16, ckpt in memory_lesson.CONFIGURATIONS:
        gpt2 = replace(GPTConfig.preset("gpt2"), checkpoint=ckpt)
        expected = memory_lesson.predicted_largest_batch(gpt2, 24 * GiB, bf16)
        assert memory["fit"]["rows"][name]["predicted"] == {"budget": expected}


def test_memory_figure(memory_run):
    out = memory_run[2] / "out"
    assert (out / "04_memory.png").stat().st_size > 10_000
    assert "USDT" not in memory_run[0].stdout + memory_run[0].stderr


@pytest.mark.parametrize("argv, code", [
    (["--budget-gb", "0"], 2), (["--budget-gb", "-1"], 2), (["--budget-gb", "nan"], 2),
    (["--budget-gb", "inf"], 2), (["--budget-gb", "lots"], 2),
    (["--json", ""], 2), (["--out", ""], 2),  # an empty path
    (["--json", "."], 1), (["--out", "a_file"], 1),  # a folder for a file, a file for a folder
    (["--json", "/proc/no-such-folder/r.json"], 1), (["--out", "/proc/no-such-folder"], 1),
    (["--json", "new/deeper/r.json", "--out", "figures/new"], None),  # folders made
    (["--device", "cuda"], None if torch.cuda.is_available() else 1),
    (["--budget-gb", "16", "--quick"], None),
])
def test_memory_bad_input_refused_before_the_work(memory_lesson, argv, code, monkeypatch,
                                                  tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    assert refused(memory_lesson.parse_args, argv) == code
    if code is None and "new/deeper/r.json" in argv:
        assert (tmp_path / "new" / "deeper").is_dir() and (tmp_path / "figures" / "new").is_dir()
        assert not (tmp_path / "new" / "deeper" / "r.json").exists()  # written after the work


def test_memory_without_model_file_says_which_to_copy(tmp_path):
    shutil.copy(HERE / "04_memory.py", tmp_path / "04_memory.py")
    proc = subprocess.run([sys.executable, "04_memory.py", "--quick"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: model_torch.py is missing: copy it beside 04_memory.py"]


def start_memory_ctrl_c(tmp_path, environ):
    return ctrl_c_after_first_line("04_memory.py", "--device", "cpu", "--out",
                                   str(tmp_path / "out"), tmp_path=tmp_path, environ=environ)


memory_ctrl_c = waits_for("memory_ctrl_c")


def test_memory_ctrl_c_is_one_line_and_exit_130(memory_ctrl_c):
    returncode, err = memory_ctrl_c
    assert returncode == 130 and err.strip() == "interrupted", err[-2000:]


# ---------------------------------------------------------------------------------------
# 05_ddp_scratch.py

DDP_SCRATCH = "05_ddp_scratch.py"


def check_ddp_scratch(r, world):
    """What must hold on any machine for a --quick run on `world` gloo ranks."""
    assert r["lesson"] == "05_ddp_scratch" and r["world_size"] == world and r["backend"] == "gloo"
    assert all(r["checks"].values()), r["checks"]
    # hand-rolled data parallelism: identical replicas, the same as one process on the whole batch
    d = r["ddp"]
    assert d["replicas_identical"] and d["grad_max_rel_err_vs_single"] <= 1e-5
    assert d["param_diff_over_distance_moved"] <= 1e-3
    assert d["losses"] == pytest.approx(d["single_process_losses"], rel=1e-5)
    # ring and naive equal dist.all_reduce on awkward lengths
    a = r["allreduce_correctness"]
    assert any(n % world for n in a["lengths"]) and min(a["lengths"]) < world + 1
    assert a["ring_max_rel_err"] <= 1e-6 and a["naive_max_rel_err"] <= 1e-6
    # the bill: each rank sends 2(N-1)/N S in the ring (counted), rank 0 sends (N-1) S in naive
    b = r["bill"]
    for S, ring, naive in zip(b["sizes_bytes"], b["ring"]["bytes_sent_max_rank"],
                              b["naive"]["bytes_sent_max_rank"]):
        assert abs(ring - 2 * (world - 1) / world * S) <= 2 * (world - 1) * 4
        assert naive == (world - 1) * S
    for k in ("naive", "ring", "library"):
        assert len(b[k]["median_s"]) == len(b["sizes_bytes"]) >= 2 and min(b[k]["median_s"]) > 0
        assert b[k]["fit"]["beta_s_per_byte"] > 0 and b[k]["fit"]["alpha_s"] >= 0
        for S, t, algbw, busbw in zip(b["sizes_bytes"], b[k]["median_s"], b[k]["algbw_GBps"],
                                      b[k]["busbw_GBps"]):  # nccl-tests' definitions
            assert algbw == pytest.approx(S / t / 1e9) and busbw == pytest.approx(
                algbw * 2 * (world - 1) / world)
        # one rule for "unreliable": a spread wider than the median; a fit on one is too
        for t, spread, unreliable in zip(b[k]["median_s"], b[k]["spread_s"], b[k]["unreliable"]):
            assert unreliable == (spread > t)
        if any(b[k]["unreliable"]):
            assert not b[k]["fit"]["reliable"]
    # this GPT's gradients: every fp32 parameter once (the tied matrix once), bucketed = per tensor
    g = r["gradients"]
    config = GPTConfig.preset("tiny", n_layer=2, vocab_size=4096)
    assert g["grad_bytes"] == 4 * sum(p.numel() for p in GPT(config).parameters())
    assert g["max_rel_err"] <= 1e-6 and g["buckets"] < g["grad_tensors"]
    for way in ("per_tensor", "bucketed"):
        step, comm = g["step_s"], g[way]["measured_s"]
        assert g[way]["efficiency_no_overlap"] == pytest.approx(step / (step + comm))
        assert 0 < g[way]["efficiency_no_overlap"] <= g[way]["efficiency_full_overlap"] <= 1


def test_ddp_scratch_three_nodes_of_one_rank(tmp_path):
    """Past one machine: three "nodes" of one gloo rank each, with the variables torchrun
    --nnodes=3 gives them; N=3, so the chunks are uneven; every rank exits 0."""
    out = tmp_path / "r.json"
    ranks = fork_ranks(DDP_SCRATCH, "--quick", "--device", "cpu", "--json", str(out), "--out",
                       str(tmp_path / "out"), tmp_path=tmp_path, world=3, nodes=3)
    assert wait_ranks(ranks) == [0, 0, 0], stderr_tails(ranks)
    r = json.loads(out.read_text())
    check_ddp_scratch(r, 3)
    assert r["nodes"] == 3
    assert (tmp_path / "out" / "05_ddp_scratch_allreduce.png").exists()


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """This process as a reader's plain `python`: no torchrun variables, NCCL's log set aside."""
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.log"))


def test_ddp_scratch_runs_as_one_rank(no_launch, tmp_path, capsys):
    """Plain python, in this process: one rank, nothing to send, the group torn down after."""
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as stop:
        load_lesson(DDP_SCRATCH).main(["--quick", "--device", "cpu", "--json", str(out)])
    assert stop.value.code == 0 and not dist.is_initialized()
    r = json.loads(out.read_text())
    assert r["world_size"] == 1 and all(r["checks"].values()) and "bill" not in r
    assert r["ddp"]["max_abs_param_diff_vs_single"] == 0
    assert r["ddp"]["losses"] == r["ddp"]["single_process_losses"]
    assert "== 3. the communication bill: one rank sends nothing" in capsys.readouterr().out


def test_ddp_scratch_half_set_environment_fails_clearly(no_launch, monkeypatch, capsys):
    """RANK without the rest of torchrun's variables: one line saying what is missing, exit 1."""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        load_lesson(DDP_SCRATCH).main(["--quick", "--device", "cpu"])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and not dist.is_initialized()
    assert err.startswith("error: rank 0: ") and "WORLD_SIZE expected" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_ddp_scratch_refuses_bad_input(tmp_path):
    """Bad flags and paths where no file can be made: argparse's one line, exit 2."""
    parse_args = load_lesson(DDP_SCRATCH).parse_args
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    bad_input = [["--interconnect", "nvlink"], ["--device", "gpu"], ["--json", ""],
                 ["--out", ""], ["--json", str(tmp_path)], ["--out", str(a_file)],
                 ["--json", str(a_file / "r.json")], ["--out", str(a_file / "figures")],
                 ["--json", "/proc/no/r.json"], ["--out", "/proc/figures"]]
    if not torch.cuda.is_available():
        bad_input.append(["--device", "cuda"])
    for bad in bad_input:
        assert refused(parse_args, bad) == 2, bad
    missing = tmp_path / "missing"  # made at the end of a run, not while parsing
    good_input = [[], ["--interconnect", "staged"], ["--json", str(tmp_path / "r.json")],
                  ["--json", str(missing / "r.json")], ["--out", str(missing / "figures")]]
    for good in good_input:
        assert refused(parse_args, good) is None, good
    assert not missing.exists()


def simulate_ring(lesson, data):
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


def test_ddp_scratch_ring_schedule_sums_on_every_rank():
    """The ring's chunk lengths and schedule, in milliseconds, without processes: for N = 2..5
    and lengths below, at and not divisible by N, every rank ends with every chunk's sum."""
    lesson = load_lesson(DDP_SCRATCH)
    for world in range(2, 6):
        for length in sorted({1, world - 1, world, world + 1, 2 * world + 1, 97}):
            data = [[1000 * (rank + 1) + i for i in range(length)] for rank in range(world)]
            total = [sum(column) for column in zip(*data)]
            chunks, starts = simulate_ring(lesson, data)
            for rank in range(world):
                for c in range(world):
                    want = total[starts[c]:starts[c + 1]]
                    assert chunks[rank][c] == want, (
                        f"N={world}, length {length}: rank {rank} ends with chunk {c} = "
                        f"{chunks[rank][c]}, not the sum {want}")


def test_ddp_scratch_ctrl_c_on_one_node_stops_the_other(tmp_path):
    """Two "nodes" of one rank each. Ctrl-C on one node's terminal reaches its rank twice
    (from the terminal, then forwarded by its torchrun agent): the rank prints one line and
    exits 130. The other rank, now without its peer, stops at once with a one-line reason and
    exits 1: no hang, no traceback."""
    ranks = fork_ranks(DDP_SCRATCH, "--quick", "--device", "cpu", tmp_path=tmp_path, world=2,
                       nodes=2)
    try:
        deadline = time.monotonic() + 60
        while "== 1." not in ranks[0].out.read_text():  # rank 0 starts training
            assert time.monotonic() < deadline, stderr_tails(ranks)
            time.sleep(0.05)
        os.kill(ranks[1].pid, signal.SIGINT)  # the terminal's
        time.sleep(0.05)
        os.kill(ranks[1].pid, signal.SIGINT)  # the agent's, forwarded
        interrupted = time.monotonic()
    finally:
        codes = wait_ranks(ranks, timeout=60)
    assert time.monotonic() - interrupted < 20
    out0 = ranks[0].out.read_text()
    err0 = ranks[0].err.read_text()
    err1 = ranks[1].err.read_text()
    assert "checks:" not in out0 + ranks[1].out.read_text()
    assert codes == [1, 130], stderr_tails(ranks)
    assert err1.count("interrupted") == 1 and "KeyboardInterrupt" not in err1
    assert err0.count("error: rank 0: ") == 1 and "Traceback" not in err0


# ---------------------------------------------------------------------------------------
# 06_ddp_prod.py


JAX_PROCESS = """
import os, sys
# XLA:CPU's fastest compile (conftest.py's): the same HLO, collectives, shardings
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=2"
                           " --xla_backend_optimization_level=0"
                           " --xla_cpu_use_fusion_emitters=false")
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


def start_jax_multi_process(tmp_path, environ):
    """JAX_PROCESS as two processes: [(exit code, stdout, stderr)] of each."""
    folder = lesson_folder("model_jax.py", tmp_path)
    (folder / "job.py").write_text(JAX_PROCESS)
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [ZYGOTE.start(folder, ["job.py", address, str(i)], env) for i in (0, 1)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=400)  # 2 busy cores: minutes
        outputs.append((proc.returncode, out, err))
    return outputs


jax_multi_process = waits_for("jax_multi_process")


def test_06_jax_multi_process_path_on_cpus(jax_multi_process):
    # The README's multi-machine JAX recipe, as two processes of two CPU devices each joined by
    # jax.distributed.initialize: one global mesh of 4 devices, gloo collectives between the
    # processes; two data-parallel AdamW steps equal one device's on the whole batch.
    printed = []
    for returncode, out, err in jax_multi_process:
        assert returncode == 0, err[-2000:]
        lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()
                 if line.startswith(("global ", "one "))}  # gloo prints its own lines too
        assert lines["global"][0] == "4"  # 2 processes x 2 devices in one mesh
        printed.append(lines)
    global_losses = [float(loss) for loss in printed[0]["global"][1:]]
    one_device = [float(loss) for loss in printed[0]["one"][1:]]
    assert len(global_losses) == 2 and global_losses == pytest.approx(one_device, rel=1e-5)
    assert printed[1]["global"] == printed[0]["global"]  # process 1 sees the same global losses


def test_06_ddp_two_nodes_of_one_rank(tmp_path):
    """World 2 as two "nodes" of one rank, with the variables torchrun --nnodes=2 gives them
    (ranks spanning "machines"): DDP ends where hand-rolled ends, the buckets are counted,
    no_sync and FSDP2 hold. (Real torchrun: the Ctrl-C test below.)"""
    out = tmp_path / "r.json"
    ranks = fork_ranks("06_ddp_prod.py", "--quick", "--device", "cpu", "--interconnect",
                       "staged", "--json", str(out), "--out", str(tmp_path / "out"),
                       tmp_path=tmp_path, world=2, nodes=2)
    assert wait_ranks(ranks) == [0, 0], stderr_tails(ranks)
    r = json.loads(out.read_text())
    assert r["framework"] == "torch" and r["world_size"] == 2 and r["backend"] == "gloo"
    assert all(r["checks"].values()), r["checks"]
    assert r["interconnect"]["name"] == "staged" and "no NCCL" in r["interconnect"]["transport"]
    assert r["equivalence"]["max_abs_param_diff"] < 1e-4
    # no_sync: one backward's all-reduces; the trap (forward outside no_sync): k of them
    ns, k = r["no_sync"], r["no_sync"]["k"]
    right, trap = ns["no_sync"]["allreduce_calls"], ns["backward_only_in_no_sync"]["allreduce_calls"]
    assert right >= 1 and trap == k * right
    assert ns["max_abs_grad_diff"] <= 1e-5 * ns["max_abs_grad"]
    # hand-rolled: one call per tensor; DDP: a few buckets, fewer with bigger buckets; the
    # default row counts what no_sync's one synced backward counts
    sweep, hand = r["bucket_sweep"], r["step_time"]["handrolled"]
    assert sweep[0]["allreduce_calls_per_step"] >= sweep[-1]["allreduce_calls_per_step"] >= 1
    assert hand["allreduce_calls_per_step"] > sweep[-1]["allreduce_calls_per_step"]
    assert r["step_time"]["ddp"]["allreduce_calls_per_step"] == right
    for row in [hand] + sweep:  # a median inside its IQR; overlap a fraction of the comm time
        assert 0 < row["q1_ms"] <= row["median_ms"] <= row["q3_ms"]
        assert row["comm_ms_per_step"] > 0 and 0 <= row["overlap_fraction"] <= 1
    ddp = r["step_time"]["ddp"]  # the verdict is the one its printed numbers give
    assert ddp["against"] == "hand-rolled"
    assert ddp["saves_ms"] == pytest.approx(hand["median_ms"] - ddp["median_ms"])
    apart = ddp["q3_ms"] < hand["q1_ms"] or hand["q3_ms"] < ddp["q1_ms"]
    assert ddp["resolved"] == apart
    assert hand["overlap_fraction"] < 0.01  # its all-reduces start after backward
    assert sweep[0]["overlap_fraction"] > 0  # many small buckets: the first ones run under backward
    assert abs(r["fsdp"]["sharded_over_replicated"] * 2 - 1) < 0.05  # FSDP2: 1/N per rank
    # the trace (Chrome/Perfetto JSON holding gloo's all-reduces, one per all-reduce counted)
    trace = tmp_path / "out" / "06_ddp_trace_staged.json"
    events = json.loads(trace.read_text())["traceEvents"]
    calls = sum(e.get("name") == "gloo:all_reduce" for e in events)
    assert calls == 2 * r["step_time"]["ddp"]["allreduce_calls_per_step"]  # two profiled steps
    assert trace.stat().st_size < 16 * 2**20


def start_jax_three_devices(tmp_path, environ):
    """06's JAX half on 3 simulated CPU devices: its JSON."""
    # XLA:CPU's fastest compile (conftest.py's): 16 s of CPU, not 23; the HLO, its
    # collectives and shardings are the same
    flags = f"--xla_force_host_platform_device_count=3 {FAST_COMPILE}"
    out = tmp_path / "06_ddp_prod.json"
    quick_run("06_ddp_prod.py", "--framework", "jax", json_path=out, tmp_path=tmp_path,
              env={"XLA_FLAGS": flags}, environ=environ)
    return json.loads(out.read_text())


jax_three_devices = waits_for("jax_three_devices")


def test_06_jax_three_devices_shard_what_divides(jax_three_devices):
    """A Mesh of 3: jit inserts the all-reduce, the losses equal one device's; 3 divides few of
    this model's shapes, so what cannot be split stays replicated and the bytes say so."""
    r = jax_three_devices
    assert r["framework"] == "jax" and r["n_devices"] == 3
    assert all(r["checks"].values()), r["checks"]
    assert r["single_device"]["collectives"]["all-reduce"] == 0
    assert r["data_parallel"]["collectives"]["all-reduce"] > 0
    assert "all-reduce" in r["data_parallel"]["allreduce_example"]
    assert r["data_parallel"]["max_rel_loss_diff"] < 1e-4
    assert r["sharded_params"]["max_rel_loss_diff"] < 1e-4
    p = r["sharded_params"]
    assert p["state_bytes_per_device"] == p["expected_bytes_per_device"]
    assert 0 < p["sharded_share"] < 1  # the split arrays hold 1/3 of their bytes per device:
    assert r["sharded_over_replicated"] == pytest.approx(1 - p["sharded_share"] * 2 / 3)
    step, one = r["data_parallel"]["step"], r["single_device"]["step"]
    assert step["saves_ms"] == pytest.approx(one["median_ms"] - step["median_ms"])
    assert step["resolved"] == (step["q3_ms"] < one["q1_ms"] or one["q3_ms"] < step["q1_ms"])


def test_06_wrong_launches_say_what_to_run(monkeypatch, capsys):
    lesson = load_lesson("06_ddp_prod.py")
    monkeypatch.delenv("RANK", raising=False)
    # the torch half without torchrun: exit 2, saying how to launch it
    assert refused(lesson.parse_args, ["--framework", "torch"]) == 2
    assert "torchrun --nproc_per_node" in capsys.readouterr().err
    # the JAX half under torchrun: exit 2, saying to run it as one process
    monkeypatch.setenv("RANK", "0")
    assert refused(lesson.parse_args, ["--framework", "jax"]) == 2
    assert "python 06_ddp_prod.py --framework jax" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--quick", "yes"], ["--json"], ["--out"],
                                  ["--interconnect", "nvlink"],
                                  ["--framework", "mpi"], ["--device", "tpu"]])
def test_06_bad_flags_exit_2(argv, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert refused(load_lesson("06_ddp_prod.py").parse_args, argv) == 2


def test_06_bad_paths_refused_before_the_work(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    parse_args = load_lesson("06_ddp_prod.py").parse_args
    (tmp_path / "file").write_text("")
    assert refused(parse_args, ["--json", ""]) == 2
    assert refused(parse_args, ["--out", ""]) == 2
    assert refused(parse_args, ["--json", str(tmp_path)]) == 2  # a folder
    assert refused(parse_args, ["--out", str(tmp_path / "file")]) == 2  # a file
    assert refused(parse_args, ["--json", "/proc/06/r.json"]) == 2  # cannot be made
    assert refused(parse_args, ["--out", "/proc/06_out"]) == 2
    # missing folders are made now, before the work; nothing else is written yet
    args = parse_args(["--json", str(tmp_path / "a" / "r.json"), "--out", str(tmp_path / "b")])
    assert (tmp_path / "a").is_dir() and (tmp_path / "b").is_dir()
    assert not args.json.exists() and not any((tmp_path / "b").iterdir())


def start_jax_own_flags(tmp_path, environ):
    """06's JAX half with the user's XLA_FLAGS, Ctrl-C once it names its devices: (the lines
    up to then, the CompletedProcess)."""
    proc = launch("06_ddp_prod.py", "--quick", "--device", "cpu", "--out", str(tmp_path / "o"),
                  tmp_path=tmp_path, env={"XLA_FLAGS": "--xla_backend_optimization_level=3"},
                  environ=environ, forked=True)[0]
    said = []
    for line in proc.stdout:
        said.append(line)
        if line.startswith("device:"):
            break
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    return said, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


jax_own_flags = waits_for("jax_own_flags")


def test_06_jax_adds_the_device_count_to_the_users_xla_flags(jax_own_flags):
    """XLA_FLAGS without a device count: the lesson adds one (and says so), keeps the user's
    flag, and runs on 4 devices, not 1; Ctrl-C then stops it with one line and exit 130."""
    said, proc = jax_own_flags
    stderr = proc.stderr
    assert said[0].startswith("XLA_FLAGS: added --xla_force_host_platform_device_count=4")
    assert said[-1].startswith("device: 4 x cpu"), said
    assert proc.returncode == 130 and stderr.count("interrupted") == 1, stderr[-2000:]
    assert "Traceback" not in stderr


def test_06_jax_refuses_one_device(tmp_path, monkeypatch, capsys):
    """One device has nothing to all-reduce: a clear error, not a check passed trivially. In
    this process, whose JAX has its one CPU device (the variables the lesson sets restored)."""
    lesson = load_lesson("06_ddp_prod.py")
    monkeypatch.delenv("RANK", raising=False)
    for name, value in [("XLA_FLAGS", "--xla_force_host_platform_device_count=1"),
                        ("JAX_PLATFORMS", "cpu"), ("NCCL_DEBUG", "WARN"),
                        ("NCCL_DEBUG_FILE", str(tmp_path / "nccl.log")),
                        ("KINETO_LOG_LEVEL", "6")]:
        monkeypatch.setenv(name, value)
    argv = ["06_ddp_prod.py", "--quick", "--device", "cpu", "--out", str(tmp_path / "o")]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as stop:
        lesson.main()
    message = str(stop.value.code)  # sys.exit(text): the text on stderr, exit 1
    assert message.startswith("error: ")
    assert "JAX sees 1 device" in message and "device_count=4" in message
    assert "device:" not in capsys.readouterr().out  # refused before the work


def start_torchrun_ctrl_c(tmp_path, environ):
    """06 under torchrun, 2 ranks; Ctrl-C once rank 0 has printed: torchrun's stderr."""
    proc = launch("06_ddp_prod.py", "--quick", "--device", "cpu", "--out", str(tmp_path / "out"),
                  nproc=2, tmp_path=tmp_path, environ=environ)[0]
    for line in proc.stdout:  # rank 0 speaks after the first collective: both ranks are in
        if line.startswith("device:"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
    stdout, stderr = proc.communicate(timeout=60)
    return stderr


torchrun_ctrl_c = waits_for("torchrun_ctrl_c")


def start_ctrl_c_while_importing(tmp_path, environ):
    """04, 05 and 06 as a reader starts them, Ctrl-C 0.7 s in, while torch imports:
    {script: CompletedProcess}."""
    results = {}
    for script in ("04_memory.py", "05_ddp_scratch.py", "06_ddp_prod.py"):
        results[script] = interrupt(script, "--quick", "--device", "cpu", after=0.7,
                                    tmp_path=tmp_path / script, environ=environ)
    return results


ctrl_c_while_importing = waits_for("ctrl_c_while_importing")


@pytest.mark.parametrize("script", ["04_memory.py", "05_ddp_scratch.py", "06_ddp_prod.py"])
def test_ctrl_c_while_importing_is_one_line_and_130(ctrl_c_while_importing, script):
    result = ctrl_c_while_importing[script]
    assert result.returncode == 130, result.stderr[-2000:]
    assert result.stderr.strip() == "interrupted", result.stderr[-2000:]


def test_06_ctrl_c_under_torchrun_one_line_per_rank(torchrun_ctrl_c):
    """Ctrl-C once the ranks are at work (rank 0 has printed): each says one line, exit 130."""
    stderr = torchrun_ctrl_c
    assert stderr.count("interrupted") == 2, stderr[-3000:]
    assert '06_ddp_prod.py", line' not in stderr  # no traceback from the lesson's ranks


# ---------------------------------------------------------------------------------------
# 07_capstone_torch.py: a --quick waterfall and a --quick --headline through main() in this
# process, and the waterfall on 2 gloo ranks forked from it (torch already imported: no
# interpreter to start). Every derived number is recomputed from the raw ones in the JSON.

import contextlib  # noqa: E402 (this section's: main() run in this process)
import io  # noqa: E402

import model_torch  # noqa: E402 (its classifier's loss, replaced by the mutation tests)

CAPSTONE_FUSED = "+ fused classifier (logits never written)"
CAPSTONE_RUNGS = ["fp32 eager", "+ TF32", "+ bf16 autocast", "+ flash attention (SDPA)",
                  "+ torch.compile", "+ fused AdamW", "+ vocab 50304, 1 micro-step",
                  "+ no host sync per step", CAPSTONE_FUSED, "+ activation checkpointing"]
CAPSTONE_DDP_RUNGS = ["final rung, each GPU alone", "+ DDP", "+ bf16 gradient all-reduce"]
CAPSTONE_CLASSES = ["matmul", "attention", "loss", "optimizer", "norm+elementwise",
                    "communication", "other", "idle"]


def small_text(tmp_path):
    """A few KB of real text: enough tokens for the toy model, read in no time."""
    path = tmp_path / "small.txt"
    path.write_text((HERE / "README.md").read_text()[:20000])
    return path


def capstone_rederive(result):
    """Recompute every derived number of a capstone JSON from its raw measurements."""
    rungs = result["rungs"]
    base = rungs[0]
    peaks = result["peak_flops"]
    assert base["name"] in ("fp32 eager", "final rung, each GPU alone")
    for rung in rungs:
        name = rung["name"]
        ms = float(np.median(rung["step_ms"]))
        assert rung["ms_per_step"] == pytest.approx(ms, rel=1e-12), name
        tokens_per_s = rung["tokens_per_step"] / (ms / 1e3)
        assert rung["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-12), name
        assert rung["speedup"] == pytest.approx(base["ms_per_step"] / ms, rel=1e-12), (
            f"{name}: speed-up not measured against the baseline's ms/step")
        flops = tokens_per_s * result["flops_per_token"] / rung["world"]  # one device's
        assert rung["mfu_measured_peak"] == pytest.approx(flops / peaks["measured"],
                                                          rel=1e-12), (
            f"{name}: MFU is not one device's FLOP/s over one device's peak")
        if peaks["datasheet"] is None:
            assert rung["mfu_datasheet"] is None, name
        else:
            assert rung["mfu_datasheet"] == pytest.approx(flops / peaks["datasheet"],
                                                          rel=1e-12), name
        gaps = [abs(a - b) / b for a, b in zip(rung["losses"][:10], base["losses"][:10])]
        assert rung["loss_rel_gap"] == pytest.approx(max(gaps), rel=1e-9, abs=1e-15), (
            f"{name}: loss gap not measured against the baseline's losses")
        spread = max(rung["step_ms"]) - min(rung["step_ms"])
        busy = spread > ms or flops > 1.1 * peaks["measured"] or base["unreliable"]
        assert rung["unreliable"] == busy, f"{name}: the unreliable mark does not follow"
        split = rung["profile"]
        assert rung["binds"] == max(split, key=split.get), name
        if rung["peak_memory_bytes"] is None:
            assert rung["fits_24gb"] is None, name
        else:
            assert rung["fits_24gb"] == (rung["peak_memory_bytes"] < 23 * 2**30), name
        assert rung["tokens_per_step"] == result["tokens_per_step"], name  # one global batch


@pytest.fixture(scope="module")
def capstone_torch_module():
    return load_lesson("07_capstone_torch.py")


@pytest.fixture(scope="module")
def capstone_torch_runs(capstone_torch_module, tmp_path_factory):
    """The waterfall on 2 ranks forked from this process, and meanwhile main() here: a
    --quick waterfall (its stdout kept), a --quick --headline; then one more setup's shared
    state. torch's settings put back after."""
    m = capstone_torch_module
    folder = tmp_path_factory.mktemp("capstone_torch")
    argv = ["--quick", "--device", "cpu", "--data", str(small_text(folder))]
    cwd = os.getcwd()
    caches = torch._inductor.config.force_disable_caches
    os.chdir(folder)  # the token cache goes there
    ranks = []
    try:
        ranks = fork_ranks("07_capstone_torch.py", *argv, "--json", str(folder / "ddp.json"),
                           "--out", str(folder / "ddp"), tmp_path=folder, world=2)
        with contextlib.redirect_stdout(io.StringIO()) as stdout:
            m.main(argv + ["--json", "waterfall.json"])
        m.main(argv + ["--headline", "--json", "headline.json"])
        shared, _, _, _ = m.setup(m.parse_args(argv))
    finally:
        codes = wait_ranks(ranks)
        os.chdir(cwd)
        torch.set_float32_matmul_precision("highest")
        torch._inductor.config.force_disable_caches = caches
    assert codes == [0, 0], stderr_tails(ranks)
    runs = dict(shared=shared, stdout=stdout.getvalue())
    for name in ("waterfall", "headline", "ddp"):
        runs[name] = json.loads((folder / f"{name}.json").read_text())
    runs["figures"] = sorted(p.name for p in (folder / "out").glob("*.png"))
    runs["ddp_figures"] = sorted(p.name for p in (folder / "ddp").glob("*.png"))
    return runs


def test_capstone_torch_every_rung_runs_and_reports(capstone_torch_runs):
    r = capstone_torch_runs["waterfall"]
    assert r["lesson"] == "07_capstone_torch" and r["quick"] and r["world"] == 1
    assert r["flops_per_token"] > 0 and r["peak_flops"]["measured"] > 0
    assert [x["name"] for x in r["rungs"]] == CAPSTONE_RUNGS
    assert list(r["skipped"]) == CAPSTONE_DDP_RUNGS[1:]  # one process: it says how
    assert all("torchrun" in why for why in r["skipped"].values())
    rungs = {x["name"]: x for x in r["rungs"]}
    for rung in r["rungs"]:
        assert rung["tokens_per_s"] > 0 and rung["ms_per_step"] > 0, rung["name"]
        assert rung["regime"] and rung["binds"] in rung["profile"], rung["name"]
    # reading the loss less often changes when the host waits, not what is computed
    vocab, nosync = rungs["+ vocab 50304, 1 micro-step"], rungs["+ no host sync per step"]
    assert vocab["settings"]["host_sync"] and not nosync["settings"]["host_sync"]
    assert np.allclose(nosync["losses"], vocab["losses"], rtol=1e-6, atol=0)
    assert not rungs["+ activation checkpointing"]["kept"]  # measured, then dropped
    assert not rungs["+ bf16 autocast"]["kept"]  # no bf16 units on a CPU:
    assert not rungs["+ flash attention (SDPA)"]["settings"]["bf16"]  # not carried on
    assert capstone_torch_runs["figures"] == ["07_capstone_torch.png",
                                              "07_capstone_torch_headline.png"]
    assert all(r["checks"].values()), r["checks"]


def test_capstone_torch_derived_numbers_recomputed(capstone_torch_runs):
    for name in ("waterfall", "headline", "ddp"):
        capstone_rederive(capstone_torch_runs[name])
    rungs = {x["name"]: x for x in capstone_torch_runs["ddp"]["rungs"]}
    alone = rungs["final rung, each GPU alone"]
    for name in ("+ DDP", "+ bf16 gradient all-reduce"):  # against 2 x one GPU alone
        scaling = rungs[name]["tokens_per_s"] / (2 * alone["tokens_per_s"])
        assert rungs[name]["scaling"] == pytest.approx(scaling, rel=1e-12), name


def test_capstone_torch_losses_track_the_baseline(capstone_torch_runs):
    waterfall = capstone_torch_runs["waterfall"]
    tolerance = 0.0015  # the lesson's LOSS_TOLERANCE, over the first 10 steps
    assert all(x["loss_rel_gap"] <= tolerance for x in waterfall["rungs"])
    assert waterfall["checks"]["losses_track_baseline"]


def test_capstone_torch_rungs_count_their_steps_and_their_compile(capstone_torch_runs):
    # every step is in the losses; a compile lands in the warm-up, never in a timed step
    waterfall = capstone_torch_runs["waterfall"]
    for rung in waterfall["rungs"] + capstone_torch_runs["ddp"]["rungs"]:
        name = rung["name"]
        steps = rung["warmup_steps"] + rung["timed_steps"] + rung["profiled_steps"]
        assert len(rung["losses"]) == steps, f"{name}: losses of steps not run or lost"
        assert rung["warmup_steps"] >= 1, f"{name}: no warm-up: a compile lands in the timing"
        assert rung["profiled_steps"] == 1, name
        assert len(rung["step_ms"]) * 5 >= rung["timed_steps"], name
        if not rung["settings"]["compile"]:
            assert rung["graphs"] == 0 and rung["compile_s"] < 5, name  # nothing compiles
        if rung["graphs"]:  # dynamo's capture alone takes ~0.4 s
            assert rung["compile_s"] > 0.05, f"{name}: its compile is not in the warm-up"
            assert rung["compile_s"] * 1e3 > max(rung["step_ms"]), (
                f"{name}: a timed step is slower than the compile: it compiled there")
    rungs = {x["name"]: x for x in waterfall["rungs"]}
    for name in ("+ torch.compile", "+ vocab 50304, 1 micro-step", CAPSTONE_FUSED):
        assert rungs[name]["graphs"] >= 1, f"{name}: no graph compiled in its warm-up"
    # "compiling" is said when, and only when, a rung compiles; then its measured time
    said = capstone_torch_runs["stdout"].split("\n   compiling")
    compiled = [rung for rung in waterfall["rungs"] if rung["graphs"]]
    assert len(said) - 1 == len(compiled)
    for text, rung in zip(said[1:], compiled):
        assert f"\n   compiled {rung['graphs']} graph: " in text, text[:300]  # 1: no "s"
    assert "1 graphs" not in capstone_torch_runs["stdout"]


def test_capstone_torch_each_technique_acts(capstone_torch_runs):
    rungs = {x["name"]: x for x in capstone_torch_runs["waterfall"]["rungs"]}
    fused_from = CAPSTONE_RUNGS.index("+ fused AdamW")
    for i, name in enumerate(CAPSTONE_RUNGS):  # the profiled step ran the fused kernel
        fused = rungs[name]["acts"]["fused_adamw_ran"]
        assert fused == (i >= fused_from), f"{name}: fused AdamW ran: {fused}, not as set"
    assert rungs["+ bf16 autocast"]["acts"]["logits_dtype"] == "torch.bfloat16"
    assert rungs["fp32 eager"]["acts"]["logits_dtype"] == "torch.float32"
    assert rungs["+ flash attention (SDPA)"]["acts"]["logits_dtype"] == "torch.float32"
    # TF32 on a CPU: the flag is set, and fp32 matmuls stay fp32 (no TF32 units)
    assert rungs["+ TF32"]["settings"]["tf32"]
    assert rungs["+ TF32"]["acts"]["fp32_matmul_rel_error"] < 1e-5
    # the fused classifier: no logits beside the loss from its rung on, the same losses
    # (chunked sums: rounding only), and the logits' bytes gone from the prediction
    for name in CAPSTONE_RUNGS:
        fused = rungs[name]["settings"]["fused_classifier"]
        assert rungs[name]["acts"]["logits_written"] == (not fused), name
    assert rungs[CAPSTONE_FUSED]["settings"]["fused_classifier"]
    fused, before = rungs[CAPSTONE_FUSED], rungs["+ no host sync per step"]
    assert np.allclose(fused["losses"], before["losses"], rtol=1e-5, atol=0)
    assert fused["activation_bytes"] < before["activation_bytes"]
    # the hook really sends 16-bit gradients: 2 bytes a parameter a step (fp16 on gloo)
    ddp = {x["name"]: x for x in capstone_torch_runs["ddp"]["rungs"]}
    config = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, vocab_size=4096)
    hook = ddp["+ bf16 gradient all-reduce"]["acts"]
    assert hook["allreduced_dtype"] == "torch.float16", "the hook sent no 16-bit gradients"
    assert hook["allreduced_bytes_per_step"] == 2 * param_count(config), (
        "the hook did not send 2 bytes a parameter a step")
    assert "allreduced_bytes_per_step" not in ddp["+ DDP"]["acts"]  # DDP's own fp32 path


def test_capstone_torch_checkpointing_lowers_activation_memory(capstone_torch_runs):
    waterfall = capstone_torch_runs["waterfall"]
    rungs = {x["name"]: x for x in waterfall["rungs"]}
    ckpt = rungs["+ activation checkpointing"]
    [before] = [x for x in rungs.values() if x["settings"] == dict(ckpt["settings"],
                                                                    checkpoint=False)]
    assert ckpt["activation_bytes"] < before["activation_bytes"]
    assert waterfall["checks"]["checkpointing_lowers_memory"]


def test_capstone_torch_time_split_adds_up_to_the_step(capstone_torch_runs):
    # the classes (and idle) partition the profiled step: they sum to its wall time
    for name in ("waterfall", "ddp"):
        result = capstone_torch_runs[name]
        for rung in result["rungs"]:
            split = rung["profile"]
            assert sorted(split) == sorted(CAPSTONE_CLASSES)
            assert all(seconds >= 0 for seconds in split.values()), rung["name"]
            assert sum(split.values()) == pytest.approx(rung["profile_step_s"], rel=1e-6)
            assert split["matmul"] > 0 and split["optimizer"] > 0, rung["name"]
        assert result["checks"]["time_split_adds_up"]


def test_capstone_torch_ddp_rungs(capstone_torch_runs):
    result = capstone_torch_runs["ddp"]
    rungs = {x["name"]: x for x in result["rungs"]}
    assert list(rungs) == CAPSTONE_DDP_RUNGS and result["world"] == 2
    ddp, bf16 = rungs["+ DDP"], rungs["+ bf16 gradient all-reduce"]
    alone = rungs["final rung, each GPU alone"]
    assert ddp["world"] == 2 and alone["world"] == 1 and bf16["settings"]["bf16_grads"]
    # alone: the batch in 2 micro-batches, each one rank's share: the same work per GPU
    assert alone["settings"]["accum"] == 2 and ddp["settings"]["accum"] == 1
    # DDP computes what one process computes on the whole batch: the same losses
    assert np.allclose(ddp["losses"], alone["losses"], rtol=1e-5, atol=0)
    assert bf16["loss_rel_gap"] <= 0.0015  # fp16 on gloo: the same bytes as bf16
    assert result["interconnect"] == "default"
    assert all(result["checks"].values()), result["checks"]
    assert capstone_torch_runs["ddp_figures"] == ["07_capstone_torch.png"]  # rank 0 alone


def test_capstone_torch_headline(capstone_torch_module, capstone_torch_runs):
    m = capstone_torch_module
    h = capstone_torch_runs["headline"]
    base, final = h["rungs"]
    assert base["settings"] == m.BASELINE
    # the final rung: every single-device rung kept, the fused classifier while it is kept
    assert final["settings"] == dict(m.settings_for("+ DDP", False), ddp=False)
    assert final["settings"]["compile"] and final["settings"]["pad_vocab"]
    assert final["settings"]["fused_classifier"] == m.is_kept(CAPSTONE_FUSED, False)
    assert not final["settings"]["checkpoint"] and not final["settings"]["ddp"]
    assert len(base["losses"]) == len(final["losses"]) == h["headline"]["steps"]
    assert base["losses"][-1] < base["losses"][0]  # it trains
    window = np.ones(20) / 20  # the lesson's SMOOTH
    smooth = np.convolve(final["losses"], window, mode="valid")
    smooth_base = np.convolve(base["losses"], window, mode="valid")
    curve = np.max(np.abs(smooth - smooth_base) / smooth_base)
    assert h["headline"]["curve_gap"] == pytest.approx(curve, rel=1e-9, abs=1e-15)
    assert h["headline"]["early_gap"] == final["loss_rel_gap"]
    ratio = base["ms_per_step"] / final["ms_per_step"]
    assert h["headline"]["time_ratio"] == pytest.approx(ratio, rel=1e-12)
    assert h["checks"] == {"headline_starts_the_same": True, "headline_same_curve": True}


def test_capstone_torch_headline_check_fails_on_broken_math(capstone_torch_module,
                                                            capstone_torch_runs,
                                                            monkeypatch):
    """The headline's 'starts the same' check: honest runs pass it; a loss computed on bf16
    logits, or a reported loss not divided by its micro-step count, fail it."""
    m = capstone_torch_module
    shared = capstone_torch_runs["shared"]
    base_losses = capstone_torch_runs["headline"]["rungs"][0]["losses"]
    final = dict(m.settings_for("+ DDP", False), ddp=False, compile=False)  # no compile

    def early_gap(settings):  # the rung's first losses, as train() records them
        _, step, _ = m.build(settings, shared)
        losses = []
        for x, y in shared.batches[:m.EARLY_STEPS]:
            losses.append(step(x, y).item())
        return m.loss_gap(losses, base_losses)

    assert early_gap(final) <= m.LOSS_TOLERANCE  # honest
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

    # the final rung's loss, fused or plain, on bf16 logits: the toy's loss, ~8.3, sits
    # where bf16's steps are 2**-4: rounding moves it up to ~0.4%
    monkeypatch.setattr(model_torch, "chunk_cross_entropy", chunk_on_bf16_logits)
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", on_bf16_logits)
    assert early_gap(final) > m.LOSS_TOLERANCE
    monkeypatch.undo()

    def forgets_to_divide(model, x, y, accum, bf16):
        total = torch.zeros(())
        for x_micro, y_micro in zip(x.chunk(accum), y.chunk(accum)):
            _, loss = model(x_micro, y_micro)
            (loss / accum).backward()
            total += loss.detach()
        return total

    monkeypatch.setattr(m, "accumulate", forgets_to_divide)
    assert early_gap(m.BASELINE) > 1.0  # 4 micro-steps: 4x the loss


def test_capstone_torch_accumulated_gradient_equals_full_batch(capstone_torch_module,
                                                               capstone_torch_runs,
                                                               monkeypatch):
    for name in ("waterfall", "ddp"):
        result = capstone_torch_runs[name]
        assert result["accumulation_rel_diff"] < 1e-4
        assert result["checks"]["accumulated_gradient_equals_full_batch"]
    # the check can fail: a step that forgets to divide by the micro-batch count is caught
    m, shared = capstone_torch_module, capstone_torch_runs["shared"]
    assert m.accumulation_error(shared) < m.ACCUM_TOLERANCE

    def forgets_to_divide(model, x, y, accum, bf16):
        total = torch.zeros(())
        for x_micro, y_micro in zip(x.chunk(accum), y.chunk(accum)):
            _, loss = model(x_micro, y_micro)
            loss.backward()
            total += loss.detach() / accum
        return total

    monkeypatch.setattr(m, "accumulate", forgets_to_divide)
    assert m.accumulation_error(shared) > 1.0  # off by 3x


def test_capstone_torch_gpu_results_recompute():
    """The committed GPU results: their derived numbers follow from their raw ones."""
    paths = sorted((HERE / "results" / "h200").glob("07_capstone_torch*.json"))
    for path in paths:
        result = json.loads(path.read_text())
        if "peak_flops" in result:  # the current format
            capstone_rederive(result)
            assert all(result["checks"].values()), (path.name, result["checks"])
        rungs = {x["name"]: x for x in result.get("rungs", [])}
        if "+ TF32" in rungs and "acts" in rungs["+ TF32"]:  # a GPU waterfall: TF32 acts
            tf32 = rungs["+ TF32"]["acts"]["fp32_matmul_rel_error"]
            fp32 = rungs["fp32 eager"]["acts"]["fp32_matmul_rel_error"]
            assert tf32 > 100 * fp32, f"{path.name}: TF32 did not round the fp32 matmuls"
            assert rungs["+ bf16 autocast"]["acts"]["logits_dtype"] == "torch.bfloat16"
            assert rungs["+ fused AdamW"]["acts"]["fused_adamw_ran"]


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--batch", "-4"], ["--batch", "6"],
                                  ["--batch", "100000"], ["--steps", "0"],
                                  ["--steps", "100000"], ["--device", "tpu"],
                                  ["--interconnect", "pcie"], ["--tokenizer", "spm"],
                                  ["--headline", "--batch", "2"],
                                  ["--quick", "--tokenizer", "gpt2"]])
def test_capstone_torch_bad_arguments_exit_2(capstone_torch_module, argv):
    assert refused(capstone_torch_module.parse_args, argv) == 2


def test_capstone_torch_bad_output_paths_refused_first(capstone_torch_module, tmp_path):
    m = capstone_torch_module
    (tmp_path / "file").write_text("x")

    def refused_path(argv):
        return refused(lambda a: m.check_paths(m.parse_args(a)), argv)

    assert refused_path(["--json", "", "--out", str(tmp_path)]) == 1
    assert refused_path(["--json", str(tmp_path)]) == 1  # a folder
    assert refused_path(["--out", ""]) == 1
    assert refused_path(["--out", str(tmp_path / "file")]) == 1  # a file
    assert refused_path(["--out", str(tmp_path / "file" / "out")]) == 1  # cannot be made
    # missing folders are made before the work; nothing is written in them yet
    argv = ["--json", str(tmp_path / "a" / "r.json"), "--out", str(tmp_path / "b")]
    assert refused_path(argv) is None
    assert (tmp_path / "a").is_dir() and not any((tmp_path / "b").iterdir())


@pytest.mark.parametrize("content", ["missing", "folder", b"", b"0123456789", b"\x7fELF\x02\x01"
                                     + bytes(range(256)) * 4])
def test_capstone_torch_bad_data_refused_without_a_cache(capstone_torch_module, tmp_path, content):
    path = tmp_path / "data"
    if content == "folder":
        path.mkdir()
    elif content != "missing":
        path.write_bytes(content)
    with pytest.raises(SystemExit) as refusal:
        capstone_torch_module.load_tokens(str(path), "bytes", 18, cache_dir=tmp_path / "cache")
    assert isinstance(refusal.value.code, str) and refusal.value.code.startswith("error: --data")
    assert "\n" not in refusal.value.code  # one line
    assert not list(tmp_path.glob("cache/*"))  # nothing left behind


def test_capstone_torch_empty_cache_is_treated_as_absent(capstone_torch_module, tmp_path):
    data, cache = small_text(tmp_path), tmp_path / "cache"
    tokens, _ = capstone_torch_module.load_tokens(str(data), "bytes", 18, cache_dir=cache)
    [cached] = cache.glob("tokens-*.npy")
    cached.write_bytes(b"")  # what a Ctrl-C during the first run could leave
    again, _ = capstone_torch_module.load_tokens(str(data), "bytes", 18, cache_dir=cache)
    assert np.array_equal(again, tokens) and cached.stat().st_size > 0


def test_capstone_torch_tokenizer_without_network(capstone_torch_module, tmp_path,
                                                  monkeypatch, capsys):
    """No cached BPE files, no network: one line saying how to cache them, then bytes;
    --tokenizer bytes never looks; --tokenizer gpt2 refuses. No test opens a socket."""
    m = capstone_torch_module

    def no_network(*args, **kwargs):
        raise OSError("no network in the tests")

    monkeypatch.setattr(m.socket, "create_connection", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    assert m.gpt2_encoding("bytes") is None and capsys.readouterr().out == ""
    assert m.gpt2_encoding("auto") is None
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and "TIKTOKEN_CACHE_DIR" in said[0] and "UTF-8 bytes" in said[0]
    with pytest.raises(SystemExit) as refusal:
        m.load_tokens(str(small_text(tmp_path)), "gpt2", 18, cache_dir=tmp_path / "cache")
    assert refusal.value.code.startswith("error: --tokenizer gpt2")


def start_capstone_torch_ctrl_c(tmp_path, environ):
    """Ctrl-C once the work has begun (its first line printed), then Ctrl-C a moment after
    start, while torch is still importing."""
    at_work = ctrl_c_after_first_line("07_capstone_torch.py", "--quick", "--device", "cpu",
                                      "--data", str(small_text(tmp_path)), "--out",
                                      str(tmp_path / "out"), tmp_path=tmp_path, environ=environ)
    importing = interrupt("07_capstone_torch.py", "--quick", "--device", "cpu", after=1.0,
                          tmp_path=tmp_path, environ=environ)
    return at_work, importing


capstone_torch_ctrl_c = waits_for("capstone_torch_ctrl_c")


def test_capstone_torch_ctrl_c_one_line_exit_130(capstone_torch_ctrl_c):
    (code, err), _ = capstone_torch_ctrl_c
    assert code == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err


def test_capstone_torch_ctrl_c_while_importing(capstone_torch_ctrl_c):
    # Ctrl-C a moment after start, while torch is still importing: the same one line
    _, result = capstone_torch_ctrl_c
    assert result.returncode == 130, result.stderr[-2000:]
    assert result.stderr.strip() == "interrupted"


# ---------------------------------------------------------------------------------------
# 07_capstone_jax.py: the waterfall on 4 simulated CPU devices, --headline on one, and two
# runs that get Ctrl-C, all started with the session; the mutations in this process. Every
# derived number is recomputed.

JAX_CAPSTONE = "07_capstone_jax.py"


def start(tmp_path, *args, devices=None, environ=None, forked=True):
    """Start `--quick --device cpu --tokenizer bytes --json --out *args` without waiting."""
    result = tmp_path / "result.json"
    proc = launch(JAX_CAPSTONE, "--quick", "--device", "cpu", "--tokenizer", "bytes", "--json",
                  str(result), "--out", str(tmp_path / "out"), *args, tmp_path=tmp_path,
                  devices=devices, environ=environ, forked=forked)[0]
    return proc, result


def start_capstone_jax_waterfall(tmp_path, environ):
    """The --quick waterfall on 4 simulated devices: (its JSON, its folder, its stdout)."""
    proc, result = start(tmp_path, "--data", str(small_text(tmp_path)), devices=4,
                         environ=environ)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    return json.loads(result.read_text()), tmp_path, out


def start_capstone_jax_headline(tmp_path, environ):
    """--quick --headline on one device: (its JSON, its folder, its stdout)."""
    proc, result = start(tmp_path, "--data", str(small_text(tmp_path)), "--headline",
                         environ=environ)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    return json.loads(result.read_text()), tmp_path, out


@pytest.fixture(scope="module")
def capstone_jax_lesson():
    return load_lesson(JAX_CAPSTONE)


def interrupt_after_first_line(proc):
    """Ctrl-C as a terminal sends it, once the run is under way (its first line out)."""
    for line in proc.stdout:
        if line.startswith("device:"):
            break
    os.killpg(proc.pid, signal.SIGINT)


def start_capstone_jax_ctrl_c(tmp_path, environ):
    """Two runs on the stdlib's text: Ctrl-C inside the imports, and once the work is under
    way. {name: (exit code, stderr)}."""
    procs = {"ctrl_c_early": start(tmp_path / "early", environ=environ, forked=False)[0],
             "ctrl_c": start(tmp_path / "later", environ=environ)[0]}
    time.sleep(1)
    os.killpg(procs["ctrl_c_early"].pid, signal.SIGINT)  # inside its imports
    interrupt_after_first_line(procs["ctrl_c"])
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = (proc.returncode, err)
    return results


capstone_jax_ctrl_c = waits_for("capstone_jax_ctrl_c")


@pytest.fixture(scope="module")
def capstone_jax(capstone_jax_lesson, early):
    """The mutations, in this process; with them, once it has ended, the waterfall the
    session started."""
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        results["forgets_to_divide"] = forgets_to_divide_error(capstone_jax_lesson, patch)
    for hook in ("cross_entropy", "chunk_cross_entropy"):
        with pytest.MonkeyPatch.context() as patch:
            results[hook] = bf16_loss_acts(capstone_jax_lesson, patch, hook)
    results["waterfall"] = early["capstone_jax"].result()
    return results


def toy_shared(lesson):
    """The Shared state of a --quick run on one CPU device, made without setup()."""
    sizes = lesson.QUICK
    torch.manual_seed(0)
    init = lesson.TorchGPT(lesson.model_config(sizes, dict(lesson.BASELINE,
                                                           pad_vocab=True))).state_dict()
    tokens = np.arange(1000, dtype=np.uint16) % 256
    options = dict(xla_backend_optimization_level=0, xla_cpu_use_fusion_emitters=False)
    return lesson.Shared(sizes, lesson.jax.devices("cpu")[:1], False, tokens, init, "xla",
                         options)


def jax_rungs(out):
    return {r["name"]: r for r in out["rungs"]}


def jax_rederive(out):
    """Every derived number of a JSON recomputed from its raw measurements."""
    base = out["rungs"][0]
    peak = out["peak_flops"]
    for r in out["rungs"]:
        ms = float(np.median(r["step_ms"]))
        assert r["ms_per_step"] == pytest.approx(ms, rel=1e-12), "ms/step: the timed median"
        tokens_per_s = out["tokens_per_step"] / (ms / 1e3)
        assert r["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-12)
        assert r["speedup"] == pytest.approx(base["ms_per_step"] / ms, rel=1e-12), \
            f"{r['name']}: speed-up not measured against the baseline rung"
        per_device = tokens_per_s * out["flops_per_token"] / r["world"]
        assert r["mfu_measured_peak"] == pytest.approx(per_device / peak["measured"]), \
            f"{r['name']}: MFU is per device (world {r['world']}) over the measured peak"
        assert r["mfu_datasheet"] is None and peak["datasheet"] is None  # a CPU: none
        gaps = [abs(a - b) / b for a, b in zip(r["losses"][:10], base["losses"][:10])]
        assert r["loss_rel_gap"] == pytest.approx(max(gaps), rel=1e-12, abs=1e-15)
        spread = max(r["step_ms"]) - min(r["step_ms"])
        busy = spread > ms or per_device > 1.1 * peak["measured"]
        assert r["unreliable"] == (busy or base["unreliable"])
        assert r["binds"] == max(r["profile"], key=r["profile"].get)
        if r["peak_memory_bytes"] is None:  # the un-jitted rung on a CPU: none
            assert r["fits_24gb"] is None
        else:
            assert r["fits_24gb"] == (r["peak_memory_bytes"] < 23 * 2**30)


def test_capstone_jax_every_rung_runs_and_reports(capstone_jax, capstone_jax_lesson):
    lesson = capstone_jax_lesson
    out, tmp_path, stdout = capstone_jax["waterfall"]
    assert out["lesson"] == "07_capstone_jax" and out["quick"] and out["device"]["count"] == 4
    assert [r["name"] for r in out["rungs"]] == [name for name, _, _ in lesson.RUNGS]
    assert out["skipped"] == {}
    for r in out["rungs"]:  # every rung ran with its own settings
        assert r["settings"] == lesson.settings_for(r["name"], False)
        assert r["kept"] == lesson.is_kept(r["name"], False)  # a CPU keeps no bf16
        steps = r["warmup_steps"] + r["timed_steps"] + r["profiled_steps"]
        assert len(r["losses"]) == steps, (f"{r['name']}: {len(r['losses'])} losses for "
                                           f"{steps} steps (warm-up + timed + profiled)")
        assert r["warmup_steps"] >= 1, f"{r['name']}: no warm-up before the timed steps"
        window = r["warmup_steps"]  # a call's steps: 1, or a window without host syncs
        assert r["profiled_steps"] == window and r["timed_steps"] == len(r["step_ms"]) * window
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and r["mfu_measured_peak"] > 0
    rungs = jax_rungs(out)
    base, jit = rungs["un-jitted (op-by-op)"], rungs["+ jax.jit (whole step)"]
    assert base["settings"] == lesson.BASELINE and base["compile_s"] == 0
    assert jit["compile_s"] > 0, "the jitted rung's compile was measured"
    # "compiling" is said once per program that really compiles, each with its time after it
    compiles = [r for r in out["rungs"] if r["compile_s"] > 0]
    assert stdout.count("compiling the whole step") == len(compiles) == stdout.count(
        "compiled 1 graph in")
    assert base["settings"]["precision"] == "highest" and not base["settings"]["pad_vocab"]
    # waiting for the device less often changes when Python waits, not what is computed
    vocab, nosync = rungs["+ vocab 50304, 1 micro-step"], rungs["+ no host sync per step"]
    assert vocab["settings"]["host_sync"] and not nosync["settings"]["host_sync"]
    common = len(vocab["losses"])
    assert nosync["losses"][:common] == vocab["losses"]  # the same program: the same numbers
    cublas = rungs["+ cuBLAS for every matmul"]  # a kernel choice: the same math
    assert cublas["settings"]["triton_gemm"] is False
    assert cublas["losses"] == nosync["losses"]  # (a CPU compiles them the same)
    assert lesson.FINAL == "+ cuBLAS for every matmul"
    final = rungs[lesson.FINAL]
    fused = rungs["+ fused classifier (logits never written)"]  # no logits: the same loss
    assert fused["settings"] == dict(final["settings"], fused_classifier=True)
    assert not fused["kept"]  # a detour: measured, not carried forward
    assert np.allclose(fused["losses"], cublas["losses"], rtol=1e-5, atol=0)
    shard = rungs[lesson.SHARDED]  # the detours are dropped: it builds on the final rung
    assert shard["settings"] == dict(lesson.settings_for(lesson.FINAL, False), shard=True)
    assert lesson.settings_for(lesson.SHARDED, True) == dict(
        lesson.settings_for(lesson.FINAL, True), shard=True)  # on a GPU: bf16 kept too
    assert shard["world"] == 4 and all(r["world"] == 1 for r in out["rungs"][:-1])
    # the same batches, their rows split 4 ways: the same losses to rounding
    assert np.allclose(shard["losses"], final["losses"], rtol=1e-5, atol=0)
    assert out["flops_per_token"] > 0 and out["peak_flops"]["measured"] > 0
    assert all(out["checks"].values()), out["checks"]
    assert (tmp_path / "out" / "07_capstone_jax.png").exists()
    jax_rederive(out)


def test_capstone_jax_losses_track_the_baseline(capstone_jax, capstone_jax_lesson):
    out, _, _ = capstone_jax["waterfall"]
    assert out["checks"]["losses_track_baseline"]
    for r in out["rungs"]:
        assert r["loss_rel_gap"] <= capstone_jax_lesson.LOSS_TOLERANCE, r["name"]


def test_capstone_jax_each_technique_acts(capstone_jax, capstone_jax_lesson):
    # not only configured: seen in the compiled programs and the buffers
    lesson = capstone_jax_lesson
    out, _, _ = capstone_jax["waterfall"]
    rungs = jax_rungs(out)
    for r in out["rungs"]:
        assert r["acts"]["donated_inputs_deleted"] == r["settings"]["donate"], r["name"]
        if not r["settings"]["jit"]:
            continue
        acts = r["acts"]
        assert (acts["bf16_dots"] > 0) == r["settings"]["bf16"], (r["name"], acts)
        assert (acts["all_reduces"] > 0) == r["settings"]["shard"], (r["name"], acts)
        assert acts["f32_vocab_exps"] > 0, f"{r['name']}: the loss's softmax is not in fp32"
    checkpointed = rungs["+ activation checkpointing"]
    assert checkpointed["activation_bytes"] < rungs[lesson.FINAL]["activation_bytes"]
    assert out["checks"]["checkpointing_lowers_memory"]
    fused = rungs["+ fused classifier (logits never written)"]  # no B x T x V kept for
    # the backward
    logits = out["tokens_per_step"] * lesson.QUICK.padded_vocab * 4  # fp32
    saved = rungs["+ cuBLAS for every matmul"]["activation_bytes"] - fused["activation_bytes"]
    assert saved >= logits, (saved, logits)


def forgets_to_divide_error(lesson, monkeypatch):
    """accumulation_error with a step that lost its "/ accum"."""
    right = lesson.accumulate

    def forgets_to_divide(model, x, y, accum, jitted=True):
        loss, grads = right(model, x, y, accum, jitted)
        return loss, lesson.jax.tree.map(lambda g: g * accum, grads)

    monkeypatch.setattr(lesson, "accumulate", forgets_to_divide)
    return lesson.accumulation_error(toy_shared(lesson))


def test_capstone_jax_accumulated_gradient_is_the_full_batch_gradient(capstone_jax):
    # the check that catches a lost "/ accum" (which the losses do not see: AdamW's update
    # is scale-free); the lesson exits 1 if it fails
    out, _, _ = capstone_jax["waterfall"]
    assert out["accumulation_rel_diff"] < 1e-4
    assert out["checks"]["accumulated_gradient_equals_full_batch"]
    assert capstone_jax["forgets_to_divide"] > 1  # 4x the gradient: error 3


def test_capstone_jax_profile_splits_the_step(capstone_jax):
    # the kernel classes plus idle add up to the profiled step, and the un-jitted rung, which
    # dispatches every op from Python, is bound by idle time
    out, _, _ = capstone_jax["waterfall"]
    rungs = jax_rungs(out)
    for r in out["rungs"]:
        p = r["profile"]
        assert abs(sum(p.values()) / r["profile_step_s"] - 1) < 1e-6, (r["name"], p)
        assert sum(p.values()) - p["idle"] > 0 and min(p.values()) >= 0
    base = rungs["un-jitted (op-by-op)"]["profile"]
    assert max(base, key=base.get) == "idle"
    jitted = rungs["+ jax.jit (whole step)"]["profile"]  # the step's named scopes are found
    assert jitted["matmul"] > 0 and jitted["loss"] > 0 and jitted["optimizer"] > 0
    assert rungs["+ data-parallel sharding"]["profile"]["communication"] > 0  # the all-reduce


capstone_jax_headline = waits_for("capstone_jax_headline")


def test_capstone_jax_headline(capstone_jax_headline, capstone_jax_lesson):
    # the first jitted rung and the final rung, the same steps from one init on the same
    # batches: their smoothed loss curves agree; every number recomputed from the losses
    lesson = capstone_jax_lesson
    out, tmp_path, _ = capstone_jax_headline
    h = out["headline"]
    base, final = out["rungs"]
    assert [base["name"], final["name"]] == h["rungs"] == ["+ jax.jit (whole step)", lesson.FINAL]
    for r in (base, final):
        assert len(r["losses"]) == h["steps"] == (r["warmup_steps"] + r["timed_steps"]
                                                  + r["profiled_steps"])
    early = h["early_steps"]
    gaps = np.abs(np.subtract(final["losses"], base["losses"])) / np.array(base["losses"])
    assert h["early_gap"] == pytest.approx(max(gaps[:early]), rel=1e-9)
    kernel = np.ones(h["smooth"]) / h["smooth"]
    smooth_base = np.convolve(base["losses"], kernel, "valid")
    smooth_final = np.convolve(final["losses"], kernel, "valid")
    curve = max(np.abs(smooth_final - smooth_base) / smooth_base)
    assert h["curve_gap"] == pytest.approx(curve, rel=1e-9)
    assert h["time_ratio"] == pytest.approx(base["ms_per_step"] / final["ms_per_step"])
    assert h["loss_tolerance"] == lesson.LOSS_TOLERANCE and h["curve_tolerance"] == 0.04
    assert h["early_steps"] == lesson.EARLY_STEPS and h["smooth"] == lesson.SMOOTH
    assert out["checks"] == {"headline_starts_the_same": h["early_gap"] <= h["loss_tolerance"],
                             "headline_same_curve": curve <= h["curve_tolerance"],
                             "loss_softmax_in_fp32": True}
    assert all(out["checks"].values()), out["checks"]
    assert (tmp_path / "out" / "07_capstone_jax_headline.png").exists()
    jax_rederive(out)


def bf16_loss_acts(lesson, monkeypatch, hook):
    """The evidence of a bf16 rung's program whose loss (model_jax's `hook`) takes the
    logits as they come, in bf16: the plain loss (the final rung's) or the fused
    classifier's."""
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
    name = "+ cuBLAS for every matmul"
    if hook == "chunk_cross_entropy":
        name = "+ fused classifier (logits never written)"
    settings = lesson.settings_for(name, True)  # bf16 compute, as on a GPU
    shared = toy_shared(lesson)
    step, state, batches, _ = lesson.build(settings, shared, shared.devices, 4, 1)
    program = lesson.compile_step(step, settings, (state, *batches[0]), shared.options)
    acts, _, _ = lesson.evidence(program, lesson.model_config(shared.sizes, settings).vocab_size)
    return acts


@pytest.mark.parametrize("hook", ["cross_entropy", "chunk_cross_entropy"])
def test_capstone_jax_bf16_logits_in_the_loss_fail_the_check(capstone_jax, capstone_jax_lesson,
                                                             hook):
    # broken math that the loss's value barely shows (bf16 rounds it by ~0.3%, within the
    # honest spread of a long run): the compiled program shows it
    acts = capstone_jax[hook]
    assert acts["bf16_dots"] > 0 and acts["f32_vocab_exps"] == 0, acts
    assert not capstone_jax_lesson.loss_in_fp32([dict(acts=acts)])  # (the right loss: every
    # rung's, test_capstone_jax_each_technique_acts)


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--batch", "-4"], ["--batch", "6"],
                                  ["--batch", "4096"], ["--steps", "0"], ["--steps", "-1"],
                                  ["--steps", "100000"], ["--batch", "x"],
                                  ["--headline", "--scaling"], ["--tokenizer", "bpe"],
                                  ["--device", "tpu"]])
def test_capstone_jax_bad_flags_exit_2(capstone_jax_lesson, argv):
    assert refused(capstone_jax_lesson.parse_args, argv) == 2


def test_capstone_jax_bad_output_paths_are_refused_first(capstone_jax_lesson, tmp_path):
    lesson = capstone_jax_lesson

    def check(argv):
        return refused(lambda a: lesson.check_paths(lesson.parse_args(a)), argv)

    (tmp_path / "file").write_text("x")
    assert check(["--json", ""]) == 1
    assert check(["--json", str(tmp_path)]) == 1
    assert check(["--out", str(tmp_path / "file")]) == 1
    assert check(["--out", ""]) == 1
    assert check(["--json", str(tmp_path / "new" / "r.json")]) is None
    assert (tmp_path / "new").is_dir()  # a missing folder is made
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert check(["--out", str(locked)]) == 1


@pytest.mark.parametrize("data", ["missing", "folder", "empty", "tiny", "binary"])
def test_capstone_jax_bad_data_is_refused_without_a_cache(capstone_jax_lesson, tmp_path, data):
    path = tmp_path / data
    if data == "folder":
        path.mkdir()
    elif data != "missing":
        path.write_bytes({"empty": b"", "tiny": b"0123456789",
                          "binary": bytes(range(256)) * 64}[data])
    with pytest.raises(SystemExit) as refusal:
        capstone_jax_lesson.load_tokens(str(path), "bytes", 34, cache_dir=tmp_path / "cache")
    assert str(refusal.value.code).startswith(f"error: --data {path}")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("when", ["ctrl_c_early", "ctrl_c"])
def test_capstone_jax_ctrl_c_is_one_line_and_exit_130(capstone_jax_ctrl_c, when):
    returncode, err = capstone_jax_ctrl_c[when]
    assert returncode == 130 and err.strip().splitlines() == ["interrupted"], err[-2000:]


# ---------------------------------------------------------------------------------------
# The runs the session starts at once (see `early`), in the order the tests need them: the
# fixture each one is for, and the function that runs it.

EARLY_RUNS = {  # two queues, each run in its turn: the long runs, and the short ones
    "long": {
        "compile_run": start_compile_run,  # its compiles are cold in CI: ~40 s
        "jax_multi_process": start_jax_multi_process,
        "jax_three_devices": start_jax_three_devices,
        "capstone_jax": start_capstone_jax_waterfall,
    },
    "short": {
        "roofline": start_roofline,
        "hardware": start_hardware,
        "roofline_ctrl_c": start_roofline_ctrl_c,
        "hardware_ctrl_c": start_hardware_ctrl_c,
        "memory_run": start_memory_run,
        "compile_ctrl_c": start_compile_ctrl_c,
        "memory_ctrl_c": start_memory_ctrl_c,
        "jax_own_flags": start_jax_own_flags,
        "ctrl_c_while_importing": start_ctrl_c_while_importing,
        "torchrun_ctrl_c": start_torchrun_ctrl_c,
        "capstone_torch_ctrl_c": start_capstone_torch_ctrl_c,
        "capstone_jax_ctrl_c": start_capstone_jax_ctrl_c,
        "capstone_jax_headline": start_capstone_jax_headline,
    },
}
