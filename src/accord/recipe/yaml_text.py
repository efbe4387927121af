"""YAML text read strictly: a key written twice in one mapping is a mistake, not an override.

PyYAML (like the YAML 1.1 loaders people use) keeps the last of two equal keys, so a second `optim:` section silently
replaces the first. The text is composed once into nodes, checked for repeated keys with their lines, then built.
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(ValueError):
    """`key` appears twice in one mapping; `first` and `second` are 1-based lines."""

    def __init__(self, key: str, first: int, second: int):
        super().__init__(f"duplicate key {key} (lines {first} and {second}); keep one")
        self.key, self.first, self.second = key, first, second


def load_yaml(text: str) -> Any:
    """The YAML document in `text`, refusing repeated keys at any depth (yaml.YAMLError for bad syntax)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()  # what yaml.safe_load does, with the check between its two halves
        if node is None:
            return None
        _refuse_repeated_keys(node, [])
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_repeated_keys(node: yaml.Node, path: list[str]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value) if isinstance(key, yaml.ScalarNode) else None
            if name is not None and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if name in seen:
                    raise DuplicateKey(".".join([*path, name]), seen[name], line)
                seen[name] = line
            _refuse_repeated_keys(value, [*path, name or "?"])
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_repeated_keys(item, [*path, str(index)])
