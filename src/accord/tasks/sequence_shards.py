"""Each rank's slice of a causal-LM micro-batch under sequence parallelism
(engine.sequence_parallel; the attention that joins the slices is accord.engine.sequence_parallel.ulysses).

Not DeepSpeed's `UlyssesSPDataLoaderAdapter`: it wraps a DataLoader and runs its own
collectives to share batches inside the group, while accord's global plan already gives
every rank of a group the same rows. Here each rank shifts the labels over the whole row
first (a slice's last token predicts the next slice's first), pads the row to a multiple of
N (padding has no targets), then keeps its slice of tokens, positions and targets; the
document mask covers the whole row, since attention runs over the whole row (under sdpa,
rows of one document each need none: the attention is causal over the whole row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from accord.tasks.base import IGNORE
from accord.tasks.causal import block_causal_mask
from accord.tasks.chunked_loss import shifted_targets

_NO_MASK = ("flash_attention_2", "flash_attention_3")  # they find documents from the position ids


class SequenceShards:
    """This rank's slice of every row (the identity for N = 1)."""

    def __init__(self, size: int = 1, part: int = 0, core_attention: str = "sdpa"):
        self.size = size
        self.part = part  # which of the `size` slices (the rank within its sequence-parallel group)
        self.core_attention = core_attention

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A causal-LM micro-batch (CausalLMTask.collate) cut to this rank's tokens: input ids,
        position ids and `shift_labels` (each position's next-token target, shifted over the
        whole row), and the whole row's document mask."""
        if self.size == 1:
            return batch
        ids = batch["input_ids"]
        rows, width = ids.shape
        extra = -width % self.size
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(width).expand(rows, width)
        # Padding continues the last document's count: it comes after every real token, so
        # causality keeps it out of their attention, and it has no targets.
        positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(extra)], dim=1)
        targets = F.pad(shifted_targets(batch["labels"]), (0, extra), value=IGNORE)
        ids = F.pad(ids, (0, extra), value=0)
        local = (width + extra) // self.size
        part = slice(self.part * local, (self.part + 1) * local)
        out = {"input_ids": ids[:, part], "position_ids": positions[:, part], "shift_labels": targets[:, part]}
        if self.core_attention in _NO_MASK:
            return out
        documents = _documents(positions)
        if self.core_attention == "sdpa" and all(len(row) == 1 for row in documents):
            # One document a row: plain causal attention, which sdpa takes as is_causal (no
            # mask given). The whole row's mask would cost rows × L × L bytes, and CPU sdpa
            # turns a boolean mask into a float one (4 bytes each): 1 GiB at 16k tokens.
            return out
        out["attention_mask"] = block_causal_mask(documents, width + extra, float_mask=self.core_attention == "eager")
        return out


def _documents(positions: torch.Tensor) -> list[list[int]]:
    """Document lengths per row from position ids that restart at 0 at every document."""
    out = []
    for row in positions.tolist():
        starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
        out.append([b - a for a, b in zip(starts, starts[1:])])
    return out
