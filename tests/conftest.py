"""Shared fixtures: tiny recipes and running the real `accord` command in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

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
    "data": {"generate": {"kind": "addition", "train_examples": 512, "eval_examples": 32, "max_digits": 3}, "max_length": 32},
    "batch": {"global_batch_size": 32, "micro_batch_size": 8},
    "optim": {"lr": 3.0e-3, "warmup_steps": 2, "schedule": "cosine", "max_grad_norm": 1.0},
    "train": {"max_steps": 10, "log_every": 5},
    "engine": {"strategy": "ddp", "precision": "no", "processes": 2},
    "output": {"dir": "runs/tiny"},
}


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)


def accord_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # let accord split the cores itself
    env["HF_HUB_OFFLINE"] = "1"  # the tests must never touch a hub
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_accord(*args: str | Path, cwd: Path | None = None, timeout: float = 300, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m accord ARGS` (or under `launcher`) and return the finished process."""
    command = (launcher or [sys.executable]) + ["-m", "accord", *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=accord_env(), capture_output=True, text=True, timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def start_accord(*args: str | Path, cwd: Path | None = None, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `python -m accord ARGS` in its own session, stdout and stderr merged, so a
    test can signal it mid-run."""
    env = accord_env() | (env_extra or {})
    return subprocess.Popen(
        [sys.executable, "-m", "accord", *map(str, args)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


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
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


def max_param_diff(a, b) -> float:
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    if os.environ.get("ACCORD_DIFF_LOG"):  # the measured figures, for a closing note
        with open(os.environ["ACCORD_DIFF_LOG"], "a") as log:
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{diff:.3g}\n")
    return diff


def step_losses(out: Path) -> dict[int, float]:
    from accord.observe.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(out) if r["kind"] == "train"}


# ---------------------------------------------------------------- small data for every task

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
            "model": {"config": {"architecture": "bert", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
                                 "attention_probs_dropout_prob": 0.0}, "tokenizer": "byte"},
            "data": {"train": [{"path": str(path), "fields": {"text": "sentence", "label": "sentiment"}}], "eval_fraction": 0.2, "max_length": 32},
        }
    if task == "dpo":
        rows = []
        for _ in range(96):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + rng.randint(1, 9))})
        return {"task": "dpo", "data": {"train": str(write_jsonl(folder / "pairs.jsonl", rows)), "eval_fraction": 0.1, "max_length": 32}}
    if task == "chat":
        rows = []
        for _ in range(128):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            rows.append({"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]})
        return {"task": "sft", "data": {"train": str(write_jsonl(folder / "chat.jsonl", rows)), "eval_fraction": 0.1, "max_length": 48}}
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
    root = tmp_path_factory.mktemp("reference")
    recipe = write_recipe(root / "tiny.yaml", TINY_RECIPE)
    out = root / "ddp"
    assert_ok(run_accord("train", recipe, "checkpoint.every_steps=5", f"output.dir={out}"))
    return recipe, out
