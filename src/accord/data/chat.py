"""Chat rows in the shapes people share them, as the one `messages` shape tasks read.

- ShareGPT: `conversations` of `{from, value}` turns, roles human / gpt / system ...
  (found without any setting when a source has `conversations` and no `messages`).
- Content given as a list of parts (`[{"type": "text", "text": ...}]`, the OpenAI shape):
  the text parts are joined with a line break, as vLLM joins them for templates that
  take a string; any other kind of part is refused. Rows with images (an `images` or
  `image` column, data/images.py) keep their parts for a vision-language model's processor.
"""

from __future__ import annotations

from typing import Any

from accord.data.images import image_column
from accord.data.rows import ROW, SOURCE, DataError

# ShareGPT speakers -> chat-template roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}


def normalise_chat(ds):
    """`conversations` -> `messages`, and content-part lists -> strings; other rows pass."""
    columns = ds.column_names
    if "conversations" in columns and "messages" not in columns:
        return ds.map(_from_sharegpt, batched=True, remove_columns=["conversations"], desc="sharegpt")
    if "messages" in columns and image_column(columns) is None and _has_part_lists(ds.features["messages"]):
        return ds.map(_flatten_parts, batched=True, desc="content parts")
    return ds


def _has_part_lists(feature) -> bool:
    """Whether some message's `content` is stored as a list (datasets' List of parts)."""

    def item(f):  # a list's item feature: datasets' List / Sequence, or an older [feature]
        return f[0] if isinstance(f, list) and f else getattr(f, "feature", None)

    inner = item(feature)
    content = inner.get("content") if isinstance(inner, dict) else None
    return content is not None and item(content) is not None


def _from_sharegpt(batch: dict[str, list]) -> dict[str, list]:
    messages = []
    for conversation, source, row in zip(batch["conversations"], batch[SOURCE], batch[ROW]):
        where = f"{source}: row {row}"
        if not isinstance(conversation, list):
            raise DataError(f"{where}: `conversations` must be a list of {{from, value}} turns")
        messages.append([_turn(turn, where) for turn in conversation])
    return {"messages": messages}


def _turn(turn: Any, where: str) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise DataError(f"{where}: every turn of `conversations` needs `from` and `value`")
    speaker = turn.get("from") if turn.get("from") is not None else turn.get("role")
    role = SHAREGPT_ROLES.get(str(speaker).lower()) if speaker is not None else None
    if role is None:
        known = ", ".join(SHAREGPT_ROLES)
        raise DataError(f"{where}: ShareGPT role {speaker!r} is not one of {known}; rename it in the data")
    value = turn.get("value") if turn.get("value") is not None else turn.get("content")
    return {"role": role, "content": _text(value, where)}


def _flatten_parts(batch: dict[str, list]) -> dict[str, list]:
    out = []
    for messages, source, row in zip(batch["messages"], batch[SOURCE], batch[ROW]):
        where = f"{source}: row {row}"
        out.append(
            [m if not isinstance(m, dict) else m | {"content": _text(m.get("content"), where)} for m in messages or []]
        )
    return {"messages": out}


def _text(content: Any, where: str) -> Any:
    """A message's content as one string; a string (or a missing value) is left as it is,
    for the task's own checks to judge."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            raise DataError(
                f"{where}: a message has an image part ({{type: image}}) but the row has no `images` column; "
                "give the image files in `images` (a list of paths relative to the data file)"
            )
        if kind != "text" or not isinstance(part.get("text"), str):
            raise DataError(
                f"{where}: a message content part of type {kind!r}: only text parts ({{type: text, text: ...}}) "
                "can be trained on"
            )
        texts.append(part["text"])
    return "\n".join(texts)
