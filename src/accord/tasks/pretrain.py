"""Pre-training (or continued pre-training) of a causal LM on raw text.

With packing (the default) documents are joined with EOS and cut into max_length blocks,
in file order, so every block is full and no token is padding; without packing each
document is one row, truncated to max_length.
"""

from __future__ import annotations

from typing import Any

from accord.tasks.base import IGNORE, text_prefix, token_ids
from accord.tasks.causal import CausalLMTask

# Documents joined per group before cutting blocks: bounded memory, and only the last
# block of each group is shorter than max_length.
_GROUP = 1000


class PretrainTask(CausalLMTask):
    name = "pretrain"
    text_fields = ("text",)
    packable = False  # blocks are already full rows; nothing is packed after them
    streams_text = True  # prepared from pieces of text, never a whole document at once (data/chunks.py)
    eval_shards = True

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.join = config.data.packing is not False
        self.eos_id = tokenizer.eos_token_id
        # Each document starts as `tokenizer(text)` starts it (data.add_bos) and ends with EOS.
        self.add_bos = config.data.add_bos
        self.prefix = text_prefix(tokenizer, self.add_bos)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"join_documents": self.join, "add_bos": self.add_bos, "prefix": self.prefix}

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        docs = [self.prefix + ids + [self.eos_id] for ids in token_ids(self.tokenizer, batch["text"])]
        if self.join:
            return {"input_ids": docs}  # blocks are cut in regroup()
        return _rows([d[: self.max_length] for d in docs], over=[len(d) > self.max_length for d in docs])

    def regroup(self, ds):
        if not self.join:
            return ds

        def blocks(batch: dict[str, list]) -> dict[str, list]:
            stream = [t for doc in batch["input_ids"] for t in doc]
            cut = [stream[i : i + self.max_length] for i in range(0, len(stream), self.max_length)]
            return _rows([c for c in cut if len(c) > 1], over=None)

        return ds.map(blocks, batched=True, batch_size=_GROUP, remove_columns=ds.column_names, desc="blocks")


def _rows(sequences: list[list[int]], over: list[bool] | None) -> dict[str, list]:
    return {
        "input_ids": sequences,
        "labels": [[IGNORE] + s[1:] for s in sequences],
        "num_targets": [len(s) - 1 for s in sequences],
        "length": [len(s) for s in sequences],
        "over_length": over if over is not None else [False] * len(sequences),
    }
