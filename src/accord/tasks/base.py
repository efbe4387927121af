"""The one interface every training method implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from accord.data.generated import Rows


@dataclass(frozen=True)
class Example:
    """One tokenized training sequence; `labels` is -100 where no loss is taken."""

    input_ids: list[int]
    labels: list[int]

    @property
    def num_targets(self) -> int:
        return sum(label != IGNORE for label in self.labels)


IGNORE = -100


class Task(Protocol):
    required_fields: tuple[str, ...]

    def encode(self, row: dict[str, str]) -> Example: ...

    def collate(self, examples: list[Example]) -> dict[str, torch.Tensor]: ...

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss over the batch's targets, number of targets): never a mean.

        The trainer divides by the target count of the whole global batch, which keeps
        the update independent of how the batch is split over ranks and micro-steps.
        """
        ...

    def evaluate_generation(
        self, model: nn.Module, rows: Rows, device: torch.device, max_new_tokens: int, lockstep: bool = False
    ) -> dict[str, float]:
        """Sums (not rates) of generation metrics over `rows`, so ranks can add them up.
        Rows marked PADDING keep ranks in lockstep and are not scored; with `lockstep`,
        generation runs until every rank is done (sharded models)."""
        ...


# A row that only keeps a rank's number of forward passes equal to the others'.
PADDING = "__accord_padding__"
