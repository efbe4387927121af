"""Knowledge distillation (GKD, TRL's GKDTrainer): the student learns a frozen teacher's next-token
distributions through the generalized Jensen-Shannon divergence (accord.tasks.distill_loss), summed
over completion tokens; the trainer divides by the completion tokens of the whole global batch.

Rows are sft's (prompt/completion, or chat `messages` with the assistant turns as targets). Each
optimizer step takes its completions from one source, chosen once per step from (seed, step), so
the choice does not depend on how many processes draw it: with probability distill.lmbda the
student's own samples (on-policy), else the teacher's samples (distill.seq_kd) or the data's. A
sampled completion follows the row's prompt (everything before its last answer); it is drawn with
grpo's per-sample seeds (accord.tasks.rollout), keyed by (seed, step, row), so it is the same on
any layout. TRL flips its coin per micro-batch and rank; here one flip serves the global batch.

Off-policy only (lmbda 0, no seq_kd) the rows are batched like sft's and the normaliser comes from
the data plan; otherwise the task is online: the step's completions are made first
(run/rollout_step.py) and one reduction gives the normaliser.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from accord.errors import UserInputError
from accord.recipe.distill import DistillConfig
from accord.recipe.schema import ModelConfig
from accord.tasks.base import IGNORE, FrozenModel, LossOutput, Task
from accord.tasks.chunked_divergence import divergence_at, entropy, logits_at
from accord.tasks.chunked_loss import HeadCall, chunk_tokens, chunking_blocker, plain_loss_note, shifted_targets
from accord.tasks.distill_loss import generalized_jsd
from accord.tasks.reference_model import ReferenceModel
from accord.tasks.rollout import padded_width, sample_groups, sample_seed
from accord.tasks.rollout_groups import RolloutSummary
from accord.tasks.sft import SFTTask

# Where a step's completions come from.
DATA, STUDENT, TEACHER = "data", "student", "teacher"
# Mixed into the coin's seed so it draws apart from every other use of (seed, step).
_COIN = 0x6B64


def completion_source(seed: int, step: int, lmbda: float, seq_kd: bool) -> str:
    """Whose completions optimizer step `step` (0-based) trains on: a function of the recipe and
    the step alone, the same on every rank and world size."""
    if lmbda > 0 and np.random.default_rng([seed, step, _COIN]).random() < lmbda:
        return STUDENT
    return TEACHER if seq_kd else DATA


def prompt_ids(ids: list[int], labels: list[int]) -> list[int]:
    """The tokens before a row's last answer (its last run of labelled tokens): the prompt a
    sampled completion follows. Earlier assistant turns of a conversation stay in it, as the
    prompt of TRL's chat collator is every message but the last."""
    end = len(labels)
    while end > 0 and labels[end - 1] == IGNORE:
        end -= 1
    while end > 0 and labels[end - 1] != IGNORE:
        end -= 1
    return list(ids[:end]) if end else list(ids)


def vocab_size(config) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)


class DistillTask(SFTTask):
    name = "distill"
    # One example a row (a sampled completion replaces the row's answer), the teacher beside the
    # student on whole rows: not packed, not split over a sequence-parallel group.
    packable = False
    splits_rows = False
    chunked_loss = True  # the student's logits chunk by chunk (accord.tasks.chunked_divergence)
    eval_hidden = ("entropy", "generated")
    sections = ("distill",)

    @classmethod
    def frozen_model(cls, config) -> FrozenModel | None:
        cfg = config.section("distill")
        return FrozenModel(cfg.teacher, cfg.teacher_revision, keeps_logits=True, key="distill.teacher")

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.cfg = config.section("distill")
        self.completion_only = True  # the recipe refuses data.completion_only_loss=false
        self.online = self.cfg.lmbda > 0 or self.cfg.seq_kd
        self.teacher = ReferenceModel(
            config, tokenizer, self.model_kind, self.cfg.teacher, revision=self.cfg.teacher_revision
        )
        trust_remote_code = config.model.trust_remote_code
        self.teacher_vocab = _teacher_vocab(self.cfg, trust_remote_code)
        _check_tokenizers(self.cfg, trust_remote_code, tokenizer)
        student = _student_vocab(config.model, tokenizer)
        if student is not None:
            _check_vocab(student, self.teacher_vocab, self.cfg)
        self.policy: nn.Module | None = None
        self.lockstep = False
        # The output layers' second mode (train.loss_chunk_size), when both models can take it.
        self.heads: tuple[HeadCall, HeadCall] | None = None
        self.plain_divergence_reason: str | None = None
        self._sequences: dict[int, dict[str, list[int]]] = {}  # this step's rows: prompt + completion

    # ---------------------------------------------------------------- the teacher

    def configure_model(self, model: nn.Module) -> None:
        # Not sft's: its packed attention and chunked cross-entropy serve no distillation loss.
        # A GGUF student's vocabulary is known once converted: checked here, before any step.
        _check_vocab(vocab_size(model.config), self.teacher_vocab, self.cfg)
        self.teacher.configure_model(model)
        teacher = self.teacher.module
        assert teacher is not None
        self.plain_divergence_reason = chunking_blocker(model, self.config) or chunking_blocker(teacher, self.config)
        if self.plain_divergence_reason is None:
            self.heads = (HeadCall.install(model), HeadCall.install(teacher))

    def setup(self, engine, train, eval_ds):
        self.teacher.setup(engine)
        self.policy = engine.module
        self.lockstep = engine.lockstep
        return train, eval_ds

    def describe(self) -> list[str]:
        c = self.cfg
        if c.lmbda == 0 and not c.seq_kd:
            source = "the data's completions (off-policy)"
        else:
            rest = "the teacher's samples" if c.seq_kd else "the data's completions"
            source = f"the student's samples on {c.lmbda:.0%} of steps, else {rest}, up to {c.max_new_tokens} tokens"
        return (
            super().describe()
            + [
                f"distill: teacher {c.teacher} (vocabulary {self.teacher_vocab}); generalized JSD beta {c.beta:g}, "
                f"temperature {c.temperature:g}; trains on {source}"
            ]
            + plain_loss_note(self.plain_divergence_reason)
        )

    # ---------------------------------------------------------------- the loss

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        targets = shifted_targets(batch["labels"])
        mask = targets != IGNORE
        teacher = self.teacher.module
        assert teacher is not None, "configure_model() first"
        cfg = self.cfg
        chunk = chunk_tokens(self.config.loss_chunk_size, targets.numel(), self.teacher_vocab)
        # The teacher's pass first: a frozen forward before the training one, not between it and
        # its backward (sharded strategies track the forward's order).
        if self.heads is not None and chunk:
            positions = mask.reshape(-1).nonzero().squeeze(1)
            student_head, teacher_head = self.heads
            with torch.no_grad():
                teacher_logits = teacher_head.run(teacher, inputs, logits_at(positions), what="divergence")
            served = student_head.run(
                model,
                inputs,
                divergence_at(positions, teacher_logits, cfg.beta, cfg.temperature, chunk),
                what="divergence",
            )
            return LossOutput(served[:, 0].sum(), mask.sum(), {"entropy": served[:, 1].sum()})
        with torch.no_grad():
            teacher_logits = teacher(**inputs).logits[mask]
        student_logits = model(**inputs).logits[mask]
        divergence = generalized_jsd(student_logits, teacher_logits, cfg.beta, cfg.temperature)
        metrics = {"entropy": entropy(student_logits.detach(), cfg.temperature).sum()}
        return LossOutput(divergence.sum(), mask.sum(), metrics)

    def eval_summary(self, sums: dict[str, float]) -> dict[str, float]:
        return Task.eval_summary(self, sums)  # a divergence has no perplexity

    # ---------------------------------------------------------------- online steps (lmbda > 0 or seq_kd)

    def rollout(self, step: int, row_ids: list[int], rows: list[dict]) -> RolloutSummary:
        """This rank's rows of `step`'s global batch with the step's completions. Every rank
        calls it with the same number of rows and makes the same number of forward passes."""
        start = time.perf_counter()
        source = completion_source(self.config.seed, step, self.cfg.lmbda, self.cfg.seq_kd)
        if source == DATA:
            sequences = [{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in rows]
        else:
            sequences = self._sampled(source, step, row_ids, rows)
        self._sequences = dict(zip(row_ids, sequences))
        targets = sum(sum(label != IGNORE for label in s["labels"][1:]) for s in sequences)
        lengths = [sum(label != IGNORE for label in s["labels"]) for s in sequences]
        clipped = [n >= self.cfg.max_new_tokens and s["labels"][-1] != self.eos_id for n, s in zip(lengths, sequences)]
        sums = {
            "completions/mean_length": float(sum(lengths)),
            "completions/clipped_ratio": float(sum(clipped)) if source != DATA else 0.0,
            "on_policy": float(len(rows)) if source == STUDENT else 0.0,
            "teacher_sampled": float(len(rows)) if source == TEACHER else 0.0,
        }
        tokens = sum(len(s["input_ids"]) for s in sequences)
        return RolloutSummary(targets, tokens, len(rows), sums, time.perf_counter() - start)

    def _sampled(self, source: str, step: int, row_ids: list[int], rows: list[dict]) -> list[dict[str, list[int]]]:
        keep = self.max_length - self.cfg.max_new_tokens
        prompts = []
        for row in rows:
            prompt = prompt_ids(row["input_ids"], row["labels"])
            if len(prompt) > keep:  # an over-long prompt keeps its start (the BOS) and its end
                head = len(self.prefix)
                prompt = prompt[:head] + prompt[len(prompt) - (keep - head) :]
            prompts.append(prompt)
        model = self.policy if source == STUDENT else self.teacher.module
        assert model is not None, "setup() first"
        seeds = [[sample_seed(self.config.seed, step, int(rid), 0)] for rid in row_ids]
        # Prompts of one padded width share a call; under lockstep each has its own (every rank
        # holds the same number of rows, so every rank calls generate equally often).
        calls: dict[Any, list[int]] = {}
        for i, prompt in enumerate(prompts):
            calls.setdefault(i if self.lockstep else padded_width(len(prompt)), []).append(i)
        completions: dict[int, list[int]] = {}
        was_training = model.training
        model.eval()
        try:
            for call in calls.values():
                groups = sample_groups(
                    model,
                    [prompts[i] for i in call],
                    [seeds[i] for i in call],
                    max_new_tokens=self.cfg.max_new_tokens,
                    temperature=self.cfg.temperature,
                    top_p=1.0,
                    eos_id=self.eos_id,
                    pad_id=self.pad_id,
                    lockstep=self.lockstep,
                )
                completions.update((i, group[0]) for i, group in zip(call, groups))
        finally:
            model.train(was_training)
        out = []
        for i, prompt in enumerate(prompts):
            completion = completions[i]
            out.append({"input_ids": prompt + completion, "labels": [IGNORE] * len(prompt) + completion})
        return out

    def rollout_metric_names(self) -> list[str]:
        return ["completions/mean_length", "completions/clipped_ratio", "on_policy", "teacher_sampled"]

    def rollout_means(self, means: dict[str, float], completions: float) -> dict[str, float]:
        return means

    def rollout_batch(self, row_ids) -> dict[str, torch.Tensor]:
        return self.collate([[self._sequences[int(r)]] for r in row_ids])


def _teacher_vocab(cfg: DistillConfig, trust_remote_code: bool) -> int:
    """The teacher's vocabulary size, from its config alone; a missing teacher is one line."""
    from transformers import AutoConfig

    from accord.recipe.hub import local_path

    folder = local_path(cfg.teacher, cfg.teacher_revision, where="distill.teacher")
    if not (folder / "config.json").is_file():
        what = "folder not found" if not folder.exists() else "no config.json in it (expected a save_pretrained folder)"
        if folder.name == "final" and not folder.exists():
            # A run's final model (recipes/distill.yaml's teacher is addition-sft's).
            what += f" (the final model of an accord run: train the recipe whose output.dir is {folder.parent} first)"
        raise UserInputError(f"distill.teacher: {folder}: {what}; give the teacher's model folder or hub name")
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())[:300]
        raise UserInputError(f"distill.teacher: {folder}/config.json cannot be loaded: {reason}") from None
    size = vocab_size(config)
    if size is None:
        raise UserInputError(f"distill.teacher: {folder}/config.json names no vocab_size; it must be a language model")
    return size


# A teacher folder with these files has its own tokenizer, compared with the student's.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _check_tokenizers(cfg: DistillConfig, trust_remote_code: bool, tokenizer) -> None:
    """Where the teacher ships a tokenizer, it must map every token to the student's id: the
    divergence compares the two distributions id by id (equal vocabulary sizes are not enough)."""
    from transformers import AutoTokenizer

    from accord.recipe.hub import local_path

    folder = local_path(cfg.teacher, cfg.teacher_revision, where="distill.teacher")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return
    try:
        theirs = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code).get_vocab()
    except (OSError, ValueError, TypeError):
        return  # a folder whose tokenizer transformers cannot read: the vocabulary sizes were compared
    ours = tokenizer.get_vocab()
    differ = sorted({token for token in ours.keys() | theirs.keys() if ours.get(token) != theirs.get(token)})
    if differ:
        token = differ[0]
        raise UserInputError(
            f"distill.teacher: the teacher's tokenizer differs from the student's on {len(differ)} token(s) (first: "
            f"{token!r} is id {theirs.get(token)} for the teacher, {ours.get(token)} for the student); the divergence "
            f"compares the two distributions id by id, so give a teacher with the student's tokenizer"
        )


def _student_vocab(model: ModelConfig, tokenizer) -> int | None:
    """The student's vocabulary size before it is built (None: a GGUF file, known once converted)."""
    if model.path is None:
        return int((model.config or {}).get("vocab_size", len(tokenizer)))
    from accord.recipe.hub import local_path

    folder = local_path(model.path, model.revision, where="model.path")
    if folder.suffix == ".gguf" or not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return vocab_size(AutoConfig.from_pretrained(folder, trust_remote_code=model.trust_remote_code))


def _check_vocab(student: int | None, teacher: int, cfg: DistillConfig) -> None:
    if student is not None and student != teacher:
        raise UserInputError(
            f"distill.teacher: the teacher's vocabulary has {teacher} tokens and the student's {student}; the "
            f"divergence compares their distributions token by token, so give a teacher with the student's "
            f"tokenizer (distill.teacher={cfg.teacher})"
        )
