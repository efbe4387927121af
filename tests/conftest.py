"""Shared fixtures: tiny recipes and running the real `accord` command in a subprocess."""

from __future__ import annotations

import contextlib
import copy
import os
import platform
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

# The platform module asks `uname -p` once per process, on first use (DeepSpeed's import does,
# and MLflow's, which DeepSpeed imports when it is installed): asked here, before any test, so
# that a unit test importing such a library (saving a model: transformers -> accelerate ->
# DeepSpeed) starts no process.
platform.processor()

# One OpenMP thread per process, here and in every run a test starts: the suite runs a pytest
# worker per core, each starting runs of its own, so a second thread per process only
# oversubscribes the cores, and OpenMP's spinning waits then cost far more than they save (a
# tiny in-process training step took 40x longer with two threads on a busy 2-core machine).
# Tests of accord's own thread split set the variable themselves.
os.environ["OMP_NUM_THREADS"] = "1"

# A model and data small enough that a 2-process run takes seconds: a 2-layer Llama on
# accord's generated additions (sequences of 6-13 tokens, so padding varies per micro-batch).
TINY_RECIPE = {
    "seed": 7,
    "model": {
        "config": {
            "architecture": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        },
        "tokenizer": "byte",
    },
    "task": "sft",
    "data": {
        "generate": {"kind": "addition", "train_examples": 512, "eval_examples": 32, "max_digits": 3},
        "max_length": 32,
    },
    "batch": {"global_batch_size": 32, "micro_batch_size": 8},
    "optim": {"lr": 3.0e-3, "warmup_steps": 2, "schedule": "cosine", "max_grad_norm": 1.0},
    "train": {"max_steps": 10, "log_every": 5},
    # device pinned: on a GPU machine "auto" would take the GPUs and ignore processes, turning
    # the 2-process layouts into 1-process runs.
    "engine": {"strategy": "ddp", "precision": "no", "processes": 2, "device": "cpu"},
    "output": {"dir": "runs/tiny"},
}


# Where the tests' recipes cache their tokenized data: the session's temp folder, never the
# user's ~/.cache/accord/data (set by the data_cache fixture; a script a test starts that
# imports TINY_RECIPE from here inherits it through this variable).
_DATA_CACHE_VARIABLE = "ACCORD_TEST_DATA_CACHE"
if os.environ.get(_DATA_CACHE_VARIABLE):
    TINY_RECIPE["data"]["cache_dir"] = os.environ[_DATA_CACHE_VARIABLE]


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory) -> Path:
    """One data cache per session (a fresh CI machine's, shared by the session's runs as
    ~/.cache would be) in the session's temp folder, so that tests neither read nor fill the
    user's cache. Tests of the cache itself use a folder of their own."""
    folder = tmp_path_factory.mktemp("data-cache")
    TINY_RECIPE["data"]["cache_dir"] = str(folder)
    os.environ[_DATA_CACHE_VARIABLE] = str(folder)
    yield folder
    del TINY_RECIPE["data"]["cache_dir"], os.environ[_DATA_CACHE_VARIABLE]


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)


def accord_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"  # the tests must never touch a hub
    env["PYTHONUNBUFFERED"] = "1"
    # The suite tests the CPU (gloo) paths with several processes: on a GPU machine a recipe
    # that leaves engine.device open would otherwise take the GPUs (one process per GPU).
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# ---------------------------------------------------------------- subprocesses and their trees

# The test being set up or run (the fixtures it requests included, session-wide ones too):
# the process helpers check its `distributed` mark.
_current_test: pytest.Item | None = None
# The tiers (pyproject's markers): a test that starts any process is marked `subprocess`, one
# whose processes train (workers) `distributed`; the rest is the unit tier, which starts none.
_PROCESS_MARKS = ("subprocess", "distributed")
# Processes started by start_process and not finished yet: killed, with all they started, when
# the test ends (a failed assertion must not leave a launcher and its workers running).
_started: list[subprocess.Popen] = []


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    # The shared reference runs train in worker processes: whoever asks for one is distributed.
    for item in items:
        if {"tiny_reference", "one_process_reference"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.distributed)


class _FilesThatTrainMostFirst:
    """pytest-xdist (--dist loadfile) hands out whole files in collection order; alphabetically
    the files that train the most came last and one worker trained them alone while
    the other had nothing left. The files with the most training tests first, the others
    filling the end."""

    @pytest.hookimpl(trylast=True)  # after pytest's own fixture-based ordering and -m
    def pytest_collection_modifyitems(self, items):
        weight: dict[str, int] = {}
        for item in items:
            file = item.nodeid.split("::")[0]
            weight[file] = weight.get(file, 0) + (item.get_closest_marker("distributed") is not None)
        items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])  # stable: a file keeps its order


def pytest_configure(config):
    config.pluginmanager.register(_FilesThatTrainMostFirst(), "accord-file-order")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _current_test
    _current_test = item


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A unit test (neither `subprocess` nor `distributed`) that starts a process, in its
    fixtures or its body, fails saying which mark to add: the unit tier stays one process."""
    if any(item.get_closest_marker(mark) for mark in _PROCESS_MARKS):
        yield
        return
    with _no_processes():
        yield


@contextlib.contextmanager
def _no_processes():
    """Every way a test may start a process (subprocess, multiprocessing, a fork, a shell)
    replaced by a test failure naming the marks that allow it."""
    import multiprocessing.process

    def refuse(what: str):
        def refused(*args, **kwargs):
            command = f" {args[1]}" if what == "subprocess.Popen" else ""  # _execute_child(self, args, ...)
            pytest.fail(
                f"this unit test started a process ({what}{command}): mark it @pytest.mark.subprocess, "
                "or @pytest.mark.distributed if the process trains"
            )

        return refused

    with pytest.MonkeyPatch.context() as mp:
        for owner, name, what in [
            (subprocess.Popen, "_execute_child", "subprocess.Popen"),  # run, check_output, os.popen ... too
            (multiprocessing.process.BaseProcess, "start", "multiprocessing"),  # every start method, pools too
            (os, "fork", "os.fork"),
            (os, "forkpty", "os.forkpty"),
            (os, "posix_spawn", "os.posix_spawn"),
            (os, "posix_spawnp", "os.posix_spawnp"),
            (os, "system", "os.system"),
        ]:
            if hasattr(owner, name):
                mp.setattr(owner, name, refuse(what))
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    while _started:
        kill_tree(_started.pop())


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    global _current_test
    _current_test = None


def _is_distributed_test() -> bool:
    return _current_test is None or _current_test.get_closest_marker("distributed") is not None


_TREE_VARIABLE = "ACCORD_TEST_PROCESS_TREE"


def _tree_members(token: str) -> list[int]:
    """Every live process that inherited `token` in its environment: the started process and
    all it started, even those in sessions of their own (torch's elastic agent starts each
    worker with start_new_session) or orphaned by a launcher that died."""
    mark = f"{_TREE_VARIABLE}={token}".encode()
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    members.append(int(entry.name))
            except OSError:
                pass
    return members


def kill_tree(proc: subprocess.Popen) -> tuple[str | None, str | None]:
    """SIGKILL `proc` and everything it started (so a launcher's workers do not outlive it);
    returns what it printed that was not read yet."""
    import signal

    for _ in range(5):  # again, in case one forked while the others were being killed
        pids = [proc.pid] if proc.poll() is None else []
        pids += [pid for pid in _tree_members(proc.tree_token) if pid != proc.pid]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        return proc.communicate(timeout=30)
    except (subprocess.TimeoutExpired, ValueError):
        return None, None


def start_process(
    command: list[str], *, merge_output: bool = False, env: dict[str, str] | None = None, **popen
) -> subprocess.Popen:
    """Popen in a new session, its tree tagged so that all of it is killed on a timeout, or
    when the test ends if it is still running."""
    import uuid

    token = uuid.uuid4().hex
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=(os.environ if env is None else env) | {_TREE_VARIABLE: token},
        **popen,
    )
    proc.tree_token = token
    _started.append(proc)
    return proc


class ProcessTimeout(subprocess.TimeoutExpired):
    def __str__(self) -> str:
        printed = "\n".join(part[-4000:] for part in (self.output, self.stderr) if part)
        return f"{super().__str__()} Killed it and every process it started. It printed:\n{printed}"


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of `proc` once it ends; after `timeout` seconds it and all it started
    are killed and TimeoutExpired is raised with what it printed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = kill_tree(proc)
        raise ProcessTimeout(proc.args, timeout, output=out, stderr=err) from None
    finally:
        if proc in _started:
            _started.remove(proc)
    return out, err


def run_process(command: list[str], *, timeout: float, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) that kills the whole tree on timeout."""
    proc = start_process(command, **popen)
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def run_accord(
    *args: str | Path,
    cwd: Path | None = None,
    timeout: float = 300,
    launcher: list[str] | None = None,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `python -m accord ARGS` (or under `launcher`) and return the finished process.
    A test that gets as far as training (a worker announces its batch) must be marked
    `distributed`, so that `-m "not distributed"` stays a fast tier without workers."""
    command = (launcher or [sys.executable]) + ["-m", "accord", *map(str, args)]
    proc = run_process(command, cwd=cwd, env=accord_env() | (env_extra or {}), timeout=timeout)
    if not _is_distributed_test() and "accord: batch " in proc.stdout + proc.stderr:
        pytest.fail("this test started training workers: mark it @pytest.mark.distributed")
    return proc


class ReachedWorkerStart(AssertionError):
    """run_accord_here's command got past the launcher's own checks."""


def run_accord_here(*args: str | Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`accord ARGS` run by cli.main in this process, for the refusals the launcher makes
    before any worker starts: the same lines and exit code as run_accord without a Python
    start and accord's imports (~1.5 s of CPU each). Reaching the workers' start fails the
    test (such a refusal is not the launcher's: use run_accord). The environment is put back
    afterwards, and the once-per-process refusal line is allowed before and after."""
    import io

    from accord.cli import main as cli
    from accord.launch import agent as launch
    from accord.launch import refusal_relay as refusals

    def no_workers(*_, **__):
        raise ReachedWorkerStart(f"accord {' '.join(map(str, args))} got as far as starting workers")

    from accord.launch import ray_train

    out, err, saved_env, real_run = io.StringIO(), io.StringIO(), dict(os.environ), launch.run
    real_ray_run = ray_train.RaySession
    env = accord_env() | (env_extra or {})
    os.environ.clear()
    os.environ.update(env)
    launch.run = ray_train.RaySession = no_workers
    refusals.forget_claim()  # an earlier test in this process may have printed a refusal
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as e:  # argparse: --help, usage errors
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    finally:
        launch.run, ray_train.RaySession = real_run, real_ray_run
        os.environ.clear()
        os.environ.update(saved_env)
        refusals.forget_claim()
    return subprocess.CompletedProcess(["accord", *map(str, args)], code, out.getvalue(), err.getvalue())


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )


def start_accord(
    *args: str | Path, cwd: Path | None = None, env_extra: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start `python -m accord ARGS` in its own session, stdout and stderr merged, so a
    test can signal it mid-run."""
    if not _is_distributed_test():
        pytest.fail("start_accord starts training workers: mark the test @pytest.mark.distributed")
    env = accord_env() | (env_extra or {})
    return start_process([sys.executable, "-m", "accord", *map(str, args)], merge_output=True, cwd=cwd, env=env)


def wait_for(condition, timeout: float = 120, interval: float = 0.1) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)


def logged_steps(out: Path) -> int:
    """The highest training step in out/metrics.jsonl so far (0 if none)."""
    import json

    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if '"kind": "train"' in line]
    return max(steps, default=0)


def final_params(out: Path):
    return read_safetensors_folder(out / "final")


def read_safetensors_folder(folder: Path) -> dict:
    """Every tensor of a save_pretrained folder: one model.safetensors, or the shards its
    model.safetensors.index.json lists."""
    import json

    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(folder / "model.safetensors")
    out = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out |= load_file(folder / shard)
    return out


def max_param_diff(a, b) -> float:
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    if os.environ.get("ACCORD_DIFF_LOG"):  # the measured figures, for a closing note
        with open(os.environ["ACCORD_DIFF_LOG"], "a") as log:
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{diff:.3g}\n")
    return diff


def records(out: Path, kind: str) -> list[dict]:
    """The run's metrics.jsonl records of one kind (train, eval, model_state, memory...), in order."""
    from accord.observe.metrics import read_metrics

    return [r for r in read_metrics(out) if r["kind"] == kind]


def step_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out, "train")}


# ---------------------------------------------------------------- small data for every task


def save_tiny_byte_llama(folder: Path, max_positions: int) -> Path:
    """A seeded 2-layer Llama with accord's byte tokenizer, built by transformers and saved as a
    model folder (what a Trainer or TRL job would name by hub id); returns the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from accord.models.build import build_byte_tokenizer

    torch.manual_seed(0)
    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task_data(folder: Path, task: str) -> dict:
    """Deterministic little data sets (and the recipe overrides to use them) per task."""
    import random

    rng = random.Random(0)
    words = "the a cat dog sat ran on under mat log sun moon red blue small big".split()
    folder.mkdir(parents=True, exist_ok=True)
    if task == "pretrain":
        docs = folder / "docs"
        docs.mkdir(exist_ok=True)
        for d in range(24):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 90)))
            (docs / f"doc{d:02d}.txt").write_text(text + ".\n")
        return {"task": "pretrain", "data": {"train": str(docs), "max_length": 32}}
    if task == "classify":
        rows = []
        for _ in range(160):
            label = rng.choice(["pos", "neg", "neu"])
            cue = {"pos": "great", "neg": "awful", "neu": "fine"}[label]
            text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) + f" {cue}"
            rows.append({"sentence": text, "sentiment": label})
        path = folder / "labels.csv"
        path.write_text("sentence,sentiment\n" + "".join(f"{r['sentence']},{r['sentiment']}\n" for r in rows))
        return {
            "task": "classify",
            "model": {
                "config": {
                    "architecture": "bert",
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "max_position_embeddings": 64,
                    "hidden_dropout_prob": 0.0,
                    "attention_probs_dropout_prob": 0.0,
                },
                "tokenizer": "byte",
            },
            "data": {
                "train": [{"path": str(path), "fields": {"text": "sentence", "label": "sentiment"}}],
                "eval_fraction": 0.2,
                "max_length": 32,
            },
        }
    if task == "dpo":
        rows = []
        for _ in range(96):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + rng.randint(1, 9))})
        return {
            "task": "dpo",
            "data": {"train": str(write_jsonl(folder / "pairs.jsonl", rows)), "eval_fraction": 0.1, "max_length": 32},
        }
    if task == "reward":
        # The preferred answer ends politely: a cue a tiny scorer learns in a few steps.
        rows = []
        for _ in range(96):
            prompt, answer = (" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))) for _ in range(2))
            rows.append({"prompt": f"{prompt}? ", "chosen": f"{answer} thanks", "rejected": f"{answer} go away"})
        return {
            "task": "reward",
            "data": {"train": str(write_jsonl(folder / "pairs.jsonl", rows)), "eval_fraction": 0.125, "max_length": 48},
        }
    if task == "chat":
        rows = []
        for _ in range(128):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            rows.append(
                {
                    "messages": [
                        {"role": "system", "content": "add"},
                        {"role": "user", "content": f"{a}+{b}"},
                        {"role": "assistant", "content": str(a + b)},
                    ]
                }
            )
        return {
            "task": "sft",
            "data": {"train": str(write_jsonl(folder / "chat.jsonl", rows)), "eval_fraction": 0.1, "max_length": 48},
        }
    raise ValueError(task)


def recipe_for(task: str, folder: Path, **sections) -> dict:
    """TINY_RECIPE switched to `task` on task_data, with extra section overrides."""
    import copy

    recipe = copy.deepcopy(TINY_RECIPE)
    overrides = task_data(folder, task)
    for key, value in {**overrides, **sections}.items():
        recipe[key] = value if not isinstance(value, dict) or key not in recipe else {**recipe[key], **value}
    recipe["data"] = {**{"cache_dir": str(folder / "cache")}, **recipe["data"]}
    recipe["data"].pop("generate", None) if "train" in recipe["data"] else None
    return recipe


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, output dir) of TINY_RECIPE on 2 processes with DDP (2 × 8 × 2), with a
    checkpoint at step 5: the run that many tests compare against, made once per session."""
    with _once_per_session(tmp_path_factory, "reference") as (root, make):
        recipe, out = root / "tiny.yaml", root / "ddp"
        if make:
            write_recipe(recipe, TINY_RECIPE)
            assert_ok(run_accord("train", recipe, "checkpoint.every_steps=5", f"output.dir={out}"))
    return recipe, out


@pytest.fixture(scope="session")
def one_process_reference(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, output dir) of TINY_RECIPE on 1 process (1 × 8 × 4), with a checkpoint at
    step 6 (mid-epoch): the invariance layout 1x8x4 and the run the resume tests start from."""
    with _once_per_session(tmp_path_factory, "reference-1") as (root, make):
        recipe, out = root / "tiny.yaml", root / "1x8x4"
        if make:
            write_recipe(recipe, TINY_RECIPE)
            assert_ok(
                run_accord(
                    "train",
                    recipe,
                    "engine.processes=1",
                    "batch.micro_batch_size=8",
                    "checkpoint.every_steps=6",
                    f"output.dir={out}",
                )
            )
    return recipe, out


# A 2-layer Qwen3-MoE: 4 experts of which each token takes 2 (its experts fused 3-D parameters).
MOE_CONFIG = {
    "architecture": "qwen3_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}


def moe_recipe(**moe) -> dict:
    """TINY_RECIPE on the tiny MoE, its balancing loss (and z-loss) weighted enough to move the weights."""
    recipe = copy.deepcopy(TINY_RECIPE)
    recipe["model"] = {"config": dict(MOE_CONFIG), "tokenizer": "byte"}
    recipe["train"] = {"max_steps": 4, "log_every": 1}
    recipe["moe"] = {"aux_loss_coef": 0.1, "z_loss_coef": 0.01} | moe
    return recipe


@pytest.fixture(scope="session")
def moe_reference(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, output dir) of moe_recipe() on 1 process (1 × 8 × 4) with checkpoints every 2
    steps: the run the MoE layouts (2 processes, expert parallelism) are compared against."""
    with _once_per_session(tmp_path_factory, "moe-reference") as (root, make):
        recipe, out = root / "moe.yaml", root / "1x8x4"
        if make:
            write_recipe(recipe, moe_recipe())
            overrides = ["engine.processes=1", "checkpoint.every_steps=2", f"output.dir={out}"]
            assert_ok(run_accord("train", recipe, *overrides))
    return recipe, out


@contextlib.contextmanager
def _once_per_session(tmp_path_factory, name: str):
    """(folder, whether to make its contents) for a run shared by the whole session: under
    pytest-xdist the first worker to ask makes it in the session's common temp folder while
    the others wait, then all read it (each worker would otherwise train it again). Readers
    must not write into it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield tmp_path_factory.mktemp(name), True
        return
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent / f"shared-{name}"
    with FileLock(str(root) + ".lock"):
        made = root / ".made"
        if made.exists():
            yield root, False
            return
        shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way
        root.mkdir()
        yield root, True
        made.touch()


# Two hosts on this machine: two network namespaces joined by a veth pair (needs root and iproute2).
ADDRESSES = ("10.123.0.1", "10.123.0.2")


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture(scope="module")
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two-node test needs root and iproute2 (ip netns)")
    tag = uuid.uuid4().hex[:5]
    names = [f"acc{tag}n{i}" for i in (0, 1)]
    links = [f"acc{tag}v{i}" for i in (0, 1)]
    try:
        for name in names:
            _sh("ip", "netns", "add", name)
        _sh("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, addr in zip(names, links, ADDRESSES):
            _sh("ip", "link", "set", link, "netns", name)
            _sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{addr}/24", "dev", link)
            _sh("ip", "netns", "exec", name, "ip", "link", "set", link, "up")
            _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    yield names
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
