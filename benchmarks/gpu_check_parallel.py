"""Phases 7 and 9 of benchmarks/gpu_check.py: the model-parallel degrees beside their
data-parallel run on the same GPUs (an even number of them, 2 or more: on one each says it
skips, and why): fsdp alone, then fsdp x engine.tensor_parallel 2; ddp alone, then ddp x
engine.pipeline_parallel 2 (1f1b). Tokens/s and each rank's peak memory; the dry run: a tiny
Llama on 2 gloo processes."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

TP_TINY = {  # the dry run's Llama: 4 heads (TP 2 splits them), a wide MLP
    "architecture": "llama",
    "hidden_size": 64,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}


def tp_gpus(visible: int) -> str:
    """Why phase 7 cannot run on `visible` GPUs ("" when it can)."""
    if visible < 2:
        return f"engine.tensor_parallel=2 needs 2 GPUs (one per TP rank); this machine has {visible}"
    return ""


def tensor_parallel(folder: Path, dry_run: bool, visible: int, recipe, train) -> list[dict]:
    """Phase 7: fsdp alone, then fsdp x TP 2, on the same processes; the dry run: 2 gloo processes, tiny.
    `recipe` and `train`: gpu_check's own (a pretraining recipe on its corpus, a run of it)."""

    def layout(tp: int, world: int) -> tuple[str, Path]:
        path = recipe(folder, f"tp{tp}-fsdp", "fsdp", 2 if dry_run else 8, False, 4 if dry_run else 8)
        data = yaml.safe_load(path.read_text())
        data["engine"] |= {"tensor_parallel": tp, "processes": world}
        del data["batch"]["micro_batch_size"]  # the default: the global batch over the data-parallel ranks
        return "fsdp x tp2" if tp > 1 else "fsdp", _written(path, data, dry_run)

    why = "" if dry_run else tp_gpus(visible)
    return _beside_data_parallel("tensor parallel", "fsdp x tp2", why, dry_run, visible, layout, train)


def pp_gpus(visible: int) -> str:
    """Why phase 9 cannot run on `visible` GPUs ("" when it can)."""
    if visible < 2:
        return f"engine.pipeline_parallel=2 needs 2 GPUs (one per stage); this machine has {visible}"
    return ""


def pipeline_parallel(folder: Path, dry_run: bool, visible: int, recipe, train) -> list[dict]:
    """Phase 9: ddp alone, then ddp x PP 2 (1f1b), on the same processes; the dry run: 2 gloo processes, tiny.
    `recipe` and `train`: gpu_check's own."""

    def layout(pp: int, world: int) -> tuple[str, Path]:
        batch = 8 if dry_run else 16
        path = recipe(folder, f"pp{pp}-ddp", "ddp", 2 if dry_run else 8, False, batch)
        data = yaml.safe_load(path.read_text())
        data["engine"] |= {"pipeline_parallel": pp, "processes": world}
        # 4 micro-batches per pipeline (1f1b needs at least one per stage); the same rows per step either way.
        data["batch"]["micro_batch_size"] = batch * pp // world // 4
        return "ddp x pp2" if pp > 1 else "ddp", _written(path, data, dry_run)

    why = "" if dry_run else pp_gpus(visible)
    return _beside_data_parallel("pipeline parallel", "ddp x pp2", why, dry_run, visible, layout, train)


def _written(path: Path, data: dict, dry_run: bool) -> Path:
    """`data` written to `path`, on the dry run's tiny Llama on the CPU when it is one."""
    if dry_run:
        data["model"]["config"] = TP_TINY
        data["data"]["max_length"] = 64
        data["engine"] |= {"device": "cpu", "precision": "no"}
    path.write_text(yaml.safe_dump(data))
    return path


def _beside_data_parallel(title: str, run: str, why: str, dry_run: bool, visible: int, layout, train) -> list[dict]:
    """The data-parallel run (degree 1), then the model-parallel one (degree 2), on an even number
    of GPUs (the dry run: 2 gloo processes); `layout(degree, world)` writes each one's recipe."""
    if why:
        print(f"\n{title}: skipped: {why}")
        return [{"run": run, "skipped": why}]
    world = 2 if dry_run else visible - visible % 2
    env = dict(os.environ)
    if not dry_run:  # an even number of GPUs, so that a degree of 2 divides the world
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(world))
    where = f"{world} gloo processes (dry run: plumbing only)" if dry_run else f"{world} GPUs"
    print(f"\n{title} on {where}:")
    results = []
    for degree in (1, 2):
        name, path = layout(degree, world)
        label = f"{name} ({world})"
        seconds, summary = train(path, 300, env=env)
        summary |= {"run": label, "wall_s": seconds, "planned_gib": None}
        results.append(summary)
        if "error" in summary:
            print(f"{label:24} {seconds:>7.0f}  failed: {summary['error']}")
            continue
        peaks = " ".join(f"{p:.2f}" for p in summary.get("peak_gib_per_rank", []))
        print(
            f"{label:24} {seconds:>7.0f} s {summary['tokens_per_s']:>10,.0f} tokens/s, peak per rank "
            f"{peaks} GiB, loss {summary['final_loss']:.3f}"
        )
    return results
