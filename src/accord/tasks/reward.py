"""Reward modelling (pairwise, Bradley-Terry): rows of `prompt`, `chosen`, `rejected`.

The model is a sequence classifier with one output, the reward r(prompt + answer), read by
transformers' own pooling (the last token that is not padding). A pair's loss is
-log σ(r(chosen) − r(rejected)), summed over pairs; the trainer divides by the pairs of the
whole global batch, so the update does not depend on how pairs are split over ranks and
micro-steps. TRL's RewardTrainer takes the mean of the same term over its batch.

No EOS is appended to the answers: the saved model scores `tokenizer(prompt + answer)`
exactly as it was trained, with plain transformers and nothing from accord.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accord.tasks.base import LossOutput, Task, text_prefix
from accord.tasks.pairs import collate_pairs, encode_pairs


class RewardTask(Task):
    name = "reward"
    text_fields = ("prompt", "chosen", "rejected")
    model_kind = "sequence_classification"

    def __init__(self, tokenizer, recipe):
        super().__init__(tokenizer, recipe)
        self.add_bos = recipe.data.add_bos
        self.prefix = text_prefix(tokenizer, self.add_bos)  # what `tokenizer(text)` puts first (data.add_bos)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"format": 1, "add_bos": self.add_bos, "prefix": self.prefix}

    def model_kwargs(self) -> dict[str, Any]:
        return {"num_labels": 1}

    def configure_model(self, model: nn.Module) -> None:
        # transformers finds a decoder's last token through config.pad_token_id: it must be
        # the id batches are padded with here, and it is saved with final/ so that plain
        # transformers pools the same token.
        model.config.pad_token_id = self.pad_id

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        return encode_pairs(self.tokenizer, batch, self.prefix, [], self.max_length, labels=False)

    def collate(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        return collate_pairs([row[0] for row in rows], self.pad_id)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1).float()
        pairs = len(rewards) // 2
        margin = rewards[:pairs] - rewards[pairs:]
        return LossOutput(
            loss_sum=-F.logsigmoid(margin).sum(),
            num_targets=torch.tensor(pairs, device=rewards.device),
            metrics={"accuracy": (margin > 0).sum().float(), "margin": margin.detach().sum()},
        )
