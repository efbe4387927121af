"""What a run shows: report pages, throughput and MFU figures."""

from __future__ import annotations

import json

import torch

from accord.observe.report import render_report
from accord.observe.throughput import flops_per_token, peak_tflops
from conftest import run_accord_here


def _metrics(folder, records):
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_renders_plots_into_one_self_contained_page(tmp_path):
    records = [{"kind": "train", "step": s, "loss": 5.0 / s, "lr": 1e-3} for s in range(1, 21)]
    records += [{"kind": "eval", "step": 20, "loss": 0.3, "accuracy": 0.9}]
    records += [
        {"kind": "throughput", "step": 20, "tokens_per_s": 1000.0, "target_tokens_per_s": 800.0, "peak_memory_gib": 1.5}
    ]
    _metrics(tmp_path, records)
    page = render_report(tmp_path)
    names = sorted(p.name for p in page.parent.glob("*.png"))
    assert names == ["eval_accuracy.png", "learning_rate.png", "loss.png", "memory.png", "throughput.png"]
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 5 and "accuracy 90.0%" in text


def test_report_plots_only_metrics_per_task_with_labelled_axes(tmp_path):
    """No timestamp or prompt count as a series; accuracies as % on 0-100, perplexity apart,
    memory from 0, every axis labelled."""
    from accord.observe.report import panels, summary

    t0 = 1.796e9
    records = [
        {"kind": "train", "step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0, "time": t0 + s}
        for s in range(1, 11)
    ]
    records += [
        {
            "kind": "eval",
            "step": s,
            "loss": 1.0 / s,
            "perplexity": 2.0,
            "exact_match_accuracy": s / 10,
            "generated": 256,
            "time": t0 + s,
        }
        for s in (5, 10)
    ]
    records += [
        {"kind": "throughput", "step": s, "tokens_per_s": 900.0 + s, "peak_memory_gib": 0.59 + s / 1000, "time": t0}
        for s in (5, 10)
    ]
    records += [
        {"kind": "memory", "step": 10, "phase": "export", "peak_gib_per_rank": [0.6, 0.597], "peak_gib_max": 0.6}
    ]
    made = {p.name: p for p in panels(records, "sft")}
    assert set(made) == {
        "loss",
        "eval_accuracy",
        "eval_perplexity",
        "learning_rate",
        "grad_norm",
        "throughput",
        "memory",
    }
    assert [label for label, _ in made["eval_accuracy"].lines] == ["exact match"] and made["eval_accuracy"].percent
    every_label = [label for p in made.values() for label, _ in p.lines]
    assert not any("time" in label or "generated" in label for label in every_label)
    assert all(p.ylabel for p in made.values()) and made["memory"].from_zero
    rows = dict(
        summary(
            records,
            {
                "task": "sft",
                "model": {"config": {"architecture": "llama"}},
                "engine": {"strategy": "ddp", "precision": "no"},
            },
        )
    )
    assert rows["final evaluation (step 10)"].startswith("loss 0.1, perplexity 2, exact match 100.0%")
    assert "time" not in rows["final evaluation (step 10)"] and rows["peak memory"] == "0.60 GiB per process (largest)"

    _metrics(tmp_path, records)
    page = render_report(tmp_path)
    import matplotlib.image

    assert matplotlib.image.imread(page.parent / "memory.png").shape[:2] == (360, 640)


def test_report_of_a_folder_without_metrics_is_a_clear_error(tmp_path):
    proc = run_accord_here("report", tmp_path)
    assert proc.returncode == 2 and "no metrics.jsonl here" in proc.stderr


def test_flops_per_token_counts_non_embedding_weights_and_attention():
    """Against torch's own count of the matrix products in a forward + backward (eager
    attention, so QKᵀ and AV are counted too), at two context lengths. The 6·N convention
    also charges 6 FLOPs per token to the few weights used elementwise (the norms): added
    here by hand."""
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config)
    elementwise = sum(
        p.numel()
        for m in model.modules()
        if not isinstance(m, (nn.Linear, nn.Embedding))
        for p in m.parameters(recurse=False)
    )
    assert elementwise == (2 * 2 + 1) * 32  # two norms per layer and the final one
    for context in (64, 128):
        ids = torch.randint(0, 100, (2, context))
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        counted = counter.get_total_flops() / ids.numel()
        assert flops_per_token(model, context=context) == counted + 6 * elementwise


def test_peak_rate_is_known_only_for_accelerators():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), override=100.0) == 100.0


def test_report_page_in_a_headless_browser_shows_the_summary_first(tmp_path):
    """Chromium (Debian's `chromium`) renders the page: the run's summary (final evaluation as
    percentages, throughput, memory) and the recipe are visible text, and the screenshot shows them."""
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        import pytest

        pytest.skip("no chromium installed (apt-get install -y chromium)")
    records = [
        {"kind": "train", "step": s, "loss": 4.0 / s, "lr": 1e-3, "grad_norm": 0.5, "time": 1.796e9 + s}
        for s in range(1, 11)
    ]
    records += [
        {
            "kind": "eval",
            "step": 10,
            "loss": 0.25,
            "perplexity": 1.28,
            "exact_match_accuracy": 0.973,
            "generated": 256,
            "time": 1.796e9,
        }
    ]
    records += [{"kind": "throughput", "step": 10, "tokens_per_s": 4321.0, "peak_memory_gib": 0.59, "time": 1.796e9}]
    _metrics(tmp_path, records)
    (tmp_path / "recipe.yaml").write_text(
        "seed: 0\ntask: sft\nmodel: {config: {architecture: llama}}\nengine: {strategy: ddp, precision: 'no'}\n"
    )
    page = render_report(tmp_path)
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1300,900"]
    dom = subprocess.run(base + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=60).stdout
    import re

    visible = re.sub(r"<style>.*?</style>", "", dom, flags=re.S)
    visible = re.sub(r"<[^>]+>", " ", re.sub(r'src="data:[^"]*"', "", visible))
    visible = " ".join(visible.split())
    assert "final evaluation (step 10) loss 0.25, perplexity 1.28, exact match 97.3% (256 prompts generated)" in visible
    assert "4,321 tokens/s" in visible and "0.59 GiB per process" in visible and "architecture: llama" in visible
    assert "1.796e+09" not in visible and "eval time" not in visible
    assert visible.index("summary") < visible.index("plots")
    shot = tmp_path / "page.png"
    subprocess.run(base + [f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=60)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (900, 1300)
    assert (pixels[:400, :, :3].mean(axis=2) < 0.3).mean() > 0.005  # dark text in the top part: the summary rendered
