"""Sampling a prompt's group of completions with seeds that belong to the sample, and the
per-token log-probabilities GRPO's loss reads.

Why per-sample seeds: transformers' sampling draws from one global generator for the whole
batch, so a completion would depend on which other prompts shared its batch and on how the
prompts were split over ranks. Here decoding is greedy over logits plus Gumbel noise drawn
from the sample's own generator (argmax(logits + Gumbel) is a sample of softmax(logits)), seeded
by (seed, generation batch, prompt index, sample index): the same completion wherever and
beside whatever it is generated. Prompts are left-padded to a width that depends on the
prompt's length alone (padded_width), so prompts of nearby lengths share a `generate` call
while each row's shapes are those it has alone (its floats too, on the CPU, except where a
kernel depends on the batch size: a linear layer over 3 rows or fewer takes another one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from accord.compat.transformers import cache_argument, generate_positions, new_cache, prefill_cache

# Sequences are padded to a multiple of this many tokens (padded_width).
WIDTH_MULTIPLE = 8


def padded_width(length: int) -> int:
    """The width a sequence of `length` tokens is padded to (a prompt when sampled, a group in
    GRPO's loss): a function of its length alone, so a row's shapes do not depend on what
    shares its batch, while sequences of nearby lengths can share one."""
    return -(-length // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


def sample_seed(seed: int, generation: int, prompt: int, sample: int) -> int:
    """A 63-bit seed drawn from the four numbers (numpy's SeedSequence mixes them)."""
    words = np.random.SeedSequence([seed, generation, prompt, sample]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


class PerSampleGumbel(LogitsProcessor):
    """Adds Gumbel(0, 1) noise to each row's scores from that row's own generator (on the CPU,
    so the draws are the same on every device)."""

    def __init__(self, seeds: list[int]):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        noise = torch.empty(len(self.generators), scores.shape[-1])
        for row, g in zip(noise, self.generators):
            row.exponential_(generator=g)
        # -log(Exp(1)) is Gumbel(0, 1); the clamp keeps a (vanishingly rare) 0 draw finite.
        return scores.float() + noise.clamp_min_(1e-30).log_().neg_().to(scores.device)


@torch.no_grad()
def sample_group(
    model: nn.Module,
    prompt_ids: list[int],
    seeds: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
    lockstep: bool,
) -> list[list[int]]:
    """One completion per seed for one prompt (one batch), each cut after its EOS.

    `lockstep`: sharded parameters are gathered in every forward, so ranks keep decoding
    (transformers' synced_gpus) until all of them are done."""
    return sample_groups(
        model,
        [prompt_ids],
        [seeds],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos_id=eos_id,
        pad_id=pad_id,
        lockstep=lockstep,
    )[0]


@torch.no_grad()
def sample_groups(
    model: nn.Module,
    prompts: list[list[int]],
    seeds: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
    lockstep: bool,
) -> list[list[list[int]]]:
    """Each prompt's group (one completion per seed), sampled in one batch: the prompts must
    have the same padded_width, to which each is left-padded, so each row's tokens depend only
    on its prompt and its seed (up to rounding where a kernel depends on the batch size)."""
    widths = {padded_width(len(p)) for p in prompts}
    if len(widths) != 1:
        raise ValueError("sample_groups: prompts of one call must have the same padded_width")
    (width,) = widths
    device = next(model.parameters()).device
    padded = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    # Each prompt's keys and values up to its last token once, then shared by its group's rows
    # (rather than computed G times): generate takes them up from the last prompt token on.
    cache = prefill_cache(model, padded[:, :-1], mask[:, :-1])
    rows = torch.tensor([i for i, group in enumerate(seeds) for _ in group], device=device)
    cache.batch_select_indices(rows)
    input_ids, attention_mask = padded[rows], mask[rows]
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    processors.append(PerSampleGumbel([seed for group in seeds for seed in group]))
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,  # greedy over the noised scores: the sampling is the processors'
        logits_processor=processors,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        synced_gpus=lockstep,
        temperature=None,
        top_p=None,
        top_k=None,
        **{cache_argument(model): cache},
    )
    completions = []
    for ids in out[:, width:].tolist():
        completions.append(ids[: ids.index(eos_id) + 1] if eos_id in ids else ids)
    groups, start = [], 0
    for group in seeds:
        groups.append(completions[start : start + len(group)])
        start += len(group)
    return groups


def token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """(B, L-1) log-probability of each next token under the sampling temperature (fp32), as
    TRL computes the policy's: logits divided by the temperature (whole sequences, one pass)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@dataclass
class GroupsPass:
    """The groups of one forward pass of GRPO's loss: each group's prompt once (left-padded,
    P wide) and its G completions (right-padded, C wide)."""

    prompts: torch.Tensor  # (n, P)
    prompt_mask: torch.Tensor  # (n, P)
    completions: torch.Tensor  # (n·G, C)
    completion_mask: torch.Tensor  # (n·G, C)
    group: int  # G
    split_embeddings: bool  # look the input embeddings up one group at a time


def completion_logprobs(model: nn.Module, p: GroupsPass, temperature: float) -> torch.Tensor:
    """(n·G, C) log-probability of each completion token under the sampling temperature (fp32),
    as TRL computes the policy's (logits divided by the temperature). Each prompt takes one
    pass, whose last position scores its completions' first token and whose keys and values
    its G completion rows then share (differentiably): a prompt is computed once per group,
    not G times.

    `split_embeddings`: the input embeddings are looked up one group at a time, so an embedding
    row's gradient is summed within each group as when the group has its own pass."""
    # The model under an engine's wrapper (DDP, DeepSpeed): the prompt pass is not one of the
    # wrapper's training forwards, and the cache is built from the model's own config.
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    n, g = p.prompts.shape[0], p.group
    mask = torch.cat([p.prompt_mask.repeat_interleave(g, 0), p.completion_mask], 1)
    positions = generate_positions(mask)
    prompt_inputs: dict[str, torch.Tensor] = {"input_ids": p.prompts}
    inputs: dict[str, torch.Tensor] = {"input_ids": p.completions}
    if p.split_embeddings and n > 1:
        embed = inner.get_input_embeddings()
        prompt_inputs = {"inputs_embeds": torch.cat([embed(p.prompts[k : k + 1]) for k in range(n)])}
        inputs = {"inputs_embeds": torch.cat([embed(p.completions[k * g : (k + 1) * g]) for k in range(n)])}
    cache = new_cache(inner)
    first = inner(
        **prompt_inputs,
        attention_mask=p.prompt_mask,
        position_ids=positions[::g, : p.prompts.shape[1]],
        use_cache=True,
        **{cache_argument(inner): cache},
    ).logits[:, -1:]  # every position's logits: the head on n rows alone would take another kernel
    cache.batch_repeat_interleave(g)
    rest = model(
        **inputs,
        attention_mask=mask,
        position_ids=positions[:, p.prompts.shape[1] :],
        use_cache=True,
        **{cache_argument(inner): cache},
    ).logits[:, :-1]
    logits = torch.cat([first.repeat_interleave(g, 0), rest], 1).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, p.completions.unsqueeze(-1)).squeeze(-1)
