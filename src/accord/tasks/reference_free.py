"""Reference-free preference optimisation: ORPO and CPO (with SimPO), rows of `prompt`,
`chosen`, `rejected`, as TRL's ORPOTrainer and CPOTrainer compute them.

Both add a preference term per pair to a negative log-likelihood of the chosen sequences,
and the two are averaged over different counts: TRL takes the NLL's mean over the chosen
tokens of its batch and the preference term's mean over its pairs. Here the chosen tokens
are the targets (`num_targets`, the trainer's normaliser) and the preference term is a
LossOutput row term, averaged over the pairs (rows) of the whole global batch; so a step's
loss is NLL_sum / chosen tokens + preference_sum / pairs, both counts of the global batch,
and the update does not depend on how the pairs are split over ranks and micro-steps. It
equals TRL's loss where one global batch is one TRL batch (1 process, no accumulation).

ORPO (Hong et al. 2024): NLL over the whole chosen sequence (prompt and answer, as TRL
computes it) − β · log σ(log odds(chosen) − log odds(rejected)), the odds of the mean answer
log-probability per token. CPO (Xu et al. 2024): cpo_alpha · NLL of the chosen answers plus
the sigmoid, hinge or IPO loss of the answers' log-probability margin (summed, or per token
for ipo); simpo (Meng et al. 2024) is the sigmoid loss of the per-token margin less a target
margin γ.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accord.data.columns import Schema
from accord.tasks.base import IGNORE, LossOutput, Task, text_prefix
from accord.tasks.chunked_loss import TargetLogprobs, answer_logprobs, chunking_blocker, plain_loss_note
from accord.tasks.pairs import collate_pairs, encode_pairs, pair_schema


class _ReferenceFreeTask(Task):
    """What ORPO and CPO share: the pair rows, their targets and the logged metrics."""

    text_fields = ("prompt", "chosen", "rejected")
    token_shards = eval_shards = True
    takes_streams = True  # pairs are encoded as they come: nothing reads the whole table first
    # Which chosen tokens the NLL covers: "sequence" (every token after the first) or "answer".
    nll_over = "answer"

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.eos_id = tokenizer.eos_token_id
        self.add_bos = config.data.add_bos
        self.prefix = text_prefix(tokenizer, self.add_bos)  # what `tokenizer(prompt)` puts first (data.add_bos)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "format": 1,
            "add_bos": self.add_bos,
            "prefix": self.prefix,
            "nll_over": self.nll_over,
        }

    def shard_schema(self) -> Schema:
        return pair_schema(labels=True)

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        out = encode_pairs(self.tokenizer, batch, self.prefix, [self.eos_id], self.max_length, labels=True)
        # A pair's targets are its chosen tokens under the NLL: the trainer's normaliser.
        if self.nll_over == "sequence":
            out["num_targets"] = [len(ids) - 1 for ids in out["chosen_input_ids"]]
        else:
            out["num_targets"] = [sum(label != IGNORE for label in labels[1:]) for labels in out["chosen_labels"]]
        return out

    def collate(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        return collate_pairs([row[0] for row in rows], self.pad_id)

    def _output(
        self, loss_sum, nll_sum, targets, preference: torch.Tensor, chosen_rewards, rejected_rewards, logps, extra=None
    ) -> LossOutput:
        """The LossOutput of a micro-batch: `loss_sum` (the weighted NLL over `targets` tokens),
        the per-pair `preference` losses as the row term, and TRL's metrics (per pair, but
        nll_loss: the unweighted NLL per token)."""
        pairs = len(preference)
        margins = (chosen_rewards - rejected_rewards).detach()
        return LossOutput(
            loss_sum=loss_sum,
            num_targets=targets,
            metrics={"nll_loss": nll_sum.detach()},
            row_loss_sum=preference.sum(),
            num_rows=torch.tensor(pairs, device=preference.device),
            row_metrics={
                "rewards/chosen": chosen_rewards.detach().sum(),
                "rewards/rejected": rejected_rewards.detach().sum(),
                "rewards/accuracies": (margins > 0).sum().float(),
                "rewards/margins": margins.sum(),
                "logps/chosen": logps[:pairs].detach().sum(),
                "logps/rejected": logps[pairs:].detach().sum(),
            }
            | (extra or {}),
        )


class ORPOTask(_ReferenceFreeTask):
    name = "orpo"
    nll_over = "sequence"
    sections = ("orpo",)
    # The NLL covers the whole chosen sequence and the odds its answer alone: one forward
    # gives both only from whole logits (the chunked path returns one sum per row).

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.beta = config.section("orpo").beta

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        token_logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        token_logps = token_logps.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        pairs = len(token_logps) // 2
        answer = batch["labels"][:, 1:] != IGNORE
        logps = (token_logps * answer).sum(-1) / answer.sum(-1).clamp(min=1)  # mean per answer token
        sequence = batch["attention_mask"][:pairs, 1:].bool()
        nll_sum = -(token_logps[:pairs] * sequence).sum()
        chosen, rejected = logps[:pairs], logps[pairs:]
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        return self._output(
            nll_sum,
            nll_sum,
            sequence.sum(),
            -self.beta * ratio,
            self.beta * chosen,
            self.beta * rejected,
            logps,
            {"log_odds_ratio": ratio.detach().sum(), "log_odds_chosen": log_odds.detach().sum()},
        )


class CPOTask(_ReferenceFreeTask):
    name = "cpo"
    chunked_loss = True
    sections = ("cpo",)

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.cfg = config.section("cpo")
        self.logprobs: TargetLogprobs | None = None  # the chunked log-probabilities (train.loss_chunk_size)
        self.plain_loss_reason: str | None = None

    def configure_model(self, model: nn.Module) -> None:
        self.plain_loss_reason = chunking_blocker(model, self.config)
        if self.plain_loss_reason is None:
            self.logprobs = TargetLogprobs.install(model, self.config.loss_chunk_size)

    def describe(self) -> list[str]:
        return plain_loss_note(self.plain_loss_reason)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        sums = answer_logprobs(model, self.logprobs, inputs, batch["labels"])
        tokens = (batch["labels"][:, 1:] != IGNORE).sum(-1)
        pairs = len(sums) // 2
        cfg = self.cfg
        # ipo and simpo compare the mean log-probability per answer token; sigmoid and hinge the sums.
        logps = sums / tokens.clamp(min=1) if cfg.loss_type in ("ipo", "simpo") else sums
        margin = logps[:pairs] - logps[pairs:]
        if cfg.loss_type == "simpo":
            margin = margin - cfg.simpo_gamma / cfg.beta
        if cfg.loss_type in ("sigmoid", "simpo"):
            smoothing = cfg.label_smoothing
            losses = -F.logsigmoid(cfg.beta * margin) * (1 - smoothing) - F.logsigmoid(-cfg.beta * margin) * smoothing
        elif cfg.loss_type == "hinge":
            losses = torch.relu(1 - cfg.beta * margin)
        else:  # ipo
            losses = (margin - 1 / (2 * cfg.beta)) ** 2
        nll_sum = -sums[:pairs].sum()
        return self._output(
            cfg.cpo_alpha * nll_sum,
            nll_sum,
            tokens[:pairs].sum(),
            losses,
            cfg.beta * logps[:pairs],
            cfg.beta * logps[pairs:],
            logps,
        )


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, without cancellation on either side of −ln 2 (Mächler 2012)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
