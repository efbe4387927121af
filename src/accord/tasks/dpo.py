"""Direct preference optimisation: rows of `prompt`, `chosen`, `rejected`.

The loss of a pair is a function of its summed answer log-probabilities under the policy
and the reference (dpo.loss_type: sigmoid, -log σ(β·[(log π(c) − log π_ref(c)) − (log π(r) −
log π_ref(r))]), by default; accord.tasks.preference_losses holds TRL's whole family), summed
over pairs; the trainer divides by the pairs of the whole global batch, so the update does
not depend on how pairs are split over ranks and micro-steps. The reference is a frozen model
(by default the starting model; with LoRA, the same model with its adapters switched off),
log-probabilities precomputed once before training, or none (dpo.reference_free: 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from accord.data.columns import Schema
from accord.data.fetch import fetch, to_device
from accord.tasks.base import IGNORE, LossOutput, Task, text_prefix
from accord.tasks.chunked_loss import plain_loss_note, shifted_targets
from accord.tasks.pairs import collate_pairs, encode_pairs, pair_schema
from accord.tasks.preference_losses import LossParams, PairLogps, pair_loss
from accord.tasks.reference_model import ReferenceModel, frozen_reference


class DPOTask(Task):
    name = "dpo"
    text_fields = ("prompt", "chosen", "rejected")
    token_shards = eval_shards = True
    takes_streams = True  # pairs are encoded as they come: nothing reads the whole table first
    chunked_loss = True
    sections = ("dpo",)

    @classmethod
    def frozen_model(cls, config):
        dpo = config.section("dpo")
        return frozen_reference(config.lora, dpo.reference, "dpo.reference", dpo.reference_free)

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.cfg = cfg = config.section("dpo")
        self.beta = cfg.beta
        self.terms = cfg.weighted_losses()
        self.params = LossParams(cfg.beta, cfg.label_smoothing, cfg.discopop_tau)
        self.eos_id = tokenizer.eos_token_id
        self.add_bos = config.data.add_bos
        self.prefix = text_prefix(tokenizer, self.add_bos)  # what `tokenizer(prompt)` puts first (data.add_bos)
        self.reference = ReferenceModel(config, tokenizer, self.model_kind, cfg.reference, cfg.reference_free)
        self.precomputed = 0  # training pairs whose reference log-probabilities were precomputed

    eval_hidden = ("logps_chosen", "logps_rejected")

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"format": 1, "add_bos": self.add_bos, "prefix": self.prefix}

    # ---------------------------------------------------------------- the reference policy

    def configure_model(self, model: nn.Module) -> None:
        self.reference.configure_model(model)

    def setup(self, engine, train, eval_ds):
        self.reference.setup(engine)
        if not self.cfg.precompute_reference:  # (the recipe refuses it with reference_free)
            return train, eval_ds
        train, eval_ds = (self._with_reference_logps(ds, engine) if ds is not None else None for ds in (train, eval_ds))
        self.reference.release()
        self.precomputed = len(train)
        return train, eval_ds

    @torch.no_grad()
    def _with_reference_logps(self, ds, engine):
        """`ds` with a `ref_logp` column (chosen, rejected), computed once so training needs
        no reference forward pass. Every rank runs the same batches (a sharded policy's
        forward is collective)."""
        size = self.config.eval_micro_batch_size
        values = np.zeros((len(ds), 2), dtype=np.float32)
        for start in range(0, len(ds), size):
            indices = list(range(start, min(start + size, len(ds))))
            batch = to_device(self.collate([[e] for e in fetch(ds, indices)]), engine.device)
            with engine.autocast():
                logps = self.reference_logps(batch).float().cpu().numpy()
            values[indices, 0], values[indices, 1] = logps[: len(indices)], logps[len(indices) :]
        return ds.add_column("ref_logp", values)

    def describe(self) -> list[str]:
        lines = plain_loss_note(self.reference.plain_loss_reason)
        if not self.precomputed:
            return lines
        return lines + [f"reference log-probabilities precomputed for {self.precomputed} training pairs"]

    def shard_schema(self) -> Schema:
        return pair_schema(labels=True)

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        return encode_pairs(self.tokenizer, batch, self.prefix, [self.eos_id], self.max_length, labels=True)

    def collate(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        examples = [row[0] for row in rows]
        batch = collate_pairs(examples, self.pad_id)
        if "ref_logp" in examples[0]:
            batch["ref_logps"] = torch.tensor(
                [e["ref_logp"][0] for e in examples] + [e["ref_logp"][1] for e in examples], dtype=torch.float32
            )
        return batch

    def reference_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed answer log-probabilities under the reference, chosen rows then rejected
        (dpo.reference_free: 0, a uniform reference)."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return self.reference.logps(inputs, batch["labels"])

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        policy = self.reference.policy_logps(model, inputs, batch["labels"])
        reference = batch["ref_logps"] if "ref_logps" in batch else self.reference_logps(batch)
        pairs = len(policy) // 2
        tokens = (shifted_targets(batch["labels"]) != IGNORE).sum(-1)
        p = PairLogps(
            policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:], tokens[:pairs], tokens[pairs:]
        )
        # What TRL logs, as sums over pairs (the trainer divides by the step's pairs).
        chosen, rejected = (self.beta * p.chosen_logratio).detach(), (self.beta * p.rejected_logratio).detach()
        margin = chosen - rejected
        metrics = {
            "reward_accuracy": (margin > 0).sum().float(),
            "reward_margin": margin.sum(),
            "reward_chosen": chosen.sum(),
            "reward_rejected": rejected.sum(),
            "logps_chosen": p.chosen.detach().sum(),
            "logps_rejected": p.rejected.detach().sum(),
        }
        if any(name == "sft" for name, _ in self.terms):
            metrics["nll"] = (-p.chosen / p.chosen_tokens.clamp(min=1)).detach().sum()
        return LossOutput(
            loss_sum=pair_loss(p, self.terms, self.params).sum(),
            num_targets=torch.tensor(pairs, device=policy.device),
            metrics=metrics,
        )
