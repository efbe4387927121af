"""Dotted recipe keys in a nested recipe dict: setting one, and accord's default for it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def put(recipe: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c`; `data.train.*.key` sets the key on every source of data.train."""
    parts = dotted.split(".")
    if "*" in parts:
        star = parts.index("*")
        head, rest = ".".join(parts[:star]), parts[star + 1 :]
        sources = _get(recipe, head) or []
        for source in sources:
            source[rest[0]] = value
        return
    node = recipe
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _get(recipe: dict[str, Any], dotted: str) -> Any:
    node: Any = recipe
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


MISSING = object()


def accord_default(dotted: str) -> Any:
    """The value accord uses when the recipe leaves `dotted` out (a sentinel for keys the schema
    does not have, so a TRL default for them is never written)."""
    from accord.recipe.schema import Recipe

    model: type[BaseModel] | None = Recipe
    default: Any = MISSING
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return MISSING
        info = model.model_fields[part]
        default = info.get_default(call_default_factory=True)
        annotation = info.annotation
        model = (
            annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else _section(annotation)
        )
    if isinstance(default, tuple):
        default = list(default)
    return default


def _section(annotation: Any) -> type[BaseModel] | None:
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
