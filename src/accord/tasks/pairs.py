"""Preference pairs (`prompt`, `chosen`, `rejected`) as token rows, shared by the methods
that learn from them (dpo, reward).

A pair becomes two sequences, prompt + chosen and prompt + rejected, that share the
prompt's tokens. A batch puts every chosen sequence first and every rejected one after
(the layout TRL's preference collators use), right-padded, so one forward pass scores both
halves and row i pairs with row i + pairs.
"""

from __future__ import annotations

import torch

from accord.data.columns import Schema
from accord.tasks.base import IGNORE, pad_rows, token_ids


def pair_schema(labels: bool) -> Schema:
    """The token shard columns of encode_pairs (data/columns.py)."""
    sides = ("chosen", "rejected")
    return Schema(
        tuple(f"{s}_input_ids" for s in sides),
        labels={f"{s}_labels": f"{s}_input_ids" for s in sides} if labels else {},
    )


def encode_pairs(
    tokenizer, batch: dict[str, list], prefix: list[int], ending: list[int], max_length: int, labels: bool
) -> dict[str, list]:
    """Token columns for a batch of pairs: `prefix` (the BOS policy) + prompt + answer +
    `ending` per side, one pair a target. An over-long pair keeps the end of its prompt
    (what the answer follows) after the prefix, then cuts the answers. `labels`: also the
    answer tokens as labels (IGNORE over the prompt), for methods that score log-probabilities."""
    tok = lambda texts: token_ids(tokenizer, texts)  # noqa: E731
    sides = ("chosen", "rejected")
    columns = [f"{s}_input_ids" for s in sides] + ([f"{s}_labels" for s in sides] if labels else [])
    out: dict[str, list] = {k: [] for k in columns + ["num_targets", "length", "over_length"]}
    for prompt, chosen, rejected in zip(tok(batch["prompt"]), tok(batch["chosen"]), tok(batch["rejected"])):
        over = len(prefix) + max(len(prompt) + len(chosen), len(prompt) + len(rejected)) + len(ending) > max_length
        keep = max_length // 2 - len(prefix)
        prompt = prefix + (prompt[-keep:] if len(prompt) > keep and over else prompt)
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            answer = (answer + ending)[: max_length - len(prompt)]
            out[f"{name}_input_ids"].append(prompt + answer)
            if labels:
                out[f"{name}_labels"].append([IGNORE] * len(prompt) + answer)
        out["num_targets"].append(1)  # one pair
        out["length"].append(max(len(out["chosen_input_ids"][-1]), len(out["rejected_input_ids"][-1])))
        out["over_length"].append(over)
    return out


def collate_pairs(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask of every chosen sequence, then every rejected one,
    right-padded; `labels` too where the examples carry them."""
    sides = ("chosen", "rejected")
    sequences = [e[f"{side}_input_ids"] for side in sides for e in examples]
    input_ids = pad_rows(sequences, pad_id)
    lengths = torch.tensor([len(s) for s in sequences])
    batch = {
        "input_ids": input_ids,
        "attention_mask": (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long(),
    }
    if "chosen_labels" in examples[0]:
        batch["labels"] = pad_rows([e[f"{side}_labels"] for side in sides for e in examples], IGNORE)
    return batch
