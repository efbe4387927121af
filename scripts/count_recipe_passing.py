"""Count the functions a Recipe object is passed through on the way from `accord.train` to the
first training step: a one-process run of a tiny generated recipe, traced with sys.setprofile;
every accord function called with a Recipe among its arguments (positional, keyword, or `self`
of a method on a Recipe) before Trainer.train_step first runs is counted once, by name.

    PYTHONPATH=src .venv/bin/python scripts/count_recipe_passing.py [--list]

The count is the number of distinct functions (module:qualname), not of calls. Functions of
other libraries (pydantic's own, transformers') are not counted: the question is how far
accord's own code carries the whole recipe rather than its section or a resolved plan.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import accord
from accord.recipe.schema import Recipe

SOURCE = str(Path(accord.__file__).parent)

RECIPE = {
    "seed": 0,
    "model": {
        "config": {
            "architecture": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        },
        "tokenizer": "byte",
    },
    "task": "sft",
    "data": {"generate": {"kind": "addition", "train_examples": 64, "eval_examples": 0}, "max_length": 32},
    "batch": {"global_batch_size": 8, "micro_batch_size": 4},
    "train": {"max_steps": 1},
    "engine": {"strategy": "ddp", "precision": "no", "processes": 1, "device": "cpu"},
    "checkpoint": {"every_steps": 1000},
}


class _FirstStep(Exception):
    """Raised by the tracer at Trainer.train_step: the counting ends there."""


def count(recipe: dict) -> list[str]:
    seen: dict[str, None] = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(SOURCE):
            return
        if code.co_name == "train_step" and code.co_filename.endswith("trainer.py"):
            sys.setprofile(None)
            raise _FirstStep
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(isinstance(frame.f_locals.get(name), Recipe) for name in names):
            module = frame.f_globals.get("__name__", "?")
            seen.setdefault(f"{module}:{code.co_qualname}")

    with tempfile.TemporaryDirectory() as folder:
        recipe = recipe | {"output": {"dir": str(Path(folder) / "run")}}
        recipe["data"] = recipe["data"] | {"cache_dir": str(Path(folder) / "cache")}
        sys.setprofile(profile)
        try:
            accord.train(recipe)
        except _FirstStep:
            pass
        finally:
            sys.setprofile(None)
    return list(seen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print each function's name")
    args = parser.parse_args()
    functions = count(RECIPE)
    if args.list:
        print("\n".join(sorted(functions)))
    print(f"{len(functions)} functions take the Recipe between accord.train and the first step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
