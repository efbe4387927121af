"""The peers' contenders of long_context.py (`longest`): transformers.Trainer and TRL's
SFTTrainer, each with its documented long-row options, training one row for two steps; and
the peers' long-row options this machine cannot run. Each runner is given the model's
config (long_context.llama_config), the row's token ids and a work folder, and returns the
last step's seconds and the loss, as long_context.py's own accord contender does.
"""

from __future__ import annotations

import time
from pathlib import Path

PEER_NAMES = {
    "trainer": "transformers.Trainer, gradient checkpointing",
    "trl": "TRL SFTTrainer, gradient checkpointing, fused LM head",
}


class _StepTimer:
    """A transformers TrainerCallback (built lazily: transformers is imported in the child only)."""

    @staticmethod
    def make(times: list[float]):
        from transformers import TrainerCallback

        class Timer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                times.append(time.perf_counter() - self.start)

        return Timer()


def _hf_model(config: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {k: v for k, v in config.items() if k != "architecture"}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa", tie_word_embeddings=False))


def _rows(row: list[int], steps: int):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [row] * steps})


def _same_training(work: Path, steps: int) -> dict:
    """What both peers train with: one row a step, gradient checkpointing, nothing saved or logged."""
    return {
        "output_dir": str(work),
        "per_device_train_batch_size": 1,
        "max_steps": steps,
        "learning_rate": 1e-4,
        "gradient_checkpointing": True,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def run_trainer(config: dict, row: list[int], work: Path, steps: int = 2) -> dict:
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(**_same_training(work, steps))
    data = _rows(row, steps).map(lambda example: {"labels": example["input_ids"]})
    times: list[float] = []
    trainer = Trainer(
        model=_hf_model(config),
        args=args,
        train_dataset=data,
        data_collator=default_data_collator,
        callbacks=[_StepTimer.make(times)],
    )
    result = trainer.train()
    return {"step_s": times[-1], "loss": result.training_loss}


def run_trl(config: dict, row: list[int], work: Path, steps: int = 2) -> dict:
    import torch
    from trl import SFTConfig, SFTTrainer

    from accord.models.build import build_byte_tokenizer

    # TRL's activation offloading asks torch for the current accelerator: there is none on a CPU machine.
    offload = getattr(torch, "accelerator", None) is not None and torch.accelerator.current_accelerator() is not None
    args = SFTConfig(
        **_same_training(work, steps),
        activation_offloading=offload,
        bf16=False,
        max_length=len(row),
        packing=False,
        dataset_num_proc=None,
    )
    times: list[float] = []
    trainer = SFTTrainer(
        model=_hf_model(config),
        args=args,
        train_dataset=_rows(row, steps),
        processing_class=build_byte_tokenizer(),
        callbacks=[_StepTimer.make(times)],
    )
    result = trainer.train()
    return {"step_s": times[-1], "loss": result.training_loss, "activation_offloading": offload}


def unavailable_peers() -> list[tuple[str, str]]:
    """The peers' documented long-row options this machine cannot run, each with why."""
    import importlib.util

    import torch

    out = []
    if not torch.cuda.is_available():
        out.append(("TRL SFTTrainer, activation_offloading=True", "offloading needs an accelerator (CPU only here)"))
    if not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None:
        why = "Liger's kernels are Triton, with no CPU backend" if not torch.cuda.is_available() else "not installed"
        out += [(f"{peer}, use_liger_kernel=True", why) for peer in ("transformers.Trainer", "TRL SFTTrainer")]
    return out
