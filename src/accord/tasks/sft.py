"""Supervised fine-tuning of a causal LM on prompt -> completion pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from accord.data.generated import Rows
from accord.recipe import DataConfig
from accord.tasks.base import IGNORE, PADDING, Example


class SFTTask:
    required_fields = ("prompt", "completion")

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig):
        self.tokenizer = tokenizer
        self.max_length = cfg.max_length
        self.completion_only_loss = cfg.completion_only_loss
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        # Tokenizers without a BOS (e.g. GPT-2 style) start the sequence with the prompt.
        self.prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(self, row: dict[str, str]) -> Example:
        prompt = self.prefix + self._tokens(row["prompt"])
        completion = self._tokens(row["completion"]) + [self.eos_id]
        input_ids = (prompt + completion)[: self.max_length]
        prompt_labels = [IGNORE] * len(prompt) if self.completion_only_loss else [IGNORE] + prompt[1:]
        labels = (prompt_labels + completion)[: self.max_length]
        return Example(input_ids, labels)

    def collate(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        """Right-pad to the longest sequence of the micro-batch."""
        width = max(len(e.input_ids) for e in examples)
        input_ids = torch.full((len(examples), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        for i, e in enumerate(examples):
            n = len(e.input_ids)
            input_ids[i, :n] = torch.tensor(e.input_ids)
            labels[i, :n] = torch.tensor(e.labels)
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # Token t predicts token t+1; cross-entropy in fp32 whatever the compute dtype.
        targets = batch["labels"][:, 1:]
        loss_sum = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        return loss_sum, (targets != IGNORE).sum()

    @torch.no_grad()
    def evaluate_generation(
        self, model: nn.Module, rows: Rows, device: torch.device, max_new_tokens: int, lockstep: bool = False
    ) -> dict[str, float]:
        """Greedy completion of each prompt; exact match against the reference completion."""
        correct = count = 0
        batch_size = 64
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            prompts = [self.prefix + self._tokens(r["prompt"]) for r in chunk]
            width = max(map(len, prompts))
            # Left padding so every prompt ends where generation starts.
            input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                synced_gpus=lockstep,
            )
            for row, generated in zip(chunk, out[:, width:].tolist()):
                if row.get(PADDING):
                    continue
                count += 1
                if self.eos_id in generated:
                    generated = generated[: generated.index(self.eos_id)]
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                correct += int(text.strip() == row["completion"].strip())
        return {"exact_match": float(correct), "count": float(count)}
