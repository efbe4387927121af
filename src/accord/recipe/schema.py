"""The recipe: one typed, validated description of a training run.

A recipe is a YAML file plus dotted command-line overrides (`batch.micro_batch_size=4`);
precedence is overrides > file > defaults. Every section rejects unknown keys with a
did-you-mean, and every error names the key, what was expected and the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from accord import registry
from accord.errors import UserInputError
from accord.recipe.cpo import CPOConfig
from accord.recipe.data import DataConfig, GeneratedData, SourceConfig, addition_capacity  # noqa: F401 (read from here)
from accord.recipe.distill import DistillConfig
from accord.recipe.dpo import DPOConfig
from accord.recipe.engine import PROCESS_GROUP_TIMEOUT_S, EngineConfig  # noqa: F401 (PROCESS_GROUP_TIMEOUT_S: read from here)
from accord.recipe.errors import describe_error
from accord.recipe.grpo import GRPOConfig
from accord.recipe.kto import KTOConfig
from accord.recipe.model import BYTE_TOKENIZER, ModelConfig, RopeScalingConfig  # noqa: F401 (read from here)
from accord.recipe.moe import MoEConfig
from accord.recipe.observe import ObserveConfig
from accord.recipe.orpo import ORPOConfig
from accord.recipe.paths import locate
from accord.recipe.rloo import RLOOConfig
from accord.recipe.section import Section
from accord.recipe.yaml_text import DuplicateKey, load_yaml


class RecipeError(UserInputError):
    """A user mistake in a recipe or its overrides; the message is meant to be shown as is."""


class BatchConfig(Section):
    """Batch sizes. The global batch is the knob; accumulation is derived from the world size."""

    global_batch_size: int = Field(..., gt=0, description="Sequences per optimizer step, over all processes.")
    micro_batch_size: int | None = Field(
        None, gt=0, description="Sequences per forward pass on one process. Default: global / world (no accumulation)."
    )


class OptimConfig(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = Field(3.0e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1.0e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    extend: Literal["continue", "restart_decay"] = Field(
        "continue",
        description="Resuming with a different train.max_steps: continue recomputes the schedule as if the run had "
        "been planned that long (the lr at the resume step moves to the new curve); restart_decay keeps the steps "
        "so far as they ran and starts a new warm-up and decay from optim.lr over the added steps. Either way the "
        "run prints what happens.",
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this (null: no clipping)."
    )

    @field_validator("betas")
    @classmethod
    def _betas_are_decay_rates(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"optim.betas={list(betas)}: each must be in [0, 1), e.g. [0.9, 0.999]")
        return betas


class TrainConfig(Section):
    """How long to train and how often to log and evaluate."""

    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to run.")
    epochs: float | None = Field(
        None, gt=0, description="Alternatively, passes over the training data (steps derived)."
    )
    log_every: int = Field(10, gt=0, description="Write metrics every N steps (each step's loss is still recorded).")
    eval_every: int | None = Field(
        None, gt=0, description="Evaluate every N steps (always at the end when eval data exists)."
    )
    eval_on_start: bool = Field(
        False,
        description="Also evaluate before the first step of a fresh run (the baseline the later evaluations improve "
        "on).",
    )
    eval_micro_batch_size: int = Field(32, gt=0, description="Sequences per forward pass during evaluation.")
    eval_limit: int | None = Field(
        None, gt=0, description="Evaluate on the first N held-out examples only (default: all)."
    )
    eval_generate: int = Field(
        0,
        ge=0,
        description="At each evaluation, greedy-generate this many held-out prompts and report exact-match accuracy.",
    )
    max_new_tokens: int = Field(32, gt=0, description="Longest generated completion during eval_generate.")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="A NaN/inf loss or gradient norm: stop (naming the step; the last checkpoint is intact) "
        "or skip that update (checked every step, which costs one host sync per step).",
    )
    max_skipped_steps: int = Field(
        10, ge=0, description="With on_nonfinite=skip: stop after this many skipped updates."
    )
    # In `train`, not `engine`: it changes how a task computes its loss (same value, less
    # memory) under every strategy, not how the model is distributed.
    loss_chunk_size: int | Literal["auto"] = Field(
        "auto",
        description="sft, pretrain, dpo, cpo: compute the loss this many target tokens at a time, recomputing each "
        "chunk's logits in backward, so the full rows × vocabulary logits are never held (0: the plain loss over whole "
        "logits); "
        "auto: chunks of 1024 where a micro batch's whole fp32 logits would pass 128 MiB (a 32k vocabulary from about "
        "1k tokens), else the plain loss (a byte-level vocabulary keeps it up to ~128k tokens).",
    )

    @field_validator("loss_chunk_size", mode="before")
    @classmethod
    def _chunk_size(cls, value: Any) -> Any:
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"train.loss_chunk_size={value!r} must be auto, 0 (the plain loss) or a number of tokens")
        return value

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of train.max_steps or train.epochs")
        return self


class TaskClassConfig(Section):
    """A task defined outside accord: a subclass of accord.tasks.base.Task."""

    # Dumped as `class` everywhere (recipe.yaml, checkpoints, the workers' copy) and read either way.
    model_config = ConfigDict(
        extra="forbid", validate_default=True, validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    class_: str = Field(
        ...,
        alias="class",
        description="Where the Task subclass lives, as package.module:Class (importable on every node).",
    )


class ClassifyConfig(Section):
    """Sequence classification: rows have `text` (and optionally `text_pair`) and `label`."""

    labels: list[str] | None = Field(
        None, description="The label set, in id order (default: the sorted labels found in the training data)."
    )


class LoraConfig(Section):
    """Low-rank adapters (peft) instead of training every weight."""

    r: int = Field(8, gt=0, description="Adapter rank.")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator (the update is scaled by alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or all-linear."
    )
    merge_on_export: bool = Field(
        True,
        description="Save the final model with the adapters merged in (loadable without peft); the adapter is saved "
        "too.",
    )


class CheckpointConfig(Section):
    """When to write checkpoints (always also at the end), how many to keep, and whether to write them in the
    background."""

    model_config = ConfigDict(
        extra="forbid", validate_default=True, validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    every_steps: int | None = Field(None, gt=0, description="Write a checkpoint every N optimizer steps.")
    every_minutes: float | None = Field(
        None, gt=0, description="Write a checkpoint when this many minutes passed since the last one."
    )
    keep_last: int = Field(
        2,
        ge=1,
        description="Keep the newest K complete checkpoints (older ones are removed after a newer one is complete).",
    )
    # `async` is a Python keyword: the attribute is async_, the recipe key `async`.
    async_: bool = Field(
        False,
        alias="async",
        description="Write checkpoints in the background while training continues (sealed once written; "
        "the next checkpoint waits for the previous one).",
    )


class OutputConfig(Section):
    """Where the run writes its recipe, metrics, TensorBoard events and final model."""

    dir: str = Field("runs/default", description="Output folder.")

    @field_validator("dir")
    @classmethod
    def _dir_is_named(cls, folder: str) -> str:
        if not folder.strip():
            raise ValueError("output.dir is empty: name the run's folder, e.g. output.dir=runs/my-run")
        return folder

    overwrite: bool = Field(False, description="Replace an earlier run in `dir` (otherwise refused).")


class Recipe(Section):
    """A whole training run."""

    seed: int = Field(0, description="Seeds model init, data order and every random choice.")
    model: ModelConfig
    # A name registered in accord.registry.TASKS (built-in or added with accord.register_task).
    task: str | TaskClassConfig = Field(
        "sft",
        description="sft (prompt -> completion or chat messages), pretrain (raw text), classify (text -> label), "
        "dpo (prompt, chosen, rejected), orpo and cpo (the same rows, no reference model), kto (prompt, completion, "
        "label, or preference pairs unpaired), reward (prompt, chosen, "
        "rejected -> a one-output scorer), grpo (prompts; online RL with the grpo section's rewards), rloo (the same "
        "prompts, rewards and grpo keys; leave-one-out advantages, the rloo section), distill (prompt -> completion or "
        "chat messages, learning a frozen teacher's distributions; the distill section); or "
        "{class: package.module:Class} for a task written outside accord.",
    )
    data: DataConfig
    batch: BatchConfig
    optim: OptimConfig = OptimConfig()
    train: TrainConfig
    classify: ClassifyConfig = ClassifyConfig()
    dpo: DPOConfig = DPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    rloo: RLOOConfig = RLOOConfig()
    orpo: ORPOConfig = ORPOConfig()
    cpo: CPOConfig = CPOConfig()
    kto: KTOConfig = KTOConfig()
    distill: DistillConfig = DistillConfig()
    moe: MoEConfig = MoEConfig()
    lora: LoraConfig | None = Field(None, description="Train low-rank adapters instead of every weight.")
    engine: EngineConfig = EngineConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    output: OutputConfig = OutputConfig()
    observe: ObserveConfig = ObserveConfig()
    resume: str = Field(
        "never",
        description="never: a fresh run; auto: continue from the latest complete checkpoint in output.dir "
        "(fresh if there is none); or the path of a checkpoints/step-NNNNNN folder, or of a checkpoint-N folder "
        "written by transformers.Trainer (its weights, AdamW state, schedule and step; not its data position).",
    )

    @field_validator("task")
    @classmethod
    def _registered_task(cls, value: str | TaskClassConfig) -> str | TaskClassConfig:
        if isinstance(value, str) and value not in registry.TASKS:
            raise ValueError(registry.unknown_name("task", "task", value, registry.TASKS))
        return value

    @model_validator(mode="after")
    def _kto_batch(self) -> Recipe:
        if self.task == "kto" and self.kto.loss_type == "kto" and self.batch.global_batch_size < 2:
            raise ValueError(
                "task kto with batch.global_batch_size=1: its KL estimate pairs each row with another row's "
                "completion in the global batch; set batch.global_batch_size to 2 or more (or kto.loss_type: "
                "apo_zero_unpaired, which has no KL term)"
            )
        return self

    @model_validator(mode="after")
    def _distill(self) -> Recipe:
        if self.task != "distill":
            return self
        cfg = self.distill
        if cfg.teacher is None:
            raise ValueError(
                "task distill needs a teacher: set distill.teacher to a model folder or hub name (ORG/NAME) with "
                "the student's vocabulary"
            )
        if not self.data.completion_only_loss:
            raise ValueError(
                "task distill trains on completion tokens only (the teacher is matched where the student answers); "
                "remove data.completion_only_loss=false"
            )
        samples = cfg.lmbda > 0 or cfg.seq_kd
        if samples and cfg.max_new_tokens >= self.data.max_length:
            raise ValueError(
                f"distill.max_new_tokens={cfg.max_new_tokens} leaves no room for the prompt in "
                f"data.max_length={self.data.max_length}; raise data.max_length or lower distill.max_new_tokens"
            )
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self) -> Recipe:
        n = self.engine.tensor_parallel
        if n == 1:
            return self
        key = f"engine.tensor_parallel={n}"
        # What combines with it is declared with the strategies and tasks (accord.registry).
        strategies, tasks = registry.combining("tensor_parallel")
        if self.engine.strategy not in strategies:
            raise ValueError(
                f"{key} composes with engine.strategy={_or(strategies)} (torch's own data parallelism over the TP "
                f"groups), not {self.engine.strategy}; use engine.strategy=fsdp to shard parameters too, or "
                "tensor_parallel=1"
            )
        if self.engine.sequence_parallel > 1:
            raise ValueError(
                f"{key} with engine.sequence_parallel={self.engine.sequence_parallel} is not supported (Ulysses' "
                f"all-to-all expects every head on each rank); use one of them"
            )
        if self.lora is not None:
            raise ValueError(f"{key} with lora is not supported (peft's adapters are not split); remove lora or TP")
        if not isinstance(self.task, str) or self.task not in tasks:
            name = self.task if isinstance(self.task, str) else self.task.class_
            raise ValueError(
                f"{key} supports task {', '.join(tasks)}, not {name} (its frozen or rollout model is "
                f"not split); set engine.tensor_parallel=1"
            )
        if self.engine.tiled_mlp:
            raise ValueError(f"{key} with engine.tiled_mlp is not supported (each splits the MLP); use one of them")
        return self

    @model_validator(mode="after")
    def _expert_parallel(self) -> Recipe:
        n = self.engine.expert_parallel
        if n == 1:
            return self
        key = f"engine.expert_parallel={n}"
        # What combines with it is declared with the strategies and tasks (accord.registry).
        strategies, tasks = registry.combining("expert_parallel")
        if self.engine.strategy not in strategies:
            raise ValueError(
                f"{key} composes with engine.strategy={_or(strategies)} (torch's own data parallelism over the "
                f"rest of the model), not {self.engine.strategy}; use engine.strategy=fsdp to shard the rest too, "
                "or expert_parallel=1"
            )
        others = [
            f"engine.{k}={getattr(self.engine, k)}"
            for k in ("tensor_parallel", "pipeline_parallel", "sequence_parallel")
            if getattr(self.engine, k) > 1
        ]
        if others:
            raise ValueError(f"{key} with {others[0]} is not supported yet; use one of them")
        if self.lora is not None:
            raise ValueError(
                f"{key} with lora is not supported yet (peft's adapters on the fused experts are not split); "
                "remove lora or set engine.expert_parallel=1"
            )
        if not isinstance(self.task, str) or self.task not in tasks:
            name = self.task if isinstance(self.task, str) else self.task.class_
            raise ValueError(
                f"{key} supports task {' and '.join(tasks)}, not {name} (its frozen or rollout model is not "
                "split); set engine.expert_parallel=1"
            )
        if self.engine.tiled_mlp:
            raise ValueError(
                f"{key} with engine.tiled_mlp is not supported (tiled MLPs are dense ones; a mixture-of-experts "
                "layer is not tiled); remove engine.tiled_mlp"
            )
        return self

    @model_validator(mode="after")
    def _pipeline_parallel(self) -> Recipe:
        n = self.engine.pipeline_parallel
        if n == 1:
            return self
        key = f"engine.pipeline_parallel={n}"
        # What combines with it is declared with the strategies and tasks (accord.registry).
        strategies, tasks = registry.combining("pipeline_parallel")
        if self.engine.strategy not in strategies:
            raise ValueError(
                f"{key} composes with engine.strategy={_or(strategies)} (torch's own data parallelism over the "
                f"pipelines), not {self.engine.strategy}; use engine.strategy=fsdp to shard the stages too, or "
                "pipeline_parallel=1"
            )
        if not isinstance(self.task, str) or self.task not in tasks:
            name = self.task if isinstance(self.task, str) else self.task.class_
            raise ValueError(
                f"{key} supports task {' and '.join(tasks)}, not {name}: its loss needs more than "
                "one forward of the trained model per row (a reference, pairs or rollouts), which the pipeline "
                "schedule cannot run yet; set engine.pipeline_parallel=1"
            )
        if self.lora is not None:
            raise ValueError(f"{key} with lora is not supported yet (peft's wrapper is not split); remove one of them")
        held_out = (
            "data.eval"
            if self.data.eval is not None
            else "data.eval_fraction"
            if self.data.eval_fraction
            else "data.generate.eval_examples"
            if self.data.generate is not None and self.data.generate.eval_examples
            else None
        )
        if held_out:
            fix = "set it to 0" if held_out != "data.eval" else "remove it"
            raise ValueError(
                f"{key} with {held_out} is not supported yet (evaluation does not run through the stages); "
                f"{fix}, or set engine.pipeline_parallel=1"
            )
        if self.engine.compile:
            raise ValueError(f"{key} with engine.compile is not supported yet; remove one of them")
        return self


def _or(names: list[str]) -> str:
    """Names as a sentence lists them: a, b or c."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "none"


# --------------------------------------------------------------------------- loading


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply `a.b=c` overrides, validate. Raises RecipeError."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        raw = load_yaml(path.read_text(encoding="utf-8")) or {}
    except DuplicateKey as e:
        raise RecipeError(f"{path}:{e.second}: {e}") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise RecipeError(
            f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x}); save the recipe as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path}: a recipe is a mapping of sections (seed, model, data, ...), got {type(raw).__name__}"
        )
    for item in overrides:
        apply_override(raw, item)
    recipe = validate_recipe(raw, source=str(path))
    _anchor_paths(recipe, path.parent)
    return recipe


def _anchor_paths(recipe: Recipe, folder: Path) -> None:
    """Relative data and model paths are read from the current folder when they exist there,
    else from the recipe file's folder (see accord.recipe.paths.locate)."""
    for source in (recipe.data.train or []) + (recipe.data.eval or []):
        if source.path is not None:
            source.path, source._looked_in = locate(source.path, folder)
    if recipe.model.path is not None:
        recipe.model.path = locate(recipe.model.path, folder)[0]
    if recipe.distill.teacher is not None:
        recipe.distill.teacher = locate(recipe.distill.teacher, folder)[0]
    if recipe.model.tokenizer not in (None, BYTE_TOKENIZER):
        recipe.model.tokenizer = locate(recipe.model.tokenizer, folder)[0]


def apply_override(raw: dict, item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is read as YAML (numbers, lists, true/false)."""
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {item!r}: expected key.sub=value, e.g. batch.micro_batch_size=4")
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for depth, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parents[: depth + 1])
            raise RecipeError(f"override {item!r}: {where} is a value ({child!r}), not a section")
        node = child
    node[leaf] = value


def validate_recipe(raw: dict, source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        lines = [f"{source}: {describe_error(err, Recipe)}" for err in e.errors()]
        raise RecipeError("\n".join(lines)) from None


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
