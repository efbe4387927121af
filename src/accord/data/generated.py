"""Learnable tasks that accord generates itself, so the quickstart (and the preference
recipes' pairs) need no download."""

from __future__ import annotations

import io
import random
from typing import Any

from accord.data.rows import ROW, SOURCE
from accord.recipe.schema import GeneratedData, addition_capacity

Rows = list[dict[str, Any]]

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
    "white": (245, 245, 245),
    "purple": (150, 60, 200),
}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What is in the picture?"


def generate(cfg: GeneratedData, seed: int) -> tuple[Rows, Rows]:
    """(train, eval) rows: addition's {prompt, completion}, addition_pairs' {prompt, chosen,
    rejected}, eval prompts never in train; shapes' chat {messages, images} (PNG bytes), eval
    pictures drawn apart from the training ones."""
    if cfg.kind == "addition":
        return _addition(cfg, seed)
    if cfg.kind == "addition_pairs":
        return _pairs(_addition(cfg, seed), seed)
    if cfg.kind == "shapes":
        rng = random.Random(f"accord-shapes-{seed}")
        rows = [shape_row(rng, cfg.image_size) for _ in range(cfg.train_examples + cfg.eval_examples)]
        for i, row in enumerate(rows):
            row[SOURCE], row[ROW] = "data.generate", i + 1
        return rows[: cfg.train_examples], rows[cfg.train_examples :]
    raise ValueError(f"unknown generated data kind {cfg.kind!r}")


def shape_picture(rng: random.Random, size: int):
    """A PIL picture of one shape in one colour on a dark background, and its caption."""
    from PIL import Image, ImageDraw

    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    shade = rng.randint(0, 60)
    image = Image.new("RGB", (size, size), (shade, shade, shade))
    extent = rng.randint(size // 3, size - 2)
    x, y = rng.randint(0, size - extent), rng.randint(0, size - extent)
    box = (x, y, x + extent - 1, y + extent - 1)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    else:
        corners = [(x + extent // 2, y), (x, y + extent - 1), (x + extent - 1, y + extent - 1)]
        draw.polygon(corners, fill=COLOURS[colour])
    return image, f"a {colour} {shape}"


def shape_row(rng: random.Random, size: int) -> dict[str, Any]:
    """A chat row asking what the picture shows, answered by its caption; the picture as PNG bytes."""
    image, caption = shape_picture(rng, size)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": [{"type": "text", "text": caption}]},
        ],
        "images": [{"bytes": buffer.getvalue(), "path": None}],
    }


# The columns each kind's rows have, for a one-line refusal of a kind the task cannot read.
COLUMNS = {
    "addition": ("prompt", "completion"),
    "addition_pairs": ("prompt", "chosen", "rejected"),
    "shapes": ("messages", "images"),
}


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
