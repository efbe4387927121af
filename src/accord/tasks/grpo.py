"""Group relative policy optimisation (online RL): rows hold a `prompt` (or chat `messages`)
plus the columns the rewards read.

A step (see Trainer.train_step) first asks `rollout` for this rank's prompts of the global
batch: each prompt's group of G completions is sampled as one batch with per-sample seeds
(accord.tasks.rollout), scored, and given advantages normalised within the group. The
micro-steps then compute the token-level clipped objective plus beta × KL (the k3 estimator)
summed over completion tokens; the trainer divides by the completion tokens of the whole
global batch, so the update does not depend on how prompts are split over ranks and
micro-steps. With num_iterations > 1 one generation batch serves that many optimizer steps,
the ratio taken against the log-probabilities of the policy that sampled it.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import torch
from torch import nn

from accord.data.sources import DataError, check_columns
from accord.errors import UserInputError
from accord.tasks.base import PADDING, FrozenModel, LossOutput, Task, text_prefix
from accord.tasks.grpo_loss import clipped, grpo_token_loss, kl_k3
from accord.tasks.reference_model import adapters_off
from accord.tasks.rewards import Group, RewardFunctions
from accord.tasks.rollout import GroupsPass, completion_logprobs, padded_width, sample_groups, sample_seed
from accord.tasks.rollout_groups import Rollout, RolloutSummary, collate_groups, group_logps

ROW = "row_json"  # the raw row (all its columns), for the rewards


class GRPOTask(Task):
    name = "grpo"
    online = True  # generates its training targets each step (Trainer.train_step)
    token_targets = True  # the loss is a sum over completion tokens (rloo: over completions)
    eval_loss = False  # held-out rows are scored by generation (train.eval_generate), not a loss
    sections = ("grpo",)

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.cfg = config.section("grpo")
        if self.cfg.max_new_tokens >= self.max_length:
            raise UserInputError(
                f"grpo.max_new_tokens={self.cfg.max_new_tokens} leaves no room for the prompt "
                f"in data.max_length={self.max_length}; "
                "raise data.max_length or lower grpo.max_new_tokens"
            )
        self.rewards = RewardFunctions(self.cfg)  # imports callables, checks reward models: one line each
        self.eos_id = tokenizer.eos_token_id
        self.add_bos = config.data.add_bos
        self.prefix = text_prefix(tokenizer, self.add_bos)
        self.chat = False
        self.reference: nn.Module | None = None
        self.policy: nn.Module | None = None
        self.lockstep = False
        self._rollouts: dict[int, Rollout] = {}
        self._generation: int | None = None  # which generation batch _rollouts holds
        self._summary: RolloutSummary | None = None

    @classmethod
    def frozen_model(cls, config) -> FrozenModel | None:
        # The KL anchor (beta > 0): a copy of the starting model; under LoRA the policy with its adapters off.
        return FrozenModel() if config.section("grpo").beta > 0 and config.lora is None else None

    @property
    def steps_per_batch(self) -> int:
        return self.cfg.num_iterations

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "add_bos": self.add_bos,
            "prefix": self.prefix,
            "max_new_tokens": self.cfg.max_new_tokens,
        }

    # ---------------------------------------------------------------- data

    def fit(self, train, eval_ds):
        self.chat = "messages" in train.column_names
        if self.chat and self.tokenizer.chat_template is None:
            raise DataError(
                f"{self.name} on chat `messages` needs a tokenizer with a chat template (model.tokenizer has none)"
            )
        checked = []
        for ds in (train, eval_ds):
            if ds is not None:
                ds = check_columns(ds, () if self.chat else ("prompt",), f"{self.name} data (prompt or messages)")
                missing = sorted(self.rewards.columns() - set(ds.column_names))
                if missing:
                    present = [c for c in ds.column_names if not c.startswith("__")]
                    raise DataError(
                        f"grpo.rewards: exact_match reads column {missing[0]!r}, which the data lacks "
                        f"(fields present: {', '.join(present)})"
                    )
            checked.append(ds)
        return tuple(checked)

    def state(self) -> dict[str, Any]:
        return {"chat": self.chat}

    def load_state(self, state: dict[str, Any]) -> None:
        self.chat = state["chat"]

    def prompt_text(self, row: dict[str, Any]) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template(
                prompt_turns(row["messages"]), tokenize=False, add_generation_prompt=True
            )
        return row["prompt"]

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        keep = self.max_length - self.cfg.max_new_tokens - len(self.prefix)  # room left for the prompt
        out: dict[str, list] = {"prompt_ids": [], ROW: [], "num_targets": [], "length": [], "over_length": []}
        for row in rows:
            ids = self.tokenizer(self.prompt_text(row), add_special_tokens=False)["input_ids"]
            out["over_length"].append(len(ids) > keep)
            ids = self.prefix + ids[-keep:]  # an over-long prompt keeps its end, which the completion follows
            out["prompt_ids"].append(ids)
            out[ROW].append(json.dumps(row, default=str))
            out["num_targets"].append(1)  # one prompt; its completion tokens are counted when sampled
            out["length"].append(len(ids))
        return out

    # ---------------------------------------------------------------- the reference and the rewards

    def configure_model(self, model: nn.Module) -> None:
        """The KL anchor: a frozen copy of the starting model (its description: it is on the
        meta device), or under LoRA the policy with its adapters off."""
        if self.cfg.beta > 0 and self.config.lora is None:
            self.reference = copy.deepcopy(model).requires_grad_(False).eval()

    def setup(self, engine, train, eval_ds):
        self.policy = engine.module
        self.lockstep = engine.lockstep
        if self.reference is not None:
            self.reference = engine.prepare_frozen(self.reference)
        self.rewards.load(engine.device)
        # Held-out prompts are only scored by greedy generation (train.eval_generate).
        return train, eval_ds if self.config.eval_generate else None

    def describe(self) -> list[str]:
        c = self.cfg
        return [
            f"grpo: {c.group_size} completions per prompt, up to {c.max_new_tokens} tokens; "
            f"rewards {', '.join(self.rewards.names)}; "
            f"beta {c.beta:g}, epsilon {c.epsilon:g}, {c.num_iterations} step(s) per generation batch"
        ]

    # ---------------------------------------------------------------- generation (once per batch)

    def rollout(self, step: int, row_ids: list[int], rows: list[dict]) -> RolloutSummary:
        """Sample, score and normalise the groups of this rank's prompts of `step`'s batch.
        Every rank calls it with the same number of prompts (its forward passes are
        collective under sharded strategies)."""
        generation = step // self.cfg.num_iterations
        if generation == self._generation and self._summary is not None:
            return self._summary  # num_iterations > 1: the batch's later steps reuse it
        start = time.perf_counter()
        model = self.policy
        assert model is not None, "setup() first"
        was_training = model.training
        model.eval()
        try:
            # Every forward first (collective under sharded strategies), then the rewards,
            # which may fail on one rank only: the trainer agrees on that in its next reduction.
            groups = self._sample(model, generation, row_ids, rows)
        finally:
            model.train(was_training)
        for row_id, group in zip(row_ids, groups):
            self._score(group, row_id)
        self._rollouts = dict(zip(row_ids, groups))
        self._generation = generation
        self._summary = self._summarise(row_ids, time.perf_counter() - start)
        return self._summary

    def _sample(self, model: nn.Module, generation: int, row_ids: list[int], rows: list[dict]) -> list[Rollout]:
        """The groups of this rank's prompts. Prompts of one padded_width share a `generate`
        call (each left-padded to that width, each completion's noise from its own seed);
        under lockstep every rank must call generate equally often, so there each prompt has
        its own call (every rank holds the same number of prompts)."""
        c = self.cfg
        seeds = [[sample_seed(self.config.seed, generation, rid, k) for k in range(c.group_size)] for rid in row_ids]
        calls = (
            [[i] for i in range(len(rows))]
            if self.lockstep
            else _same_length_calls([padded_width(len(row["prompt_ids"])) for row in rows])
        )
        completions: dict[int, list[list[int]]] = {}
        for call in calls:
            groups = sample_groups(
                model,
                [rows[i]["prompt_ids"] for i in call],
                [seeds[i] for i in call],
                max_new_tokens=c.max_new_tokens,
                temperature=c.temperature,
                top_p=c.top_p,
                eos_id=self.eos_id,
                pad_id=self.pad_id,
                lockstep=self.lockstep,
            )
            completions.update(zip(call, groups))
        rollouts = [self._rollout(rows[i], completions[i]) for i in range(len(rows))]
        if self._logps_at_rollout:
            # At most a micro-batch of groups at a time (the memory the loss's passes are sized
            # for); a group's floats do not depend on which others share the pass (_group_logps).
            chunk = self.config.micro_batch_size or len(rollouts)
            for k in range(0, len(rollouts), chunk):
                self._add_old_logps(model, rollouts[k : k + chunk])
        return rollouts

    def _rollout(self, row: dict, completions: list[list[int]]) -> Rollout:
        texts = [
            self.tokenizer.decode([t for t in ids if t != self.eos_id], skip_special_tokens=True) for ids in completions
        ]
        return Rollout(row["prompt_ids"], completions, json.loads(row[ROW]), texts)

    def _score(self, r: Rollout, row_id: int) -> None:
        r.scores = self.rewards.score(
            Group(self.prompt_text(r.row), r.row, r.texts, [len(ids) for ids in r.completions], row_id)
        )
        r.total = (torch.tensor(self.rewards.weights, dtype=torch.float64)[:, None] * r.scores).sum(0)
        r.advantages = self._advantages(r)

    def _advantages(self, r: Rollout) -> torch.Tensor:
        """(G,) advantages of a scored group."""
        # Normalised within the group (TRL's scale_rewards=group): std + 1e-4 keeps a group of
        # equal rewards at advantage 0.
        return ((r.total - r.total.mean()) / (r.total.std() + 1e-4)).float()

    @property
    def _has_reference(self) -> bool:
        return self.cfg.beta > 0

    @property
    def _logps_at_rollout(self) -> bool:
        """Whether the sampling policy's log-probabilities are taken after sampling (grpo: only
        as the ratios' denominator when a generation batch serves several steps)."""
        return self.cfg.num_iterations > 1

    @torch.no_grad()
    def _add_old_logps(self, model: nn.Module, rollouts: list[Rollout]) -> None:
        """Per-token log-probabilities of the groups' completions under the sampling policy,
        over each group's completion positions (G, its longest completion): the ratios'
        denominator when a generation batch serves several steps (with one step the ratio is 1
        and needs none). Taken as the loss takes the policy's (_group_logps): the same floats."""
        logps = self._rollout_logps(lambda p: completion_logprobs(model, p, self.cfg.temperature), rollouts)
        for r, old in zip(rollouts, logps):
            r.old_logps = old

    def _rollout_logps(self, logprobs, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """`logprobs(GroupsPass)` of each group's completion tokens, (G, its longest completion)
        per group, on the CPU; the positions past a completion's end hold padding's values."""
        batch = self._collate_groups(rollouts, with_logps=False)
        batch = {key: value.to(self._device) for key, value in batch.items()}
        logps = self._group_logps(logprobs, batch).cpu()
        size, out = self.cfg.group_size, []
        for k, r in enumerate(rollouts):
            start = len(r.prompt_ids) - 1
            out.append(logps[k * size : (k + 1) * size, start : start + max(len(c) for c in r.completions)])
        return out

    @torch.no_grad()
    def _reference_logps(self, p: GroupsPass) -> torch.Tensor:
        """The reference's log-probabilities, taken in the loss over the same group shapes as the
        policy's (same shapes, same floats): at the first step (policy = reference) the KL
        term's gradient is then exactly zero, not rounding noise, which AdamW would turn into
        full-size steps whose sign depends on how the batch was split (1 vs 2 processes: 0.01
        apart at lr 3e-3 on an embedding row no reward moved)."""
        if self.reference is not None:
            return completion_logprobs(self.reference, p, self.cfg.temperature)
        assert self.policy is not None, "setup() first"
        was_training = self.policy.training
        self.policy.eval()  # as the frozen copy is
        try:
            with adapters_off(self.policy):
                return completion_logprobs(self.policy, p, self.cfg.temperature)
        finally:
            self.policy.train(was_training)

    @property
    def _device(self) -> torch.device:
        assert self.policy is not None
        return next(self.policy.parameters()).device

    def rollout_metric_names(self) -> list[str]:
        return ["reward", "reward_std", "completion_length"] + [f"reward_{name}" for name in self.rewards.names]

    def _summarise(self, row_ids: list[int], seconds: float) -> RolloutSummary:
        sums = dict.fromkeys(self.rollout_metric_names(), 0.0)
        targets = tokens = completions = 0
        samples = []
        for rid in row_ids:
            r = self._rollouts[rid]
            texts, scores, total = r.texts, r.scores, r.total
            assert scores is not None and total is not None
            lengths = [len(c) for c in r.completions]
            targets += sum(lengths) if self.token_targets else len(lengths)
            tokens += sum(lengths) + len(r.prompt_ids) * len(lengths)
            completions += len(lengths)
            sums["reward"] += float(total.sum())
            sums["reward_std"] += float(total.std()) * len(lengths)
            sums["completion_length"] += float(sum(lengths))
            for name, row_scores in zip(self.rewards.names, scores):
                sums[f"reward_{name}"] += float(row_scores.sum())
            prompt = self.prompt_text(r.row)
            samples += [{"prompt": prompt, "completion": t, "reward": float(v)} for t, v in zip(texts, total)]
        return RolloutSummary(targets, tokens, completions, sums, seconds, samples)

    def rollout_means(self, means: dict[str, float], completions: float) -> dict[str, float]:
        """The step's metrics from the per-completion means of the summed values over the whole
        global batch (one reduction, every rank the same): called once per step, after `rollout`."""
        return means

    # ---------------------------------------------------------------- batches and the loss

    def rollout_batch(self, row_ids: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch of these prompts' groups (sampled by `rollout`)."""
        return self._collate_groups([self._rollouts[int(r)] for r in row_ids], with_logps=True)

    def _collate_groups(self, groups: list[Rollout], with_logps: bool) -> dict[str, torch.Tensor]:
        return collate_groups(groups, self.pad_id, with_logps)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        mask = batch["completion_mask"]
        # The reference's passes first: forwards without gradients before the training ones,
        # not between them and their backward (sharded strategies track the forward's order).
        ref = self._group_logps(self._reference_logps, batch) if self._has_reference else None
        logps = self._group_logps(lambda p: completion_logprobs(model, p, self.cfg.temperature), batch)
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()  # num_iterations=1: ratio 1, same gradient
        advantages = batch["advantages"][:, None]
        per_token, ratio = grpo_token_loss(logps, old, advantages, ref, self.cfg.beta, self.cfg.epsilon)
        metrics = {"clip_fraction": (clipped(ratio, advantages, self.cfg.epsilon).float() * mask).sum()}
        if ref is not None:
            metrics["kl"] = (kl_k3(logps.detach(), ref) * mask).sum()
        return LossOutput((per_token * mask).sum(), mask.sum(), metrics)

    def _group_logps(self, logprobs, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """`logprobs(GroupsPass)` of the micro-batch's completion tokens, each group in shapes of
        its own (rollout_groups.group_logps)."""
        return group_logps(logprobs, batch, self.cfg.group_size, self.pad_id, self.lockstep)

    # ---------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate_generation(
        self, model: nn.Module, rows, device, max_new_tokens: int, lockstep: bool = False
    ) -> dict[str, float]:
        """Greedy completion of each held-out prompt, scored by each reward function (unweighted).
        Prompts of one length share a `generate` call (no padding, so each row's completion is
        its own, up to floating-point differences between batch shapes); under lockstep every
        rank must call generate equally often, so there each row has its own call."""
        sums = {name: 0.0 for name in self.rewards.names} | {"count": 0.0}
        if lockstep:
            calls = [[i] for i in range(len(rows))]
        else:
            scored = [i for i, row in enumerate(rows) if not row.get(PADDING)]  # padding rows only keep ranks in step
            calls = [
                [scored[k] for k in call]
                for call in _same_length_calls([len(rows[i]["prompt_ids"]) for i in scored], EVAL_PROMPTS_PER_CALL)
            ]
        for call in calls:
            ids = torch.tensor([rows[i]["prompt_ids"] for i in call], device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.cfg.max_new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                synced_gpus=lockstep,
                temperature=None,
                top_p=None,
                top_k=None,
            )
            for i, completion in zip(call, out[:, ids.shape[1] :].tolist()):
                if rows[i].get(PADDING):
                    continue
                completion = (
                    completion[: completion.index(self.eos_id) + 1] if self.eos_id in completion else completion
                )
                raw = json.loads(rows[i][ROW])
                text = self.tokenizer.decode([t for t in completion if t != self.eos_id], skip_special_tokens=True)
                scores = self.rewards.score(Group(self.prompt_text(raw), raw, [text], [len(completion)]))
                for name, value in zip(self.rewards.names, scores[:, 0].tolist()):
                    sums[name] += value
                sums["count"] += 1
        return sums

    def generation_results(self, reduced: dict[str, float], count: float) -> dict[str, float]:
        return {f"greedy_reward_{name}": value / max(count, 1.0) for name, value in reduced.items()} | {
            "generated": count
        }


def prompt_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation as a prompt: without its closing assistant turns (an SFT-style row's
    answer), so the policy writes the reply the rewards score rather than the turn after it."""
    end = len(messages)
    while end > 1 and messages[end - 1].get("role") == "assistant":
        end -= 1
    return messages[:end]


# Prompts sampled in one `generate` call at most (their groups' KV caches exist together).
PROMPTS_PER_CALL = 16
# Held-out prompts completed greedily in one call (one sequence each, not a group).
EVAL_PROMPTS_PER_CALL = 64


def _same_length_calls(lengths: list[int], per_call: int = PROMPTS_PER_CALL) -> list[list[int]]:
    """Indices of prompts grouped by length (or padded width), in order, at most `per_call` a call."""
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    return [same[k : k + per_call] for same in by_length.values() for k in range(0, len(same), per_call)]
