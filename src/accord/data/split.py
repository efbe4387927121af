"""The held-out split of `data.eval_fraction`: seeded, disjoint from training, and sized by
text rather than by rows where rows are whole documents.

Examples (sft pairs, chats, labelled texts, preference pairs) are held out by count: the
fraction is a fraction of examples. Documents (pre-training text) differ wildly in size —
a folder of novels holds one book per row — so they are held out by characters: whole
documents in seeded order while they fit, then the tail of the next one (cut at a line
break), so the held-out share of text is the fraction whatever the document sizes.
"""

from __future__ import annotations

import numpy as np


def hold_out(train, fraction: float, seed: int, documents: bool):
    """(train, held out) Datasets; `documents`: rows are `text` documents that may be cut."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(train))
    if not documents:
        held = max(1, round(len(train) * fraction))
        return train.select(sorted(order[held:])), train.select(sorted(order[:held]))
    import pyarrow.compute as pc

    sizes = pc.utf8_length(train.with_format("arrow")["text"]).to_numpy(zero_copy_only=False)
    target = fraction * float(sizes.sum())
    taken, held_chars = [], 0
    for i in order:
        if held_chars + sizes[i] > target:
            break
        taken.append(int(i))
        held_chars += int(sizes[i])
    else:  # only empty documents: nothing to size them by
        return hold_out(train, fraction, seed, documents=False)
    cut, need = int(i), round(target - held_chars)
    kept = sorted(set(range(len(train))) - set(taken) - {cut})
    if need < 1 and taken:
        return train.select(sorted(kept + [cut])), train.select(sorted(taken))
    head, tail = _cut(train.select([cut]), max(need, 1))
    before = [k for k in kept if k < cut]
    after = [k for k in kept if k > cut]
    return _concat([train.select(before), head, train.select(after)]), _concat([train.select(sorted(taken)), tail])


def _cut(row, need: int):
    """One document as (head, tail) one-row Datasets, the tail about `need` characters long,
    starting at a line break (else a space) so no line is split when it can be helped."""
    text = row[0]["text"]
    at = len(text) - need
    for mark in ("\n", " "):
        found = text.find(mark, at)
        if 0 < found < len(text) - 1:
            at = found + 1
            break
    at = min(max(at, 1), len(text) - 1)
    return row.map(lambda r: {"text": r["text"][:at]}), row.map(lambda r: {"text": r["text"][at:]})


def _concat(parts):
    import datasets

    return datasets.concatenate_datasets([p for p in parts if len(p)] or parts[:1])


def held_out_warning(fraction: float, train_tokens: int, eval_tokens: int) -> str | None:
    """A line when the held-out split has over twice the requested share of the tokens."""
    total = train_tokens + eval_tokens
    if not fraction or not total or eval_tokens / total <= 2 * fraction:
        return None
    return (
        f"warning: the held-out split has {100 * eval_tokens / total:.1f}% of the tokens, over twice "
        f"data.eval_fraction={fraction:g} (its rows are longer than most); give data.eval instead, or split the "
        f"documents smaller (document: paragraph)"
    )
