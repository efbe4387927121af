"""The table's conversions: a job key's value (with the rest of the job) -> {recipe key: value}.

Each is named by a rule's `how` in mapping.py; one that cannot express the original raises
Refused with the nearest thing accord runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from accord.interop.job_keys import ImportError_, Job
from accord.interop.mapping import Refused
from accord.interop.mixture import handbook_mixture, test_split, trl_mixture


def _same(target: str):
    return lambda value, job: {target: value}


def _flag(target):
    return lambda value, job: {target: bool(value)}


def _precision(value, job):
    if job.value("fp16"):
        return {"engine.precision": "fp16"}
    # TRL's configs: bf16 None means true unless fp16; transformers' TrainingArguments: false.
    bf16 = job.value("bf16")
    return {"engine.precision": "bf16" if (bf16 is None or bf16) else "no"}


def _dtype(value, job):
    names = {"bfloat16": "bf16", "float16": "fp16", "float32": "no", "auto": None, None: None}
    if value not in names:
        raise Refused(f"dtype {value!r} is not a training precision", "bfloat16, float16 or float32")
    return {"engine.precision": names[value]} if names[value] and not job.given("bf16") else {}


def _batch(value, job):
    if job.world is None:
        raise ImportError_(
            "the global batch needs the device count the original ran on: give --devices N (per node) and --nodes M, "
            "or an accelerate config with num_processes"
        )
    micro = int(job.value("per_device_train_batch_size"))
    accum = int(job.value("gradient_accumulation_steps"))
    return {"batch.micro_batch_size": micro, "batch.global_batch_size": micro * accum * job.world}


def _schedule(value, job):
    value = str(value).removeprefix("SchedulerType.").lower()
    if value in ("linear", "cosine"):
        return {"optim.schedule": value}
    if value == "constant_with_warmup":
        return {"optim.schedule": "constant"}
    if value == "constant":  # transformers' constant ignores warm-up
        return {"optim.schedule": "constant", "optim.warmup_steps": 0}
    raise Refused(f"lr_scheduler_type {value!r} is not one of accord's schedules", "cosine (or linear, constant)")


def _optimizer(value, job):
    value = str(value).removeprefix("OptimizerNames.").lower()
    if value in ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"):
        return {}
    raise Refused(f"optim {value!r}: accord runs torch's AdamW", "adamw_torch")


def total_steps(job: Job) -> tuple[int, str]:
    """The original's optimizer steps, and how they were found (for warm-up ratios)."""
    if int(job.value("max_steps") or -1) > 0:
        return int(job.value("max_steps")), "max_steps"
    epochs = float(job.value("num_train_epochs"))
    data = job.value("dataset_name")
    batch = _batch(None, job)["batch.global_batch_size"]
    if data and Path(str(data)).is_file() and str(data).endswith(".jsonl") and not job.value("packing"):
        rows = sum(1 for line in Path(str(data)).read_text(encoding="utf-8").splitlines() if line.strip())
        steps = math.ceil(epochs * math.ceil(rows / batch))
        return steps, f"{epochs:g} epochs × ceil({rows} rows / {batch})"
    raise Refused(
        "a warm-up ratio with num_train_epochs needs the run's total steps, known only from the data's size",
        "give max_steps, or warmup_steps as a whole number",
    )


def _warmup(value, job):
    ratio = job.value("warmup_ratio") if job.given("warmup_ratio") else None
    steps = job.value("warmup_steps")
    if ratio is None and (steps is None or float(steps) >= 1 or float(steps) == 0):
        return {"optim.warmup_steps": int(steps or 0)}
    ratio = float(ratio if ratio is not None else steps)
    total, how = total_steps(job)
    return {"optim.warmup_steps": math.ceil(ratio * total), "_note": f"ceil({ratio:g} × {total} steps, {how})"}


def _max_steps(value, job):
    return {"train.max_steps": int(value)} if value is not None and int(value) > 0 else {}


def _epochs(value, job):
    return {} if int(job.value("max_steps") or -1) > 0 else {"train.epochs": float(value)}


def _eval_strategy(value, job):
    value = str(value).removeprefix("IntervalStrategy.").lower()
    if value == "no":
        return {}
    if value == "epoch":
        raise Refused("evaluating once per epoch is not supported", "eval_strategy: steps with eval_steps")
    steps = job.value("eval_steps") or job.value("logging_steps")
    return {"train.eval_every": _count(steps, job), "data.eval": _eval_sources(job)}


def _eval_sources(job):
    name = job.value("dataset_name")
    if job.value("datasets"):  # TRL's scripts evaluate on the mixture's test split (test_split_size)
        return None
    return [{"path": name, "split": job.value("dataset_test_split")}] if name else None


def _count(steps, job) -> int:
    """transformers' step counts below 1 are fractions of the total steps."""
    steps = float(steps)
    return int(steps) if steps >= 1 else math.ceil(steps * total_steps(job)[0])


def _eval_steps(value, job):
    return (
        {}
        if value is None
        else _eval_strategy(job.value("eval_strategy"), job)
        if job.value("eval_strategy")
        not in (
            None,
            "no",
        )
        else {}
    )


def _save_strategy(value, job):
    value = str(value).removeprefix("SaveStrategy.").lower()
    if value in ("no", "best"):
        return {}
    if value == "epoch":
        raise Refused("checkpoints once per epoch are not supported", "save_strategy: steps with save_steps")
    return {"checkpoint.every_steps": _count(job.value("save_steps"), job)}


def _log_every(value, job):
    return {"train.log_every": _count(value, job)}


def _max_length(value, job):
    return {"data.max_length": int(value)} if value else {}


def _truncation(value, job):
    names = {"keep_start": "truncate", "right": "truncate"}
    if value in names:
        return {"data.truncation": names[value]}
    raise Refused(f"truncation {value!r}: accord cuts the end of an example", "keep_start")


def _completion_only(value, job):
    if value is False:
        return {"data.completion_only_loss": False}
    return {}  # None / true: completion only for prompt/completion rows, as accord (see assistant_only_loss)


def _assistant_only(value, job):
    if value or job.value("completion_only_loss") is False:
        return {}
    if _data_kind(job) == "messages":
        return {"data.completion_only_loss": False}
    return {}


def _data_kind(job) -> str | None:
    """messages / prompt / text: the first row of a local JSONL dataset (None when it cannot be read)."""
    import json

    name = job.value("dataset_name")
    if not name or not Path(str(name)).is_file():
        return None
    with open(str(name), encoding="utf-8") as f:
        first = json.loads(next((line for line in f if line.strip()), "{}"))
    return next((k for k in ("messages", "prompt", "text") if k in first), None)


def _packing_strategy(value, job):
    if not job.value("packing"):
        return {}
    if value == "wrapped":
        raise Refused("packing_strategy wrapped cuts rows across documents", "bfd (accord's packing)")
    return {"data.packing": True}


def _lora(value, job):
    if not value:
        return {}
    out = {"lora.r": job.value("lora_r"), "lora.alpha": float(job.value("lora_alpha"))}
    out["lora.dropout"] = float(job.value("lora_dropout"))
    targets = job.value("lora_target_modules")
    if targets:
        out |= _lora_targets(targets, job)
    return out


def _lora_targets(value, job):
    if not job.value("use_peft") or value is None:
        return {}
    if value in ("all-linear", ["all-linear"]):
        return {"lora.target_modules": "all-linear"}
    return {"lora.target_modules": list(value) if isinstance(value, (list, tuple)) else [value]}


def lora_key(target):
    def convert(value, job):
        return {target: value} if job.value("use_peft") else {}

    return convert


def _dataset(value, job):
    if value and job.value("datasets"):
        return {"_note": "ignored: TRL's scripts load the `datasets` mixture when both are given"}
    return {"data.train": [{"path": value}]} if value else {}


def source_key(target):
    sub = target.rsplit(".", 1)[1]

    def convert(value, job):
        return {f"data.train.*.{sub}": value}

    return convert


def _mixer(value, job):
    return {"data.train": [{"path": name, "fraction": fraction} for name, fraction in dict(value).items()]}


def _splits(value, job):
    value = list(value)
    out = {"data.train.*.split": value[0]} if value and value[0] != "train" else {}
    return out


def _configs(value, job):
    return {"data.train.*.config": value[0]} if value else {}


def _text_field(value, job):
    return {"data.train.*.fields": {"text": value}} if value and value != "text" else {}


def _loss_type(value, job):
    if job.task == "sft" or job.task == "trainer":
        if value in ("nll", None):
            return {}
        raise Refused(f"SFT loss_type {value!r} is not supported", "nll")
    if job.task == "dpo":
        return {"dpo.loss_type": value} if value not in ("sigmoid", ["sigmoid"]) else {}
    if job.task == "kto":
        return {} if value == "kto" else {"kto.loss_type": value}
    if job.task == "grpo":
        raise Refused(f"GRPO loss_type {value!r}: accord runs GRPO's loss", "grpo")
    return {}


def _beta(value, job):
    section = {"dpo": "dpo", "kto": "kto", "grpo": "grpo"}.get(job.task)
    return {f"{section}.beta": float(value)} if section and value is not None else {}


def _reward_model(value, job):
    return {"grpo.rewards": [{"kind": "model", "path": value}]} if value else {}


def _reward_weights(value, job):
    if value is None:
        return {}
    raise Refused("reward_weights without TRL's reward functions", "weight on each grpo.rewards entry")


def _grad_norm(value, job):
    return {"optim.max_grad_norm": float(value) if value and float(value) > 0 else None}


def _average_tokens(value, job):
    if value is False:
        raise Refused("a per-device mean of the loss is not hardware-invariant", "true (accord's normalisation)")
    return {}


def _disable_dropout(value, job):
    return {"_note": "dropout off in TRL: zero the model config's dropout probabilities"} if value else {}


def _offload(value, job):
    return {"engine.activation_checkpointing": "offload"} if value else {}


def _deepspeed_file(value, job):
    return {} if not value else {}  # read as an input of its own (sources.read_deepspeed)


def _fsdp(value, job):
    if not value:
        return {}
    text = " ".join(value) if isinstance(value, list) else str(value)
    if "full_shard" not in text and "shard_grad_op" not in text:
        raise Refused(f"fsdp {text!r}", "full_shard auto_wrap")
    if "offload" in text:
        raise Refused("FSDP CPU offload", "engine.strategy=zero3 with engine.offload")
    return {"engine.strategy": "fsdp"}


def _fsdp_config(value, job):
    if not value:
        return {}
    out = {"engine.strategy": "fsdp"}
    if isinstance(value, dict) and (
        value.get("activation_checkpointing") or value.get("fsdp_activation_checkpointing")
    ):
        out["engine.activation_checkpointing"] = True
    return out


def _use_cpu(value, job):
    return {"engine.device": "cpu"} if value else {}


def _flash(value, job):
    return {"model.attn_implementation": "flash_attention_2"} if value else {}


def _revision(value, job):
    return {"model.revision": value} if value not in (None, "main") else {}


def _eval_split(value, job):
    return {}  # read with eval_strategy (it names the split the evaluation loads)


def _resume(value, job):
    """Trainer's resume_from_checkpoint: a checkpoint-N path, or true for the newest in output_dir."""
    if value in (None, False, "", "false", "False"):
        return {}
    if value is True or str(value).lower() == "true":
        out = Path(str(job.value("output_dir") or "."))
        found = sorted(
            out.glob("checkpoint-*"),
            key=lambda p: int(p.name.rsplit("-", 1)[1]) if p.name.rsplit("-", 1)[1].isdigit() else -1,
        )
        if not found:
            raise Refused(
                f"resume_from_checkpoint: true, but {out} holds no checkpoint-N folder",
                "the checkpoint-N folder's path",
            )
        return {"resume": str(found[-1])}
    return {"resume": str(value)}


# accelerate config conversions
def _devices(value, job):
    return {}


def _mixed_precision(value, job):
    value = str(value).lower()
    if value not in ("no", "bf16", "fp16"):
        raise Refused(f"mixed_precision {value!r}", "bf16")
    return {"engine.precision": value}


def _distributed_type(value, job):
    value = str(value).upper().removeprefix("DISTRIBUTEDTYPE.")
    if value in ("NO", "MULTI_GPU"):
        return {"engine.strategy": "ddp"}
    if value == "FSDP":
        return {"engine.strategy": "fsdp"}
    if value == "DEEPSPEED":
        return {}  # deepspeed_config says which stage
    raise Refused(f"distributed_type {value}", "MULTI_GPU, FSDP or DEEPSPEED")


def _accelerate_deepspeed(value, job):
    value = dict(value or {})
    stage = value.get("zero_stage")
    out: dict[str, Any] = {}
    if stage is not None:
        if int(stage) == 0:
            out["engine.strategy"] = "ddp"
        else:
            out["engine.strategy"] = f"zero{int(stage)}"
    if str(value.get("offload_param_device", "none")).lower() not in ("none", ""):
        out["engine.offload"] = "optimizer+params"
    elif str(value.get("offload_optimizer_device", "none")).lower() not in ("none", ""):
        out["engine.offload"] = "optimizer"
    return out


CONVERSIONS = {
    "": None,
    "dtype": _dtype,
    "bf16": _precision,
    "fp16": _precision,
    "flag": None,
    "batch": _batch,
    "schedule": _schedule,
    "optimizer": _optimizer,
    "warmup": _warmup,
    "max_steps": _max_steps,
    "epochs": _epochs,
    "eval_strategy": _eval_strategy,
    "eval_steps": _eval_steps,
    "save_strategy": _save_strategy,
    "save_steps": lambda value, job: _save_strategy(job.value("save_strategy"), job),
    "log_every": _log_every,
    "max_length": _max_length,
    "truncation": _truncation,
    "completion_only_loss": _completion_only,
    "assistant_only_loss": _assistant_only,
    "packing_strategy": _packing_strategy,
    "lora": _lora,
    "lora_targets": _lora_targets,
    "dataset": _dataset,
    "source_key": None,
    "mixture": trl_mixture,
    "handbook_mixture": handbook_mixture,
    "test_split": test_split,
    "mixer": _mixer,
    "splits": _splits,
    "configs": _configs,
    "text_field": _text_field,
    "loss_type": _loss_type,
    "beta": _beta,
    "beta1": lambda value, job: {"optim.betas": [float(value), float(job.value("adam_beta2"))]},
    "beta2": lambda value, job: {"optim.betas": [float(job.value("adam_beta1")), float(value)]},
    "reward_model": _reward_model,
    "reward_weights": _reward_weights,
    "grad_norm": _grad_norm,
    "average_tokens": _average_tokens,
    "disable_dropout": _disable_dropout,
    "offload": _offload,
    "deepspeed_file": _deepspeed_file,
    "fsdp": _fsdp,
    "fsdp_config": _fsdp_config,
    "use_cpu": _use_cpu,
    "flash_attention": _flash,
    "revision": _revision,
    "eval_split": _eval_split,
    "resume_from_checkpoint": _resume,
    "devices": _devices,
    "nodes": _devices,
    "mixed_precision": _mixed_precision,
    "distributed_type": _distributed_type,
    "accelerate_deepspeed": _accelerate_deepspeed,
}
