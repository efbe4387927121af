"""Learnable tasks that accord generates itself, so the quickstart needs no download."""

from __future__ import annotations

import random

from accord.recipe.schema import GeneratedData, addition_capacity

Rows = list[dict[str, str]]


def generate(cfg: GeneratedData, seed: int) -> tuple[Rows, Rows]:
    """(train, eval) rows of {prompt, completion}; eval prompts never occur in train."""
    if cfg.kind == "addition":
        return _addition(cfg, seed)
    raise ValueError(f"unknown generated data kind {cfg.kind!r}")


def _addition(cfg: GeneratedData, seed: int) -> tuple[Rows, Rows]:
    rng = random.Random(f"accord-addition-{seed}")

    def operand() -> int:
        # Uniform over the number of digits first, so short and long sums are equally
        # common and sequence lengths vary.
        digits = rng.randint(1, cfg.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    wanted = cfg.train_examples + cfg.eval_examples
    assert wanted <= addition_capacity(cfg.max_digits)  # the recipe's validation refuses more
    seen: set[tuple[int, int]] = set()
    rows: Rows = []
    while len(rows) < wanted:
        pair = (operand(), operand())
        if pair in seen:
            continue
        seen.add(pair)
        a, b = pair
        rows.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
    return rows[: cfg.train_examples], rows[cfg.train_examples :]
