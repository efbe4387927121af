"""What every row carries through the data layer: where it came from (the `__source` /
`__row` columns a later error names it by), the error that names it, and the label of a
position that is not a target. At the bottom of data: every reader and writer imports it.
"""

from __future__ import annotations

from typing import Any

from accord.errors import UserInputError

SOURCE = "__source"
ROW = "__row"
IGNORE = -100  # the label of a position that is not a target (torch's cross-entropy ignore_index)


class DataError(UserInputError):
    """Unusable input data; the message names the file and row and how to fix it."""


def row_origin(row: dict[str, Any]) -> str:
    """ "file: row N" for a row that went through load_source."""
    return f"{row.get(SOURCE, '?')}: row {row.get(ROW, '?')}"
