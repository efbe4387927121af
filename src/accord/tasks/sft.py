"""Supervised fine-tuning of a causal LM: prompt -> completion pairs, or chat `messages`
rendered with the tokenizer's chat template (loss on assistant turns only by default)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accord.data.images import image_column
from accord.data.rows import DataError, row_origin
from accord.data.sources import check_columns
from accord.data.streams import checked as checked_rows
from accord.data.streams import columns, is_stream
from accord.tasks.base import IGNORE, PADDING, text_prefix, token_ids
from accord.tasks.causal import CausalLMTask


class SFTTask(CausalLMTask):
    name = "sft"

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.completion_only = config.data.completion_only_loss
        self.eos_id = tokenizer.eos_token_id
        # data.add_bos: by default what `tokenizer(prompt)` puts first (the BOS for Llama-style
        # tokenizers, nothing for GPT-2 style), so final/ encodes prompts as training did.
        self.add_bos = config.data.add_bos
        self.prefix = text_prefix(tokenizer, self.add_bos)
        self.chat = False
        # split -> [count, where the first is]: rows whose completion is "" train on EOS alone,
        # which is legal but almost always a data bug; said at every start (kept with the cache).
        self.empty_completions: dict[str, list] = {}

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "completion_only_loss": self.completion_only,
            "add_bos": self.add_bos,
            "prefix": self.prefix,
        }

    def fit(self, train, eval_ds):
        self.chat = "messages" in (columns(train) if is_stream(train) else train.column_names)
        for ds in (train, eval_ds):
            if ds is not None and image_column(columns(ds) if is_stream(ds) else ds.column_names):
                first = "" if is_stream(ds) else f"{row_origin(ds[0])}: "
                raise DataError(
                    f"{first}image rows (an `images` column) need a vision-language model, and "
                    f"{self.config.model.path or self.config.model.config.get('architecture')} is text-only; use a "
                    "model transformers loads with AutoModelForImageTextToText (llava, qwen2_vl, idefics3, ...)"
                )
        checked = []
        self.empty_completions = {}
        for split, ds in (("train", train), ("eval", eval_ds)):
            if ds is not None and is_stream(ds):  # checked row by row as preparation reads it
                fields = () if self.chat else ("prompt", "completion")
                ds = checked_rows(
                    ds,
                    fields,
                    f"sft {split} data (prompt/completion or messages)",
                    _check_messages if self.chat else None,
                )
            elif ds is not None and self.chat:
                _check_messages(ds)
            elif ds is not None:
                ds = check_columns(ds, ("prompt", "completion"), "sft data (prompt/completion or messages)")
                empty = [i for i, completion in enumerate(ds["completion"]) if completion == ""]
                if empty:
                    self.empty_completions[split] = [len(empty), row_origin(ds[empty[0]])]
            checked.append(ds)
        if self.chat and self.tokenizer.chat_template is None:
            raise DataError("sft on chat `messages` needs a tokenizer with a chat template (model.tokenizer has none)")
        return tuple(checked)

    def state(self) -> dict[str, Any]:
        return {"chat": self.chat, "empty_completions": self.empty_completions}

    def load_state(self, state: dict[str, Any]) -> None:
        self.chat = state["chat"]
        self.empty_completions = state.get("empty_completions", {})

    def describe(self) -> list[str]:
        return super().describe() + [
            f"warning: {count} {'training' if split == 'train' else 'eval'} example(s) "
            "have an empty completion, so only "
            f"the EOS token is a target (first: {first}); fill them in or remove them if that is not intended"
            for split, (count, first) in self.empty_completions.items()
        ]

    def _tokens(self, text: str) -> list[int]:
        return token_ids(self.tokenizer, [text])[0]

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        if self.chat:
            pairs = [self._encode_chat(messages) for messages in batch["messages"]]
        else:
            prompts = token_ids(self.tokenizer, batch["prompt"])
            completions = token_ids(self.tokenizer, batch["completion"])
            pairs = [self._encode_pair(p, c) for p, c in zip(prompts, completions)]
        out: dict[str, list] = {"input_ids": [], "labels": [], "num_targets": [], "length": [], "over_length": []}
        for ids, labels in pairs:
            out["over_length"].append(len(ids) > self.max_length)
            ids, labels = ids[: self.max_length], labels[: self.max_length]
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["num_targets"].append(sum(label != IGNORE for label in labels[1:]))
            out["length"].append(len(ids))
        return out

    def _encode_pair(self, prompt: list[int], completion: list[int]) -> tuple[list[int], list[int]]:
        prompt = self.prefix + prompt
        completion = completion + [self.eos_id]
        prompt_labels = [IGNORE] * len(prompt) if self.completion_only else [IGNORE] + prompt[1:]
        return prompt + completion, prompt_labels + completion

    def _encode_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """Render with the tokenizer's chat template and label the assistant turns."""
        render = self.tokenizer.apply_chat_template
        return self._label_turns(render(messages, tokenize=False), messages, render, "tokenizer")

    def _label_turns(self, text: str, messages: list[dict], render, whose: str) -> tuple[list[int], list[int]]:
        """`text` (the conversation as `render`, a chat template, renders it) as tokens, labelled
        on the characters of each assistant turn (its content and the template's end-of-turn
        text), found as the difference between the conversation rendered up to that turn and up
        to the turn before it. `whose`: the template's owner, for the error."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = render(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            through = render(messages[: i + 1], tokenize=False)
            if not (text.startswith(through) and through.startswith(before)):
                raise DataError(
                    f"the {whose}'s chat template renders a conversation differently from its beginning, so "
                    "assistant turns cannot be located; set data.completion_only_loss=false"
                )
            spans.append((len(before), len(through)))
        # The template's own text, as `apply_chat_template` tokenizes it (auto); `always` puts a
        # BOS first where the template does not, `never` drops one the template puts there.
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
        bos = self.tokenizer.bos_token_id
        if self.add_bos == "always" and bos is not None and ids[:1] != [bos]:
            ids, offsets = [bos] + ids, [(-1, -1)] + offsets
        elif self.add_bos == "never" and bos is not None and ids[:1] == [bos]:
            ids, offsets = ids[1:], offsets[1:]
        if not self.completion_only:
            return ids, [IGNORE] + ids[1:]
        labels = [
            token if any(start <= begin < end for start, end in spans) else IGNORE
            for token, (begin, _) in zip(ids, offsets)
        ]
        return ids, labels

    @torch.no_grad()
    def evaluate_generation(
        self, model: nn.Module, rows, device, max_new_tokens: int, lockstep: bool = False
    ) -> dict[str, float]:
        """Greedy completion of each prompt; exact match against the reference completion."""
        if self.chat:
            return {}
        correct = count = 0
        batch_size = 64
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            prompts = [self.prefix + self._tokens(r["prompt"]) for r in chunk]
            width = max(map(len, prompts))
            # Left padding so every prompt ends where generation starts.
            input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                synced_gpus=lockstep,
            )
            for row, generated in zip(chunk, out[:, width:].tolist()):
                if row.get(PADDING):
                    continue
                count += 1
                if self.eos_id in generated:
                    generated = generated[: generated.index(self.eos_id)]
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                correct += int(text.strip() == row["completion"].strip())
        return {"exact_match": float(correct), "count": float(count)}


def _check_messages(ds) -> None:
    for i, messages in enumerate(ds["messages"]):
        problem = None
        if not isinstance(messages, list) or not messages:
            problem = "`messages` must be a non-empty list of {role, content}"
        elif not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            problem = "every message needs string `role` and `content`"
        elif not any(m["role"] == "assistant" for m in messages):
            problem = "no assistant turn, so nothing to train on (zero target tokens)"
        if problem:
            raise DataError(f"{row_origin(ds[i])}: {problem}")
