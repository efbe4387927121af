"""The recipe's train and eval splits (load_split: files, streams or generated rows), and the
held-out split of `data.eval_fraction`: seeded, disjoint from training, and sized by
text rather than by rows where rows are whole documents.

Examples (sft pairs, chats, labelled texts, preference pairs) are held out by count: the
fraction is a fraction of examples. Documents (pre-training text) differ wildly in size —
a folder of novels holds one book per row — so they are held out by characters: whole
documents in seeded order while they fit, then the tail of the next one (cut at a line
break), so the held-out share of text is the fraction whatever the document sizes.
"""

from __future__ import annotations

import numpy as np

from accord.data.generated import COLUMNS, generate
from accord.data.pieces import PIECE, document_starts, has_pieces
from accord.data.rows import DataError
from accord.data.sources import load_source, mix, take_share
from accord.data.streams import load_stream_split
from accord.recipe.schema import DataConfig


def load_split(cfg: DataConfig, seed: int, required: tuple[str, ...]):
    """(train, eval or None) Datasets from the recipe's data section (files or generated)."""
    import datasets

    if cfg.generate is not None:
        check_generated_columns(cfg, required)
        train_rows, eval_rows = generate(cfg.generate, seed)
        to_ds = datasets.Dataset.from_list
        return to_ds(train_rows), (to_ds(eval_rows) if eval_rows else None)
    assert cfg.train is not None
    if any(s.streamed for s in cfg.train + (cfg.eval or [])):
        return load_stream_split(cfg, seed, required)
    train = mix([take_share(load_source(s, required), s, seed) for s in cfg.train], [s.weight for s in cfg.train], seed)
    if cfg.eval is not None:
        parts = [take_share(load_source(s, required, role="data.eval"), s, seed) for s in cfg.eval]
        return train, mix(parts, [s.weight for s in cfg.eval], seed)
    if cfg.eval_fraction:
        # Pre-training text is documents, sized by characters; anything else is examples, held out by count.
        documents = required == ("text",) and "label" not in train.column_names
        return hold_out(train, cfg.eval_fraction, seed, documents)
    return train, None


def check_generated_columns(cfg: DataConfig, required: tuple[str, ...]) -> None:
    """One line when data.generate's kind lacks a column the task reads (sums for sft given to
    dpo, pairs given to sft), naming the kind that has them."""
    assert cfg.generate is not None
    kind = cfg.generate.kind
    missing = [c for c in required if c not in COLUMNS[kind]]
    if missing:
        fits = [k for k, columns in COLUMNS.items() if set(required) <= set(columns)]
        hint = f"use data.generate.kind: {fits[0]}" if fits else "give data.train files with those columns instead"
        raise DataError(
            f"data.generate.kind: {kind} makes rows of {', '.join(COLUMNS[kind])}, but this task reads "
            f"{', '.join(required)} (missing {', '.join(missing)}); {hint}"
        )


def hold_out(train, fraction: float, seed: int, documents: bool):
    """(train, held out) Datasets; `documents`: rows are `text` documents (or pieces of
    one, pieces.py) that may be cut."""
    if not documents:
        order = np.random.default_rng([seed, 0x5EED]).permutation(len(train))
        held = max(1, round(len(train) * fraction))
        return train.select(sorted(order[held:])), train.select(sorted(order[:held]))
    import pyarrow.compute as pc

    row_sizes = pc.utf8_length(train.with_format("arrow")["text"]).to_numpy(zero_copy_only=False)
    first = document_starts(train)
    end = np.append(first[1:], len(train))
    sizes = np.add.reduceat(row_sizes, first) if len(first) else row_sizes[:0]
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(first))
    target = fraction * float(sizes.sum())
    taken, held_chars = [], 0
    for d in order:
        if held_chars + sizes[d] > target:
            break
        taken.append(int(d))
        held_chars += int(sizes[d])
    else:  # only empty documents: nothing to size them by
        return hold_out(train, fraction, seed, documents=False)
    d, need = int(d), round(target - held_chars)
    taken_rows = sorted(r for t in taken for r in range(first[t], end[t]))
    if need < 1 and taken:
        return train.select(sorted(set(range(len(train))) - set(taken_rows))), train.select(taken_rows)
    # The cut document's last rows go whole while they are shorter than what is still needed,
    # then one row is cut; its tail starts a held-out document.
    cut, need = int(end[d]) - 1, max(need, 1)
    while cut > first[d] and row_sizes[cut] < need:
        need -= int(row_sizes[cut])
        cut -= 1
    head, tail = _cut(train.select([cut]), need)
    kept = sorted(set(range(len(train))) - set(taken_rows) - set(range(cut, int(end[d]))))
    before = [k for k in kept if k < cut]
    after = [k for k in kept if k > cut]
    held = [train.select(taken_rows), tail, train.select(range(cut + 1, int(end[d])))]
    return _concat([train.select(before), head, train.select(after)]), _concat(held)


def _cut(row, need: int):
    """One row of text as (head, tail) one-row Datasets, the tail about `need` characters long,
    starting at a line break (else a space) so no line is split when it can be helped; the
    tail is the first piece of its document."""
    text = row[0]["text"]
    at = len(text) - need
    for mark in ("\n", " "):
        found = text.find(mark, at)
        if 0 < found < len(text) - 1:
            at = found + 1
            break
    at = min(max(at, 1), len(text) - 1)
    starts = {PIECE: 0} if has_pieces(row) else {}
    return row.map(lambda r: {"text": r["text"][:at]}), row.map(lambda r: {"text": r["text"][at:]} | starts)


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
