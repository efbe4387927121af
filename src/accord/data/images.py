"""Image rows: chat `messages` whose content parts include `{"type": "image"}`, with their
images in an `images` column (or one in `image`), as TRL's SFTTrainer takes them for
vision-language models.

An image is a file path (relative to the data file's folder), `{bytes, path}` as datasets
stores an Image feature in parquet / arrow, or a decoded PIL image. Rows whose messages hold
no image part get TRL's placement: one part per image before the first user turn's text.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from accord.data.rows import SOURCE, DataError

IMAGE_COLUMNS = ("images", "image")


def image_column(column_names) -> str | None:
    """The column a source keeps its images in, if any."""
    return next((name for name in IMAGE_COLUMNS if name in column_names), None)


def row_images(value: Any) -> list:
    """A row's images as a list (the `image` column holds one; a missing value: none)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def with_image_parts(messages: list[dict], count: int) -> list[dict]:
    """`messages` with every content as a list of parts; where no part is an image, `count`
    image parts go before the first user turn's text (TRL's prepare_multimodal_messages)."""
    placed = any(
        isinstance(part, dict) and part.get("type") == "image"
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if message.get("role") == "user" and not placed:
                parts = [{"type": "image"}] * count + parts
                placed = True
            content = parts
        else:
            content = [_part(part) for part in content or []]
        out.append({**message, "content": content})
    return out


def _part(part: Any) -> Any:
    """A content part without the keys Arrow adds as None to structs of mixed parts."""
    if not isinstance(part, dict):
        return part
    return {key: value for key, value in part.items() if value is not None}


def count_placeholders(messages: list[dict]) -> int:
    return sum(
        1
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


def check_image_row(messages: Any, images: list, base: Path | None, where: str) -> None:
    """One line for a row whose image parts and images disagree in number, or whose image
    file is missing; reading the pixels comes later (open_image)."""
    if not isinstance(messages, list):
        return  # the task's own message checks word this
    placeholders = count_placeholders(with_image_parts(messages, len(images)))
    if placeholders != len(images):
        raise DataError(
            f"{where}: {placeholders} image placeholder(s) ({{type: image}} content parts) but {len(images)} "
            f"image(s) in `images`; give one image per placeholder"
        )
    for image in images:
        path = _path_of(image, base, where)
        if path is not None and not path.is_file():
            raise DataError(f"{where}: image file {path} does not exist; fix the path (relative to the data file)")


def image_files(ds) -> list[Path]:
    """The image files the rows of `ds` name, resolved as open_image reads them, without
    decoding any (an Image column is read as its stored {bytes, path})."""
    column = image_column(ds.column_names)
    if column is None:
        return []
    table = ds.with_format("arrow")
    values = table[column].to_pylist()
    sources = table[SOURCE].to_pylist() if SOURCE in ds.column_names else [None] * len(values)
    files = set()
    for value, source in zip(values, sources):
        base = source_folder(str(source)) if source else None
        for image in row_images(value):
            try:
                path = _path_of(image, base, "")
            except DataError:
                continue  # an entry without a file: the task's row checks word it
            if path is not None:
                files.add(path)
    return sorted(files)


def open_image(image: Any, base: Path | None, where: str):
    """The image decoded as an RGB PIL image; an unreadable one is one line."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    path = _path_of(image, base, where)
    source: Any = path if path is not None else io.BytesIO(image["bytes"])
    try:
        with Image.open(source) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        what = f"image file {path}" if path is not None else "an image's bytes"
        raise DataError(f"{where}: {what} cannot be read as an image ({e}); replace or remove it") from None


def _path_of(image: Any, base: Path | None, where: str) -> Path | None:
    """The file an image entry names (None: bytes or a decoded image)."""
    if isinstance(image, dict):
        if image.get("bytes"):
            return None
        image = image.get("path")
    if isinstance(image, (str, Path)):
        path = Path(image).expanduser()
        return path if path.is_absolute() or base is None else base / path
    if image is None or isinstance(image, dict):
        raise DataError(f"{where}: an entry of `images` has neither a path nor bytes; give a file path per image")
    return None


def source_folder(source: str) -> Path | None:
    """The folder a row's relative image paths are read from: its data file's (the row's
    `__source`, after any `data.eval: ` label), or the source folder itself."""
    path = Path(source.rsplit(": ", 1)[-1])
    if path.is_dir():
        return path
    return path.parent if path.exists() else None
