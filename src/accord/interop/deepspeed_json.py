"""A DeepSpeed JSON's keys against the rest of the job: "auto" resolved, an explicit value checked."""

from __future__ import annotations

from typing import Any

from accord.interop.job_keys import Entry, Job, Row

_DS_TARGETS = {
    "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
    "train_batch_size": "batch.global_batch_size",
    "gradient_clipping": "optim.max_grad_norm",
    "gradient_accumulation_steps": None,  # checked against the job's own
    "zero_optimization.stage": "engine.strategy",
    "bf16.enabled": "engine.precision",
    "fp16.enabled": "engine.precision",
}


def _lookup(recipe: dict, dotted: str) -> Any:
    node: Any = recipe
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def deepspeed_row(key: str, entry: Entry, recipe: dict, job: Job, refusals: list[str]) -> Row:
    """A DeepSpeed JSON key: "auto" resolved from the rest, an explicit value checked against it."""
    from accord.interop.recipe_keys import put

    value = entry.value
    if key == "gradient_accumulation_steps":
        ours = int(job.value("gradient_accumulation_steps"))
        target = None
    elif key in _DS_TARGETS:
        target = _DS_TARGETS[key]
        ours = _lookup(recipe, target)
    else:
        return Row(key, entry.origin, value, "dropped", "", "DeepSpeed tuning; accord derives its DeepSpeed config")
    if key.endswith(".enabled"):
        wanted = key.split(".")[0] if value is True else None
        if value == "auto" or wanted is None:
            return Row(key, entry.origin, value, "mapped", "", f"auto: engine.precision={_lookup(recipe, target)!r}")
        value, ours = wanted, _lookup(recipe, target) or "no"
    elif key == "zero_optimization.stage" and value != "auto":
        value = f"zero{value}" if int(value) else "ddp"
        if ours is None:
            put(recipe, "engine.strategy", value)
            return Row(key, entry.origin, entry.value, "mapped", f"engine.strategy={value!r}", "")
    if value == "auto":
        return Row(key, entry.origin, value, "mapped", "", f"auto: resolved from the rest ({target or key}={ours!r})")
    if ours is not None and _number(value) != _number(ours):
        refusals.append(f"{entry.origin}: {key}={value!r} but the job gives {target or key}={ours!r}")
        return Row(key, entry.origin, value, "refused", "", f"conflicts with {target or key}={ours!r}")
    return Row(key, entry.origin, value, "mapped", "", "agrees with the rest")


def _number(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value
