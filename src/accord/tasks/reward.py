"""Reward modelling (pairwise, Bradley-Terry): rows of `prompt`, `chosen`, `rejected` as
text, or as chat messages (TRL's conversational preference rows: `chosen` and `rejected`
are conversations, with or without a shared `prompt` conversation before them).

The model is a sequence classifier with one output, the reward r(prompt + answer), read by
transformers' own pooling (the last token that is not padding). A pair's loss is
-log σ(r(chosen) − r(rejected)), summed over pairs; the trainer divides by the pairs of the
whole global batch, so the update does not depend on how pairs are split over ranks and
micro-steps. TRL's RewardTrainer takes the mean of the same term over its batch.

A text is encoded as `tokenizer(prompt + answer)` encodes it: the prefix data.add_bos
chooses, and after the answer only what the tokenizer itself puts there (an encoder's
[SEP]; no EOS otherwise). So the saved model scores `tokenizer(prompt + answer)` (or, for
chat, the conversation as `apply_chat_template` renders it) exactly as it was trained, with
plain transformers and nothing from accord.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accord.data.columns import Schema
from accord.data.sources import DataError, check_columns, row_origin
from accord.tasks.base import LossOutput, Task, text_prefix, text_suffix
from accord.tasks.pairs import collate_pairs, encode_pairs, pair_schema


class RewardTask(Task):
    name = "reward"
    model_kind = "sequence_classification"
    token_shards = eval_shards = True

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.add_bos = config.data.add_bos
        self.prefix = text_prefix(tokenizer, self.add_bos)  # what `tokenizer(text)` puts first (data.add_bos)
        self.suffix = text_suffix(tokenizer)  # what `tokenizer(text)` puts last (an encoder's [SEP])
        self.chat = False  # rows are conversations, rendered with the chat template in fit()

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"format": 1, "add_bos": self.add_bos, "prefix": self.prefix, "suffix": self.suffix}

    def fit(self, train, eval_ds):
        self.chat = _holds_conversations(train, "chosen")
        if self.chat and self.tokenizer.chat_template is None:
            raise DataError("reward on chat messages needs a tokenizer with a chat template (model.tokenizer has none)")
        return tuple(
            None if ds is None else self._as_text(ds) if self.chat else _text_pairs(ds) for ds in (train, eval_ds)
        )

    def _as_text(self, ds):
        """Conversation rows as text pairs: `prompt` the template's rendering of the prompt
        turns with the assistant's opening ("" without a prompt), each answer the rest of
        its whole conversation's rendering."""
        render = self.tokenizer.apply_chat_template
        missing = [name for name in ("chosen", "rejected") if name not in ds.column_names]
        if missing:
            present = ", ".join(c for c in ds.column_names if not c.startswith("__"))
            raise DataError(
                f"{row_origin(ds[0])}: chat preference rows need `chosen` and `rejected` conversations "
                f"(fields present: {present})"
            )

        def split(row):
            for name in ("prompt", "chosen", "rejected"):
                value = row.get(name) or []
                if not isinstance(value, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value
                ):
                    raise DataError(
                        f"{row_origin(row)}: `{name}` must be a list of {{role, content}} messages, "
                        "like the first row's"
                    )
            prompt = row.get("prompt") or []
            head = render(prompt, tokenize=False, add_generation_prompt=True) if prompt else ""
            texts = {name: render(prompt + row[name], tokenize=False) for name in ("chosen", "rejected")}
            if not all(text.startswith(head) for text in texts.values()):
                head = ""  # a template that renders the prompt differently inside a conversation
            return {"prompt": head} | {name: text[len(head) :] for name, text in texts.items()}

        return ds.map(split, remove_columns=[c for c in ("prompt", "chosen", "rejected") if c in ds.column_names])

    def state(self) -> dict[str, Any]:
        return {"chat": self.chat}

    def load_state(self, state: dict[str, Any]) -> None:
        self.chat = state["chat"]

    def model_kwargs(self) -> dict[str, Any]:
        return {"num_labels": 1}

    def configure_model(self, model: nn.Module) -> None:
        # transformers finds a decoder's last token through config.pad_token_id: it must be
        # the id batches are padded with here, and it is saved with final/ so that plain
        # transformers pools the same token.
        model.config.pad_token_id = self.pad_id

    def shard_schema(self) -> Schema:
        return pair_schema(labels=False)

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        # A rendered conversation starts as the template renders it (as sft's chat rows do).
        if self.chat:
            return encode_pairs(self.tokenizer, batch, [], [], self.max_length, labels=False)
        return encode_pairs(self.tokenizer, batch, self.prefix, self.suffix, self.max_length, labels=False)

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


def _holds_conversations(ds, column: str) -> bool:
    return column in ds.column_names and len(ds) > 0 and isinstance(ds[0][column], list)


def _text_pairs(ds):
    return check_columns(
        ds, ("prompt", "chosen", "rejected"), "reward data (prompt/chosen/rejected as text or chat messages)"
    )
