"""A transformers.Trainer `checkpoint-N/` folder as accord's starting point: its weights as
model.path, and `resume: PATH/checkpoint-N` continuing with its AdamW state, schedule and step
(against the real Trainer's own continuation), on one process or two; a broken folder is one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import (
    assert_ok,
    final_params,
    max_param_diff,
    run_accord,
    run_accord_here,
    save_tiny_byte_llama,
    step_losses,
    write_recipe,
)

STEPS, SAVED = 5, 3


def _stand_in(folder: Path) -> tuple[Path, Path]:
    """A tiny Llama folder (with accord's byte tokenizer saved in it) and prompt/completion rows."""
    model = save_tiny_byte_llama(folder / "model", max_positions=64)
    rng = random.Random(0)
    rows = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(48)]
    data = folder / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n" for a, b in rows))
    return model, data


def _recipe(folder: Path, model: Path, data: Path, **engine) -> dict:
    """Trainer's defaults spelled out (AdamW betas, eps, clipping at 1.0), file order on both sides."""
    return {
        "seed": 42,
        "model": {"path": str(model)},
        "task": "sft",
        "data": {
            "train": str(data),
            "shuffle": False,
            "packing": False,
            "max_length": 64,
            "cache_dir": str(folder / "cache"),
        },
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "optim": {
            "lr": 1e-3,
            "weight_decay": 0.01,
            "warmup_steps": 2,
            "schedule": "linear",
            "max_grad_norm": 1.0,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
        },
        "train": {"max_steps": STEPS, "log_every": 1},
        "engine": {"strategy": "ddp", "precision": "no", "processes": 1, "device": "cpu"} | engine,
        "output": {"dir": str(folder / "accord")},
    }


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """transformers.Trainer trains STEPS steps on accord's token rows in file order, saving at SAVED."""
    import datasets
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    from accord.api import load
    from accord.models.build import build_tokenizer
    from accord.run.inputs import build_inputs
    from accord.tasks import task_config

    folder = tmp_path_factory.mktemp("trainer")
    model_dir, data = _stand_in(folder)
    recipe = _recipe(folder, model_dir, data)
    inputs = build_inputs(task_config(load(recipe)), preparer=True)
    rows = [inputs.data.train[i] for i in range(len(inputs.data.train))]
    dataset = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    losses: dict[int, float] = {}

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    args = TrainingArguments(
        output_dir=str(folder / "trainer"),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        learning_rate=1e-3,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVED,
        seed=42,
        use_cpu=True,
        report_to="none",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
    )
    tokenizer = build_tokenizer(load(recipe).model)
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
        callbacks=[Keep()],
    )
    trainer.train()
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return folder, recipe, folder / "trainer" / f"checkpoint-{SAVED}", losses, params


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_from_a_trainer_checkpoint_continues_as_trainer_did(trainer_run):
    folder, recipe, checkpoint, losses, params = trainer_run
    path = write_recipe(folder / "one.yaml", recipe)
    proc = run_accord("train", path, f"resume={checkpoint}")
    assert_ok(proc)
    said = proc.stdout + proc.stderr
    assert f"resumed from the transformers.Trainer checkpoint {checkpoint.resolve()} at step {SAVED}" in said
    assert "not carried over: Trainer's data position" in said
    ours = step_losses(Path(recipe["output"]["dir"]))
    assert sorted(ours) == list(range(SAVED + 1, STEPS + 1))
    # the step after the checkpoint reads its weights; the one after that its AdamW moments and schedule too
    assert all(abs(ours[s] - losses[s]) <= 1e-5 for s in ours), (ours, losses)
    assert max_param_diff(final_params(Path(recipe["output"]["dir"])), params) <= 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_from_a_trainer_checkpoint_on_two_processes(trainer_run):
    """The full AdamW state read by 2 ranks as accord's own resume reads it across layouts."""
    folder, recipe, checkpoint, losses, params = trainer_run
    two = _recipe(folder, Path(recipe["model"]["path"]), Path(recipe["data"]["train"]), processes=2)
    two["output"]["dir"] = str(folder / "accord-2")
    proc = run_accord("train", write_recipe(folder / "two.yaml", two), f"resume={checkpoint}")
    assert_ok(proc)
    ours = step_losses(folder / "accord-2")
    assert all(abs(ours[s] - losses[s]) <= 1e-5 for s in ours), (ours, losses)
    assert max_param_diff(final_params(folder / "accord-2"), params) <= 1e-5


def test_a_trainer_checkpoint_with_missing_or_foreign_files_is_one_line(tmp_path):
    """Missing optimizer.pt; one that is not plain tensors; one of another model; LoRA adapters only.
    The folder's files are written by hand (no model is built): each is refused before any check."""
    import torch
    from safetensors.torch import save_file

    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n' * 8)
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    llama = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 262, **llama}))
    save_file({"model.embed_tokens.weight": torch.zeros(262, 32)}, checkpoint / "model.safetensors")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    (checkpoint / "scheduler.pt").write_bytes(b"")
    recipe = write_recipe(tmp_path / "r.yaml", _recipe(tmp_path, checkpoint, data))

    def refusal() -> str:
        proc = run_accord_here("train", recipe, f"resume={checkpoint}")
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        assert len(errors) == 1, proc.stderr
        return errors[0]

    assert f"resume: {checkpoint} is not a complete transformers.Trainer checkpoint: optimizer.pt missing" in refusal()
    (checkpoint / "optimizer.pt").write_bytes(b"not a pickle")
    assert "optimizer.pt cannot be read as plain tensors (torch.load weights_only=True)" in refusal()
    torch.save({"state": {}, "param_groups": [{"params": [0, 1]}]}, checkpoint / "optimizer.pt")
    assert "optimizer.pt holds 2 parameters in 1 group(s) but the model" in refusal()
    (checkpoint / "model.safetensors").write_bytes(b"")
    assert f"the weights in {checkpoint} cannot be read" in refusal()
    (checkpoint / "model.safetensors").rename(checkpoint / "adapter_model.safetensors")
    assert "holds LoRA adapters, not a whole model" in refusal()
    assert not (tmp_path / "accord").exists()
