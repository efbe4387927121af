"""accord: train transformer models on any hardware from one recipe, with the same result.

From Python: `accord.train(recipe, overrides, ...)` and `accord.plan(recipe, gpus=...)`
(see accord.api), `accord.load_recipe(recipe, overrides)` for the validated Recipe, and
`accord.register_task(name, cls)` / `accord.register_strategy(name, factory)` to add names
a recipe may use (see accord.registry); user mistakes raise `accord.AccordError` subclasses.
"""

from accord.errors import AccordError, RunStopped, UserInputError
from accord.registry import register_strategy, register_task

__version__ = "0.1.0"

# Imported on first use: these pull in pydantic and torch, which `import accord` (and every
# `accord --help`) should not pay for. name -> (module, attribute).
_LAZY = {
    "train": ("accord.api", "train"),
    "plan": ("accord.api", "plan"),
    "TrainResult": ("accord.api", "TrainResult"),
    "PlanResult": ("accord.api", "PlanResult"),
    "load_recipe": ("accord.api", "load"),
    "task_class": ("accord.tasks", "task_class"),
}

__all__ = [
    "AccordError",
    "RunStopped",
    "UserInputError",
    "__version__",
    "register_strategy",
    "register_task",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'accord' has no attribute {name!r}")
