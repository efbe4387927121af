"""Target log-probabilities of a causal LM without its full-vocabulary logits (train.loss_chunk_size).

A model's logits are rows × vocabulary: at 8k tokens and a 50k vocabulary that is 1.6 GB in
fp32, held twice (logits and their log-softmax) until backward. Here the output layer gets a
second mode: asked for the log-probabilities of given targets, it takes the targeted
positions `chunk` at a time, each chunk under torch.utils.checkpoint, so neither the forward
nor the backward holds more than one chunk's logits. Positions without a target (prompts
under completion-only loss, padding) never reach the output layer at all.

The request is served inside the model's own forward, as the output layer's call, because
that is where every strategy has its weight in place: FSDP2's root has gathered it (and keeps
it through backward), ZeRO-3's module hooks fetch it, and fetch it again in backward through
the returned tensor; DDP and LoRA see an ordinary module call. The returned tensor takes the
place of the logits in the model's output.

Why not DeepSpeed's TiledFusedLogitsLoss (ulysses_sp): it runs each shard's backward inside
its forward with an incoming gradient of 1, so the output layer's weight gradient is
accumulated before the trainer's `loss_sum / N` scaling (or DPO's sigmoid on top of the
log-probabilities) exists, and under DDP/FSDP that accumulation fires their gradient hooks
during the forward. Liger's fused linear cross-entropy is Triton (GPU only) and not installed;
transformers' loss functions take materialised logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from accord.compat.torch import replace_forward
from accord.errors import UserInputError
from accord.tasks.base import IGNORE, sequence_logprobs

if TYPE_CHECKING:
    from accord.tasks.config import TaskConfig

# Config fields through which a model rescales its logits after the output layer (Gemma's
# soft-capping, Cohere's logit_scale, Granite's logits_scaling): a request served by the
# output layer would miss that step, so those models keep the plain loss.
_LOGIT_POSTPROCESSING = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


# train.loss_chunk_size: auto (the default), measured with benchmarks/long_context.py (see
# docs/long-rows.md): chunks of AUTO_CHUNK_TOKENS target tokens, for a micro batch whose whole fp32 logits
# (positions × vocabulary × 4 bytes) would pass AUTO_WHOLE_LOGITS_BYTES; a smaller one keeps the
# plain loss, which is as fast and sums in the order it always did (a byte-level vocabulary
# never chunks, a 32k one from about one chunk's worth of positions).
AUTO_CHUNK_TOKENS = 1024
AUTO_WHOLE_LOGITS_BYTES = 128 * 2**20


def chunk_tokens(setting: int | str, positions: int, vocab: int) -> int:
    """The chunk size in target tokens for a micro batch of `positions` (0: the plain loss)."""
    if setting != "auto":
        return int(setting)
    return AUTO_CHUNK_TOKENS if 4 * positions * vocab > AUTO_WHOLE_LOGITS_BYTES else 0


def chunking_blocker(model: nn.Module, config: TaskConfig) -> str | None:
    """Why the chunked loss cannot serve this model under the task's `config` (None: it can)."""
    if config.loss_chunk_size == 0:
        return "train.loss_chunk_size=0"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return "the model's output layer is not a linear layer"
    for name, neutral in _LOGIT_POSTPROCESSING.items():
        value = getattr(model.config, name, neutral)
        if value is not None and value != neutral:
            return f"the model rescales its logits after the output layer ({name}={value})"
    if config.compile:
        # The request is Python state read inside the forward that torch.compile traces.
        return "engine.compile is on"
    lora = config.lora
    if lora is not None and lora.target_modules != "all-linear" and "lm_head" in lora.target_modules:
        return "lora.target_modules adapts lm_head"
    return None


def plain_loss_note(blocker: str | None) -> list[str]:
    """The start-of-run line for a chunked loss the recipe wanted but cannot have."""
    if blocker is None or blocker == "train.loss_chunk_size=0":
        return []
    return [f"loss: over whole logits (not chunked: {blocker})"]


class HeadCall:
    """The output layer's second mode, installed once per layer: for the next forward,
    `fn(hidden, weight, bias)` is what the layer returns in place of the logits (the model hands
    it back as its `logits`). The chunked loss (TargetLogprobs) and distillation's chunked
    divergence are its users; a layer serving both keeps one replaced forward."""

    def __init__(self, head: nn.Linear):
        self.head = head
        self.pending: Callable | None = None  # of the forward about to run
        self.served: torch.Tensor | None = None
        self.checked = False
        self._plain = head.forward
        replace_forward(head, self._forward)  # module hooks still run around it
        head._accord_head_call = self

    @classmethod
    def install(cls, model: nn.Module) -> HeadCall:
        """The mode on `model`'s output layer (the one already there on a deep copy of an
        installed model, bound to the copy's layer)."""
        head = model.get_output_embeddings()
        existing = head.__dict__.get("_accord_head_call")
        return existing if existing is not None else cls(head)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        fn, self.pending = self.pending, None
        if fn is None:
            return self._plain(hidden)
        self.served = fn(hidden, self.head.weight, self.head.bias)
        return self.served

    def run(self, model: nn.Module, inputs: dict[str, torch.Tensor], fn: Callable, *, what: str) -> torch.Tensor:
        """`model(**inputs)` (the wrapped training model, or a frozen one) with `fn` served by
        this layer; `what` names the chunked computation asking ("loss", "divergence")."""
        self.pending = fn
        try:
            out = model(**inputs).logits
        finally:
            self.pending = None
        served, self.served = self.served, None
        if not self.checked:
            # Once: the model handed back what the output layer computed, untouched.
            if served is None or out.shape != served.shape or not torch.equal(out.detach(), served.detach()):
                raise UserInputError(
                    "train.loss_chunk_size: this model changes what its output layer returns before handing it back, "
                    f"so the chunked {what} cannot be used with it; set train.loss_chunk_size=0"
                )
            self.checked = True
        return out


class TargetLogprobs:
    """The chunked loss on a causal LM's output layer (see the module's text): each row's
    summed target log-probabilities, served by the layer's HeadCall."""

    def __init__(self, call: HeadCall, setting: int | str):
        self.call = call
        self.head = call.head
        self.setting = setting  # train.loss_chunk_size

    @classmethod
    def install(cls, model: nn.Module, setting: int | str) -> TargetLogprobs:
        return cls(HeadCall.install(model), setting)

    def serves(self, labels: torch.Tensor) -> bool:
        """Whether a micro batch with these labels takes the chunked loss (else the plain one)."""
        return chunk_tokens(self.setting, labels.numel(), self.head.out_features) > 0

    def row_logprobs(self, model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        """Per row, the summed log-probability of each position's target (shifted_targets of
        the labels; fp32), from a forward of `model` (the wrapped training model, or a frozen
        one) whose output layer is this one."""
        chunk = chunk_tokens(self.setting, targets.numel(), self.head.out_features) or targets.numel()

        def project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return row_target_logprobs(hidden, targets, weight, bias, chunk)

        return self.call.run(model, inputs, project, what="loss")


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """The target of each position: the next token's label (the last position has none)."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


def row_target_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int
) -> torch.Tensor:
    """Σ log p(target) per row over the positions with a target, `chunk` positions at a time."""
    rows, length, width = hidden.shape
    flat = targets.reshape(-1)
    positions = (flat != IGNORE).nonzero().squeeze(1)  # one host sync: the number of chunks
    picked = hidden.reshape(-1, width).index_select(0, positions)
    picked_targets = flat.index_select(0, positions)
    if len(positions) == 0:
        # No target (a padding row): still a graph through the output layer, so every
        # strategy's gradient hooks fire for it, as with the plain loss.
        return (
            _chunk_logprobs(
                hidden[:, :1].reshape(-1, width),
                torch.zeros(rows, dtype=torch.long, device=hidden.device),
                weight,
                bias,
            )
            * 0
        )
    if len(positions) <= chunk or not torch.is_grad_enabled():
        # One chunk holds them all: recomputing it in backward would save nothing over
        # keeping it (and cost a second pass through the output layer).
        token_logprobs = _chunk_logprobs(picked, picked_targets, weight, bias)
        out = torch.zeros(rows, dtype=token_logprobs.dtype, device=hidden.device)
        return out.index_add(0, positions // length, token_logprobs)
    pieces = []
    for start in range(0, len(positions), chunk):
        args = (picked[start : start + chunk], picked_targets[start : start + chunk], weight, bias)
        # Recomputed in backward: only this chunk's logits live at any time (no randomness to replay).
        pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False, preserve_rng_state=False))
    token_logprobs = torch.cat(pieces)
    out = torch.zeros(rows, dtype=token_logprobs.dtype, device=hidden.device)
    return out.index_add(0, positions // length, token_logprobs)


def _chunk_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # fp32 softmax, as the plain loss
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def answer_logprobs(
    model: nn.Module, chunked: TargetLogprobs | None, inputs: dict[str, torch.Tensor], labels: torch.Tensor
) -> torch.Tensor:
    """Summed log-probabilities of each row's labelled next tokens: chunked through the output
    layer where `chunked` serves the batch, else from whole logits (fp32 either way)."""
    if chunked is not None and chunked.serves(labels):
        return chunked.row_logprobs(model, inputs, shifted_targets(labels))
    return sequence_logprobs(model(**inputs).logits, labels)
