"""Supervised fine-tuning of a vision-language model (`task: sft` when the model is one of
transformers' AutoModelForImageTextToText families) on chat rows with images.

Each row is rendered with the processor's chat template, its images decoded and turned into
the model's inputs by the processor (which also expands each image placeholder into the
image's tokens), once, in data preparation: the prepared Arrow data holds the token ids,
labels and the processor's image tensors, so a resume or another number of processes reads
the same pixels. Targets are the assistant turns' tokens; an image's tokens never are.
Rows are never packed (an image's tokens must stay with its row) and never cut through an
image's tokens."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from accord import registry
from accord.compat.transformers import attn_implementation
from accord.data.images import (
    check_image_row,
    image_column,
    image_files,
    open_image,
    row_images,
    source_folder,
    with_image_parts,
)
from accord.data.rows import ROW, SOURCE, DataError, row_origin
from accord.errors import UserInputError
from accord.models.build import build_config
from accord.models.vision import build_processor
from accord.tasks.base import IGNORE, pad_rows
from accord.tasks.sft import SFTTask

IMAGE_INPUTS = "image_inputs"  # the processor's image tensors of a row, as one .npz blob
# Processor outputs that are the text's, not the image's.
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


class VisionSFTTask(SFTTask):
    name = "sft"
    model_kind = "image_text_to_text"
    token_shards = False  # Arrow: the image tensors travel with the ids
    takes_streams = False
    packable = False
    chunked_loss = splits_rows = False

    def __init__(self, tokenizer, config):
        if config.data.packing is True:
            raise UserInputError(
                "data.packing: rows with images are not packed (an image's tokens must stay with its row, and the "
                "vision-language model attends across the whole row); set data.packing=false"
            )
        super().__init__(tokenizer, config)
        model_config = build_config(config.model, tokenizer, self.model_kind)
        self.processor = build_processor(config.model, tokenizer, model_config)
        self.image_token_id = _image_token_id(self.processor, tokenizer)
        self.chat = True

    def settings(self) -> dict[str, Any]:
        # The image processor's settings change the cached pixels.
        processor = hashlib.sha256(self.processor.to_json_string().encode()).hexdigest()[:16]
        return super().settings() | {"processor": processor, "image_token_id": self.image_token_id}

    def row_files(self, ds) -> list[Path]:
        # The cached pixels are the image files': replacing one under its name re-prepares.
        return image_files(ds)

    def fit(self, train, eval_ds):
        sharded = registry.strategy(self.config.strategy).shards_params
        for split, ds in (("train", train), ("eval", eval_ds)):
            if ds is None:
                continue
            if "messages" not in ds.column_names:
                raise DataError(
                    f"{row_origin(ds[0])}: sft on a vision-language model reads chat `messages` rows (content parts "
                    f"with {{type: image}}) and their `images`; this {split} source has {', '.join(ds.column_names)}"
                )
            column = image_column(ds.column_names)
            for i in range(len(ds)):
                row = ds[i]
                where = row_origin(row)
                messages = row["messages"]
                _check_messages(messages, where)
                images = row_images(row[column]) if column else []
                check_image_row(messages, images, source_folder(str(row.get(SOURCE, ""))), where)
                if sharded and not images:
                    # The vision tower's forward gathers its shards from every rank: a rank
                    # whose micro-batch has no image would leave the others waiting.
                    raise DataError(
                        f"{where}: a row without images, which engine.strategy={self.config.strategy} "
                        "cannot mix with image rows (the sharded vision tower runs on every rank together); "
                        "give every row an image, or use ddp, zero1 or zero2"
                    )
        if self.tokenizer.chat_template is None and getattr(self.processor, "chat_template", None) is None:
            raise DataError("sft on chat `messages` needs a processor with a chat template (the model's has none)")
        return train, eval_ds

    def state(self) -> dict[str, Any]:
        return {"chat": True, "empty_completions": {}}

    def configure_model(self, model: nn.Module) -> None:
        self.attn_implementation = attn_implementation(model.config) or "sdpa"

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        column = image_column(batch)
        out: dict[str, list] = {
            "input_ids": [],
            "labels": [],
            "num_targets": [],
            "length": [],
            "over_length": [],
            IMAGE_INPUTS: [],
            "image_names": [],  # what `accord data --show` names each image by
        }
        for i, raw in enumerate(batch["messages"]):
            where = f"{batch[SOURCE][i]}: row {batch[ROW][i]}" if SOURCE in batch else "row"
            base = source_folder(str(batch[SOURCE][i])) if SOURCE in batch else None
            entries = row_images(batch[column][i] if column else None)
            images = [open_image(image, base, where) for image in entries]
            out["image_names"].append([_name(entry) for entry in entries])
            ids, labels, arrays = self._encode_row(with_image_parts(raw, len(images)), images, where)
            over = len(ids) > self.max_length
            last_image = max((k for k, t in enumerate(ids) if t == self.image_token_id), default=-1)
            if over and last_image >= self.max_length:
                # Cutting the row would cut an image's tokens apart from its pixels: no
                # targets, so data.truncation=truncate drops it (error and drop as for text).
                labels = [IGNORE] * len(labels)
            ids, labels = ids[: self.max_length], labels[: self.max_length]
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["num_targets"].append(sum(label != IGNORE for label in labels[1:]))
            out["length"].append(len(ids))
            out["over_length"].append(over)
            out[IMAGE_INPUTS].append(_pack_arrays(arrays))
        return out

    def _encode_row(self, messages: list[dict], images: list, where: str) -> tuple[list[int], list[int], dict]:
        """(ids, labels, image tensors) of one conversation: the template's text tokenized with
        character offsets to label the assistant turns, then the processor's expansion of the
        image placeholders, the labels carried over to it."""
        render = self.processor.apply_chat_template
        text = render(messages, tokenize=False)
        ids, labels = self._label_turns(text, messages, self.processor.apply_chat_template, "processor")
        processed = self.processor(
            text=[text], images=[images] if images else None, add_special_tokens=False, return_tensors="np"
        )
        expanded = [int(t) for t in processed["input_ids"][0]]
        bos = self.tokenizer.bos_token_id
        if self.add_bos == "always" and bos is not None and expanded[:1] != [bos]:
            expanded = [bos] + expanded
        elif self.add_bos == "never" and bos is not None and expanded[:1] == [bos]:
            expanded = expanded[1:]
        arrays = {k: np.asarray(v) for k, v in processed.items() if k not in _TEXT_KEYS}
        return expanded, expand_labels(ids, labels, expanded, self.image_token_id, where), arrays

    def collate(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        examples = [example for row in rows for example in row]
        input_ids = pad_rows([ex["input_ids"] for ex in examples], self.pad_id)
        labels = pad_rows([ex["labels"] for ex in examples], IGNORE)
        lengths = torch.tensor([len(ex["input_ids"]) for ex in examples])
        attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        arrays = [_unpack_arrays(ex[IMAGE_INPUTS]) for ex in examples if ex[IMAGE_INPUTS]]
        # One entry per image (or image patch) along the first axis, rows one after another:
        # the order the model meets the placeholders in the batch.
        for key in arrays[0] if arrays else ():
            batch[key] = torch.from_numpy(np.concatenate([a[key] for a in arrays]))
        return batch

    @torch.no_grad()
    def evaluate_generation(self, model, rows, device, max_new_tokens: int, lockstep: bool = False):
        return {}


def expand_labels(ids: list[int], labels: list[int], expanded: list[int], image_id: int, where: str) -> list[int]:
    """`labels` of the unexpanded `ids` carried over to the processor's `expanded` ids, where
    each run of image placeholders became the images' tokens (never targets). The text
    between images is the same tokens in both; a processor that changes it is one line."""
    segments: list[tuple[list[int], list[int]]] = [([], [])]
    for k, (token, label) in enumerate(zip(ids, labels)):
        if token == image_id:
            if k == 0 or ids[k - 1] != image_id:
                segments.append(([], []))
            continue
        segments[-1][0].append(token)
        segments[-1][1].append(label)
    out: list[int] = []
    at = 0
    for n, (segment, segment_labels) in enumerate(segments):
        if n > 0:  # the image tokens before this segment
            last = n == len(segments) - 1
            start = len(expanded) - len(segment) if last else _find(expanded, segment, at + 1)
            if start < at:
                break
            out += [IGNORE] * (start - at)
            at = start
        if expanded[at : at + len(segment)] != segment:
            break
        out += segment_labels
        at += len(segment)
    if at != len(expanded) or len(out) != len(expanded):
        raise DataError(
            f"{where}: the processor's expansion of the image placeholders does not keep the text around them, so "
            "the answer tokens cannot be located; report this with the model's processor"
        )
    return [IGNORE if token == image_id else label for token, label in zip(expanded, out)]


def _name(image: Any) -> str:
    if isinstance(image, dict):
        return str(image.get("path") or "(bytes)")
    return str(image) if isinstance(image, str) else "(image)"


def _find(haystack: list[int], needle: list[int], start: int) -> int:
    for at in range(start, len(haystack) - len(needle) + 1):
        if haystack[at : at + len(needle)] == needle:
            return at
    return -1


def _image_token_id(processor, tokenizer) -> int:
    found = getattr(processor, "image_token_id", None)
    if found is None:
        token = getattr(processor, "image_token", None)
        found = tokenizer.convert_tokens_to_ids(token) if token else None
    if found is None:
        raise UserInputError(
            f"model.processor: {type(processor).__name__} names no image token (image_token / image_token_id)"
        )
    return int(found)


def _pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """A row's image tensors as bytes (an .npz): one binary column whatever the processor
    returns, read back without Python lists."""
    if not arrays:
        return b""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _unpack_arrays(blob: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(blob)) as loaded:
        return {key: loaded[key] for key in loaded.files}


def _check_messages(messages: Any, where: str) -> None:
    problem = None
    if not isinstance(messages, list) or not messages:
        problem = "`messages` must be a non-empty list of {role, content}"
    elif not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
        for m in messages
    ):
        problem = "every message needs a string `role` and a `content` (a string or a list of parts)"
    elif not any(m["role"] == "assistant" for m in messages):
        problem = "no assistant turn, so nothing to train on (zero target tokens)"
    else:
        parts = [part for m in messages if isinstance(m["content"], list) for part in m["content"]]
        odd = next((part for part in parts if not _known_part(part)), None)
        if odd is not None:
            kind = odd.get("type") if isinstance(odd, dict) else type(odd).__name__
            problem = (
                f"a content part of type {kind!r}: only {{type: text, text: ...}} and {{type: image}} parts "
                "can be trained on"
            )
    if problem:
        raise DataError(f"{where}: {problem}")


def _known_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    return part.get("type") == "image" or (part.get("type") == "text" and isinstance(part.get("text"), str))
