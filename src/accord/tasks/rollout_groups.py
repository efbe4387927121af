"""A GRPO step's groups: one prompt's sampled completions and what they were scored
(Rollout), what a step's rollout sums to (RolloutSummary), and the groups laid out as
batches for the loss's log-probability passes, each group in shapes of its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from accord.tasks.base import pad_rows
from accord.tasks.rollout import GroupsPass, padded_width


@dataclass
class Rollout:
    """One prompt's group: its completions, advantages, and (when needed) per-token
    log-probabilities of the sampling policy over completion tokens."""

    prompt_ids: list[int]
    completions: list[list[int]]
    row: dict[str, Any]  # the raw row (what the rewards read)
    texts: list[str]  # the decoded completions
    old_logps: torch.Tensor | None = None  # (G, longest completion)
    scores: torch.Tensor | None = None  # (reward functions, G), unweighted
    total: torch.Tensor | None = None  # (G,) weighted sum
    advantages: torch.Tensor | None = None  # (G,)
    kl: torch.Tensor | None = None  # (G,) rloo: each completion's summed log π_old − log π_ref


@dataclass
class RolloutSummary:
    """What the trainer reduces over ranks once per step."""

    targets: int  # what the loss is divided by: completion tokens (grpo), completions (rloo)
    tokens: int  # prompt + completion tokens
    completions: int
    sums: dict[str, float]  # per-completion values summed (rewards, lengths, group std × G)
    generation_s: float
    samples: list[dict[str, Any]] = field(default_factory=list)  # this rank's, for samples.jsonl


def collate_groups(groups: list[Rollout], pad_id: int, with_logps: bool) -> dict[str, torch.Tensor]:
    """The groups' sequences (prompt + completion) as one batch, with where each completion
    starts; with_logps adds the loss's completion mask, advantages and old log-probabilities."""
    sequences, starts, lengths = [], [], []
    for g in groups:
        for completion in g.completions:
            sequences.append(g.prompt_ids + completion)
            starts.append(len(g.prompt_ids) - 1)  # the shifted position that predicts the first completion token
            lengths.append(len(completion))
    input_ids = pad_rows(sequences, pad_id)
    width = input_ids.shape[1]
    total = torch.tensor([len(s) for s in sequences])
    batch = {
        "input_ids": input_ids,
        "attention_mask": (torch.arange(width)[None, :] < total[:, None]).long(),
        "prompt_lengths": torch.tensor(starts) + 1,
    }
    if not with_logps:
        return batch
    positions = torch.arange(width - 1)[None, :]
    begin, count = torch.tensor(starts)[:, None], torch.tensor(lengths)[:, None]
    batch["completion_mask"] = ((positions >= begin) & (positions < begin + count)).float()
    batch["advantages"] = torch.cat([g.advantages for g in groups])
    if groups[0].old_logps is not None:
        batch["old_logps"] = place([row for g in groups for row in g.old_logps], starts, width - 1)
    return batch


def group_logps(logprobs, batch: dict[str, torch.Tensor], size: int, pad_id: int, lockstep: bool) -> torch.Tensor:
    """`logprobs(GroupsPass)` of the micro-batch's completion tokens, laid out as the batch
    is (B, L-1). Each group is cut to shapes of its own: its prompt left-padded to the
    prompt's padded_width, its completions right-padded to their longest one's. A group's
    floats are then those of its own shapes whatever else shares its micro-batch (which
    changes with the world size), as the sampling policy's were (GRPOTask._add_old_logps), so the
    update is the same on any number of processes: padded to the micro-batch's width, the
    rounding differed in the last bits, which AdamW turns into steps of up to its full size
    where a gradient is that small.

    On the CPU the groups of one shape share a pass: there a row's floats do not depend on
    how many rows share its batch (a test pins it). Elsewhere (GPU kernels are chosen by
    shape) and under lockstep (every rank must make the same number of passes: the same
    number of groups, not of shapes) each group has its own pass."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    width = ids.shape[1]
    prompt = batch["prompt_lengths"][::size].tolist()
    longest = (mask.view(-1, size, width).sum(2).amax(1) - batch["prompt_lengths"][::size]).tolist()
    batched = not lockstep and ids.device.type == "cpu"
    passes: dict[Any, list[int]] = {}  # (prompt width, completion width) -> its groups
    for k, (p, c) in enumerate(zip(prompt, longest)):
        passes.setdefault((padded_width(p), padded_width(c)) if batched else k, []).append(k)
    by_group: dict[int, torch.Tensor] = {}
    for groups in passes.values():
        p_width, c_width = padded_width(prompt[groups[0]]), padded_width(longest[groups[0]])
        prompts = torch.full((len(groups), p_width), pad_id, dtype=ids.dtype, device=ids.device)
        prompt_mask = torch.zeros_like(prompts)
        completions = torch.full((len(groups) * size, c_width), pad_id, dtype=ids.dtype, device=ids.device)
        completion_mask = torch.zeros_like(completions)
        for j, k in enumerate(groups):
            p, rows = prompt[k], slice(k * size, (k + 1) * size)
            n = min(c_width, width - p)
            prompts[j, p_width - p :], prompt_mask[j, p_width - p :] = ids[k * size, :p], 1
            completions[j * size : (j + 1) * size, :n] = ids[rows, p : p + n]
            completion_mask[j * size : (j + 1) * size, :n] = mask[rows, p : p + n]
        part = logprobs(GroupsPass(prompts, prompt_mask, completions, completion_mask, size, batched))
        for j, k in enumerate(groups):  # back to the batch's layout: completion token t at t-1
            p, n = prompt[k], min(c_width, width - prompt[k])
            rows = part[j * size : (j + 1) * size, :n]
            by_group[k] = torch.nn.functional.pad(rows, (p - 1, width - 1 - (p - 1) - n))
    return torch.cat([by_group[k] for k in range(len(prompt))])


def place(rows: list[torch.Tensor], starts: list[int], width: int) -> torch.Tensor:
    """Completion-aligned rows placed at their shifted start in a (B, width) zero tensor."""
    out = torch.zeros(len(rows), width)
    for i, (row, start) in enumerate(zip(rows, starts)):
        n = min(len(row), width - start)
        out[i, start : start + n] = row[:n]
    return out
