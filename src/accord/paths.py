"""User-given paths: `~` expanded, and `pkg:NAME/sub/path` inside an installed package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from accord.errors import UserInputError


class PathError(UserInputError):
    """A path that cannot be resolved; the message says why."""


def resolve_path(text: str) -> Path:
    """A path, or `pkg:NAME/sub/path` inside an installed package (located without importing
    it: some data packages cannot be imported, e.g. for a missing optional dependency)."""
    if not text.startswith("pkg:"):
        return Path(text).expanduser()
    package, _, rest = text[4:].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PathError(f"{text}: Python package {package!r} is not installed (see README: examples)")
    return Path(list(spec.submodule_search_locations)[0]) / rest
