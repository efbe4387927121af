"""Sequence classification: `text` (and optionally `text_pair`) -> `label`, with an encoder
or decoder model and a classification head (AutoModelForSequenceClassification)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accord.data.columns import Schema
from accord.data.sources import DataError, row_origin
from accord.tasks.base import LossOutput, Task, pad_rows

LABEL_BATCH_ROWS = 65536  # labels read at a time when the label set is found and checked


class ClassifyTask(Task):
    name = "classify"
    text_fields = ("text",)
    model_kind = "sequence_classification"
    token_shards = eval_shards = True
    sections = ("classify",)

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        labels = config.section("classify").labels
        self.given: list[str] | None = list(labels) if labels else None
        self.labels: list[str] | None = self.given  # names in id order
        self.ids: dict[str, int] = {}  # a row's label (as text) -> its id
        self.pair = False

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"labels": self.given}

    def fit(self, train, eval_ds):
        for ds in (train, eval_ds):
            if ds is not None and "label" not in ds.column_names:
                present = [c for c in ds.column_names if not c.startswith("__")]
                raise DataError(
                    f"classify data: missing field 'label' (fields present: {', '.join(present)}); "
                    "rename with fields: {label: <column>}"
                )
        self.pair = "text_pair" in train.column_names
        self.labels, self.ids = label_set(train, eval_ds, self.given)
        if len(self.labels) < 2:
            raise DataError(
                f"classify: found {len(self.labels)} distinct label(s) in the training data; need at least 2"
            )
        for ds in (train, eval_ds):
            if ds is None:
                continue
            for start, values in _label_batches(ds):
                for k, value in enumerate(values):
                    if value is None or str(value) not in self.ids:
                        raise DataError(
                            f"{row_origin(ds[start + k])}: label {value!r} is not in the label set "
                            f"{_shown(self.labels, self.ids)} (classify.labels)"
                        )
        return train, eval_ds

    def state(self) -> dict[str, Any]:
        return {"labels": self.labels, "ids": self.ids, "pair": self.pair}

    def load_state(self, state: dict[str, Any]) -> None:
        self.labels, self.ids, self.pair = state["labels"], state["ids"], state["pair"]

    def model_kwargs(self) -> dict[str, Any]:
        if self.labels is None:  # planning before the data is read: the model's default head
            return {}
        return {
            "num_labels": len(self.labels),
            "id2label": dict(enumerate(self.labels)),
            "label2id": {label: i for i, label in enumerate(self.labels)},
        }

    def shard_schema(self) -> Schema:
        # An encoder's tokenizer gives token types too (the text pair's segments).
        types = ("token_type_ids",) if "token_type_ids" in self.tokenizer.model_input_names else ()
        return Schema(("input_ids", *types), values={"label_id": "int32"})

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        assert self.labels is not None
        index = self.ids
        pairs = batch["text_pair"] if self.pair else None
        full = self.tokenizer(batch["text"], pairs, truncation=False)
        cut = self.tokenizer(batch["text"], pairs, truncation=True, max_length=self.max_length)
        out = {
            "input_ids": cut["input_ids"],
            "label_id": [index[str(v)] for v in batch["label"]],
            "num_targets": [1] * len(batch["text"]),
            "length": [len(ids) for ids in cut["input_ids"]],
            "over_length": [len(ids) > self.max_length for ids in full["input_ids"]],
        }
        if "token_type_ids" in cut:
            out["token_type_ids"] = cut["token_type_ids"]
        return out

    def collate(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        examples = [row[0] for row in rows]
        input_ids = pad_rows([e["input_ids"] for e in examples], self.pad_id)
        lengths = torch.tensor([len(e["input_ids"]) for e in examples])
        batch = {
            "input_ids": input_ids,
            "attention_mask": (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long(),
            "labels": torch.tensor([e["label_id"] for e in examples]),
        }
        if "token_type_ids" in examples[0]:
            batch["token_type_ids"] = pad_rows([e["token_type_ids"] for e in examples], 0)
        return batch

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        loss_sum = F.cross_entropy(logits, batch["labels"], reduction="sum")
        correct = (logits.argmax(-1) == batch["labels"]).sum()
        return LossOutput(loss_sum, torch.tensor(len(batch["labels"]), device=logits.device), {"accuracy": correct})

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loss, accuracy and per-class true/false positives and false negatives (for F1)."""
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        labels = batch["labels"]
        predicted = logits.argmax(-1)
        n = len(self.labels or [])
        onehot_pred = F.one_hot(predicted, n).double()
        onehot_true = F.one_hot(labels, n).double()
        sums = {
            "loss_sum": F.cross_entropy(logits, labels, reduction="sum").double(),
            "targets": torch.tensor(float(len(labels)), dtype=torch.float64, device=logits.device),
            "correct": (predicted == labels).sum().double(),
        }
        for c in range(n):
            sums[f"tp{c}"] = (onehot_pred[:, c] * onehot_true[:, c]).sum()
            sums[f"fp{c}"] = (onehot_pred[:, c] * (1 - onehot_true[:, c])).sum()
            sums[f"fn{c}"] = ((1 - onehot_pred[:, c]) * onehot_true[:, c]).sum()
        return sums

    def eval_summary(self, sums: dict[str, float]) -> dict[str, float]:
        targets = max(sums["targets"], 1.0)
        f1s = []
        for c in range(len(self.labels or [])):
            tp, fp, fn = sums[f"tp{c}"], sums[f"fp{c}"], sums[f"fn{c}"]
            if tp + fp + fn:  # a class neither present nor predicted is left out (as scikit-learn does)
                f1s.append(2 * tp / (2 * tp + fp + fn))
        return {
            "loss": sums["loss_sum"] / targets,
            "accuracy": sums["correct"] / targets,
            "macro_f1": sum(f1s) / max(len(f1s), 1),
        }


def label_set(train, eval_ds, given: list[str] | None) -> tuple[list[str], dict[str, int]]:
    """(names in id order, label value as text -> id). Integer labels keep their values as
    ids (0-11 are ids 0-11, not ordered as strings), named by `given` when it is set, else
    by the names of a datasets ClassLabel column, else by the numbers themselves.
    Text labels get ids in `given`'s order, else sorted (numerically when all are numbers)."""
    import datasets

    feature = train.features["label"]
    in_train = _distinct_labels(train)
    values = in_train | (_distinct_labels(eval_ds) if eval_ds is not None else set())
    if isinstance(feature, datasets.ClassLabel):
        names = given or list(feature.names)
        return names, {str(i): i for i in range(len(names))}
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if given:
            return given, {str(i): i for i in range(len(given))}
        numbers = sorted(set(values))
        if numbers[0] >= 0:  # the values are the ids; a number absent from the data is an unused class
            return [str(i) for i in range(numbers[-1] + 1)], {str(i): i for i in range(numbers[-1] + 1)}
        return [str(v) for v in numbers], {str(v): i for i, v in enumerate(numbers)}
    if given:
        return given, {name: i for i, name in enumerate(given)}
    names = sorted({str(v) for v in in_train})
    if all(re.fullmatch(r"-?\d+", name) for name in names):
        names.sort(key=int)
    return names, {name: i for i, name in enumerate(names)}


def _label_batches(ds) -> Iterator[tuple[int, list]]:
    """(first row, labels) of `ds` a batch at a time: the label column is read in pieces, never
    as one list of every row's label (which would grow with the corpus)."""
    start = 0
    for batch in ds.select_columns(["label"]).iter(batch_size=LABEL_BATCH_ROWS):
        yield start, batch["label"]
        start += len(batch["label"])


def _distinct_labels(ds) -> set:
    return {v for _, values in _label_batches(ds) for v in values if v is not None}


def _shown(labels: list[str], ids: dict[str, int]) -> str:
    """The label set as a row's label must be written: names, or the ids they name."""
    if list(ids) == labels:
        return str(labels)
    return "ids " + ", ".join(f"{value}={labels[i]}" for value, i in ids.items())
