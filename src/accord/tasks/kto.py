"""Kahneman-Tversky optimisation: rows of `prompt`, `completion` and a boolean `label`
(desirable or not); preference pairs (`prompt`, `chosen`, `rejected`) are unpaired into one
desirable and one undesirable row each, as TRL's unpair_preference_dataset does.

Each row's loss compares its log-ratio to the reference, r = log π(y|x) − log π_ref(y|x),
with a reference point z0: 1 − σ(β(r − z0)) for a desirable row, 1 − σ(β(z0 − r)) for an
undesirable one, weighted by kto.desirable_weight / undesirable_weight; kto.loss_type
apo_zero_unpaired drops z0 (1 − σ(βr), σ(βr)). z0 is the KL estimate from mismatched pairs:
each row's prompt with the completion of the row before it in the global batch (the last
row's wraps to the first), scored without gradients by the policy and the reference,
averaged over the whole global batch and clamped at 0. TRL estimates it per micro-batch and
rank; here it is one number per optimizer step, computed before the step's micro-batches
(run/batch_pass.py), so the update does not depend on how the batch is split. The loss is
summed over rows; the trainer divides by the global batch's rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accord.data.rows import DataError, row_origin
from accord.data.sources import check_columns
from accord.tasks.base import IGNORE, LossOutput, Task, pad_rows, text_prefix, token_ids
from accord.tasks.chunked_loss import plain_loss_note
from accord.tasks.reference_model import ReferenceModel, frozen_reference

PAIRED = ("chosen", "rejected")


class KTOTask(Task):
    name = "kto"
    text_fields = ("prompt",)  # and completion + label, or chosen + rejected (fit() checks which)
    chunked_loss = True
    # Its loss reads a statistic of the whole global batch (the KL estimate): the trainer runs
    # statistics_batch / statistics_sums over the step's rows before its micro-batches.
    batch_statistics = True
    sections = ("kto",)

    eval_hidden = ("logps/chosen", "logps/rejected")

    @classmethod
    def frozen_model(cls, config):
        return frozen_reference(config.lora, config.section("kto").reference, "kto.reference")

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        cfg = config.section("kto")
        self.beta = cfg.beta
        self.estimates_kl = cfg.loss_type == "kto"
        self.weights = (cfg.desirable_weight, cfg.undesirable_weight)
        self.eos_id = tokenizer.eos_token_id
        self.add_bos = config.data.add_bos
        self.prefix = text_prefix(tokenizer, self.add_bos)  # what `tokenizer(prompt)` puts first (data.add_bos)
        self.reference = ReferenceModel(config, tokenizer, self.model_kind, cfg.reference)
        # This step's totals over the global batch (use_statistics): z0, and its rows per class.
        self.kl = 0.0
        self.counts = (0.0, 0.0, 0.0)  # rows, desirable, undesirable
        self.balance: dict[str, Any] = {}  # what fit() found of the classes (describe() warns)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"format": 1, "add_bos": self.add_bos, "prefix": self.prefix}

    # ---------------------------------------------------------------- rows

    def fit(self, train, eval_ds):
        checked = tuple(None if ds is None else _unpaired_with_labels(ds) for ds in (train, eval_ds))
        labels = checked[0]["label"]
        desirable = sum(labels)
        self.balance = {"desirable": desirable, "undesirable": len(labels) - desirable}
        return checked

    def state(self) -> dict[str, Any]:
        return {"balance": self.balance}

    def load_state(self, state: dict[str, Any]) -> None:
        self.balance = state.get("balance", {})

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        """The prompt's and the completion's ids apart (a KL row joins a prompt to another
        row's completion), each kept to max_length; joined and cut from the right (TRL's
        truncation) when collated."""
        prompts = [self.prefix + ids for ids in token_ids(self.tokenizer, batch["prompt"])]
        completions = [ids + [self.eos_id] for ids in token_ids(self.tokenizer, batch["completion"])]
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        return {
            "prompt_ids": [p[: self.max_length] for p in prompts],
            "completion_ids": [c[: self.max_length] for c in completions],
            "desirable": [bool(v) for v in batch["label"]],  # (raw columns such as label are not kept)
            # One row; none where the prompt alone fills max_length (data.truncation drops it, as TRL does).
            "num_targets": [int(len(p) < self.max_length) for p in prompts],
            "length": [min(n, self.max_length) for n in lengths],
            "over_length": [n > self.max_length for n in lengths],
        }

    def collate(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        """The rows as prompt + completion, and (for evaluation, which has no global batch)
        their KL rows with the completions rotated within this batch."""
        examples = [row[0] for row in rows]
        batch = self._sequences(examples, examples)
        batch["label"] = torch.tensor([bool(e["desirable"]) for e in examples])
        if self.estimates_kl:
            rotated = examples[-1:] + examples[:-1]
            batch |= {f"kl_{name}": value for name, value in self._sequences(examples, rotated).items()}
        return batch

    def _sequences(self, prompts: list[dict], answers: list[dict]) -> dict[str, torch.Tensor]:
        """Each prompt followed by the completion of the example at the same place in `answers`,
        cut to max_length, right-padded; labels on the completion's tokens only."""
        ids, labels = [], []
        for p, a in zip(prompts, answers):
            prompt, completion = p["prompt_ids"], a["completion_ids"]
            ids.append((prompt + completion)[: self.max_length])
            labels.append(([IGNORE] * len(prompt) + completion)[: self.max_length])
        input_ids = pad_rows(ids, self.pad_id)
        lengths = torch.tensor([len(s) for s in ids])
        mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
        return {"input_ids": input_ids, "attention_mask": mask, "labels": pad_rows(labels, IGNORE)}

    # ---------------------------------------------------------------- the reference policy

    def configure_model(self, model: nn.Module) -> None:
        self.reference.configure_model(model)

    def setup(self, engine, train, eval_ds):
        self.reference.setup(engine)
        return train, eval_ds

    def describe(self) -> list[str]:
        return plain_loss_note(self.reference.plain_loss_reason) + _balance_warnings(self.balance, self.weights)

    # ---------------------------------------------------------------- the global batch's KL estimate

    def statistics_batch(self, rows: list[list[dict]], partners: list[list[dict]]) -> dict[str, torch.Tensor]:
        """Each row's prompt with its partner's completion (the row before it in the global
        batch), and the rows' labels for the class counts."""
        examples = [row[0] for row in rows]
        batch = self._sequences(examples, [row[0] for row in partners]) if self.estimates_kl else {}
        return batch | {"label": torch.tensor([bool(e["desirable"]) for e in examples])}

    @torch.no_grad()
    def statistics_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[Σ (log π − log π_ref) over the KL rows, rows, desirable rows], this micro-batch's."""
        labels = batch["label"]
        kl_sum = torch.zeros((), dtype=torch.float64, device=labels.device)
        if self.estimates_kl:
            kl_sum = self._kl_logratios(model, batch).double().sum()
        return torch.stack(
            [kl_sum, torch.tensor(float(len(labels)), dtype=torch.float64, device=labels.device), labels.double().sum()]
        )

    def use_statistics(self, totals: torch.Tensor) -> None:
        """The global batch's totals (statistics_sums over every rank and micro-batch)."""
        kl_sum, rows, desirable = totals.tolist()
        self.kl = max(kl_sum / max(rows, 1.0), 0.0) if self.estimates_kl else 0.0
        self.counts = (rows, desirable, rows - desirable)

    def _kl_logratios(self, model: nn.Module, batch: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
        inputs = {"input_ids": batch[f"{prefix}input_ids"], "attention_mask": batch[f"{prefix}attention_mask"]}
        labels = batch[f"{prefix}labels"]
        with torch.no_grad():
            return self.reference.policy_logps(model, inputs, labels) - self.reference.logps(inputs, labels)

    # ---------------------------------------------------------------- the loss

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        policy = self.reference.policy_logps(model, inputs, batch["labels"])
        logratio = policy - self.reference.logps(inputs, batch["labels"])
        desirable = batch["label"].to(policy.device)
        kl = torch.tensor(self.kl, dtype=logratio.dtype, device=logratio.device)
        if self.estimates_kl:
            losses = torch.where(
                desirable,
                1 - torch.sigmoid(self.beta * (logratio - kl)),
                1 - torch.sigmoid(self.beta * (kl - logratio)),
            )
        else:  # apo_zero_unpaired
            losses = torch.where(
                desirable, 1 - torch.sigmoid(self.beta * logratio), torch.sigmoid(self.beta * logratio)
            )
        weights = torch.where(desirable, self.weights[0], self.weights[1]).to(losses.dtype)
        return LossOutput(
            loss_sum=(weights * losses).sum(),
            num_targets=torch.tensor(len(losses), device=policy.device),
            metrics=self._metrics(policy.detach(), (self.beta * logratio).detach(), desirable),
        )

    def _metrics(self, logps: torch.Tensor, rewards: torch.Tensor, desirable: torch.Tensor) -> dict[str, torch.Tensor]:
        """TRL's KTO metrics as sums that the trainer's division by the global batch's rows turns
        into means per class: each class's sum is scaled by rows / that class's rows."""
        rows, chosen, rejected = self.counts
        up, down = rows / max(chosen, 1.0), rows / max(rejected, 1.0)
        zero = torch.zeros((), device=logps.device)
        chosen_reward = rewards[desirable].sum() * up if chosen else zero
        rejected_reward = rewards[~desirable].sum() * down if rejected else zero
        return {
            "kl": torch.full((), self.kl, device=logps.device) * len(logps),
            "rewards/chosen": chosen_reward,
            "rewards/rejected": rejected_reward,
            "rewards/margins": chosen_reward - rejected_reward,
            "logps/chosen": logps[desirable].sum() * up if chosen else zero,
            "logps/rejected": logps[~desirable].sum() * down if rejected else zero,
        }

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Held-out rows have no global batch: z0 and the class counts are this batch's own."""
        labels = batch["label"]
        kl_sum = self._kl_logratios(model, batch, "kl_").double().sum() if self.estimates_kl else 0.0
        totals = torch.tensor([float(kl_sum), float(len(labels)), float(labels.sum())], dtype=torch.float64)
        trained = self.kl, self.counts
        self.use_statistics(totals)
        try:
            return super().eval_sums(model, batch)
        finally:
            self.kl, self.counts = trained


def _unpaired_with_labels(ds):
    """`ds` as rows of prompt, completion and a boolean label: pairs unpaired (within each
    map batch every chosen row, then every rejected one, as TRL), labels checked."""
    columns = ds.column_names
    if all(c in columns for c in PAIRED) and "completion" not in columns:
        # A pair without its rejected (or chosen) text is named by row, not met by the tokenizer.
        ds = check_columns(ds, PAIRED, "kto data")
        ds = ds.map(_unpair, batched=True, remove_columns=list(PAIRED))
    missing = [c for c in ("completion", "label") if c not in ds.column_names]
    if missing:
        present = [c for c in ds.column_names if not c.startswith("__")]
        raise DataError(
            f"kto data: missing field {', '.join(map(repr, missing))} (fields present: {', '.join(present)}); "
            f"kto reads prompt, completion and a boolean label (or prompt, chosen, rejected); rename with fields: "
            f"{{{missing[0]}: <column>}}"
        )
    ds = check_columns(ds, ("completion",), "kto data")
    for i, value in enumerate(ds["label"]):
        if not isinstance(value, bool):
            raise DataError(
                f"{row_origin(ds[i])}: kto label {value!r} is not a boolean; write true (desirable) or false"
            )
    return ds


def _unpair(batch: dict[str, list]) -> dict[str, list]:
    n = len(batch["prompt"])
    out = {name: values + values for name, values in batch.items() if name not in PAIRED}
    return out | {"completion": batch["chosen"] + batch["rejected"], "label": [True] * n + [False] * n}


def _balance_warnings(balance: dict[str, Any], weights: tuple[float, float]) -> list[str]:
    """TRL's advice (the KTO paper's eq. 8) when the two classes' counts differ and neither
    weight lies in the range that balances them; a class absent from the training rows."""
    desirable, undesirable = balance.get("desirable", 0), balance.get("undesirable", 0)
    if not desirable or not undesirable:
        absent = "undesirable" if desirable else "desirable"
        return [f"warning: kto: no {absent} rows in the training data; only one side of the loss is trained"]
    if desirable == undesirable:
        return []
    up_low, up_high = undesirable * weights[1] / desirable, undesirable * weights[1] / desirable * 1.33
    down_low, down_high = desirable * weights[0] / undesirable / 1.33, desirable * weights[0] / undesirable
    if up_low <= weights[0] <= up_high or down_low <= weights[1] <= down_high:
        return []
    return [
        f"warning: kto: {desirable} desirable and {undesirable} undesirable training rows; to balance them set "
        f"EITHER kto.desirable_weight in [{up_low:.2f}, {up_high:.2f}] OR kto.undesirable_weight in "
        f"[{down_low:.2f}, {down_high:.2f}] (not both)"
    ]
