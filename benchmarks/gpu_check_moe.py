"""Phase 8 of benchmarks/gpu_check.py: a mixture-of-experts model under ddp and fsdp on one GPU,
with the router's balancing loss over the global batch (tokens/s, peak memory, router
imbalance). Expert parallelism is not built yet: its part says it skips, and why."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

MOE = {  # ~0.4B parameters in all, ~0.1B active per token (2 of 16 experts)
    "architecture": "qwen3_moe",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "moe_intermediate_size": 704,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
}
MOE_TINY = MOE | {"hidden_size": 32, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
MOE_TINY |= {"num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "max_position_embeddings": 64}


def mixture_of_experts(folder: Path, dry_run: bool, recipe, train) -> list[dict]:
    """Phase 8: the MoE under ddp and fsdp on one device; the dry run: a tiny one on the CPU.
    `recipe` and `train`: gpu_check's own (a pretraining recipe on its corpus, a run of it)."""
    print("\nmixture of experts" + (" (dry run: plumbing only)" if dry_run else "") + ":")
    results = []
    for strategy in ("ddp", "fsdp"):
        path = recipe(folder, f"moe-{strategy}", strategy, 2 if dry_run else 8, False, 4 if dry_run else 8)
        data = yaml.safe_load(path.read_text())
        data["model"]["config"] = MOE_TINY if dry_run else MOE
        data["moe"] = {"balance_loss": "global_batch", "aux_loss_coef": 0.01}
        if dry_run:
            data["data"]["max_length"] = 64
            data["engine"] |= {"device": "cpu", "precision": "no", "processes": 1}
        path.write_text(yaml.safe_dump(data))
        seconds, summary = train(path, 300)
        label = f"moe {strategy}"
        summary |= {"run": label, "wall_s": seconds}
        if "error" not in summary:
            out = Path(data["output"]["dir"])
            trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            summary["router_imbalance"] = [r for r in trained if r["kind"] == "train"][-1]["router_imbalance"]
        results.append(summary)
        if "error" in summary:
            print(f"{label:24} {seconds:>7.0f}  failed: {summary['error']}")
            continue
        print(
            f"{label:24} {seconds:>7.0f} s {summary['tokens_per_s']:>10,.0f} tokens/s, peak "
            f"{summary['peak_memory_gib']:.1f} GiB, router imbalance {summary['router_imbalance']:.2f}, "
            f"loss {summary['final_loss']:.3f}"
        )
    why = "engine.expert_parallel is not built yet (experts are sharded by fsdp/zero3 instead)"
    print(f"moe expert parallel: skipped: {why}")
    return results + [{"run": "moe expert parallel", "skipped": why}]
