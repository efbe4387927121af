"""Phase 8 of benchmarks/gpu_check.py: a mixture-of-experts model under ddp and fsdp on one GPU,
with the router's balancing loss over the global batch (tokens/s, peak memory, router
imbalance), then under fsdp x engine.expert_parallel 2 on an even number of GPUs (2 or more: on
one it says it skips, and why), each rank's peak memory beside the one-GPU runs'."""

from __future__ import annotations

import json
import os
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


def ep_gpus(visible: int) -> str:
    """Why phase 8's expert-parallel part cannot run on `visible` GPUs ("" when it can)."""
    if visible < 2:
        return (
            f"engine.expert_parallel=2 needs 2 GPUs (each holds half of every layer's experts); this machine has "
            f"{visible}"
        )
    return ""


def mixture_of_experts(folder: Path, dry_run: bool, recipe, train, visible: int = 0) -> list[dict]:
    """Phase 8: the MoE under ddp and fsdp on one device, then fsdp x EP 2 on `visible` GPUs (an
    even number of them); the dry run: a tiny one on the CPU (EP on 2 gloo processes).
    `recipe` and `train`: gpu_check's own (a pretraining recipe on its corpus, a run of it)."""
    print("\nmixture of experts" + (" (dry run: plumbing only)" if dry_run else "") + ":")
    results = []
    for strategy in ("ddp", "fsdp"):
        data = _moe_recipe(recipe, folder, f"moe-{strategy}", strategy, dry_run)
        results.append(_run(train, data, f"moe {strategy}"))
    why = "" if dry_run else ep_gpus(visible)
    if why:
        print(f"moe expert parallel: skipped: {why}")
        return results + [{"run": "moe fsdp x ep2", "skipped": why}]
    world = 2 if dry_run else visible - visible % 2
    env = dict(os.environ)
    if not dry_run:  # an even number of GPUs, so that EP 2 divides the world
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(world))
    data = _moe_recipe(recipe, folder, "moe-fsdp-ep2", "fsdp", dry_run)
    data["engine"] |= {"expert_parallel": 2, "processes": world}
    del data["batch"]["micro_batch_size"]  # the default: the global batch over the ranks
    return results + [_run(train, data, f"moe fsdp x ep2 ({world})", env)]


def _moe_recipe(recipe, folder: Path, name: str, strategy: str, dry_run: bool) -> dict:
    path = recipe(folder, name, strategy, 2 if dry_run else 8, False, 4 if dry_run else 8)
    data = yaml.safe_load(path.read_text())
    data["model"]["config"] = MOE_TINY if dry_run else MOE
    data["moe"] = {"balance_loss": "global_batch", "aux_loss_coef": 0.01}
    data["_path"] = str(path)
    if dry_run:
        data["data"]["max_length"] = 64
        data["engine"] |= {"device": "cpu", "precision": "no", "processes": 1}
    return data


def _run(train, data: dict, label: str, env: dict[str, str] | None = None) -> dict:
    """Train the recipe `data` (written back to its file first); its summary, printed as a row."""
    path = Path(data.pop("_path"))
    path.write_text(yaml.safe_dump(data))
    seconds, summary = train(path, 300, env=env)
    summary |= {"run": label, "wall_s": seconds}
    if "error" not in summary:
        out = Path(data["output"]["dir"])
        trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary["router_imbalance"] = [r for r in trained if r["kind"] == "train"][-1]["router_imbalance"]
    if "error" in summary:
        print(f"{label:24} {seconds:>7.0f}  failed: {summary['error']}")
        return summary
    peaks = " ".join(f"{p:.2f}" for p in summary.get("peak_gib_per_rank", []))
    print(
        f"{label:24} {seconds:>7.0f} s {summary['tokens_per_s']:>10,.0f} tokens/s, peak "
        f"{summary['peak_memory_gib']:.1f} GiB (per rank {peaks}), router imbalance "
        f"{summary['router_imbalance']:.2f}, loss {summary['final_loss']:.3f}"
    )
    return summary
