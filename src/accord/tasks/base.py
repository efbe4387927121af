"""The one interface every training method implements, and what the methods share.

A task turns raw rows into token columns once (cached by the data layer), and a
micro-batch into a LossOutput: the *summed* loss over the batch's targets and how many
targets that is. The trainer divides by the target count of the whole global batch, which
keeps every method's update independent of how the batch is split over ranks and
micro-steps. Tasks know nothing of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from accord.data.rows import IGNORE, DataError
from accord.data.token_ids import token_ids  # noqa: F401 (read from here too)
from accord.tasks.config import TaskConfig

if TYPE_CHECKING:
    from accord.recipe.schema import DataConfig

# A row that only keeps a rank's number of forward passes equal to the others'.
PADDING = "__accord_padding__"
# A batch's real tokens (1) and padding (0), rows × length, where its attention mask is 4-D
# and cannot say (packed rows): read by a mixture-of-experts model's router statistics, never
# handed to the model.
TOKEN_MASK = "token_mask"
# eval_sums' prefix for the sums of a LossOutput's row term (averaged over rows, not targets).
ROW_SUM = "per_row:"


@dataclass(frozen=True)
class FrozenModel:
    """A second, frozen model a task runs beside the trained one (a reference, a teacher), as
    `accord plan` counts it: built from `folder` (a folder or hub name, at `revision`), or when
    folder is None a copy of the starting model (without adapters)."""

    folder: str | None = None
    revision: str | None = None
    # Its logits are kept for the loss (distill's teacher), not reduced to per-row values in its forward.
    keeps_logits: bool = False
    key: str = ""  # the recipe key that names the folder (for a one-line error)


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    num_targets: torch.Tensor
    # Further per-step sums (e.g. DPO's correctly ranked pairs); logged divided by the
    # step's target count, like the loss.
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    # A second term averaged over the global batch's rows (examples) instead of its targets:
    # ORPO and CPO add a per-pair preference term to a per-token NLL. The step's loss is then
    # loss_sum / targets + row_loss_sum / rows, both counts of the whole global batch; its
    # metrics in row_metrics are logged divided by the rows. num_rows: this micro-batch's rows.
    row_loss_sum: torch.Tensor | None = None
    num_rows: torch.Tensor | None = None
    row_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    # A term already divided by its own count of the whole global batch (a mixture-of-experts
    # router's balancing loss, over the batch's tokens and router layers): this micro-batch's
    # share of it, added to the step's loss as it is.
    normalised_loss: torch.Tensor | None = None

    def over_targets(self, targets: int, rows: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metric sums that, divided by the global batch's `targets`, give the
        step's values: a row term is rescaled by targets / rows, a constant of the global
        batch, so the update still does not depend on how the batch is split; a normalised
        term by the targets (the trainer's division undoes it)."""
        loss, metrics = self.loss_sum, self.metrics
        if self.row_loss_sum is not None:
            scale = targets / max(rows, 1)
            metrics = metrics | {name: value * scale for name, value in self.row_metrics.items()}
            loss = loss + self.row_loss_sum * scale
        if self.normalised_loss is not None:
            loss = loss + self.normalised_loss * max(targets, 1)
        return loss, metrics


class Task:
    """Base class with the defaults most methods share; subclasses override what differs."""

    name = "task"
    text_fields: tuple[str, ...] = ()  # string columns every row must have
    model_kind = "causal_lm"  # or "sequence_classification"
    packable = False  # may several examples share one row (sft)?
    # Training data prepared as token shards (data/shards.py: ids + target bits, or with
    # shard_schema() several token and value columns, data/columns.py) instead of Arrow.
    token_shards = False
    # Held-out data prepared as token shards too: evaluation reads no raw text columns (sft's
    # generation metrics do, so its held-out rows stay Arrow with them).
    eval_shards = False
    # Sources streamed (never materialised) are taken: fit() needs no whole table.
    takes_streams = False
    # row_files(ds) -> the files a dataset's rows name and encoding reads (a vision-language
    # row's images): their size and mtime enter the prepared data's cache key, as the data
    # files' do. None: rows name no files (and the cache key never reads them).
    row_files: Callable[[Any], list[Path]] | None = None
    # Online methods (grpo) make their training batches each step from their rows (the
    # prompts): the trainer calls rollout() and rollout_batch() instead of collate().
    online = False
    eval_loss = True  # evaluation computes the loss on held-out rows (else only generation metrics)
    # Its loss goes through accord.tasks.chunked_loss (train.loss_chunk_size): `accord plan`
    # counts chunk-sized logits instead of whole ones.
    chunked_loss = False
    # A causal LM whose loss is a sum over tokens (no row-level pooling): a row's tokens may be
    # split over ranks (engine.sequence_parallel).
    splits_rows = False
    # Its loss reads a statistic of the whole global batch (kto's KL estimate): before a step's
    # micro-batches the trainer builds statistics_batch for each, adds statistics_sums over
    # them and every rank, and hands the totals to use_statistics.
    batch_statistics = False

    # Metric names left out of the one-line evaluation summary (still in metrics.jsonl).
    eval_hidden: tuple[str, ...] = ()

    # The recipe sections besides `data` this method reads, by name (dpo's "dpo"): its
    # TaskConfig carries them (config.section(name)), and no other.
    sections: tuple[str, ...] = ()

    def __init__(self, tokenizer, config: TaskConfig):
        if not isinstance(config, TaskConfig):  # code written when tasks took the whole Recipe
            raise TypeError(
                f"{type(self).__name__} is built from a TaskConfig, not a {type(config).__name__}: "
                "accord.tasks.build_task(accord.tasks.task_config(recipe), tokenizer)"
            )
        self.tokenizer = tokenizer
        self.config = config
        self.max_length = config.data.max_length
        self.pad_id = tokenizer.pad_token_id
        self.packing = self.packs(config.data)

    @classmethod
    def packs(cls, data: DataConfig) -> bool:
        """Whether several examples share a row: the task's to decide (data.packing only turns
        it off), before any row is built (and before a task exists: a checkpoint's order)."""
        return cls.packable and data.packing is not False

    @classmethod
    def frozen_model(cls, config: TaskConfig) -> FrozenModel | None:
        """The frozen model a run of this task holds beside the trained one (None: none); read
        by `accord plan` before any task exists."""
        return None

    @property
    def row_capacity(self) -> int | None:
        """Tokens per row of the global order when examples are packed; None: one example a row."""
        return self.max_length if self.packing else None

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps that each global batch of rows serves (grpo.num_iterations)."""
        return 1

    # ---------------------------------------------------------------- data (run once, cached)

    def settings(self) -> dict[str, Any]:
        """Everything besides data and tokenizer that changes the encoded columns."""
        return {"max_length": self.max_length}

    def fit(self, train, eval_ds):
        """Check the rows and learn what encoding needs (e.g. the label set); returns the
        (train, eval) datasets, possibly with columns normalised. May raise DataError."""
        return train, eval_ds

    def encode_batch(self, batch: dict[str, list]) -> dict[str, list]:
        """Columns for a batch of rows: at least `num_targets`, `length` and `over_length`
        (the untruncated length exceeded max_length)."""
        raise NotImplementedError

    def shard_schema(self):
        """The encode_batch columns kept in multi-column token shards (a data.columns.Schema),
        or None: the causal layout of `input_ids` and `labels`. Called after fit()."""
        return None

    def regroup(self, ds):
        """A dataset-level step after encoding (pretraining joins documents into blocks)."""
        return ds

    def state(self) -> dict[str, Any]:
        """What the task learned in fit(), stored with the cached data."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        pass

    def model_kwargs(self) -> dict[str, Any]:
        """Extra arguments for building the model (e.g. num_labels)."""
        return {}

    # ---------------------------------------------------------------- lifecycle (once per run)

    def configure_model(self, model: nn.Module) -> None:
        """Called with the freshly built model, before adapters and before the engine wraps it."""

    def setup(self, engine, train, eval_ds):
        """Called once the engine holds the model; returns the (train, eval) datasets, with any
        columns the task adds (e.g. precomputed reference values). `engine` gives `module`,
        `device` and `autocast()`."""
        return train, eval_ds

    def describe(self) -> list[str]:
        """Lines for the start-of-run summary, beyond what every run prints."""
        return []

    def format_eval(self, results: dict[str, float]) -> str:
        """One line for an evaluation's results (accuracies and F1 as percentages)."""
        parts = []
        for name, value in results.items():
            if name in self.eval_hidden:
                continue
            label = name.replace("_", " ")
            parts.append(f"{label} {100 * value:.1f}%" if name.endswith(("accuracy", "f1")) else f"{label} {value:.4f}")
        return "eval " + ", ".join(parts)

    # ---------------------------------------------------------------- batches and losses

    def statistics_batch(self, rows: list[list[dict]], partners: list[list[dict]]) -> dict[str, torch.Tensor]:
        """batch_statistics: tensors for a micro-batch's rows, `partners` the rows one place
        before them in the global batch (the first row's: the last)."""
        raise NotImplementedError

    def statistics_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """batch_statistics: this micro-batch's sums (float64, one vector), without gradients."""
        raise NotImplementedError

    def use_statistics(self, totals: torch.Tensor) -> None:
        """batch_statistics: statistics_sums added over the global batch, before its micro-batches."""

    def step_means(self) -> dict[str, float]:
        """Values of the step just trained, already reduced over the ranks, logged as they are
        (a mixture-of-experts router's balance). Called on every rank after each step."""
        return {}

    def collate(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        """Tensors for a micro-batch; each row is one example (or several, packed)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        raise NotImplementedError

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sums over an evaluation batch; the trainer adds them over batches and ranks."""
        out = self.loss(model, batch)
        sums = {"loss_sum": out.loss_sum.double(), "targets": out.num_targets.double()} | {
            k: v.double() for k, v in out.metrics.items()
        }
        if out.row_loss_sum is None:
            return sums
        assert out.num_rows is not None, "a row term needs num_rows"
        return (
            sums
            | {f"{ROW_SUM}loss_sum": out.row_loss_sum.double(), f"{ROW_SUM}rows": out.num_rows.double()}
            | {f"{ROW_SUM}{k}": v.double() for k, v in out.row_metrics.items()}
        )

    def eval_summary(self, sums: dict[str, float]) -> dict[str, float]:
        targets = max(sums.pop("targets"), 1.0)
        per_row = {name[len(ROW_SUM) :]: sums.pop(name) for name in [n for n in sums if n.startswith(ROW_SUM)]}
        rows = max(per_row.pop("rows", 1.0), 1.0)
        results = {"loss": sums.pop("loss_sum") / targets + per_row.pop("loss_sum", 0.0) / rows}
        per_target = {name: value / targets for name, value in sums.items()}
        return results | per_target | {name: value / rows for name, value in per_row.items()}

    def evaluate_generation(self, model, rows, device, max_new_tokens, lockstep=False) -> dict[str, float]:
        """Sums of generation metrics over `rows` (rows marked PADDING are not scored), with `count`."""
        return {}

    def generation_results(self, reduced: dict[str, float], count: float) -> dict[str, float]:
        """The logged results of evaluate_generation's sums (over all ranks) and count."""
        return {f"{name}_accuracy": value / max(count, 1.0) for name, value in reduced.items()} | {"generated": count}


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of each position's logits against its target (shifted_targets:
    the next token's label), in fp32, over the positions that have one."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def causal_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over labelled positions, in fp32, and their count."""
    targets = labels[:, 1:]
    return token_loss_sum(logits[:, :-1], targets), (targets != IGNORE).sum()


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row sum of the log-probabilities of the labelled next tokens (fp32)."""
    targets = labels[:, 1:]
    mask = targets != IGNORE
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


def text_prefix(tokenizer, policy: str = "auto") -> list[int]:
    """The ids accord puts in front of a text (data.add_bos): `auto` what the tokenizer's own
    policy puts there (`tokenizer(text)` minus `tokenizer(text, add_special_tokens=False)`:
    its post-processor or add_bos_token), `always` the BOS token, `never` nothing. So what a
    model trained on is what `tokenizer(prompt)` from its final/ folder gives."""
    if policy == "never":
        return []
    if policy == "always":
        if tokenizer.bos_token_id is None:
            raise DataError("data.add_bos=always but the tokenizer has no BOS token; use data.add_bos=auto or never")
        return [tokenizer.bos_token_id]
    return _around_text(tokenizer)[0]


def text_suffix(tokenizer) -> list[int]:
    """The ids `tokenizer(text)` puts after a text's own tokens (an encoder's [SEP]; for most
    decoders nothing)."""
    return _around_text(tokenizer)[1]


def _around_text(tokenizer) -> tuple[list[int], list[int]]:
    """(before, after): the special ids `tokenizer(text)` adds around `tokenizer(text,
    add_special_tokens=False)`."""
    probe = "0"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start]), list(full[start + len(plain) :])
    return [], []


def pad_rows(rows: list[list[int]], value: int) -> torch.Tensor:
    """Right-pad lists of ids to the longest."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out
