"""Ulysses sequence parallelism (engine.sequence_parallel: N).

Ranks r*N … r*N+N-1 form a group that trains on the same rows, each holding one N-th of every
row's tokens; attention exchanges sequence shards for head shards (all-to-all) to attend over
the whole row. The attention is DeepSpeed's `UlyssesSPAttentionHF`, registered under its own
name on this model's config (not globally) and given the whole row's mask, so packed
documents stay apart. Each target token is counted on exactly one rank, so every strategy
carries it unchanged. Rows are padded to a multiple of N; evaluation runs whole rows.
"""

from __future__ import annotations

import torch

from accord import registry
from accord.compat.deepspeed import import_deepspeed, ulysses_attention
from accord.compat.transformers import attn_implementation, set_attn_implementation, text_config
from accord.distributed.group import DistInfo
from accord.errors import UserInputError
from accord.tasks import task_class

CORE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def check_sequence_parallel(recipe, config) -> list[str]:
    """What rules out engine.sequence_parallel for this recipe and model config (None: not
    known yet); the world size is BatchPlan.derive's to check. Reads the task and model
    sections too (the task must split rows; model.attn_implementation is the attention to run)."""
    n = recipe.engine.sequence_parallel
    if n == 1:
        return []
    if not task_class(recipe.task, recipe.model).splits_rows:  # a causal LM whose loss is a sum over tokens
        task = recipe.task if isinstance(recipe.task, str) else recipe.task.class_
        return [
            f"engine.sequence_parallel={n} supports task {' and '.join(_splitting_tasks())}, not {task}; "
            "set engine.sequence_parallel=1"
        ]
    if config is None:
        return []  # not known before the model is built (a GGUF file): checked again in the worker
    return check_heads_and_attention(
        n, config, recipe.model.attn_implementation or attn_implementation(config) or "sdpa"
    )


def check_heads_and_attention(n: int, config, implementation: str) -> list[str]:
    """What rules out engine.sequence_parallel=`n` (above 1) for this model config running
    attention `implementation`: its heads must split over the group, the attention be one Ulysses wraps."""
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        return [
            f"engine.sequence_parallel={n}: the model's config names no attention heads; set engine.sequence_parallel=1"
        ]
    if heads % n or (kv_heads % n and n % kv_heads):
        valid = [d for d in range(2, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
        return [
            f"engine.sequence_parallel={n} must divide the model's {heads} attention heads "
            f"(and its {kv_heads} key/value heads, or be a multiple of them); "
            f"use {', '.join(map(str, valid)) or 'none above 1'} or 1"
        ]
    if implementation not in CORE_ATTENTION:
        return [
            f"engine.sequence_parallel={n} runs over sdpa, eager or flash attention, not {implementation}; "
            "set engine.sequence_parallel=1"
        ]
    return []


def _splitting_tasks() -> list[str]:
    """The registered tasks whose rows sequence parallelism can split (Task.splits_rows)."""
    names = []
    for name in registry.TASKS:
        try:
            if task_class(name).splits_rows:
                names.append(name)
        except UserInputError:  # a user's task that does not import here is not one to name
            continue
    return names


def install_ulysses(n: int, model, info: DistInfo, micro_batch_size: int) -> None:
    """Form the sequence-parallel groups of `n` ranks (engine.sequence_parallel) and put the
    Ulysses attention into `model` (before the strategy wraps it); collective: every rank calls
    it. Nothing for n = 1. The task was checked with the recipe before the run (preflight); here
    the built model's heads and attention, which a GGUF file's config only now shows."""
    if n == 1:
        return
    problems = check_heads_and_attention(n, model.config, attn_implementation(model.config) or "sdpa")
    if problems:
        raise UserInputError(problems[0])
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # DeepSpeed's collectives go through deepspeed.comm, over the process group accord made.
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)
    group = None
    for first in range(0, info.world_size, n):  # every rank creates every group, in the same order
        ranks = list(range(first, first + n))
        made = torch.distributed.new_group(ranks)
        if info.rank in ranks:
            group = made
    config = model.config
    text = text_config(config)
    core = attn_implementation(config) or "sdpa"
    attention = ulysses_attention(
        core,
        ALL_ATTENTION_FUNCTIONS[core],
        batch_size=micro_batch_size,
        attn_head_count=text.num_attention_heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        kv_head_count=text.num_key_value_heads or text.num_attention_heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=True,
        disable_in_eval=True,  # evaluation and generation run whole rows on each rank
    )

    def ulysses(module, query, key, value, attention_mask, *args, **kwargs):
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    name = f"accord_ulysses_{core}"
    AttentionInterface.register(name, ulysses)
    # Evaluation builds the core attention's masks from 2D padding masks, as without sp;
    # training passes the row's 4D mask, which transformers hands through unchanged.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[core])
    set_attn_implementation(config, name)
    if text is not config:
        set_attn_implementation(text, name)
