"""The frozen reference policy of the methods that score answers against the starting model
(dpo, kto), and distill's frozen teacher: a separate frozen model (a folder or hub name, or a
copy of the starting model taken before adapters are added), or with LoRA the policy itself
with its adapters switched off.

It also installs the chunked answer log-probabilities (train.loss_chunk_size) on the policy
and on a frozen reference, so both score answers the same way.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

from accord.recipe.schema import LoraConfig, ModelConfig
from accord.tasks.base import FrozenModel
from accord.tasks.chunked_loss import TargetLogprobs, answer_logprobs, chunking_blocker

if TYPE_CHECKING:
    from accord.tasks.config import TaskConfig


def holds_frozen_copy(lora: LoraConfig | None, folder: str | None, reference_free: bool = False) -> bool:
    """Whether the run keeps a second, frozen model: a reference folder, or (without LoRA,
    whose reference is the policy with adapters off) a copy of the starting model."""
    return not reference_free and (folder is not None or lora is None)


def frozen_reference(
    lora: LoraConfig | None, folder: str | None, key: str, reference_free: bool = False
) -> FrozenModel | None:
    """The reference a run holds, as `accord plan` counts it (Task.frozen_model); `key` names `folder` in the recipe."""
    return FrozenModel(folder, key=key) if holds_frozen_copy(lora, folder, reference_free) else None


class ReferenceModel:
    def __init__(
        self,
        config: TaskConfig,
        tokenizer,
        model_kind: str,
        folder: str | None,
        reference_free: bool = False,
        revision: str | None = None,
    ):
        self.config, self.tokenizer, self.model_kind = config, tokenizer, model_kind
        self.folder = folder  # a model folder or a hub name (read at `revision`)
        self.revision = revision
        self.reference_free = reference_free  # a uniform reference: log-probabilities 0, no model
        self.module: nn.Module | None = None  # a frozen model, or None: adapters off (or no reference)
        self.policy: nn.Module | None = None
        # The chunked log-probabilities (train.loss_chunk_size) of the policy and the reference.
        self.logprobs: TargetLogprobs | None = None
        self.reference_logprobs: TargetLogprobs | None = None
        self.plain_loss_reason: str | None = None

    def configure_model(self, model: nn.Module) -> None:
        """Called with the freshly built policy, before adapters: builds the frozen reference
        (on the meta device: the engine materialises it) and installs the chunked loss."""
        if self.folder is not None:
            # Here, not at the top: only a separate reference model needs the model builder (transformers).
            from accord.models.build import build_model

            config = ModelConfig(path=self.folder, revision=self.revision)
            self.module = build_model(config, self.tokenizer, self.config.seed, self.model_kind, meta=True)
        elif holds_frozen_copy(self.config.lora, None, self.reference_free):
            self.module = copy.deepcopy(model)
        if self.module is not None:
            self.module.requires_grad_(False).eval()
        self.plain_loss_reason = chunking_blocker(model, self.config)
        if self.plain_loss_reason is None:
            chunk = self.config.loss_chunk_size
            self.logprobs = TargetLogprobs.install(model, chunk)
            if self.module is not None and chunking_blocker(self.module, self.config) is None:
                self.reference_logprobs = TargetLogprobs.install(self.module, chunk)

    def setup(self, engine) -> None:
        self.policy = engine.module
        if self.module is not None:
            # Sharded like the policy under fsdp / zero3 (its forward is then collective).
            self.module = engine.prepare_frozen(self.module)

    def release(self) -> None:
        """Every value the reference would give is stored elsewhere now (precomputed)."""
        self.module = None

    def policy_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """Summed answer log-probabilities per row under the (wrapped, training) policy."""
        return answer_logprobs(model, self.logprobs, inputs, labels)

    @torch.no_grad()
    def logps(self, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """Summed answer log-probabilities per row under the reference."""
        if self.reference_free:
            return torch.zeros(len(labels), device=labels.device)
        if self.module is not None:
            return answer_logprobs(self.module, self.reference_logprobs, inputs, labels)
        assert self.policy is not None, "setup() first"
        with adapters_off(self.policy):
            return answer_logprobs(self.policy, self.logprobs, inputs, labels)


def adapters_off(model: nn.Module):
    disable = getattr(model, "disable_adapter", None)
    return disable() if callable(disable) else contextlib.nullcontext()
