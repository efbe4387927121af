"""The quickstart end to end through the CLI, shortened; its outputs load in plain transformers."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, assert_ok, run_accord

pytestmark = pytest.mark.distributed

# engine.device=cpu: on a GPU machine "auto" would take the GPUs instead of 2 CPU processes.
SHORT = [
    "engine.device=cpu",
    "train.max_steps=12",
    "train.eval_every=6",
    "train.eval_generate=16",
    "data.generate.train_examples=1024",
]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart") / "run"
    proc = run_accord("train", REPO / "recipes" / "quickstart.yaml", *SHORT, f"output.dir={out}")
    assert_ok(proc)
    return out, proc


def test_quickstart_reports_plan_eval_and_outputs(quickstart_run):
    """Everything the run says is on stderr (`2> log` keeps it all; stdout stays empty), rank 0
    only, starting with what it is doing before the workers exist."""
    out, proc = quickstart_run
    assert proc.stdout == ""
    log = proc.stderr
    assert log.count("accord: batch 2 processes × ") == 1  # printed once, by rank 0
    assert "accord: step 12: eval loss" in log and "exact-match" in log
    assert f"accord: outputs in {out}/" in log
    assert log.startswith("accord: checking recipe…\n")
    # The workers start while the data is prepared: those two lines come in either order.
    stages = [
        "accord: checking recipe…",
        ("accord: preparing data…", "accord: starting 2 workers…"),
        "accord: loading model…",
        "accord: batch ",
    ]
    positions = [[log.index(stage)] if isinstance(stage, str) else [log.index(s) for s in stage] for stage in stages]
    assert all(max(before) < min(after) for before, after in zip(positions, positions[1:])), log[:2000]
    assert log.count("accord: loading model…") == 1


def test_quickstart_writes_recipe_metrics_and_tensorboard(quickstart_run):
    out, _ = quickstart_run
    resolved = (out / "recipe.yaml").read_text()
    assert "max_steps: 12" in resolved
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 13))
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [6, 12] and "exact_match_accuracy" in evals[-1]
    assert any(r["kind"] == "throughput" and r["tokens_per_s"] > 0 for r in records)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_saved_model_reloads_in_plain_transformers(quickstart_run):
    """The exported folder, loaded by plain transformers, is the model evaluated at the last
    step: its eval loss over the held-out examples and its greedy exact match on the first
    eval_generate prompts equal what the run logged."""
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accord.data.prepare import prepare_data
    from accord.models.build import build_tokenizer
    from accord.observe.metrics import read_metrics
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    out, _ = quickstart_run
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|user|>hi<|eos|>"
    logged = [r for r in read_metrics(out) if r["kind"] == "eval"][-1]
    assert logged["step"] == 12

    # The held-out rows the run evaluated on (accord's cache of the run's own data).
    recipe = validate_recipe(yaml.safe_load((out / "recipe.yaml").read_text()))
    accord_tokenizer = build_tokenizer(recipe.model)
    rows = prepare_data(
        recipe.data, recipe.seed, accord_tokenizer, build_task(task_config(recipe), accord_tokenizer), preparer=True
    ).eval
    loss_sum, targets = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor(row["labels"][1:])
            logits = model(input_ids=ids).logits[0, :-1]
            loss_sum += torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            targets += int((labels != -100).sum())
    print(f"exported model's eval loss {loss_sum / targets:.6f}, logged {logged['loss']:.6f}")
    assert abs(loss_sum / targets - logged["loss"]) <= 1e-4

    for row in rows.select(range(16)):
        prompt = tokenizer(row["prompt"]).input_ids  # the plain way: the tokenizer's own BOS policy
        assert prompt == row["input_ids"][: len(prompt)]  # the exported tokenizer encodes as the run did
        assert row["labels"][len(prompt)] != -100  # ... and the completion follows right after


def test_final_generates_the_trained_answers_in_plain_transformers(quickstart_run):
    """The README's snippet, in a process that never imports accord: `tokenizer(prompt)` then
    `generate` from final/ gives, prompt by prompt, the answers the model gives to the tokens it
    was trained and evaluated on, and as many of them are right as accord's evaluation counted."""
    import subprocess
    import sys

    import yaml
    from transformers import AutoModelForCausalLM

    from accord.data.prepare import prepare_data
    from accord.models.build import build_tokenizer
    from accord.observe.metrics import read_metrics
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    out, _ = quickstart_run
    logged = [r for r in read_metrics(out) if r["kind"] == "eval"][-1]
    recipe = validate_recipe(yaml.safe_load((out / "recipe.yaml").read_text()))
    accord_tokenizer = build_tokenizer(recipe.model)
    rows = list(
        prepare_data(
            recipe.data, recipe.seed, accord_tokenizer, build_task(task_config(recipe), accord_tokenizer), preparer=True
        ).eval.select(range(16))
    )

    script = f"""
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(out / "final")!r})
model = AutoModelForCausalLM.from_pretrained({str(out / "final")!r})
answers = []
for prompt in json.loads(sys.stdin.read()):
    output = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=4, do_sample=False)
    answers.append(tokenizer.decode(output[0], skip_special_tokens=True)[len(prompt):])
assert not [name for name in sys.modules if name.split(".")[0] == "accord"]
print(json.dumps(answers))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([r["prompt"] for r in rows]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = json.loads(proc.stdout.strip().splitlines()[-1])

    # The same greedy answers from the trained tokens (the run's own encoded prompts).
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    trained = []
    for row in rows:
        start = row["labels"].index(next(t for t in row["labels"] if t != -100))
        prompt = torch.tensor([row["input_ids"][:start]])
        generated = model.generate(
            prompt,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=accord_tokenizer.pad_token_id,
            eos_token_id=accord_tokenizer.eos_token_id,
        )
        trained.append(accord_tokenizer.decode(generated[0, start:], skip_special_tokens=True))
    print("plain transformers:", plain)
    assert plain == trained
    correct = sum(a.strip() == r["completion"].strip() for a, r in zip(plain, rows))
    assert correct == round(logged["exact_match_accuracy"] * 16), (correct, logged["exact_match_accuracy"])


def test_second_run_into_the_same_folder_is_refused_and_loses_nothing(quickstart_run):
    out, _ = quickstart_run
    before = (out / "final" / "model.safetensors").read_bytes()
    proc = run_accord("train", REPO / "recipes" / "quickstart.yaml", *SHORT, f"output.dir={out}", timeout=60)
    assert proc.returncode == 2
    assert "already holds a run" in proc.stderr and "--overwrite" in proc.stderr
    assert (out / "final" / "model.safetensors").read_bytes() == before
