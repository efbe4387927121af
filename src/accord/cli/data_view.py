"""`accord data`: the prepared data as training will see it, before any training starts.

Prepares (or reuses) the cache exactly as `accord train` would, then prints the first
examples with the tokens that carry loss marked, and the counts a user checks a recipe
by: examples, tokens, targets, truncations and how full packed rows are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from accord.data.split import held_out_warning
from accord.recipe.hub import pin
from accord.recipe.schema import Recipe
from accord.run.assemble import eval_tokens
from accord.run.inputs import build_inputs
from accord.tasks import task_config
from accord.tasks.base import IGNORE

# How loss-carrying text is marked: green on a terminal, else between [[ and ]].
MARKS = {True: ("\x1b[32m", "\x1b[0m"), False: ("[[", "]]")}


def data_view(recipe: Recipe, show: int, color: bool = False) -> list[str]:
    """Lines: `show` prepared training examples, then the counts."""
    recipe = pin(recipe)  # hub names fetched (or found cached) here
    inputs = build_inputs(task_config(recipe), preparer=True)
    tokenizer, task = inputs.tokenizer, inputs.task
    train, report = inputs.data.train, inputs.data.report
    start, end = MARKS[color]
    lines = [
        f"{min(show, len(train))} of {len(train)} training examples as prepared (before packing and shuffling); "
        f"loss is computed on {start}these tokens{end}"
    ]
    for i in range(min(show, len(train))):
        lines.append(f"--- example {i + 1}")
        lines += render_example(train[i], task, tokenizer, color)
    tokens, targets = (int(np.asarray(train[column]).sum()) for column in ("length", "num_targets"))
    lines.append("--- counts")
    lines.append(f"examples: {len(train)} training, {report.get('eval_examples', 0)} held out")
    # Targets are tokens for the causal tasks, examples (classify) or pairs (dpo) otherwise.
    share = (
        f"{targets} target tokens, {100 * targets / max(tokens, 1):.1f}%"
        if "labels" in train.column_names
        else f"{targets} targets, one per example"
    )
    lines.append(f"tokens: {tokens} training ({share}), {eval_tokens(inputs.data.eval)} held out")
    lines.append(
        f"truncations: {report.get('train_over_length', 0)} longer than data.max_length={recipe.data.max_length} "
        f"({report.get('train_dropped', 0)} dropped, data.truncation={recipe.data.truncation})"
    )
    if task.packing:
        rows = inputs.rows
        fill = rows.lengths.sum() / (len(rows) * recipe.data.max_length)
        lines.append(
            f"packing: {len(train)} examples in {len(rows)} rows of {recipe.data.max_length} tokens, "
            f"{100 * fill:.1f}% filled"
        )
    else:
        lines.append("packing: off (one example per row)")
    warning = held_out_warning(recipe.data.eval_fraction, tokens, eval_tokens(inputs.data.eval))
    return lines + ([warning] if warning else [])


def render_example(example: dict[str, Any], task, tokenizer, color: bool) -> list[str]:
    """An encoded example as text, loss-carrying tokens marked; a classification example
    with its label, a preference pair as its two sides."""
    start, end = MARKS[color]
    if "label_id" in example:
        return [
            tokenizer.decode(example["input_ids"]),
            f"label: {start}{task.labels[example['label_id']]}{end} (id {example['label_id']})",
        ]
    lines = []
    images = (getattr(task, "image_token_id", None), example.get("image_names") or [])
    for side in ("", "chosen_", "rejected_"):
        if f"{side}labels" in example:
            text = marked(example[f"{side}input_ids"], example[f"{side}labels"], tokenizer, start, end, images)
            lines.append(f"{side[:-1]}: {text}" if side else text)
    return lines


def marked(
    ids: list[int], labels: list[int], tokenizer, start: str, end: str, images: tuple[int | None, list] = (None, [])
) -> str:
    """The decoded tokens, each run of targets (label != IGNORE) between `start` and `end`.
    Runs are decoded whole, so a character made of several byte tokens stays intact. Each run
    of an image's tokens (`images`: the image token id and the row's image names) is shown
    as one `<image N: name, K tokens>`."""
    image_id, names = images
    out, run, target = [], [], None
    shown = first = 0
    for k, (token, label) in enumerate(zip(ids, labels)):
        if image_id is not None and token == image_id:
            if k == 0 or ids[k - 1] != image_id:
                first = k
            if k + 1 < len(ids) and ids[k + 1] == image_id:
                continue
            if run:
                out.append(_decoded(run, target, tokenizer, start, end))
                run, target = [], None
            count = k + 1 - first
            name = names[shown] if shown < len(names) else "?"
            shown += 1
            out.append(f"<image {shown}: {name}, {count} tokens>")
            continue
        is_target = label != IGNORE
        if run and is_target != target:
            out.append(_decoded(run, target, tokenizer, start, end))
            run = []
        run.append(token)
        target = is_target
    if run:
        out.append(_decoded(run, target, tokenizer, start, end))
    return "".join(out)


def _decoded(run: list[int], target: bool | None, tokenizer, start: str, end: str) -> str:
    text = tokenizer.decode(run)
    return f"{start}{text}{end}" if target else text
