"""What the causal-LM methods (sft, pretrain) share: batching rows that may pack several
examples, and the summed next-token loss."""

from __future__ import annotations

import math

import torch
from torch import nn

from accord.compat.transformers import attn_implementation
from accord.models.documents import flat_inputs, install_document_attention
from accord.tasks.base import IGNORE, TOKEN_MASK, LossOutput, Task, pad_rows, token_loss_sum
from accord.tasks.chunked_loss import TargetLogprobs, chunking_blocker, plain_loss_note, shifted_targets


class CausalLMTask(Task):
    packable = True
    chunked_loss = splits_rows = True
    token_shards = True
    takes_streams = True
    eval_hidden = ("perplexity", "generated")

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.attn_implementation = "sdpa"
        self.flatten = False  # packed micro-batches as one sequence, attended document by document
        self.logprobs: TargetLogprobs | None = None  # the chunked loss (train.loss_chunk_size)
        self.plain_loss_reason: str | None = None
        # Packed rows under a 4-D attention mask also carry TOKEN_MASK (a mixture-of-experts
        # router's statistics leave the padding out; accord.tasks.router_balance sets it).
        self.marks_tokens = False

    def configure_model(self, model: nn.Module) -> None:
        self.attn_implementation = attn_implementation(model.config) or "sdpa"
        device = self.config.device
        on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        # On the CPU, attention per document beats SDPA under a block-diagonal mask and the
        # padding goes (accord.models.documents); GPUs keep their fused kernels (flash-attention's
        # varlen path where the model selects it). Sequence parallelism slices rows, tensor
        # parallelism shards the attention (not measured flattened), pipeline stages take rows
        # in equal micro-batches, and a compiled forward would meet a new length every step and
        # a Python loop over documents: not flattened.
        whole = not self.config.splits_rows_or_model
        if self.packing and on_cpu and whole and not self.config.compile:
            self.flatten = install_document_attention(model)
        self.plain_loss_reason = chunking_blocker(model, self.config)
        if self.plain_loss_reason is None:
            self.logprobs = TargetLogprobs.install(model, self.config.loss_chunk_size)

    def describe(self) -> list[str]:
        return super().describe() + plain_loss_note(self.plain_loss_reason)

    def collate(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        if self.packing and self.flatten:
            return self._flat(rows)
        input_ids = pad_rows([[t for ex in row for t in ex["input_ids"]] for row in rows], self.pad_id)
        labels = pad_rows([[t for ex in row for t in ex["labels"]] for row in rows], IGNORE)
        if not self.packing:
            lengths = torch.tensor([sum(len(ex["input_ids"]) for ex in row) for row in rows])
            attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
            return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        doc_lengths = [[len(ex["input_ids"]) for ex in row] for row in rows]
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": packed_position_ids(doc_lengths, input_ids.shape[1]),
        }
        if self.attn_implementation != "flash_attention_2":
            # flash-attention's varlen path finds the documents from the restarting
            # position ids; sdpa and eager need the block-diagonal mask spelled out.
            batch["attention_mask"] = block_causal_mask(
                doc_lengths, input_ids.shape[1], float_mask=self.attn_implementation == "eager"
            )
        if self.marks_tokens:
            lengths = torch.tensor([sum(row) for row in doc_lengths])
            batch[TOKEN_MASK] = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
        return batch

    def _flat(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        """The rows one after another as one unpadded sequence (accord.models.documents)."""
        documents = [len(ex["input_ids"]) for row in rows for ex in row]
        # A row's first label is never a target (nothing precedes it); set to IGNORE it stays
        # none here too, where the previous row's last token comes before it.
        labels = [t for row in rows for t in [IGNORE] + [t for ex in row for t in ex["labels"]][1:]]
        return {
            "input_ids": torch.tensor([[t for row in rows for ex in row for t in ex["input_ids"]]]),
            "labels": torch.tensor([labels]),
            "position_ids": packed_position_ids([documents], sum(documents)),
            **flat_inputs(documents),
        }

    def eval_summary(self, sums: dict[str, float]) -> dict[str, float]:
        results = super().eval_summary(sums)
        return results | {"perplexity": math.exp(min(results["loss"], 50.0))}

    def format_eval(self, results: dict[str, float]) -> str:
        line = super().format_eval({k: v for k, v in results.items() if k != "exact_match_accuracy"})
        if "exact_match_accuracy" not in results:
            return line
        return f"{line}, exact-match {100 * results['exact_match_accuracy']:.1f}% of {int(results['generated'])}"

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        # `shift_labels`: targets already shifted over the whole row (a sequence-parallel
        # slice of it, accord.tasks.sequence_shards); else the next token's label.
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels", TOKEN_MASK)}
        targets = batch["shift_labels"] if "shift_labels" in batch else shifted_targets(batch["labels"])
        if self.logprobs is not None and self.logprobs.serves(targets):
            row_logprobs = self.logprobs.row_logprobs(model, inputs, targets)
            return LossOutput(-row_logprobs.sum(), (targets != IGNORE).sum())
        logits = model(**inputs).logits
        return LossOutput(token_loss_sum(logits, targets), (targets != IGNORE).sum())


def packed_position_ids(doc_lengths: list[list[int]], width: int) -> torch.Tensor:
    """Positions restart at 0 at every packed document (padding continues the count)."""
    out = torch.zeros((len(doc_lengths), width), dtype=torch.long)
    for i, lengths in enumerate(doc_lengths):
        start = 0
        for n in lengths:
            out[i, start : start + n] = torch.arange(n)
            start += n
        out[i, start:] = torch.arange(width - start)
    return out


def block_causal_mask(doc_lengths: list[list[int]], width: int, float_mask: bool) -> torch.Tensor:
    """B×1×L×L mask letting each token see only earlier tokens of its own document.

    Padding positions see only themselves, so no softmax row is empty. `float_mask` gives
    the additive form (0 / -inf) that eager attention needs; sdpa takes booleans.
    """
    doc_id = torch.full((len(doc_lengths), width), -1, dtype=torch.long)
    for i, lengths in enumerate(doc_lengths):
        start = 0
        for d, n in enumerate(lengths):
            doc_id[i, start : start + n] = d
            start += n
    same_doc = doc_id[:, :, None] == doc_id[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    padding = doc_id < 0
    allowed = (same_doc & causal & ~padding[:, :, None]) | (torch.eye(width, dtype=torch.bool) & padding[:, :, None])
    allowed = allowed[:, None]
    if not float_mask:
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
