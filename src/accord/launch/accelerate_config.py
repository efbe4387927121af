"""Hugging Face Accelerate at the edges: the config `accelerate launch` was given is honoured
(what it says fills in what the recipe leaves open, and a contradiction is an error naming
both values), and `accord config` writes the accelerate config that matches a recipe.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from accord import registry
from accord.distributed.batch_plan import BatchPlan
from accord.engine.deepspeed.config import deepspeed_file_settings, deepspeed_settings
from accord.recipe.schema import Recipe, RecipeError, validate_recipe

# deepspeed_file_settings belongs to this interface (where launchers' and users' configs meet
# the recipe); the DeepSpeed JSON mapping itself lives beside the config derivation it inverts.
__all__ = [
    "accelerate_config",
    "accelerate_settings",
    "accelerate_warnings",
    "deepspeed_file_settings",
    "reconcile",
    "write_accelerate_config",
]

_PRECISION = {"no": "no", "bf16": "bf16", "fp16": "fp16"}


def accelerate_settings(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Recipe values implied by the `accelerate launch` environment (empty outside it).

    Keys are dotted recipe paths; `batch.grad_accum` and the DeepSpeed file's batch sizes
    are checked against the batch plan rather than set.
    """
    env = dict(os.environ) if env is None else env
    if "ACCELERATE_MIXED_PRECISION" not in env:
        return {}
    if "MASTER_ADDR" in env and "RANK" not in env:
        # accelerate sets MASTER_ADDR only for several processes or machines, and RANK in each
        # process it starts: this one is alone. MULTI_CPU (or --cpu) leaves starting the
        # others to mpirun; every node would train alone and write a whole model.
        raise RecipeError(
            "accelerate launch started one process although its config asks for several processes or machines "
            "(distributed_type MULTI_CPU, or use_cpu, starts no others without mpirun); on CPUs use "
            "distributed_type: MULTI_GPU with use_cpu: false (accord config R.yaml --out accelerate.yaml writes one)"
        )
    settings: dict[str, Any] = parallelism_settings(env)
    precision = env["ACCELERATE_MIXED_PRECISION"].lower()
    if precision not in _PRECISION:
        raise RecipeError(
            f"accelerate config: mixed_precision {precision!r} is not supported by accord (use no, bf16 or fp16)"
        )
    settings["engine.precision"] = precision
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        settings |= deepspeed_settings(env)
    elif env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        settings["engine.strategy"] = "fsdp"
        if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            raise RecipeError(
                "accelerate config: fsdp_offload_params is not supported by accord's fsdp; use a zero3 strategy with "
                "offload"
            )
        if env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true":
            settings["engine.activation_checkpointing"] = True
        layer = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
        if layer:
            settings["engine.fsdp_layer_class"] = layer.split(",")[0].strip()
    else:
        settings["engine.strategy"] = "ddp"
    return settings


# accelerate's parallelism_config (what `accelerate launch` passes as PARALLELISM_CONFIG_*):
# the dimensions accord cannot run yet, by the key the config file spells.
_UNSUPPORTED_PARALLELISM = {
    "CP_SIZE": ("parallelism_config_cp_size", "context parallelism"),
    "SP_SIZE": ("parallelism_config_sp_size", "sequence parallelism"),
}


def parallelism_settings(env: dict[str, str]) -> dict[str, Any]:
    """What an accelerate config's parallelism_config asks of accord: sequence parallelism on
    the deepspeed backend (accelerate's default for sp) is engine.sequence_parallel (DeepSpeed's
    Ulysses attention, as accelerate runs it); tp_size is engine.tensor_parallel (torch's
    tensor parallelism, as accelerate runs it); context or other sequence parallelism over
    more than one rank is refused (never silently dropped), and so is hybrid sharding; a
    data-parallel size is checked against the world (reconcile)."""
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() != "true":
        return {}
    settings: dict[str, Any] = {}
    sequence = int(env.get("PARALLELISM_CONFIG_SP_SIZE", "1"))
    if sequence > 1 and env.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed") == "deepspeed":
        settings["engine.sequence_parallel"] = sequence
        env = {k: v for k, v in env.items() if k != "PARALLELISM_CONFIG_SP_SIZE"}
    tensor = int(env.get("PARALLELISM_CONFIG_TP_SIZE", "1"))
    if tensor > 1:
        settings["engine.tensor_parallel"] = tensor
    for name, (key, what) in _UNSUPPORTED_PARALLELISM.items():
        size = int(env.get(f"PARALLELISM_CONFIG_{name}", "1"))
        if size > 1:
            backend = env.get(f"PARALLELISM_CONFIG_{name[:2]}_BACKEND")
            via = f" ({backend} backend)" if backend else ""
            raise RecipeError(
                f"accelerate config: {key}={size} asks for {what}{via}, which accord does not support yet; set it to 1 "
                f"(or remove parallelism_config) to train with plain data parallelism over all ranks"
            )
    replicate = int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1"))
    shard = int(env.get("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1"))
    if replicate > 1 and shard > 1:
        raise RecipeError(
            f"accelerate config: parallelism_config_dp_replicate_size={replicate} with "
            f"parallelism_config_dp_shard_size={shard} "
            "asks for hybrid sharding, which accord does not support; keep one of them (accord shards or replicates "
            "over all ranks)"
        )
    if max(replicate, shard) > 1:
        settings["parallelism.data_parallel"] = max(replicate, shard)
    return settings


def accelerate_warnings(env: dict[str, str] | None = None) -> list[str]:
    """What the `accelerate launch` environment asks that accord honours differently (one line each)."""
    env = dict(os.environ) if env is None else env
    lines = []
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true" and env.get("FSDP_VERSION", "2") == "1":
        # A warning, not an error: FSDP2 shards the same way (FULL_SHARD per layer) and gives
        # the same updates, so TRL's and others' fsdp_version 1 configs still run as meant.
        strategy = env.get("FSDP_SHARDING_STRATEGY")
        detail = (
            f" (fsdp_sharding_strategy {strategy} is not applied)"
            if strategy and strategy not in ("1", "FULL_SHARD")
            else ""
        )
        lines.append(
            "accelerate config has fsdp_version: 1, but accord runs FSDP2 (fully_shard, each decoder layer fully "
            f"sharded){detail}; "
            f"set fsdp_version: 2 to silence this"
        )
    return lines


def reconcile(recipe: Recipe, settings: dict[str, Any], world_size: int, source: str = "accelerate config") -> Recipe:
    """The recipe with the launcher's settings filled in where the recipe is silent; a value
    the recipe sets differently is an error naming both."""
    if not settings:
        return recipe
    data = recipe.model_dump(mode="json")
    accumulation = settings.pop("batch.grad_accum", None)
    data_parallel = settings.pop("parallelism.data_parallel", None)
    sequence = settings.get("engine.sequence_parallel", recipe.engine.sequence_parallel)
    tensor = settings.get("engine.tensor_parallel", recipe.engine.tensor_parallel)
    per_group = sequence * tensor
    if data_parallel is not None and data_parallel * per_group != world_size:
        groups = (
            f"{world_size // per_group} data-parallel groups of {per_group}"
            if per_group > 1
            else "all of them data-parallel"
        )
        raise RecipeError(
            f"{source} has a data-parallel size of {data_parallel} (parallelism_config) but accord runs {world_size} "
            f"processes, {groups}; make them agree or remove parallelism_config"
        )
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
        plan = BatchPlan.of(merged.batch, merged.engine, world_size)
        if plan.grad_accum != accumulation:
            groups = plan.world_size  # data-parallel: processes / engine.sequence_parallel
            micro = (
                merged.batch.global_batch_size // (groups * accumulation)
                if merged.batch.global_batch_size % (groups * accumulation) == 0
                else None
            )
            hint = f"set batch.micro_batch_size={micro}" if micro else "change the global batch or the accumulation"
            raise RecipeError(
                f"{source} has gradient_accumulation_steps={accumulation} but the recipe gives {plan.grad_accum} "
                f"({plan.describe()}); {hint}, or drop it from the config (accord derives it)"
            )
    return merged


# ---------------------------------------------------------------- accord config


def accelerate_config(
    recipe: Recipe,
    num_processes: int,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int = 29500,
) -> dict[str, Any]:
    """The accelerate config that launches `recipe` as accord itself would."""
    engine = recipe.engine
    plan = BatchPlan.of(recipe.batch, recipe.engine, num_processes)
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
    strategy = registry.strategy(engine.strategy)
    if strategy.deepspeed:
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "zero_stage": strategy.zero_stage,
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
            "fsdp_activation_checkpointing": bool(engine.activation_checkpointing),
            "fsdp_offload_params": False,
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            **({"fsdp_transformer_layer_cls_to_wrap": engine.fsdp_layer_class} if engine.fsdp_layer_class else {}),
        }
    else:
        config["distributed_type"] = "MULTI_GPU" if num_processes > 1 else "NO"
    if engine.sequence_parallel > 1 or engine.tensor_parallel > 1:
        # accelerate's ALST form (TRL's alst_ulysses configs): sp on the deepspeed backend;
        # or its tp_size; the rest of the world data-parallel, sharded or replicated as the
        # strategy does.
        sharded = strategy.shards
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": 1 if sharded else plan.world_size,
            "parallelism_config_dp_shard_size": plan.world_size if sharded else 1,
            "parallelism_config_tp_size": engine.tensor_parallel,
            "parallelism_config_cp_size": 1,
            "parallelism_config_sp_size": engine.sequence_parallel,
        }
        if engine.sequence_parallel > 1:
            config["parallelism_config"]["parallelism_config_sp_backend"] = "deepspeed"
    return config


def write_accelerate_config(config: dict[str, Any], path: Path) -> None:
    path.write_text(yaml.safe_dump(config, sort_keys=True))
