"""The import's one table: every key of the inputs, what became of it, and why."""

from __future__ import annotations

from accord.interop.job_keys import Row


def _cell(value: object, width: int) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(rows: list[Row]) -> str:
    """Grouped by decision (refused first: what needs the user), then by key."""
    order = {"refused": 0, "changed": 1, "mapped": 2, "dropped": 3}
    rows = sorted(rows, key=lambda r: (order[r.decision], r.key))
    lines = [f"{'key':34} {'value':18} {'decision':8}  recipe / reason", "-" * 100]
    for r in rows:
        detail = r.new + (f"  ({r.note})" if r.note and r.new else r.note)
        origin = "" if r.origin == "command line" else f" [{r.origin}]"
        lines.append(f"{_cell(r.key, 34):34} {_cell(r.value, 18):18} {r.decision:8}  {detail}{origin}")
    return "\n".join(lines)
