"""Learnable tasks that accord generates itself, so the quickstart (and the preference
recipes' pairs) need no download."""

from __future__ import annotations

import random

from accord.recipe.schema import GeneratedData, addition_capacity

Rows = list[dict[str, str]]


def generate(cfg: GeneratedData, seed: int) -> tuple[Rows, Rows]:
    """(train, eval) rows of {prompt, completion} (kind addition) or {prompt, chosen, rejected}
    (kind addition_pairs); eval prompts never occur in train."""
    if cfg.kind == "addition":
        return _addition(cfg, seed)
    if cfg.kind == "addition_pairs":
        return _pairs(_addition(cfg, seed), seed)
    raise ValueError(f"unknown generated data kind {cfg.kind!r}")


# The columns each kind's rows have, for a one-line refusal of a kind the task cannot read.
COLUMNS = {"addition": ("prompt", "completion"), "addition_pairs": ("prompt", "chosen", "rejected")}


def _pairs(split: tuple[Rows, Rows], seed: int) -> tuple[Rows, Rows]:
    """The same sums as kind addition (its own random stream draws the wrong answers, so the
    prompts and their order stay those of `addition` with the same seed), each correct sum
    chosen over a near miss: the sum with one digit changed, never to a leading zero."""
    rng = random.Random(f"accord-addition-pairs-{seed}")

    def near_miss(answer: str) -> str:
        at = rng.randrange(len(answer))
        lowest = 1 if at == 0 and len(answer) > 1 else 0
        digit = rng.choice([d for d in range(lowest, 10) if str(d) != answer[at]])
        return answer[:at] + str(digit) + answer[at + 1 :]

    return tuple(  # type: ignore[return-value]
        [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": near_miss(r["completion"])} for r in rows]
        for rows in split
    )


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
