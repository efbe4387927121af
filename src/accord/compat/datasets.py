"""datasets internals accord uses (data.prepare, data.chunks): a Dataset's fingerprint, which
names its cached tokenised copy, and whether it is a selection of its table's rows (an
indices mapping over the Arrow table), whose text bytes the table's size does not give.
"""

from __future__ import annotations

from typing import Any

from accord.compat import incompatible, installed_version

WRITTEN_FOR = "5.2"


def _attribute(ds: Any, name: str, needed_by: str) -> Any:
    try:
        return getattr(ds, name)
    except AttributeError:
        raise incompatible(
            "datasets", installed_version("datasets"), f"{type(ds).__name__} has no {name!r}", needed_by, WRITTEN_FOR
        ) from None


def fingerprint(ds: Any) -> str:
    """The fingerprint datasets keeps for a Dataset (what its caching keys transforms by)."""
    return _attribute(ds, "_fingerprint", "accord's tokenisation cache")


def is_selection(ds: Any) -> bool:
    """Whether a Dataset reads its rows through an indices mapping (a select, shuffle or split);
    False for rows of another kind (accord's own views), without importing datasets."""
    if not type(ds).__module__.startswith("datasets."):
        return False
    return _attribute(ds, "_indices", "accord's progress estimate") is not None
