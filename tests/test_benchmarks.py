"""The benchmarks still run end to end (slow tier): every contender of throughput.py, vlm.py and
grpo.py trains for a step in its own pinned process, none fails, the last line is the verdict,
and --write-docs rewrites only the text between the section's markers; startup.py times each
contender to its first step and writes its section; tensor_parallel.py and expert_parallel.py
measure each layout they are given and write their sections; gpu_check's --dry-run runs its
peer, tensor-, expert- and pipeline-parallel phases' plumbing on the CPU and writes its JSON and
markdown."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

VERDICT = re.compile(r"accord / best peer: \d+\.\d\dx \(.+\)")


def run_benchmark(tmp_path, script: str, section: str, *options: str) -> tuple[list[str], str]:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"before\n<!-- {section}:start -->\nSTALE-TABLE\n<!-- {section}:end -->\nafter\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *options, "--rounds", "1", "--write-docs"]
        + ["--docs", str(docs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines(), docs.read_text()


def check(lines: list[str], written: str, contenders: list[str]) -> None:
    assert VERDICT.fullmatch(lines[-1]), lines[-1]
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| contender")]
    assert len(rows) == len(contenders)
    for name, row in zip(contenders, rows):
        assert name in row and "failed" not in row, row
    assert written.startswith("before\n") and written.endswith("after\n") and "STALE-TABLE" not in written
    assert lines[-1] in written


# Each benchmark with its docs section and the options that make it tiny.
CONTENDER_BENCHMARKS = {
    "throughput": ("--steps", "1"),
    "vlm": ("--rows", "8"),
    "moe": ("--steps", "1"),
    "grpo": ("--steps", "1", "--prompts", "4", "--group", "4"),
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CONTENDER_BENCHMARKS))
def test_benchmark_runs_every_contender_and_writes_its_docs_section(tmp_path, name):
    sys.path.insert(0, str(REPO / "benchmarks"))
    benchmark = importlib.import_module(name)

    lines, written = run_benchmark(tmp_path, f"{name}.py", name, *CONTENDER_BENCHMARKS[name])
    check(lines, written, [c.name for c in benchmark.CONTENDERS])


@pytest.mark.slow
@pytest.mark.distributed
def test_methods_benchmark_runs_each_method_against_its_trl_trainer_and_writes_its_docs_section(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import methods

    tiny = ("--steps", "1", "--batch", "4", "--group", "2")
    lines, written = run_benchmark(tmp_path, "methods.py", "methods", *tiny)
    assert VERDICT.fullmatch(lines[-1]), lines[-1]
    rows = [line for line in lines if line.startswith("| **")]
    assert [row.split(" | ")[0] for row in rows] == [f"| **{m.label}**" for m in methods.METHODS]
    for row in rows:
        assert "failed" not in row and "n/a" not in row, row
    assert written.startswith("before\n") and written.endswith("after\n") and "STALE-TABLE" not in written
    assert lines[-1] in written and "--docs" not in written


def test_methods_verdict_is_the_geometric_mean_of_accords_ratio_to_each_trl_trainer():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import harness
    import methods

    def ran(rate):
        return {"rate": rate, "rate_range": (rate, rate), "peak_rss_mib": 600.0, "steps": 4}

    chosen = methods._contenders([methods.BY_KEY["dpo"], methods.BY_KEY["kto"], methods.BY_KEY["orpo"]])
    bench = harness.Benchmark("methods", "steps", chosen, prepare=None, child=None)
    summaries = {
        "dpo: accord": ran(2.0),
        "dpo: TRL": ran(1.0),
        "kto: accord": ran(1.0),
        "kto: TRL": ran(2.0),
        "orpo: accord": ran(3.0),
        "orpo: TRL": {"error": "exit 1: boom"},
    }
    lines, last = methods.report(bench, summaries, "cpu")
    assert VERDICT.fullmatch(last) and last.startswith("accord / best peer: 1.00x (") and "dpo 2.00x, kto 0.50x" in last
    assert [line.split(" | ")[3] for line in lines[2:]] == ["2.00x", "0.50x", "n/a"]
    assert "failed: exit 1: boom" in lines[-1] and "orpo" not in last


def test_methods_distill_runs_gkd_off_policy_with_accords_divergence_settings(tmp_path):
    """distill's two sides do the same work: GKDTrainer off-policy (lmbda 0, no sequence-level
    KD, so it never samples) with accord's beta, accord off-policy at temperature 1 (GKD's
    divergence compares at 1), accord's section valid as written, and both against the teacher.
    (That GKDConfig takes these settings is the slow end-to-end run's.)"""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import argparse

    import methods

    from accord.recipe.distill import DistillConfig

    method = methods.BY_KEY["distill"]
    args = argparse.Namespace(batch=4, group=2, max_new_tokens=8, steps=1)
    ours = method.accord(args)
    assert ours["task"] == "distill" and method.teacher and method.rows == "chats.jsonl"
    section = DistillConfig(**ours["distill"] | {"teacher": str(tmp_path)})
    trainer, config, gkd = method.trl(args)
    assert (trainer, config) == ("trl.experimental.gkd:GKDTrainer", "trl.experimental.gkd:GKDConfig")
    assert gkd["lmbda"] == section.lmbda == 0.0 and gkd["seq_kd"] is section.seq_kd is False
    assert gkd["beta"] == section.beta and section.temperature == 1.0


@pytest.mark.slow
def test_methods_distill_trains_both_sides_on_the_same_tokens_and_targets(tmp_path):
    """The chats prepare() writes, as accord's distill encodes them and as GKDTrainer's own
    ChatML collator does: the same token ids and the same target positions, row for row."""
    pytest.importorskip("trl")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import argparse

    import datasets
    import methods
    from transformers import AutoTokenizer
    from trl.experimental.utils import DataCollatorForChatML

    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    methods.prepare(tmp_path, argparse.Namespace(model_size="tiny", steps=2, batch=4))
    rows = [json.loads(line) for line in (tmp_path / "chats.jsonl").read_text().splitlines()]
    recipe = {
        "model": {"path": str(tmp_path / "model")},
        "data": {"train": str(tmp_path / "chats.jsonl"), "max_length": methods.MAX_LENGTH, "shuffle": False},
        "batch": {"global_batch_size": 4, "micro_batch_size": 4},
        "train": {"max_steps": 2},
        "output": {"dir": str(tmp_path / "out")},
    } | methods._distill(None)
    recipe["distill"]["teacher"] = str(tmp_path / "teacher")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    task = build_task(task_config(validate_recipe(recipe)), tokenizer)
    train, _ = task.fit(datasets.Dataset.from_list(rows), None)
    ours = task.encode_batch(train.to_dict())
    theirs = DataCollatorForChatML(tokenizer=tokenizer, max_length=methods.MAX_LENGTH)(rows)
    assert len(rows) == 8
    for i in range(len(rows)):
        kept = theirs["attention_mask"][i].bool()
        assert theirs["input_ids"][i][kept].tolist() == list(ours["input_ids"][i])
        assert theirs["labels"][i][kept].tolist() == list(ours["labels"][i])
    assert sum(label != -100 for row in ours["labels"] for label in row) > len(rows)


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_benchmark_measures_each_layout_and_writes_its_docs_section(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("before\n<!-- tensor-parallel:start -->\nSTALE-TABLE\n<!-- tensor-parallel:end -->\nafter\n")
    tiny = ["--hidden", "64", "--intermediate", "256", "--layers", "1", "--steps", "1", "2", "--batch", "4"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tensor_parallel.py"), *tiny]
        + ["--layouts", "1 process", "ddp x tp2 (2)", "--write-docs", "--docs", str(docs)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0] for row in rows] == ["| layout", "| 1 process", "| ddp x tp2 (2)"]
    assert [len(row[1].split()) for row in rows[1:]] == [1, 2]  # one peak per rank
    written = docs.read_text()
    assert written.startswith("before\n") and written.endswith("after\n") and "STALE-TABLE" not in written
    assert "| ddp x tp2 (2) |" in written and "--docs" not in written


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_benchmark_measures_each_layout_and_writes_its_docs_section(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("before\n<!-- expert-parallel:start -->\nSTALE-TABLE\n<!-- expert-parallel:end -->\nafter\n")
    tiny = ["--hidden", "64", "--expert-size", "64", "--experts", "4", "--layers", "1", "--steps", "1", "2"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "expert_parallel.py"), *tiny, "--batch", "4"]
        + ["--layouts", "1 process", "ddp x ep2 (2)", "--all-to-all", "--write-docs", "--docs", str(docs)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0] for row in rows] == ["| layout", "| 1 process", "| ddp x ep2 (2)", "| layout", "| ddp x ep2 (2)"]
    assert [len(row[1].split()) for row in rows[1:3]] == [1, 2]  # one peak per rank
    shares = rows[4][2].split()  # the all-to-all's share of a step on each rank, in percent
    assert len(shares) == 2 and all(0 < int(share.rstrip("%")) <= 100 for share in shares)
    written = docs.read_text()
    assert written.startswith("before\n") and written.endswith("after\n") and "STALE-TABLE" not in written
    assert "| ddp x ep2 (2) |" in written and "--docs" not in written


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_benchmark_measures_the_bubble_and_writes_its_docs_section(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("before\n<!-- pipeline:start -->\nSTALE-TABLE\n<!-- pipeline:end -->\nafter\n")
    tiny = ["--hidden", "64", "--layers", "4", "--micro-batches", "2", "--rounds", "1", "--schedules", "1f1b", "zbv"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "pipeline.py"), *tiny, "--write-docs", "--docs", str(docs)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0] for row in rows] == ["| schedule", "| 1f1b", "| zbv"]
    assert [row[3] for row in rows[1:]] == ["0.33", "0.20"]  # (p - 1) / (v·m + p - 1), p = m = 2
    assert all(0 <= float(b) <= 1 for row in rows[1:] for b in row[4].split())  # one bubble per rank
    written = docs.read_text()
    assert written.startswith("before\n") and written.endswith("after\n") and "STALE-TABLE" not in written
    assert "| zbv |" in written and "--docs" not in written


@pytest.mark.slow
@pytest.mark.distributed
def test_startup_benchmark_times_every_contender_to_its_first_step_and_writes_its_docs_section(tmp_path):
    docs, measured = tmp_path / "benchmarks.md", tmp_path / "startup.json"
    docs.write_text("before\n<!-- startup:start -->\nSTALE-TABLE\n<!-- startup:end -->\nafter\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "startup.py"), "--repeat", "1", "--write-docs"]
        + ["--docs", str(docs), "--json", str(measured)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert VERDICT.fullmatch(lines[-1]), lines[-1]
    runs = json.loads(measured.read_text())
    assert list(runs) == ["accord", "transformers.Trainer", "TRL SFTTrainer"]
    for name, (run,) in runs.items():
        assert 0 < run["first step"] < run["exit"] and run["CPU s"] > 0, (name, run)
        assert any(line.startswith(f"{name} ") for line in lines), name
    assert set(runs["accord"][0]) >= {"first output", "workers started", "data check", "loading model"}
    written = docs.read_text()
    assert written.startswith("before\n") and written.endswith("after\n") and "STALE-TABLE" not in written
    assert lines[-1] in written and "--docs" not in written and "--json" not in written


def test_startup_verdict_is_the_best_peers_median_first_step_over_accords():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import startup

    def runs(*seconds):
        return [{"first step": s} for s in seconds]

    results = {"accord": runs(2, 3, 9), "transformers.Trainer": runs(4, 4.5, 5), "TRL SFTTrainer": runs(6, 6, 6)}
    assert startup.verdict(results).startswith("accord / best peer: 1.50x (transformers.Trainer")
    assert VERDICT.fullmatch(startup.verdict(results))


@pytest.mark.subprocess
def test_write_docs_without_markers_stops_before_any_run(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("no markers here\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "grpo.py"), "--write-docs", "--docs", str(docs)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        timeout=120,
    )
    assert proc.returncode == 2 and "markers" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_gpu_check_dry_run_writes_its_json_and_markdown_on_a_cpu(tmp_path):
    out, table = tmp_path / "gpu.json", tmp_path / "gpu.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)]
        + ["--markdown", str(table)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [p["run"] for p in data["peers"]] == ["SFT throughput", "GRPO"]
    for peer in data["peers"]:
        assert "error" not in peer, peer
        assert VERDICT.fullmatch(peer["verdict"]) and peer["verdict"] in table.read_text()
    runs = [r["run"] for r in data["runs"]]
    assert runs == [
        "fsdp (2)",
        "fsdp x tp2 (2)",
        "moe ddp",
        "moe fsdp",
        "moe fsdp x ep2 (2)",
        "ddp (2)",
        "ddp x pp2 (2)",
    ]
    for run in data["runs"]:
        assert "error" not in run and len(run["peak_gib_per_rank"]) == (2 if "(2)" in run["run"] else 1), run
        assert f"| {run['run']} | {run['tokens_per_s']:,.0f} |" in table.read_text()
    assert data["runs"][2]["router_imbalance"] >= 1.0
    assert data["runs"][4]["router_imbalance"] >= 1.0  # the expert-parallel run's, over both ranks' tokens


def test_gpu_check_skips_tensor_expert_and_pipeline_parallel_on_one_gpu_and_says_why():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    assert "needs 2 GPUs" in gpu_check.tp_gpus(1) and "has 1" in gpu_check.tp_gpus(1)
    assert gpu_check.tp_gpus(2) == ""
    skipped = gpu_check.tensor_parallel(REPO, dry_run=False, visible=1)
    assert skipped == [{"run": "fsdp x tp2", "skipped": gpu_check.tp_gpus(1)}]
    assert "skipped: engine.tensor_parallel=2 needs 2 GPUs" in gpu_check.markdown(skipped, [], "one GPU")
    assert "needs 2 GPUs (one per stage)" in gpu_check.pp_gpus(1) and gpu_check.pp_gpus(2) == ""
    skipped = gpu_check.pipeline_parallel(REPO, dry_run=False, visible=1)
    assert skipped == [{"run": "ddp x pp2", "skipped": gpu_check.pp_gpus(1)}]
    import gpu_check_moe

    assert "needs 2 GPUs" in gpu_check_moe.ep_gpus(1) and gpu_check_moe.ep_gpus(2) == ""
