"""Everything about a recipe that can be wrong, found before any worker starts."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import torch
import yaml

from accord.checkpoint.resume import check_resume
from accord.data.nodeshare import NodeShare
from accord.data.sources import DataError
from accord.distributed import group as dist
from accord.distributed.batch_plan import BatchPlan, BatchPlanError
from accord.engine import INSTALL_DEEPSPEED, deepspeed_available, runs_deepspeed
from accord.errors import UserInputError
from accord.observe.trackers import check_trackers
from accord.output.folder import check_output_dir
from accord.recipe.hub import HubError, local_path
from accord.recipe.paths import PathError
from accord.recipe.schema import BYTE_TOKENIZER, EngineConfig, LoraConfig, ModelConfig, Recipe


def preflight(
    recipe: Recipe,
    world_size: int,
    writer: bool = True,
    share: NodeShare | None = None,
    plan: BatchPlan | None = None,
    keep_for_run: bool = False,
) -> list[str]:
    """One line per problem (empty when the run can start). `writer`: this process (or its
    node) will hold global rank 0, the one that writes the outputs. `plan`: the batch plan a
    run's start derived already (so it is sound); without one it is derived and checked here.
    `keep_for_run`: this process trains the recipe next (run/inputs.py keeps what the data
    check built for it)."""
    problems: list[str] = []
    if plan is None:
        try:
            plan = BatchPlan.of(recipe.batch, recipe.engine, world_size)
        except BatchPlanError as e:
            problems.append(str(e))
    problems += check_model_source(recipe.model)
    if recipe.model.freeze and not problems:
        problems += check_freeze(recipe)
    if recipe.engine.sequence_parallel > 1 and not problems:
        problems += check_sequence_parallel(recipe)
    if recipe.engine.tensor_parallel > 1 and not problems:
        problems += check_tensor_parallel(recipe, world_size)
    if recipe.engine.pipeline_parallel > 1 and not problems:
        problems += check_pipeline_parallel(recipe, plan.grad_accum, plan.world_size)
    if recipe.engine.expert_parallel > 1 and not problems:
        problems += check_expert_parallel(recipe, world_size)
    if not problems:
        problems += check_moe(recipe)
    problems += check_environment(recipe)
    if writer and dist.is_main():
        # Only the writer checks: another rank or node may look after rank 0 already
        # created the folder.
        problems += check_output_dir(recipe.output, recipe.resume)
    problems += check_resume(recipe)
    if problems or not dist.env_info().leads_node:
        # The data step is the expensive part: only for a sound recipe, and once per node
        # (under an outer launcher the other local ranks wait for it in the workers).
        return problems
    return prepare_and_check_data(recipe, share, keep_for_run)


def prepare_and_check_data(recipe: Recipe, share: NodeShare | None = None, keep_for_run: bool = False) -> list[str]:
    """Tokenize (or find cached) the data here, once, so bad rows stop the run before any
    worker starts and the workers only read the cache. `keep_for_run`: this process trains
    next, and its assembly takes what was built here."""
    from accord.observe.progress import announce

    announce("preparing data…")
    from accord.run import inputs as run_inputs
    from accord.tasks import task_config

    try:
        config = task_config(recipe)
        built = run_inputs.build_inputs(config, preparer=True, share=share)
    except (run_inputs.TokenizerError, DataError) as e:
        return [str(e)]
    if keep_for_run:
        run_inputs.keep(config, built)
    task, data = built.task, built.data
    # The global order draws its batches from rows, which packing makes fewer than examples.
    rows = len(built.rows)
    examples = data.report["train_examples"]
    needed = recipe.batch.global_batch_size
    if rows >= needed:
        return []
    counted = (
        f"{rows} training rows ({examples} examples packed into rows of {task.row_capacity} tokens)"
        if task.row_capacity is not None
        else f"{rows} training examples"
    )
    return [f"only {counted} but batch.global_batch_size={needed}; lower the global batch or add data"]


def _recipe_writing(out_dir: Path) -> str | None:
    """The recipe under ./recipes whose output.dir is `out_dir` (a shipped recipe that starts
    from another's final model names it in the error), if exactly one is."""
    found = []
    for path in sorted(Path("recipes").glob("*.yaml")):
        try:
            output = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("output") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if isinstance(output, dict) and output.get("dir") and Path(str(output["dir"])).resolve() == out_dir.resolve():
            found.append(path.as_posix())
    return found[0] if len(found) == 1 else None


def check_model_source(cfg: ModelConfig) -> list[str]:
    """Problems with the model section that can be seen without loading anything."""
    problems = []
    try:
        folder = local_path(cfg.path, cfg.revision, where="model.path") if cfg.path is not None else None
        tokenizer = (
            local_path(cfg.tokenizer, cfg.tokenizer_revision, where="model.tokenizer")
            if cfg.tokenizer not in (None, BYTE_TOKENIZER)
            else None
        )
    except HubError as e:
        return [str(e)]
    except PathError as e:
        return [f"model: {e}"]
    if folder is not None:
        if folder.suffix == ".gguf":
            if not folder.is_file():
                problems.append(f"model.path: GGUF file not found: {folder}")
        elif not folder.is_dir():
            # A run's `final/` (e.g. grpo-addition continues from addition-sft's): say which run writes it.
            hint = ""
            if folder.name == "final":
                writer = _recipe_writing(folder.parent)
                hint = (
                    f" (the final model of {writer}: run `accord train {writer}` first)"
                    if writer
                    else f" (the final model of an accord run: train the recipe whose output.dir is {folder.parent} "
                    "first)"
                )
            problems.append(f"model.path: folder not found: {folder}{hint}")
        elif not (folder / "config.json").is_file():
            problems.append(
                f"model.path: {folder} has no config.json (expected a save_pretrained folder or a .gguf file)"
            )
        else:
            problems += _check_config_loads(folder, cfg.trust_remote_code)
            from accord.models.weights import check_weight_files

            problems += check_weight_files(folder)
    if tokenizer is not None and not tokenizer.is_dir():
        problems.append(f"model.tokenizer: folder not found: {tokenizer} (use `byte` or a local tokenizer folder)")
    if cfg.config is not None:
        # The name table only: importing the model classes would cost seconds here.
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        architecture = str(cfg.config["architecture"])
        if architecture not in CONFIG_MAPPING_NAMES:
            close = difflib.get_close_matches(architecture, list(CONFIG_MAPPING_NAMES), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            problems.append(f"model.config.architecture: unknown model type {architecture!r}{hint}")
    if cfg.rope_scaling is not None and not problems:
        problems += check_rope_scaling(cfg)
    return problems


def check_rope_scaling(cfg: ModelConfig) -> list[str]:
    """model.rope_scaling fits the model's config (read or built here, no weights)."""
    from accord.models.build import apply_rope_scaling

    if cfg.path is not None and local_path(cfg.path, cfg.revision).suffix == ".gguf":
        return []  # its config exists only after conversion; the worker applies the same check
    try:
        config = _model_config(cfg)
        apply_rope_scaling(config, cfg.rope_scaling)
    except UserInputError as e:
        return [str(e)]
    except (KeyError, ValueError, TypeError) as e:  # transformers' own checks of the values
        return [f"model.rope_scaling: {' '.join(str(e).split())[:300]}"]
    return []


def check_freeze(recipe: Recipe) -> list[str]:
    """model.freeze names parts the model has: the model is built from its config on the meta
    device (its module names, no weights) and the worker's own freeze() is run on it."""
    from accord.models.build import auto_class
    from accord.models.vision import freeze
    from accord.tasks import task_class

    cfg = recipe.model
    if cfg.path is not None and local_path(cfg.path, cfg.revision).suffix == ".gguf":
        return []  # its config exists only after conversion; the worker applies the same check
    try:
        config = _model_config(cfg)
        with torch.device("meta"):
            model = auto_class(task_class(recipe.task, recipe.model).model_kind).from_config(
                config, trust_remote_code=cfg.trust_remote_code
            )
    except (KeyError, ValueError, TypeError, OSError, ImportError):
        return []  # a config transformers cannot build: the model's own build says why, in one line
    try:
        freeze(model, cfg.freeze)
    except UserInputError as e:
        return [str(e)]
    return []


def check_sequence_parallel(recipe: Recipe) -> list[str]:
    """engine.sequence_parallel fits the task, the model's heads and attention, and DeepSpeed
    (whose Ulysses attention it runs) is installed; the model's config is read, no weights."""
    from accord.engine.sequence_parallel.ulysses import check_sequence_parallel as check

    if not deepspeed_available():
        return [
            f"engine.sequence_parallel={recipe.engine.sequence_parallel} runs DeepSpeed's Ulysses attention, which is "
            f"not installed: {INSTALL_DEEPSPEED}"
        ]
    if recipe.model.path is not None and local_path(recipe.model.path, recipe.model.revision).suffix == ".gguf":
        return check(recipe, None)  # its config exists only after conversion; the worker checks the heads
    return check(recipe, _model_config(recipe.model))


def check_tensor_parallel(recipe: Recipe, world_size: int) -> list[str]:
    """engine.tensor_parallel divides the processes and the model's heads, key/value heads and
    intermediate size, and the model has a plan; its config is read, no weights."""
    from accord.engine.tensor_parallel import check_tensor_parallel as check

    if recipe.model.path is not None and local_path(recipe.model.path, recipe.model.revision).suffix == ".gguf":
        # Its config exists only after conversion; the worker checks.
        return check(recipe.engine.tensor_parallel, None, world_size)
    return check(recipe.engine.tensor_parallel, _model_config(recipe.model), world_size)


def check_expert_parallel(recipe: Recipe, world_size: int) -> list[str]:
    """engine.expert_parallel divides the processes and the model's experts, and the model has
    an expert-parallel plan; its config is read, no weights."""
    from accord.engine.expert_parallel import check_expert_parallel as check

    if recipe.model.path is not None and local_path(recipe.model.path, recipe.model.revision).suffix == ".gguf":
        # Its config exists only after conversion; the worker checks.
        return check(recipe.engine.expert_parallel, None, world_size)
    return check(recipe.engine.expert_parallel, _model_config(recipe.model), world_size)


def check_moe(recipe: Recipe) -> list[str]:
    """The moe section fits the model, and a mixture-of-experts model's layout and task are ones
    its router statistics are counted right in; the model's config is read, no weights."""
    from accord.models.moe import config_experts
    from accord.recipe.moe import MoEConfig
    from accord.tasks import task_class

    cfg = recipe.model
    if cfg.path is not None and local_path(cfg.path, cfg.revision).suffix == ".gguf":
        return []  # its config exists only after conversion (no GGUF MoE family is built here)
    try:
        experts = config_experts(_model_config(cfg))
    except (KeyError, ValueError, TypeError, OSError):
        return []  # a config transformers cannot build: the model's own build says why, in one line
    if experts == 0:
        if recipe.moe != MoEConfig():
            return [
                "moe: the model has no mixture-of-experts layers (no routed experts in its config); drop the "
                "moe section"
            ]
        return []
    engine = recipe.engine
    for key in ("sequence_parallel", "tensor_parallel", "pipeline_parallel"):
        value = getattr(engine, key)
        if value > 1:
            return [f"engine.{key}={value} with a mixture-of-experts model is not supported yet; set engine.{key}=1"]
    task = task_class(recipe.task, recipe.model)
    if recipe.moe.balance_loss == "global_batch" and (task.online or task.batch_statistics):
        return [
            f"moe.balance_loss=global_batch with task {task.name} is not supported yet (the task "
            f"{'samples its batches online' if task.online else 'runs its own pass over the global batch'}); "
            "set moe.balance_loss=per_forward or off"
        ]
    return []


def check_pipeline_parallel(recipe: Recipe, micro_batches: int, pipelines: int | None = None) -> list[str]:
    """engine.pipeline_parallel: the schedule can run the plan's micro-batches, the decoder
    layers split evenly into the stages, no tied embeddings; the config is read, no weights."""
    from accord.engine.pipeline.stages import check_pipeline

    if recipe.model.path is not None and local_path(recipe.model.path, recipe.model.revision).suffix == ".gguf":
        return check_pipeline(recipe.engine, None, micro_batches, pipelines)  # its config exists only after conversion
    return check_pipeline(recipe.engine, _model_config(recipe.model), micro_batches, pipelines)


def _model_config(cfg: ModelConfig):
    """The model's transformers config, from its folder or the recipe's model.config."""
    from transformers import AutoConfig

    if cfg.path is not None:
        return AutoConfig.from_pretrained(local_path(cfg.path, cfg.revision), trust_remote_code=cfg.trust_remote_code)
    settings = dict(cfg.config or {})
    return AutoConfig.for_model(str(settings.pop("architecture")), **settings)


def check_environment(recipe: Recipe) -> list[str]:
    """What this machine lacks for the recipe: the GPUs it selects, DeepSpeed, DeepSpeed's fp16, peft,
    the trackers' libraries. Kept out of the recipe's schema, so a recipe validates alike on every machine."""
    return (
        check_devices(recipe.engine)
        or check_deepspeed(recipe.engine)
        or check_peft(recipe.lora)
        or check_trackers(recipe.observe)
    )


def check_peft(lora: LoraConfig | None) -> list[str]:
    """LoRA is an optional feature: its library is an extra."""
    if lora is not None and importlib.util.find_spec("peft") is None:
        return ["lora needs peft, which is not installed: pip install 'accord[lora]' (or drop the lora section)"]
    return []


def check_devices(cfg: EngineConfig) -> list[str]:
    """The GPUs the recipe asks for are here."""
    from accord.engine.device import wants_cuda

    if cfg.launcher == "ray":  # Ray's nodes have the GPUs, not necessarily this one: see launch/ray_train.py
        return []
    try:
        cuda = wants_cuda(cfg)
    except UserInputError as e:
        return [str(e)]
    if cfg.devices is None:
        return []
    if not cuda:
        return [
            f"engine.devices={cfg.devices} selects GPUs but this run is on the CPU; drop it (engine.devices=null) or "
            "use a GPU machine"
        ]

    count = torch.cuda.device_count()
    bad = [d for d in cfg.devices if not 0 <= d < count]
    if bad or len(set(cfg.devices)) != len(cfg.devices) or not cfg.devices:
        return [f"engine.devices={cfg.devices}: each must be a distinct GPU index from 0 to {count - 1}"]
    return []


def check_deepspeed(cfg: EngineConfig) -> list[str]:
    """A zero strategy that needs DeepSpeed has it here, and does not ask it for fp16 on the CPU."""
    from accord.engine.device import wants_cuda

    # What it needs wherever it runs, and what it runs on here (zero1 may fall back to torch).
    needs_deepspeed = runs_deepspeed(cfg.strategy, cfg, installed=False)
    uses_deepspeed = runs_deepspeed(cfg.strategy, cfg)
    if needs_deepspeed and not deepspeed_available():
        what = f"engine.strategy={cfg.strategy}" + (
            f" with engine.offload={cfg.offload}" if cfg.offload != "none" else ""
        )
        return [f"{what} needs DeepSpeed, which is not installed: {INSTALL_DEEPSPEED}"]
    if uses_deepspeed and cfg.precision == "fp16" and not wants_cuda(cfg):
        return [
            f"engine.precision=fp16 with engine.strategy={cfg.strategy} (DeepSpeed) needs a GPU: DeepSpeed has no "
            f"fp16 on the CPU; use engine.precision=bf16 or no, or engine.strategy=fsdp or ddp"
        ]
    return []


def _check_config_loads(folder: Path, trust_remote_code: bool) -> list[str]:
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds; all mean the same to the user
        reason = " ".join(str(e).split())
        return [f"model.path: {folder}/config.json cannot be loaded: {reason[:300]}"]
    return []
