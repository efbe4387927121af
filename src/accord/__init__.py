"""accord: train transformer models on any hardware from one recipe, with the same result.

From Python: `accord.train(recipe, overrides, ...)` and `accord.plan(recipe, gpus=...)`
(see accord.api); user mistakes raise `accord.AccordError` subclasses.
"""

from accord.errors import AccordError, RunStopped, UserInputError

__version__ = "0.1.0"

# Imported on first use: the API pulls in pydantic and torch, which `import accord` (and
# every `accord --help`) should not pay for.
_API = ("train", "plan", "TrainResult", "PlanResult")

__all__ = ["AccordError", "RunStopped", "UserInputError", "__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from accord import api

        return getattr(api, name)
    raise AttributeError(f"module 'accord' has no attribute {name!r}")
