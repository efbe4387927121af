"""The quickstart end to end through the CLI, shortened; its outputs load in plain transformers."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, assert_ok, run_accord

pytestmark = pytest.mark.distributed

SHORT = ["train.max_steps=12", "train.eval_every=6", "train.eval_generate=16", "data.generate.train_examples=1024"]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart") / "run"
    proc = run_accord("train", REPO / "recipes" / "quickstart.yaml", *SHORT, f"output.dir={out}")
    assert_ok(proc)
    return out, proc


def test_quickstart_reports_plan_eval_and_outputs(quickstart_run):
    out, proc = quickstart_run
    log = proc.stdout + proc.stderr
    assert log.count("accord: batch 2 processes × ") == 1  # printed once, by rank 0
    assert "accord: step 12: eval loss" in log and "exact-match" in log
    assert f"accord: outputs in {out}/" in log


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = quickstart_run
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert (out / "final" / "model.safetensors").is_file()
    prompt = tokenizer("12+34=", add_special_tokens=False, return_tensors="pt").input_ids
    prompt = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), prompt], dim=1)
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > prompt.shape[1]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|user|>hi<|eos|>"


def test_second_run_into_the_same_folder_is_refused_and_loses_nothing(quickstart_run):
    out, _ = quickstart_run
    before = (out / "final" / "model.safetensors").read_bytes()
    proc = run_accord("train", REPO / "recipes" / "quickstart.yaml", *SHORT, f"output.dir={out}", timeout=60)
    assert proc.returncode == 2
    assert "already holds a run" in proc.stderr and "--overwrite" in proc.stderr
    assert (out / "final" / "model.safetensors").read_bytes() == before
