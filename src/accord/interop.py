"""Hugging Face Accelerate at the edges: the config `accelerate launch` was given is honoured
(what it says fills in what the recipe leaves open, and a contradiction is an error naming
both values), and `accord config` writes the accelerate config that matches a recipe.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from accord.batching import BatchPlan
from accord.recipe import Recipe, RecipeError, validate_recipe

_PRECISION = {"no": "no", "bf16": "bf16", "fp16": "fp16"}


def accelerate_settings(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Recipe values implied by the `accelerate launch` environment (empty outside it).

    Keys are dotted recipe paths; `batch.grad_accum` and the DeepSpeed file's batch sizes
    are checked against the batch plan rather than set.
    """
    env = dict(os.environ) if env is None else env
    if "ACCELERATE_MIXED_PRECISION" not in env:
        return {}
    settings: dict[str, Any] = {}
    precision = env["ACCELERATE_MIXED_PRECISION"].lower()
    if precision not in _PRECISION:
        raise RecipeError(f"accelerate config: mixed_precision {precision!r} is not supported by accord (use no, bf16 or fp16)")
    settings["engine.precision"] = precision
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        settings |= _deepspeed_settings(env)
    elif env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        settings["engine.strategy"] = "fsdp"
        if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            raise RecipeError("accelerate config: fsdp_offload_params is not supported by accord's fsdp; use a zero3 strategy with offload")
        if env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true":
            settings["engine.activation_checkpointing"] = True
        layer = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
        if layer:
            settings["engine.fsdp_layer_class"] = layer.split(",")[0].strip()
    else:
        settings["engine.strategy"] = "ddp"
    return settings


def deepspeed_file_settings(path: str) -> dict[str, Any]:
    """Recipe values a user's DeepSpeed JSON implies (engine.deepspeed_config)."""
    return _deepspeed_settings({"ACCELERATE_DEEPSPEED_CONFIG_FILE": path}, source="engine.deepspeed_config")


def _read_json(path: str, source: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise RecipeError(f"{source}: file not found: {path}")
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{source}: {path} is not valid JSON ({e.msg}, line {e.lineno})") from None


def _deepspeed_settings(env: dict[str, str], source: str = "accelerate config: deepspeed_config_file") -> dict[str, Any]:
    settings: dict[str, Any] = {}
    config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    ds = _read_json(config_file, source) if config_file and config_file != "none" else {}
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"))
    if stage is not None and str(stage) != "auto":
        if str(stage) == "0":
            raise RecipeError("accelerate config: DeepSpeed ZeRO stage 0 is plain data parallelism; use engine.strategy=ddp")
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
    for key, name in (("train_micro_batch_size_per_gpu", "batch.micro_batch_size"), ("train_batch_size", "batch.global_batch_size")):
        if ds.get(key) not in (None, "auto"):
            settings[name] = int(ds[key])
    for key in ("bf16", "fp16"):
        if isinstance(ds.get(key), dict) and ds[key].get("enabled") is True:
            settings["engine.precision"] = key
    return settings


def _device(section: Any, fallback: str | None) -> str | None:
    if isinstance(section, dict) and "device" in section:
        return str(section["device"]).lower()
    return fallback.lower() if fallback else None


def reconcile(recipe: Recipe, settings: dict[str, Any], world_size: int, source: str = "accelerate config") -> Recipe:
    """The recipe with the launcher's settings filled in where the recipe is silent; a value
    the recipe sets differently is an error naming both."""
    if not settings:
        return recipe
    data = recipe.model_dump(mode="json")
    accumulation = settings.pop("batch.grad_accum", None)
    conflicts = []
    for key, value in settings.items():
        section_name, field = key.split(".")
        section = getattr(recipe, section_name)
        current = getattr(section, field)
        if field in section.model_fields_set or key.startswith("batch."):
            if current != value:
                conflicts.append(f"{source} has {key}={value!r} but the recipe has {key}={current!r}")
        else:
            data[section_name][field] = value
    if conflicts:
        raise RecipeError("; ".join(conflicts) + " — make them agree (or leave the value out of one of them)")
    merged = validate_recipe(data, source=source)
    if accumulation is not None:
        plan = BatchPlan.derive(merged.batch.global_batch_size, merged.batch.micro_batch_size, world_size)
        if plan.grad_accum != accumulation:
            micro = merged.batch.global_batch_size // (world_size * accumulation) if merged.batch.global_batch_size % (world_size * accumulation) == 0 else None
            hint = f"set batch.micro_batch_size={micro}" if micro else "change the global batch or the accumulation"
            raise RecipeError(
                f"{source} has gradient_accumulation_steps={accumulation} but the recipe gives {plan.grad_accum} "
                f"({plan.describe()}); {hint}, or drop it from the config (accord derives it)"
            )
    return merged


# ---------------------------------------------------------------- accord config


def accelerate_config(
    recipe: Recipe, num_processes: int, num_machines: int = 1, machine_rank: int = 0,
    main_process_ip: str | None = None, main_process_port: int = 29500,
) -> dict[str, Any]:
    """The accelerate config that launches `recipe` as accord itself would."""
    engine = recipe.engine
    plan = BatchPlan.derive(recipe.batch.global_batch_size, recipe.batch.micro_batch_size, num_processes)
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "mixed_precision": engine.precision,
        "num_machines": num_machines,
        "num_processes": num_processes,
        "machine_rank": machine_rank,
        "rdzv_backend": "static",
        "same_network": True,
        # Not use_cpu: with it accelerate starts one process whatever num_processes says;
        # accord picks the CPU by itself when there is no GPU.
        "use_cpu": False,
        "main_training_function": "main",
    }
    if num_machines > 1:
        config |= {"main_process_ip": main_process_ip, "main_process_port": main_process_port}
    if engine.strategy.startswith("zero"):
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "zero_stage": int(engine.strategy[-1]),
            "gradient_accumulation_steps": plan.grad_accum,
            "gradient_clipping": recipe.optim.max_grad_norm if recipe.optim.max_grad_norm is not None else 0.0,
            "offload_optimizer_device": "cpu" if engine.offload != "none" else "none",
            "offload_param_device": "cpu" if engine.offload == "optimizer+params" else "none",
            "zero3_init_flag": False,
            "deepspeed_multinode_launcher": "standard",
        }
    elif engine.strategy == "fsdp":
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_activation_checkpointing": engine.activation_checkpointing,
            "fsdp_offload_params": False,
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            **({"fsdp_transformer_layer_cls_to_wrap": engine.fsdp_layer_class} if engine.fsdp_layer_class else {}),
        }
    else:
        config["distributed_type"] = "MULTI_GPU" if num_processes > 1 else "NO"
    return config


def write_accelerate_config(config: dict[str, Any], path: Path) -> None:
    path.write_text(yaml.safe_dump(config, sort_keys=True))
