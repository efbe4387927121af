"""What a task is built from: its class, the recipe's data section, the recipe sections the
class declares it reads (Task.sections), the seed, and the few facts it reads from the rest
of the recipe, each named for what it is. Made from a Recipe in one place
(accord.tasks.task_config); a task never holds the whole Recipe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from accord.recipe.schema import DataConfig, LoraConfig, ModelConfig

if TYPE_CHECKING:
    from accord.recipe.section import Section
    from accord.tasks.base import Task


@dataclass(frozen=True)
class TaskConfig:
    task_class: type[Task]
    data: DataConfig
    seed: int
    # The trained model's section: its folder or config, tokenizer, processor and
    # trust_remote_code (a vision-language task builds its processor from it, distill compares
    # vocabularies, error lines name it).
    model: ModelConfig
    lora: LoraConfig | None  # adapters (None: every weight trains); a reference is then the policy with them off
    loss_chunk_size: int | Literal["auto"]  # train.loss_chunk_size
    eval_micro_batch_size: int  # train.eval_micro_batch_size: rows per pass that scores held-out data
    eval_generate: int  # train.eval_generate: held-out prompts scored by generation (0: none)
    micro_batch_size: int | None  # batch.micro_batch_size as the recipe gives it (None: derived)
    device: Literal["auto", "cpu", "cuda"]  # engine.device, resolved where the model is configured
    compile: bool  # engine.compile: the forward is traced by torch.compile
    # engine.sequence_parallel, tensor_parallel or pipeline_parallel above 1: a rank runs a
    # slice of each row or a part of the model.
    splits_rows_or_model: bool
    strategy: str  # engine.strategy (its traits through accord.registry.strategy)
    # The recipe sections the class names in Task.sections, by name (e.g. {"dpo": DPOConfig}).
    sections: dict[str, Section]

    def section(self, name: str) -> Any:
        """The recipe section `name` (e.g. "dpo"), which the task class declares in Task.sections."""
        if name not in self.sections:
            raise KeyError(
                f"{self.task_class.__qualname__} reads recipe section {name!r} without declaring it: "
                f"add it to the class's `sections`"
            )
        return self.sections[name]
