"""The job as its inputs were read: each key with the file it came from (Entry), grouped by kind
(Job: TRL / Trainer keys, accelerate keys, DeepSpeed JSON keys), the report's Row, and the
one-line error of an input accord import cannot read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from accord.errors import UserInputError
from accord.interop.known import Field, task_fields
from accord.interop.mapping import ALIASES


class ImportError_(UserInputError):
    """A job accord import cannot read or convert; the message is one line."""


@dataclass
class Entry:
    key: str
    value: Any
    origin: str  # the file or command it came from


@dataclass
class Row:
    key: str
    origin: str
    value: Any
    decision: str
    new: str  # "recipe.key=value, ..." or ""
    note: str


@dataclass
class Job:
    task: str
    entries: dict[str, Entry] = field(default_factory=dict)  # TRL / Trainer keys
    launch: dict[str, Entry] = field(default_factory=dict)  # accelerate config keys
    devices: int | None = None  # per node
    nodes: int = 1
    deepspeed: dict[str, Entry] = field(default_factory=dict)  # DeepSpeed JSON keys (flattened)

    @property
    def fields(self) -> dict[str, Field]:
        return task_fields(self.task)

    def given(self, key: str) -> bool:
        return key in self.entries or any(ALIASES.get(k) == key for k in self.entries)

    def value(self, key: str) -> Any:
        for name, entry in self.entries.items():
            if name == key or ALIASES.get(name) == key:
                return entry.value
        f = self.fields.get(key)
        return f.default if f is not None else None

    @property
    def world(self) -> int | None:
        return None if self.devices is None else self.devices * self.nodes
