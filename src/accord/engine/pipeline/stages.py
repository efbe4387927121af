"""Splitting a decoder-only causal LM into pipeline stages by decoder layer.

Stage s of S holds layers [s*L/S, (s+1)*L/S); the first stage also the token embeddings, the
last the final norm and the output head. Every rank keeps the model object with only its own
stages' modules (the others removed, `layers` a ModuleDict keyed by the layer's index), so each
parameter keeps the name it has in the whole model: checkpoints (keyed by name) and the export
need no renaming, and a run resumes on any pipeline layout, or none.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accord.compat.transformers import text_config
from accord.recipe.engine import EngineConfig

# The parts of the decoder a stage runs, as transformers' Llama-style models name them (the
# config's base_model_pp_plan says the model is split this way).
EMBED, LAYERS, NORM, HEAD = "embed_tokens", "layers", "norm", "lm_head"
# The schedules that split each backward into input and weight gradients.
ZERO_BUBBLE = ("zero-bubble", "zbv")


def check_pipeline(
    engine: EngineConfig, config: Any, grad_accum: int | None = None, pipelines: int | None = None
) -> list[str]:
    """What rules out the engine section's pipeline_parallel for this model config (None: not
    known yet), `grad_accum` micro-batches per pipeline and `pipelines` data-parallel groups
    (None: not known yet), each a one-line message."""
    n = engine.pipeline_parallel
    if n == 1:
        return []
    key = f"engine.pipeline_parallel={n}"
    stages = n * engine.stages_per_rank
    if pipelines is not None and pipelines > 1 and engine.pipeline_schedule in ZERO_BUBBLE:
        # Measured: the weight-gradient half of their backward misses FSDP2's parameters
        # (the updates drift from one process's), so they run on one pipeline only.
        return [
            f"{key}: engine.pipeline_schedule={engine.pipeline_schedule} over {pipelines} pipelines (data "
            "parallelism) is not supported yet; use pipeline_schedule=1f1b or interleaved-1f1b, or one pipeline "
            f"({n} processes)"
        ]
    if grad_accum is not None:
        problem = schedule_problem(engine.pipeline_schedule, n, engine.stages_per_rank, grad_accum)
        if problem:
            return [f"{key}: {problem}"]
    if config is None:
        return []
    text = text_config(config)
    if not getattr(text, "base_model_pp_plan", None):
        return [
            f"{key}: {type(config).__name__} has no pipeline plan (base_model_pp_plan: embeddings, decoder layers, "
            "norm); set engine.pipeline_parallel=1"
        ]
    if getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False):
        return [
            f"{key}: the model ties its output head to its input embeddings (tie_word_embeddings), which sit on the "
            "first and last stages; this is not supported yet: set engine.pipeline_parallel=1 (or train an untied "
            "model: model.config.tie_word_embeddings=false)"
        ]
    layers = text.num_hidden_layers
    if layers % stages or layers < stages:
        valid = [d for d in range(2, layers + 1) if layers % (d * engine.stages_per_rank) == 0]
        per_rank = f" × {engine.stages_per_rank} stages per rank" if engine.stages_per_rank > 1 else ""
        return [
            f"{key}: the model's {layers} decoder layers do not split evenly into {stages} stages ({n}{per_rank}); "
            f"use engine.pipeline_parallel={' or '.join(map(str, valid)) or '1'} (uneven stages are not built)"
        ]
    return []


def schedule_problem(schedule: str, pp: int, per_rank: int, micro_batches: int) -> str | None:
    """Why torch's `schedule` cannot run `micro_batches` micro-batches per step over `pp` ranks
    (the conditions its constructors check, said before any worker starts)."""
    if schedule == "1f1b" and micro_batches < pp:
        return (
            f"the 1f1b schedule needs at least {pp} micro-batches per step (one per stage), the batch plan gives "
            f"{micro_batches}; lower batch.micro_batch_size (or use engine.pipeline_schedule=gpipe)"
        )
    if per_rank > 1:
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            return (
                f"the {schedule} schedule runs micro-batches in rounds of {pp}: {micro_batches} per step is not a "
                f"multiple of {rounds} rounds; use a number of micro-batches (global batch / data-parallel groups / "
                f"micro_batch_size) that is below {pp} or a multiple of {pp}"
            )
    return None


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The decoder layers of each stage (an even split; check_pipeline refuses any other)."""
    per = num_layers // stages
    return [range(s * per, (s + 1) * per) for s in range(stages)]


def owner_stage(name: str, num_layers: int, stages: int) -> int:
    """The stage whose modules hold state-dict entry `name` (stage 0 for what no stage runs)."""
    parts = name.split(".")
    if LAYERS in parts:
        index = parts[parts.index(LAYERS) + 1]
        if index.isdigit():
            return int(index) // (num_layers // stages)
    if NORM in parts or parts[0] == HEAD:
        return stages - 1
    return 0


def keep_stages(model: nn.Module, stages: list[int], total: int) -> None:
    """Remove from `model` (before it has storage) every decoder layer, embedding, norm and head
    that none of `stages` runs; the decoder's layer list becomes a ModuleDict with the same names."""
    decoder = model.get_decoder()
    num_layers = len(decoder.layers)
    split = stage_layers(num_layers, total)
    kept = sorted(i for s in stages for i in split[s])
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in kept})
    if 0 not in stages:
        setattr(decoder, EMBED, None)
    if total - 1 not in stages:
        setattr(decoder, NORM, None)
        setattr(model, HEAD, None)


class StageModule(nn.Module):
    """One stage's forward: token ids (first stage) or the previous stage's hidden states in,
    hidden states (or, on the last stage, logits) out. The attention mask and positions come to
    every stage as keyword arguments (each rank of a pipeline collates the same rows), so only
    the hidden states travel between stages. The modules are the pruned model's own."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool, send_dtype: torch.dtype):
        super().__init__()
        decoder = model.get_decoder()
        self.text_config = text_config(model.config)
        self.embed = getattr(decoder, EMBED) if first else None
        self.layers = nn.ModuleList([decoder.layers[str(i)] for i in layers])
        self.rotary = decoder.rotary_emb
        self.norm = getattr(decoder, NORM) if last else None
        self.head = getattr(model, HEAD) if last else None
        self.send_dtype = send_dtype

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.embed(x) if self.embed is not None else x
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        masks = causal_masks(self.text_config, hidden, attention_mask, position_ids)
        position_embeddings = self.rotary(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=masks[getattr(layer, "attention_type", "full_attention")],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
        if self.head is None:
            # What the next stage receives has the dtype its receive buffer was made with.
            return hidden.to(self.send_dtype)
        return self.head(self.norm(hidden))


def causal_masks(config: Any, hidden: torch.Tensor, attention_mask, position_ids) -> dict[str, Any]:
    """The attention masks the decoder layers take, built as the model's own forward builds them
    (transformers' masking_utils), by layer type."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    masks = {"full_attention": create_causal_mask(config, hidden, attention_mask, None, position_ids)}
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        masks["sliding_attention"] = create_sliding_window_causal_mask(
            config, hidden, attention_mask, None, position_ids
        )
    return masks
