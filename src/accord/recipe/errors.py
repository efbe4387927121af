"""The recipe's validation errors as one line each: pydantic's error records worded for a
person writing YAML (the dotted key, the expected type, did-you-mean for unknown keys)."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Union

from pydantic import BaseModel

# Keys users bring from other tools that accord plans but cannot build and test yet: named
# with the reason and what to use instead, rather than as an unknown key.
PLANNED_KEYS = {
    "engine.context_parallel": (
        "ring attention (torch's context_parallel on FSDP2 meshes) runs only on CUDA's attention kernels (on CPU "
        "torch's SDPA has no sharding rule), so it could not be built and tested here; use "
        "engine.sequence_parallel=N (Ulysses), which runs on CPU and GPU"
    ),
}


def describe_error(err: dict, root: type[BaseModel]) -> str:
    """One line for one pydantic error: the dotted key, what was expected, and for an unknown
    key the closest known one (walking the sections from `root`)."""
    loc = [str(part) for part in err["loc"]]
    key = ".".join(loc) or "recipe"
    kind = err["type"]
    if kind == "extra_forbidden" and key in PLANNED_KEYS:
        return f"{key} is not available in accord yet: {PLANNED_KEYS[key]}"
    if kind == "extra_forbidden":
        known = _field_names(root, loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = f"; did you mean {'.'.join(loc[:-1] + close)}?" if close else ""
        if not close and len(loc) == 2:  # a key in the wrong section: train.lr for optim.lr
            elsewhere = [
                f"{section}.{loc[-1]}" for section in _field_names(root, []) if loc[-1] in _field_names(root, [section])
            ]
            hint = f"; did you mean {' or '.join(elsewhere)}?" if elsewhere else ""
        where = ".".join(loc[:-1]) or "the recipe"
        return f"unknown key {key}{hint} (known keys of {where}: {', '.join(known)})"
    if kind == "missing":
        return f"{key} is required"
    if kind == "value_error":
        return str(err["ctx"]["error"])
    expected = _EXPECTED.get(kind)
    if expected:
        return f"{key}: expected {expected}, got {err['input']!r}"
    return f"{key}: {err['msg'][0].lower()}{err['msg'][1:]} (got {err['input']!r})"


_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping (a section)",
    "model_type": "a mapping (a section)",
    "model_attributes_type": "a mapping (a section)",
    "list_type": "a list",
    "tuple_type": "a list",
}


def _field_names(root: type[BaseModel], loc: list[str]) -> list[str]:
    """Field names of the section at `loc` (walking the pydantic models from `root`)."""
    model: Any = root
    for part in loc:
        if part.isdigit():  # an index into a list of sections
            continue
        field = model.model_fields.get(part) if _is_section(model) else None
        if field is None:
            return []
        model = _section_type(field.annotation)
    return [field.alias or name for name, field in model.model_fields.items()] if _is_section(model) else []


def _section_type(annotation: Any) -> Any:
    """The section class inside Optional[...] or list[...] annotations."""
    if typing.get_origin(annotation) in (Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            inner = _section_type(arg)
            if _is_section(inner):
                return inner
    return annotation


def _is_section(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)
