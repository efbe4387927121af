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
        raise PathError(
            f"{text}: Python package {package!r} is not installed (see docs/tasks-and-data.md: real models and data)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / rest


def locate(text: str, recipe_folder: Path) -> tuple[str, tuple[str, ...]]:
    """A recipe's relative path: as given when it exists from the current folder (how accord
    always read it), else the recipe file's folder's copy when that exists (returned as an
    absolute path, so workers started elsewhere read the same file). Also returns the folders
    looked in when it exists in neither, for the not-found error."""
    if text.startswith("pkg:") or Path(text).expanduser().is_absolute() or Path(text).exists():
        return text, ()
    beside = recipe_folder / text
    if beside.exists():
        return str(beside.resolve()), ()
    folders = dict.fromkeys([str(Path.cwd()), str(recipe_folder.resolve())])  # one entry when they are the same
    return text, tuple(folders)
