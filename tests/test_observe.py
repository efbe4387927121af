"""What a run shows: report pages, throughput and MFU figures."""

from __future__ import annotations

import json

import torch

from accord.observe.report import render_report
from accord.observe.throughput import flops_per_token, peak_tflops
from conftest import run_accord


def _metrics(folder, records):
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_renders_plots_into_one_self_contained_page(tmp_path):
    records = [{"kind": "train", "step": s, "loss": 5.0 / s, "lr": 1e-3} for s in range(1, 21)]
    records += [{"kind": "eval", "step": 20, "loss": 0.3, "accuracy": 0.9}]
    records += [{"kind": "throughput", "step": 20, "tokens_per_s": 1000.0, "target_tokens_per_s": 800.0, "peak_memory_gib": 1.5}]
    _metrics(tmp_path, records)
    page = render_report(tmp_path)
    names = sorted(p.name for p in page.parent.glob("*.png"))
    assert names == ["eval_metrics.png", "learning_rate.png", "loss.png", "memory.png", "throughput.png"]
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 5 and "eval accuracy" in text


def test_report_of_a_folder_without_metrics_is_a_clear_error(tmp_path):
    proc = run_accord("report", tmp_path, timeout=60)
    assert proc.returncode == 2 and "no metrics.jsonl here" in proc.stderr


def test_flops_per_token_counts_non_embedding_weights_and_attention():
    """Against torch's own count of the matrix products in a forward + backward (eager
    attention, so QKᵀ and AV are counted too), at two context lengths. The 6·N convention
    also charges 6 FLOPs per token to the few weights used elementwise (the norms): added
    here by hand."""
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    elementwise = sum(p.numel() for m in model.modules() if not isinstance(m, (nn.Linear, nn.Embedding)) for p in m.parameters(recurse=False))
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
