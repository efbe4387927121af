"""Between recipes and DeepSpeed JSON configs, both ways.

`deepspeed_config` derives the whole config accord runs DeepSpeed with from the recipe's
engine and optim sections and the batch plan (batch, clipping, precision, AdamW settings):
nothing is left to "auto". `deepspeed_settings` reads the other way: the recipe values a
user's DeepSpeed JSON (or `accelerate launch`'s DeepSpeed environment) implies, for interop's
reconcile.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accord import registry
from accord.distributed.batch_plan import BatchPlan
from accord.engine.spec import EngineSpec
from accord.engine.wrapping import hidden_size, layer_modules
from accord.recipe.schema import RecipeError


def deepspeed_config(
    spec: EngineSpec, plan: BatchPlan, device: torch.device, model: nn.Module | None = None, world: int = 1
) -> dict[str, Any]:
    """The whole DeepSpeed config, from the engine and optim sections and the batch plan (no
    "auto" values); `world` is the number of ranks ZeRO-3 partitions over."""
    engine, optim = spec.engine, spec.optim
    stage = registry.strategy(engine.strategy).zero_stage
    cuda = device.type == "cuda"
    offload_optimizer = engine.offload in ("optimizer", "optimizer+params")
    adamw: dict[str, Any] = {
        "lr": optim.lr,
        "betas": list(optim.betas),
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    }
    if not (cuda and offload_optimizer):
        # torch's AdamW (the DDP path's optimizer, fused on GPU like it); only an optimizer
        # offloaded from a GPU uses DeepSpeed's compiled CPU Adam, which is much faster there.
        adamw["torch_adam"] = True
        if cuda:
            adamw["fused"] = True
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": cuda,  # overlapping needs streams; on the CPU it only adds bookkeeping
        "reduce_scatter": True,
    }
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if engine.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    width = hidden_size(model) if model is not None else None
    if width:
        # Buckets sized to the model, as transformers' integration derives them, instead of
        # DeepSpeed's fixed 5e8 elements (2 GB per fp32 buffer). Sums are elementwise: bucket
        # boundaries do not change the result.
        zero["reduce_bucket_size"] = width * width
        if stage == 3:
            zero["stage3_prefetch_bucket_size"] = int(0.9 * width * width)
    if stage == 3:
        # Parameters smaller than this stay whole on every rank (norms, biases): gathering
        # them costs more than they weigh. 10 × hidden size, as transformers' integration derives it.
        zero["stage3_param_persistence_threshold"] = 10 * width if width else 100_000
        layer = _largest_layer(model)
        if layer:
            zero.update(_stage3_bounds(layer, world))
        zero["stage3_gather_16bit_weights_on_model_save"] = False  # accord gathers fp32 weights itself
    config: dict[str, Any] = {
        # DeepSpeed checks micro × accumulation × ranks; the ranks of a sequence-parallel
        # group each count the rows they share (its gradient averaging is over all ranks too).
        "train_batch_size": plan.global_batch_size * plan.sequence_parallel,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": float(optim.max_grad_norm) if optim.max_grad_norm is not None else 0.0,
        "optimizer": {"type": "AdamW", "params": adamw},
        "zero_optimization": zero,
        # bf16 is accord's autocast over fp32 weights, as under DDP/FSDP: DeepSpeed's own bf16
        # mode keeps bf16 weights and gradients (accumulated and reduced in bf16), which
        # moved the quickstart's loss by 0.023 at step 3 where the torch engines agree to 6e-5.
        "bf16": {"enabled": False},
        "fp16": {
            "enabled": engine.precision == "fp16",
            # Dynamic loss scaling with torch.amp.GradScaler's defaults.
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 2000,
            "hysteresis": 1,
            "min_loss_scale": 1,
        },
        "steps_per_print": 2**31 - 1,  # accord reports progress itself
        "wall_clock_breakdown": False,
    }
    if engine.precision != "no":
        config["communication_data_type"] = "fp32"  # reduce gradients in fp32, as under DDP/FSDP
    assert "auto" not in repr(config), config
    return config


def zero3_sub_groups(model: nn.Module, groups: list[list[nn.Parameter]], world: int) -> int:
    """How many optimizer sub-groups (flat fp32 partitions, each with its own AdamW step)
    ZeRO-3 makes of `groups` under the bounds above, as DeepSpeed forms them: a group's
    parameters in order, closed once their per-rank partitions reach `sub_group_size`."""
    layer = _largest_layer(model)
    size = _stage3_bounds(layer, world)["sub_group_size"] if layer else 10**12  # DeepSpeed's default
    count = 0
    for group in groups:
        parts = [math.ceil(p.numel() / world) for p in group]
        if not parts:
            continue
        if size >= sum(parts):
            count += 1
            continue
        running = 0
        for i, part in enumerate(parts):
            running += part
            if running >= size or i == len(parts) - 1:
                count, running = count + 1, 0
    return count


def _largest_layer(model: nn.Module | None) -> int:
    """Elements of the model's largest decoder layer (0 when the model has none)."""
    if model is None:
        return 0
    return max((sum(p.numel() for p in m.parameters()) for m in layer_modules(model)), default=0)


def _stage3_bounds(layer: int, world: int) -> dict[str, int]:
    """ZeRO-3's limits, in elements, sized to one decoder layer instead of DeepSpeed's 1e9
    defaults, which exceed a whole model of under a billion parameters and so let every rank
    hold all of it unpartitioned: after the first step, a parameter whose next use lies within
    `max_reuse_distance` elements of the trace is kept gathered (every parameter of the
    forward is reused by the backward), and prefetching gathers up to `max_live_parameters`.
    `sub_group_size` (per-rank elements per optimizer sub-group) bounds the fp32 buffer
    DeepSpeed allocates at start-up for the largest sub-group's *unpartitioned* size (a whole
    model's gradient otherwise) and the gradient copy flattened at each step. Gathers and
    AdamW's elementwise update are exact; only the gradient norm is summed per sub-group
    (rounding-level)."""
    return {
        "stage3_max_live_parameters": 2 * layer,
        "stage3_max_reuse_distance": layer,
        "sub_group_size": max(layer // max(world, 1), 1),
    }


# ---------------------------------------------------------------- DeepSpeed JSON -> recipe


def deepspeed_file_settings(path: str) -> dict[str, Any]:
    """Recipe values a user's DeepSpeed JSON implies (engine.deepspeed_config)."""
    return deepspeed_settings({"ACCELERATE_DEEPSPEED_CONFIG_FILE": path}, source="engine.deepspeed_config")


def deepspeed_settings(env: dict[str, str], source: str = "accelerate config: deepspeed_config_file") -> dict[str, Any]:
    """Recipe values from accelerate's DeepSpeed environment variables and the JSON file
    they name (the file's values win). Keys are dotted recipe paths."""
    settings: dict[str, Any] = {}
    config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    ds = _read_json(config_file, source) if config_file and config_file != "none" else {}
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"))
    if stage is not None and str(stage) != "auto":
        if str(stage) == "0":
            raise RecipeError(
                "accelerate config: DeepSpeed ZeRO stage 0 is plain data parallelism; use engine.strategy=ddp"
            )
        settings["engine.strategy"] = f"zero{stage}"
    optimizer_device = _device(zero.get("offload_optimizer"), env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"))
    param_device = _device(zero.get("offload_param"), env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"))
    if param_device not in ("none", None):
        settings["engine.offload"] = "optimizer+params"
    elif optimizer_device not in ("none", None):
        settings["engine.offload"] = "optimizer"
    else:
        settings["engine.offload"] = "none"
    accumulation = ds.get("gradient_accumulation_steps", env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"))
    if accumulation not in (None, "auto"):
        settings["batch.grad_accum"] = int(accumulation)
    clipping = ds.get("gradient_clipping", env.get("ACCELERATE_GRADIENT_CLIPPING"))
    if clipping not in (None, "auto", "none"):
        settings["optim.max_grad_norm"] = float(clipping)
    for key, name in (
        ("train_micro_batch_size_per_gpu", "batch.micro_batch_size"),
        ("train_batch_size", "batch.global_batch_size"),
    ):
        if ds.get(key) not in (None, "auto"):
            settings[name] = int(ds[key])
    for key in ("bf16", "fp16"):
        if isinstance(ds.get(key), dict) and ds[key].get("enabled") is True:
            settings["engine.precision"] = key
    return settings


def _read_json(path: str, source: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise RecipeError(f"{source}: file not found: {path}")
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{source}: {path} is not valid JSON ({e.msg}, line {e.lineno})") from None


def _device(section: Any, fallback: str | None) -> str | None:
    """An offload section's device, else accelerate's environment value."""
    if isinstance(section, dict) and "device" in section:
        return str(section["device"]).lower()
    return fallback.lower() if fallback else None
