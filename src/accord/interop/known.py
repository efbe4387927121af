"""Every key a TRL or Trainer job may set, read from the installed TRL and transformers
dataclasses themselves (never a hand-written list that drifts from the installed versions)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

# task -> the TRL config class its script parses (import path, class name); `trainer` is a plain
# transformers.Trainer job (a train.py building TrainingArguments).
CONFIG_CLASSES = {
    "sft": ("trl", "SFTConfig"),
    "dpo": ("trl", "DPOConfig"),
    "grpo": ("trl", "GRPOConfig"),
    "kto": ("trl", "KTOConfig"),
    "reward": ("trl", "RewardConfig"),
    "trainer": ("transformers", "TrainingArguments"),
}
# Parsed by every TRL script beside the task's config: the model, the dataset, a mixture of datasets.
SCRIPT_CLASSES = (("trl", "ModelConfig"), ("trl", "ScriptArguments"), ("trl", "DatasetMixtureConfig"))
# What trl/scripts/grpo.py adds to ScriptArguments (its own dataclass, not importable from trl).
GRPO_SCRIPT_KEYS = {"reward_model_name_or_path": None, "reward_funcs": None}


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    default: Any
    type: str  # the annotation as text: "bool", "int | None", "list[str]", ...

    @property
    def is_bool(self) -> bool:
        return self.type.replace(" ", "") in ("bool", "bool|None", "None|bool", "Optional[bool]")

    @property
    def is_list(self) -> bool:
        return self.type.startswith("list") or "| list" in self.type


def _cls(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(module), name)


def _fields(cls) -> dict[str, Field]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", None) or str(f.type)
        out[f.name] = Field(f.name, default, str(kind).replace("typing.", ""))
    return out


@functools.cache
def class_fields(module: str, name: str) -> dict[str, Field]:
    return _fields(_cls(module, name))


@functools.cache
def task_fields(task: str) -> dict[str, Field]:
    """Every key a job of `task` may set (its config class, the model and script arguments),
    with the installed default."""
    fields: dict[str, Field] = {}
    for module, name in SCRIPT_CLASSES:
        fields |= class_fields(module, name)
    if task == "grpo":
        fields |= {
            k: Field(k, v, "list[str]" if k == "reward_funcs" else "str | None") for k, v in GRPO_SCRIPT_KEYS.items()
        }
    fields |= class_fields(*CONFIG_CLASSES[task])  # the config's defaults win (its learning rate, not the base's)
    return fields


@functools.cache
def all_keys() -> frozenset[str]:
    """Every key of every class above, for did-you-mean."""
    return frozenset(k for task in CONFIG_CLASSES for k in task_fields(task))


def accelerate_keys() -> frozenset[str]:
    """The top-level keys of an accelerate config file (accelerate's own ClusterConfig)."""
    return frozenset(class_fields("accelerate.commands.config.config_args", "ClusterConfig"))
