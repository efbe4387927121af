"""Direct preference optimisation (sigmoid loss): rows of `prompt`, `chosen`, `rejected`.

The loss of a pair is -log σ(β·[(log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r))]),
summed over pairs; the trainer divides by the pairs of the whole global batch, so the
update does not depend on how pairs are split over ranks and micro-steps. The reference
is a frozen model (by default the starting model; with LoRA, the same model with its
adapters switched off), or log-probabilities precomputed once before training.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accord.tasks.base import IGNORE, LossOutput, Task, pad_rows, sequence_logprobs


class DPOTask(Task):
    name = "dpo"
    text_fields = ("prompt", "chosen", "rejected")

    def __init__(self, tokenizer, recipe):
        super().__init__(tokenizer, recipe)
        self.beta = recipe.dpo.beta
        self.eos_id = tokenizer.eos_token_id
        self.prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.reference: nn.Module | None = None  # a frozen model, or None: adapters off
        self.policy: nn.Module | None = None

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"format": 1}

    def attach_reference(self, reference: nn.Module | None, policy: nn.Module) -> None:
        self.reference, self.policy = reference, policy

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        tok = lambda texts: self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
        out: dict[str, list] = {k: [] for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "num_targets", "length", "over_length")}
        for prompt, chosen, rejected in zip(tok(batch["prompt"]), tok(batch["chosen"]), tok(batch["rejected"])):
            over = len(self.prefix) + max(len(prompt) + len(chosen), len(prompt) + len(rejected)) + 1 > self.max_length
            # Keep the end of an over-long prompt (what the answer follows) after the BOS
            # prefix, then cut answers.
            keep = self.max_length // 2 - len(self.prefix)
            prompt = self.prefix + (prompt[-keep:] if len(prompt) > keep and over else prompt)
            for name, answer in (("chosen", chosen), ("rejected", rejected)):
                answer = (answer + [self.eos_id])[: self.max_length - len(prompt)]
                out[f"{name}_input_ids"].append(prompt + answer)
                out[f"{name}_labels"].append([IGNORE] * len(prompt) + answer)
            out["num_targets"].append(1)  # one pair
            out["length"].append(max(len(out["chosen_input_ids"][-1]), len(out["rejected_input_ids"][-1])))
            out["over_length"].append(over)
        return out

    def collate(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        examples = [row[0] for row in rows]
        sequences = [e["chosen_input_ids"] for e in examples] + [e["rejected_input_ids"] for e in examples]
        labels = [e["chosen_labels"] for e in examples] + [e["rejected_labels"] for e in examples]
        input_ids = pad_rows(sequences, self.pad_id)
        lengths = torch.tensor([len(s) for s in sequences])
        batch = {
            "input_ids": input_ids,
            "attention_mask": (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long(),
            "labels": pad_rows(labels, IGNORE),
        }
        if "ref_logp" in examples[0]:
            batch["ref_logps"] = torch.tensor([e["ref_logp"][0] for e in examples] + [e["ref_logp"][1] for e in examples], dtype=torch.float32)
        return batch

    @torch.no_grad()
    def reference_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed answer log-probabilities under the reference, chosen rows then rejected."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if self.reference is not None:
            logits = self.reference(**inputs).logits
        else:
            assert self.policy is not None, "attach_reference() first"
            with _adapters_off(self.policy):
                logits = self.policy(**inputs).logits
        return sequence_logprobs(logits, batch["labels"])

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        policy = sequence_logprobs(logits, batch["labels"])
        reference = batch["ref_logps"] if "ref_logps" in batch else self.reference_logps(batch)
        pairs = len(policy) // 2
        chosen = self.beta * (policy[:pairs] - reference[:pairs])
        rejected = self.beta * (policy[pairs:] - reference[pairs:])
        margin = chosen - rejected
        return LossOutput(
            loss_sum=-F.logsigmoid(margin).sum(),
            num_targets=torch.tensor(pairs, device=policy.device),
            metrics={
                "reward_accuracy": (margin > 0).sum().float(),
                "reward_margin": margin.detach().sum(),
                "reward_chosen": chosen.detach().sum(),
                "reward_rejected": rejected.detach().sum(),
            },
        )


def _adapters_off(model: nn.Module):
    disable = getattr(model, "disable_adapter", None)
    return disable() if callable(disable) else contextlib.nullcontext()
