"""Nothing lost, nothing silent: bad inputs that used to end in a traceback or cost an earlier
run, one run per output folder, and --resume that has nothing to resume. Every refusal is
one line on stderr, exit 2, no traceback; an earlier run is compared byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from accord.output.procstat import process_stat
from conftest import (
    REPO,
    TINY_RECIPE,
    accord_env,
    assert_ok,
    final_params,
    finish,
    kill_tree,
    run_accord,
    run_accord_here,
    start_accord,
    start_process,
    wait_for,
    write_jsonl,
)
from test_cli_errors import HERE, assert_clean_error

# A short run on one process: enough to write every artefact (checkpoint, final, metrics).
SHORT = ("engine.processes=1", "train.max_steps=2", "train.log_every=1")


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones included) -> sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def assert_one_line(proc, *needles) -> None:
    assert_clean_error(proc, *needles)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accord: error: ")]
    assert len(errors) == 1, proc.stderr


@pytest.fixture
def earlier_run(tiny_reference, tmp_path) -> Path:
    """A copy of a finished run (checkpoints, final/, metrics, TensorBoard) to protect."""
    out = tmp_path / "run"
    shutil.copytree(tiny_reference[1], out)
    return out


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A tiny Llama save_pretrained folder with the byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from accord.models.build import build_byte_tokenizer

    folder = tmp_path_factory.mktemp("model") / "tiny-llama"
    tokenizer = build_byte_tokenizer()
    model_cfg = {k: v for k, v in TINY_RECIPE["model"]["config"].items() if k != "architecture"}
    LlamaForCausalLM(LlamaConfig(**model_cfg, vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def damaged_copy(model_folder: Path, where: Path, damage: str) -> Path:
    folder = where / f"model-{damage}"
    shutil.copytree(model_folder, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":  # an interrupted copy: the header is whole, the tensors are not
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\xff" * 64)
    elif damage == "missing-shard":
        weights.rename(folder / "model-00001-of-00002.safetensors")
        index = {
            "metadata": {},
            "weight_map": {
                "lm_head.weight": "model-00001-of-00002.safetensors",
                "model.norm.weight": "model-00002-of-00002.safetensors",
            },
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    elif damage == "tokenizer":
        (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    return folder


# ------------------------------------------------------------------ nothing deleted first


@pytest.mark.distributed  # the earlier run is the session's reference run
def test_overwrite_with_truncated_weights_refuses_and_keeps_earlier_run(
    earlier_run, model_folder, tiny_recipe, tmp_path
):
    before = snapshot(earlier_run)
    broken = damaged_copy(model_folder, tmp_path, "truncated")
    proc = run_accord_here(
        "train",
        tiny_recipe,
        "model.config=null",
        f"model.path={broken}",
        f"output.dir={earlier_run}",
        "--overwrite",
        HERE,
    )
    assert_one_line(proc, f"model.path: {broken}/model.safetensors cannot be read", "truncated")
    assert snapshot(earlier_run) == before


@pytest.mark.parametrize(
    "damage, needle",
    [
        # (a truncated file: test_overwrite_with_truncated_weights_refuses_and_keeps_earlier_run)
        # The same check as a truncated file: slow tier (the default suite's budget).
        pytest.param(
            "garbage", "model.safetensors cannot be read (Error while deserializing header", marks=pytest.mark.slow
        ),
        pytest.param(
            "missing-shard",
            "model-00002-of-00002.safetensors cannot be read (listed in the index but missing)",
            marks=pytest.mark.slow,
        ),
        ("tokenizer", "model.path: the tokenizer in"),
    ],
)
def test_corrupt_model_folder_is_one_line_before_any_worker(model_folder, tiny_recipe, tmp_path, damage, needle):
    broken = damaged_copy(model_folder, tmp_path, damage)
    out = tmp_path / "out"
    proc = run_accord_here(
        "train",
        tiny_recipe,
        "model.config=null",
        f"model.path={broken}",
        "model.tokenizer=null",
        f"output.dir={out}",
        HERE,
    )
    assert_one_line(proc, needle)
    assert not out.exists()


@pytest.mark.subprocess
def test_weights_of_another_config_refuse_in_one_line_and_leave_no_run_behind(model_folder, tiny_recipe, tmp_path):
    # Found by the worker as it loads (the shapes need the model): exit 2, and the fresh
    # folder holds no run afterwards, so the fixed command needs no --overwrite.
    folder = tmp_path / "model-other-config"
    shutil.copytree(model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": config["intermediate_size"] * 2}))
    out = tmp_path / "out"
    args = ("model.config=null", f"model.path={folder}", "model.tokenizer=null", f"output.dir={out}", *SHORT)
    proc = run_accord("train", tiny_recipe, *args, timeout=120)
    assert_one_line(
        proc, "model.safetensors holds model.layers.0.mlp.gate_proj.weight of shape", "come from different models"
    )
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.distributed
def test_overwrite_puts_earlier_run_back_if_new_run_fails_and_removes_it_once_new_run_trains(earlier_run, tiny_recipe):
    # The hang watchdog's stack dumps belong to the earlier run too.
    (earlier_run / "hang-20261201-101500").mkdir()
    (earlier_run / "hang-20261201-101500" / "stacks-rank-0.txt").write_text("Thread 0x1\n")
    before = snapshot(earlier_run)
    # A run that passes every check but fails at its first step (a NaN loss, injected).
    failing = run_process_with_faults(
        "nan_loss_at_step=1", tiny_recipe, *SHORT, f"output.dir={earlier_run}", "--overwrite"
    )
    assert failing.returncode == 1, failing.stderr
    assert "step 1: loss nan is not finite" in failing.stderr
    assert "the earlier run in" in failing.stderr and "is back as it was" in failing.stderr
    assert "Traceback" not in failing.stdout + failing.stderr
    assert snapshot(earlier_run) == before

    replacing = run_accord("train", tiny_recipe, *SHORT, f"output.dir={earlier_run}", "--overwrite")
    assert_ok(replacing)
    assert "removed the earlier run that --overwrite had set aside" in replacing.stderr
    assert not (earlier_run / ".previous-run").exists()
    assert not (earlier_run / "hang-20261201-101500").exists()
    steps = [
        json.loads(line)["step"]
        for line in (earlier_run / "metrics.jsonl").read_text().splitlines()
        if '"kind": "train"' in line
    ]
    assert steps == [1, 2]  # only the new run's steps: nothing of the old one mixed in
    assert sorted(p.name for p in (earlier_run / "checkpoints").iterdir() if p.name.startswith("step-")) == [
        "step-000002"
    ]


def run_process_with_faults(faults: str, *args):
    from conftest import run_process

    command = [sys.executable, "-m", "accord", "train", *map(str, args)]
    return run_process(command, cwd=REPO, env=accord_env() | {"ACCORD_FAULTS": faults}, timeout=300)


def test_overwrite_sets_aside_every_file_a_run_writes_and_puts_them_back(tmp_path):
    """grpo's samples.jsonl and the hang watchdog's dumps go with the rest, so a replacing run
    never appends to the earlier run's files."""
    from accord.output.folder import restore_earlier_run, set_aside_earlier_run

    out = tmp_path / "run"
    (out / "hang-20261201-101500").mkdir(parents=True)
    for name in ("metrics.jsonl", "samples.jsonl", "hang-20261201-101500/stacks-rank-0.txt", "notes.txt"):
        (out / name).write_text(name)
    aside = set_aside_earlier_run(out)
    assert sorted(p.name for p in out.iterdir()) == [".previous-run", "notes.txt"]  # the user's own file stays
    assert sorted(p.name for p in aside.iterdir()) == ["hang-20261201-101500", "metrics.jsonl", "samples.jsonl"]
    (out / "samples.jsonl").write_text("the failed new run's")
    assert restore_earlier_run(out)
    assert (out / "samples.jsonl").read_text() == "samples.jsonl" and (
        out / "hang-20261201-101500" / "stacks-rank-0.txt"
    ).is_file()


def test_a_run_set_aside_by_a_live_overwrite_is_not_offered_for_deletion(tmp_path):
    """While a live --overwrite holds the earlier run in .previous-run (until its first step), a
    second start is told the folder is in use, not to move or delete what the live run needs."""
    from accord.output.folder import PREVIOUS_RUN, check_output_dir
    from accord.output.lock import acquire
    from accord.recipe.schema import validate_recipe

    out = tmp_path / "run"
    (out / PREVIOUS_RUN).mkdir(parents=True)
    recipe = validate_recipe(TINY_RECIPE | {"output": {"dir": str(out), "overwrite": True}})
    with acquire(out, "the-live-run"):
        [problem] = check_output_dir(recipe.output, recipe.resume)
        assert "is in use by another run" in problem and PREVIOUS_RUN not in problem
        assert check_output_dir(recipe.output, recipe.resume, run_id="the-live-run")[0].startswith(
            f"output.dir: {out / PREVIOUS_RUN} holds"
        )
    # Nobody holds it: the interrupted run's way back is offered.
    [problem] = check_output_dir(recipe.output, recipe.resume)
    assert f"move its contents back into {out}, or delete it" in problem


def test_overwrite_left_half_done_by_a_killed_launcher_is_refused(tiny_recipe, tmp_path):
    out = tmp_path / "out"
    (out / ".previous-run").mkdir(parents=True)
    (out / ".previous-run" / "metrics.jsonl").write_text("{}\n")
    before = snapshot(out)
    proc = run_accord_here("train", tiny_recipe, f"output.dir={out}", "--overwrite", HERE)
    assert_one_line(proc, f"{out}/.previous-run holds the run an interrupted --overwrite set aside")
    assert snapshot(out) == before


# ------------------------------------------------------------------ one run per folder


@pytest.mark.distributed
def test_second_run_into_the_same_folder_is_refused_while_the_first_completes(tiny_recipe, tmp_path):
    out = tmp_path / "out"
    # resume: auto in the recipe with nothing to resume starts fresh (only the --resume flag refuses).
    # The first run stops itself (SIGSTOP) in step 1 until the second has been refused: on an
    # idle machine a 2-step run would otherwise be over before the second one looks.
    first = start_accord(
        "train",
        tiny_recipe,
        *SHORT,
        "resume=auto",
        "engine.hang_timeout_s=null",
        f"output.dir={out}",
        env_extra={"ACCORD_FAULTS": "stop_rank=0,stop_at_step=1"},
    )
    wait_for(lambda: (out / ".accord.lock").exists() or first.poll() is not None, timeout=180)
    holder = json.loads((out / ".accord.lock").read_text())
    second = run_accord_here("train", tiny_recipe, *SHORT, f"output.dir={out}")
    # One process: the launcher is the worker that stops itself; continue it once it has.
    wait_for(lambda: process_stat(holder["pid"])[0] in ("T", "") or first.poll() is not None, timeout=180)
    os.kill(holder["pid"], signal.SIGCONT)
    assert_one_line(
        second, f"output.dir: {out} is in use by another run (host {holder['host']}, pid {holder['pid']}, started 20"
    )
    first_out, _ = finish(first, timeout=300)
    assert first.returncode == 0, first_out[-4000:]
    assert final_params(out)  # the first run's model, whole
    assert not (out / ".accord.lock").exists()  # released on the way out


@pytest.mark.distributed
@pytest.mark.slow
def test_lock_left_by_a_sigkilled_run_is_taken_over(tiny_recipe, tmp_path):
    out = tmp_path / "out"
    killed = start_accord("train", tiny_recipe, *SHORT, f"output.dir={out}")
    wait_for(lambda: (out / ".accord.lock").exists() or killed.poll() is not None, timeout=180)
    pid = json.loads((out / ".accord.lock").read_text())["pid"]
    kill_tree(killed)  # SIGKILL to the launcher and its workers: nothing releases the lock
    assert (out / ".accord.lock").exists()
    proc = run_accord("train", tiny_recipe, *SHORT, f"output.dir={out}", "--overwrite")
    assert_ok(proc)
    assert (
        "taking over the lock of a run that is gone (host" in proc.stderr
        and f"process {pid} no longer exists" in proc.stderr
    )
    assert not (out / ".accord.lock").exists()


TAKE_OVER = """
import sys, time
from pathlib import Path
from accord.output.lock import OutputLocked, acquire
out, start = Path(sys.argv[1]), float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
try:
    lock = acquire(out, sys.argv[3])
except OutputLocked as e:
    print("refused:", e, flush=True)
else:
    print("owner" if lock.owner else "joined", flush=True)
    time.sleep(3)  # hold it while the others try
    lock.release()
"""


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.subprocess
def test_a_stale_lock_is_taken_over_by_exactly_one_of_several_starters(tmp_path):
    import socket

    out = tmp_path / "out"
    out.mkdir()
    stale = {
        "host": socket.gethostname(),
        "pid": dead_pid(),
        "started": time.time() - 60,
        "run_id": "dead",
        "pid_start": "",
    }
    (out / ".accord.lock").write_text(json.dumps(stale))
    start = time.time() + 1.5  # all four try at the same moment
    env = accord_env() | {"PYTHONPATH": str(REPO / "src")}
    procs = [
        start_process([sys.executable, "-c", TAKE_OVER, str(out), str(start), f"run-{i}"], env=env) for i in range(4)
    ]
    outputs = [finish(p, timeout=60)[0] for p in procs]
    assert sorted(line.split(":")[0].strip() for line in outputs) == ["owner", "refused", "refused", "refused"], outputs
    assert all("is in use by another run" in line for line in outputs if line.startswith("refused"))
    assert not (out / ".accord.lock").exists()


def test_nodes_of_one_run_share_the_lock_and_another_run_is_refused(tmp_path):
    from accord.output.lock import LOCK_FILE, OutputLocked, acquire

    out = tmp_path / "out"
    node0 = acquire(out, "run-a")
    node1 = acquire(out, "run-a")  # the same run's other node, writing into a shared folder
    assert node0.owner and not node1.owner
    with pytest.raises(OutputLocked, match=rf"in use by another run \(host .+, pid {os.getpid()}, started "):
        acquire(out, "run-b")
    node1.release()
    assert (out / LOCK_FILE).exists()  # only the node that created it removes it
    node0.release()
    assert not (out / LOCK_FILE).exists()


@pytest.mark.subprocess
def test_lock_of_a_killed_process_not_yet_collected_is_stale(tmp_path):
    import socket
    import subprocess

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: open(f"/proc/{exited.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", timeout=30)
    from accord.output import lock as runlock

    info = runlock.LockInfo(socket.gethostname(), exited.pid, time.time(), "x", "")
    assert runlock.stale_reason(info, tmp_path / runlock.LOCK_FILE) == f"process {exited.pid} has exited"
    exited.wait()
    assert runlock.stale_reason(info, tmp_path / runlock.LOCK_FILE) == f"process {exited.pid} no longer exists"
    me = runlock.LockInfo(socket.gethostname(), os.getpid(), time.time(), "x", runlock._process_start(os.getpid()))
    assert runlock.stale_reason(me, tmp_path / runlock.LOCK_FILE) is None


def test_lock_from_another_host_is_stale_only_without_heartbeat(tmp_path):
    from accord.output import lock as runlock

    path = tmp_path / runlock.LOCK_FILE
    info = runlock.LockInfo("some-other-host", 1, time.time(), "x", "")
    path.write_text(json.dumps(info.__dict__))
    assert runlock.stale_reason(info, path) is None  # refreshed just now
    old = time.time() - runlock.STALE_AFTER_S - 5
    os.utime(path, (old, old))
    assert runlock.stale_reason(info, path).startswith("no heartbeat for")


# ------------------------------------------------------------------ --resume with nothing to resume


def test_resume_flag_with_nothing_to_resume_refuses(tiny_recipe, tmp_path):
    typo = tmp_path / "rnus" / "long-run"
    assert_one_line(
        run_accord_here("train", tiny_recipe, f"output.dir={typo}", "--resume"),
        f"--resume: nothing to resume ({typo} does not exist)",
    )
    assert not typo.exists()
    empty = tmp_path / "started"
    (empty / "checkpoints").mkdir(parents=True)
    assert_one_line(
        run_accord_here("train", tiny_recipe, f"output.dir={empty}", "--resume"),
        f"--resume: nothing to resume (no complete checkpoint in {empty}/checkpoints)",
    )


# ------------------------------------------------------------------ tracebacks to one line


def test_recipe_that_is_not_utf8_is_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"seed: 7\n# caf\xe9 au lait\n")
    assert_one_line(
        run_accord_here("train", recipe), f"{recipe}:2: not UTF-8 text (byte 0xe9); save the recipe as UTF-8"
    )


def test_a_key_written_twice_names_both_lines_at_any_depth(tmp_path):
    """PyYAML keeps the last of two equal keys: a second optim: section would replace the first."""
    top = tmp_path / "top.yaml"
    top.write_text("seed: 0\noptim:\n  lr: 1.0e-3\nseed: 1\noptim:\n  lr: 2.0e-3\n")
    assert_one_line(run_accord_here("train", top), f"{top}:4: duplicate key seed (lines 1 and 4); keep one")
    nested = tmp_path / "nested.yaml"
    nested.write_text("optim:\n  lr: 1.0e-3\n  warmup_steps: 2\n  lr: 2.0e-3\n")
    assert_one_line(run_accord_here("train", nested), f"{nested}:4: duplicate key optim.lr (lines 2 and 4)")
    in_a_list = tmp_path / "list.yaml"
    in_a_list.write_text("data:\n  train:\n    - path: a.jsonl\n      path: b.jsonl\n")
    assert_one_line(run_accord_here("train", in_a_list), "duplicate key data.train.0.path (lines 3 and 4)")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lr=.inf", "optim.lr: input should be a finite number (got inf)"),
        ("optim.lr=.nan", "optim.lr: input should be a finite number (got nan)"),
        ("optim.lr=0", "optim.lr: input should be greater than 0"),
        ("optim.weight_decay=-.inf", "optim.weight_decay: input should be a finite number"),
        ("optim.max_grad_norm=.inf", "optim.max_grad_norm: input should be a finite number"),
        ("optim.betas=[0.9,1.0]", "optim.betas=[0.9, 1.0]: each must be in [0, 1), e.g. [0.9, 0.999]"),
        ("optim.betas=[-0.1,0.999]", "optim.betas=[-0.1, 0.999]: each must be in [0, 1)"),
        ("output.dir=", "output.dir is empty: name the run's folder"),
        ("output.dir=' '", "output.dir is empty"),
    ],
)
def test_absurd_values_are_refused_before_any_work(tiny_recipe, tmp_path, override, needle):
    assert_one_line(run_accord_here("train", tiny_recipe, override), needle)
    assert not (tmp_path / "run").exists() and not list(Path.cwd().glob("checkpoints"))


@pytest.mark.subprocess
def test_an_output_dir_that_is_a_file_is_refused_and_the_file_kept(tiny_recipe, tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    proc = run_accord("train", tiny_recipe, f"output.dir={taken}", *SHORT)
    assert_one_line(proc, f"output.dir: {taken} exists and is not a folder")
    assert taken.read_text() == "mine"


@pytest.mark.parametrize("split", ["train", pytest.param("eval", marks=pytest.mark.slow)])
def test_data_file_that_is_not_utf8_names_file_and_line(tiny_recipe, tmp_path, split):
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(400)])
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(
        b'{"prompt": "1+1=", "completion": "2"}\n' * 3 + '{"prompt": "café", "completion": "x"}\n'.encode("latin-1")
    )
    data = [f"data.train={bad}"] if split == "train" else [f"data.train={good}", f"data.eval={bad}"]
    proc = run_accord_here("train", tiny_recipe, "data.generate=null", *data, f"output.dir={tmp_path / 'o'}", HERE)
    prefix = "data.eval: " if split == "eval" else ""
    assert_one_line(proc, f"{prefix}{bad}:4: not UTF-8 text (byte 0xe9 at offset 129); save it as UTF-8")


@pytest.mark.slow
@pytest.mark.subprocess
def test_latin1_csv_is_pointed_at_the_encoding_setting(tiny_recipe, tmp_path):
    bad = tmp_path / "rows.csv"
    bad.write_bytes("prompt,completion\n1+1=,2\ncafé,x\n".encode("latin-1"))
    proc = run_accord(
        "train", tiny_recipe, "data.generate=null", f"data.train={bad}", f"output.dir={tmp_path / 'o'}", timeout=120
    )
    assert_one_line(proc, f"{bad}:3: not UTF-8 text", "or set encoding: (e.g. latin-1) on this source")


# ------------------------------------------------------------------ errors that point at the right place


@pytest.mark.parametrize(
    "rows, needle",
    [
        ([{"prompt": "1+1="}], "sft data (prompt/completion or messages): missing field 'completion'"),
        pytest.param(
            [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": None}],
            "row 2: field 'completion' is missing or null",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_error_in_the_eval_file_names_it_as_the_eval_source(tiny_recipe, tmp_path, rows, needle):
    good = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(400)])
    bad = write_jsonl(tmp_path / "eval.jsonl", rows)
    proc = run_accord_here(
        "train",
        tiny_recipe,
        "data.generate=null",
        f"data.train={good}",
        f"data.eval={bad}",
        f"output.dir={tmp_path / 'o'}",
        HERE,
    )
    assert_one_line(proc, f"data.eval: {bad}: {needle}")


def test_empty_completions_give_a_warning_with_their_count(tmp_path):
    from accord.data.prepare import prepare_data
    from accord.models.build import build_byte_tokenizer
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(40)]
    for i in (5, 17, 30):
        rows[i]["completion"] = ""
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    recipe = validate_recipe(
        {**TINY_RECIPE, "data": {"train": str(train), "max_length": 32, "cache_dir": str(tmp_path / "cache")}}
    )
    tokenizer = build_byte_tokenizer()
    for _ in range(2):  # prepared here, then read from the cache: the warning is said at every start
        task = build_task(task_config(recipe), tokenizer)
        prepared = prepare_data(recipe.data, recipe.seed, tokenizer, task, preparer=True)
        assert prepared.report["train_examples"] == 40  # a warning, not an error: the rows still train
        assert task.describe() == [
            f"warning: 3 training example(s) have an empty completion, so only the EOS token is a target "
            f"(first: {train}: row 6); fill them in or remove them if that is not intended"
        ]


# ------------------------------------------------------------------ experiment trackers


def test_a_tracker_without_its_library_is_one_line_before_any_worker(tiny_recipe, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "wandb" else real(name, *a, **k)
    )
    out = tmp_path / "out"
    proc = run_accord_here("train", tiny_recipe, "observe.report_to=[tensorboard,wandb]", f"output.dir={out}", HERE)
    assert_one_line(proc, "observe.report_to: wandb needs wandb, which is not installed: pip install 'accord[wandb]'")
    assert not out.exists()


def test_an_unknown_tracker_is_one_line_with_the_closest_name(tiny_recipe, tmp_path):
    proc = run_accord_here("train", tiny_recipe, "observe.report_to=[tensorbord]", f"output.dir={tmp_path / 'o'}")
    assert_one_line(proc, "observe.report_to: unknown tracker 'tensorbord'; did you mean tensorboard?")


@pytest.mark.slow  # the default tier has the message (tests/test_trackers.py) without the processes
@pytest.mark.subprocess
def test_a_tracker_that_cannot_start_refuses_on_every_rank_before_the_model_is_built(tiny_recipe, tmp_path):
    # Found by rank 0 as it opens the trackers (the store is MLflow's to judge): every rank
    # refuses in one line, exit 2, before loading the model, and the fresh folder holds no run.
    out = tmp_path / "out"
    proc = run_accord(
        "train",
        tiny_recipe,
        "observe.report_to=[tensorboard,mlflow]",
        f"output.dir={out}",
        env_extra={"MLFLOW_TRACKING_URI": "bogus://nowhere"},
        timeout=120,
    )
    assert_one_line(proc, "observe.report_to: mlflow cannot start with MLFLOW_TRACKING_URI=bogus://nowhere: ")
    assert "accord: loading model" not in proc.stderr
    assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------ the post-training methods' rows and losses

_PAIR = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
_UNPAIRED = {"prompt": "1+1=", "completion": "2", "label": True}


@pytest.mark.parametrize(
    "task, rows, override, needle",
    [
        ("kto", [_UNPAIRED, {"prompt": "1+2=", "completion": "4"}], None, "row 2: kto label None is not a boolean"),
        ("kto", [{"prompt": "1+2=", "completion": "4"}] * 2, None, "kto data: missing field 'label'"),
        ("kto", [_UNPAIRED, {**_UNPAIRED, "label": "no"}], None, "row 2: kto label 'no' is not a boolean"),
        ("kto", [_PAIR, {"prompt": "1+2=", "chosen": "3"}], None, "row 2: field 'rejected' is missing or null"),
        ("dpo", [_PAIR, {"prompt": "1+2=", "chosen": "3"}], None, "row 2: field 'rejected' is missing or null"),
        ("orpo", [{"prompt": "1+2=", "chosen": "3"}] * 2, None, "missing field 'rejected'"),
        ("cpo", [_PAIR, {**_PAIR, "rejected": None}], None, "row 2: field 'rejected' is missing or null"),
        ("cpo", None, "cpo.loss_type=simpoo", "cpo.loss_type: input should be 'sigmoid', 'hinge', 'ipo' or 'simpo'"),
        ("kto", None, "kto.loss_type=kto_pair", "kto.loss_type: input should be 'kto' or 'apo_zero_unpaired'"),
        ("orpo", None, "data.generate.kind=addition", "use data.generate.kind: addition_pairs"),
    ],
    ids=[
        "kto-a-row-without-label",
        "kto-no-label-field",
        "kto-label-not-boolean",
        "kto-pair-without-rejected",
        "dpo-pair-without-rejected",
        "orpo-no-rejected-field",
        "cpo-null-rejected",
        "cpo-unknown-loss-type",
        "kto-unknown-loss-type",
        "orpo-generated-sums-not-pairs",
    ],
)
def test_a_methods_bad_rows_or_loss_type_is_one_line_before_any_worker(tmp_path, task, rows, override, needle):
    """Each post-training method's rows and settings: a KTO row without a boolean label, a
    preference row without its rejected answer, a loss_type that does not exist (the valid
    ones listed), generated sums where the task reads pairs."""
    recipe = {
        **TINY_RECIPE,
        "task": task,
        "data": {"generate": {"kind": "addition_pairs", "train_examples": 64, "eval_examples": 0}, "max_length": 32},
        "batch": {"global_batch_size": 2},
    }
    if rows is not None:
        recipe["data"] = {"train": str(write_jsonl(tmp_path / "rows.jsonl", rows)), "max_length": 32}
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    out = tmp_path / "out"
    extra = [override] if override else []
    proc = run_accord_here("train", path, *extra, f"output.dir={out}", HERE)
    assert_one_line(proc, needle)
    if rows is not None:
        assert str(tmp_path / "rows.jsonl") in proc.stderr or task == "kto" and "label'" in needle
    assert not out.exists()
