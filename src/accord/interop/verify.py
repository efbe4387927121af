"""`accord import ... --verify N`: the original's own trainer (TRL's SFTTrainer / DPOTrainer, or
transformers.Trainer) and accord train the same job side by side for N steps, in this process,
at fp32, and each step's loss is compared.

Both start from the same model folder and tokenizer. The rows are the same and in the same
order: accord's global order (data/order.py) picks the examples of each step, and the peer
is handed exactly those examples, in that order, with its sequential sampler (a public
TrainingArguments setting), so no sampler of either side is re-implemented. TRL tokenizes the
raw rows itself, so a tokenization that differs shows up as a loss that differs; a plain
Trainer job tokenizes in the user's own script, so it is given accord's token rows. Both runs
stop after N steps with a schedule planned for N steps (the same on both sides).

What cannot match is said before the runs, with the keys that make the two agree: packing
(accord packs with its own best fit over the global order; the comparison runs with packing off
on both sides), length-grouped batches, dropout in the model's config."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accord.interop.job_keys import ImportError_, Job
from accord.interop.known import CONFIG_CLASSES
from accord.interop.mapping import ALIASES

TOLERANCE = 1e-5
PEERS = {"sft": "trl.SFTTrainer", "dpo": "trl.DPOTrainer", "trainer": "transformers.Trainer"}

# The original's keys the side-by-side run does not take from it: where it wrote, logged,
# evaluated and how it was launched (no effect on the updates), and what the comparison fixes
# itself (precision, steps, batch split over one process, order, warm-up in whole steps).
_NOT_CARRIED = {
    "output_dir",
    "logging_dir",
    "report_to",
    "run_name",
    "push_to_hub",
    "hub_model_id",
    "hub_strategy",
    "hub_token",
    "hub_private_repo",
    "resume_from_checkpoint",
    "deepspeed",
    "fsdp",
    "fsdp_config",
    "accelerator_config",
    "parallelism_config",
    "eval_strategy",
    "eval_steps",
    "do_eval",
    "save_strategy",
    "save_steps",
    "load_best_model_at_end",
    "bf16",
    "fp16",
    "tf32",
    "dtype",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "activation_checkpointing",
    "torch_compile",
    "use_cpu",
    "warmup_ratio",
    "num_train_epochs",
    "dataloader_num_workers",
    "dataset_num_proc",
    "model_init_kwargs",
    "use_liger_kernel",
}


@dataclass
class Verification:
    peer: str
    steps: list[tuple[int, float, float]]  # (step, accord's loss, the peer's loss)
    max_param_diff: float
    causes: list[str] = field(default_factory=list)  # what differs by construction, and the keys that align it

    @property
    def largest_loss_diff(self) -> float:
        return max((abs(a - b) for _, a, b in self.steps), default=math.inf)

    @property
    def matches(self) -> bool:
        return len(self.steps) > 0 and self.largest_loss_diff <= TOLERANCE

    def table(self) -> str:
        lines = [f"{'step':>4}  {'accord loss':>14}  {self.peer + ' loss':>24}  {'|difference|':>12}"]
        for step, ours, theirs in self.steps:
            lines.append(f"{step:>4}  {ours:>14.8f}  {theirs:>24.8f}  {abs(ours - theirs):>12.3e}")
        lines.append(f"largest parameter difference after {len(self.steps)} steps: {self.max_param_diff:.3e}")
        verdict = "the same job" if self.matches else "NOT the same job"
        lines.append(
            f"verify: {verdict}: largest loss difference {self.largest_loss_diff:.3e} (tolerance {TOLERANCE:g})"
        )
        lines += [f"verify: {cause}" for cause in self.causes]
        return "\n".join(lines)


def verify(job: Job, recipe: dict[str, Any], steps: int, workdir: Path) -> Verification:
    """Train `recipe` (the import of `job`) and the original's trainer for `steps` steps, side by side."""
    check_verifiable(job, steps)
    recipe, causes = comparable(recipe, workdir, steps)
    from accord.recipe.schema import validate_recipe

    validated = validate_recipe(recipe, source="imported recipe (verify)")
    causes += _dropout(validated)
    examples = _step_examples(validated, steps)
    # The peer first: accord's run leaves a process group's environment behind, which
    # accelerate (under the peer's Trainer) would take as a launcher's.
    theirs, params = _train_peer(job, validated, examples, workdir / "peer")
    ours = _train_accord(validated)
    final = _read_folder(Path(validated.output.dir) / "final")
    diff = max(((final[k] - params[k]).abs().max().item() for k in final if k in params), default=math.inf)
    rows = [(s, ours[s], theirs[s]) for s in sorted(ours) if s in theirs]
    result = Verification(PEERS[job.task], rows, diff, causes)
    if not result.matches:
        result.causes.append(_first_difference(job, validated, examples))
    return result


def check_verifiable(job: Job, steps: int) -> None:
    """Refused before the import does any work: a step count below 1, a task without a peer, a
    LoRA job, a peer library that is not installed."""
    if steps < 1:
        raise ImportError_(f"--verify {steps}: give the number of steps to compare (1 or more)")
    if job.task not in PEERS:
        raise ImportError_(
            f"--verify compares {', '.join(PEERS)} jobs with their own trainer, not a {job.task} job; "
            "import without --verify"
        )
    if job.value("use_peft"):
        raise ImportError_(
            "--verify compares full fine-tunes (the peer would need its own peft setup): import once without "
            "--use_peft and verify that, then import with it"
        )
    peer = PEERS[job.task].split(".")[0]
    if importlib.util.find_spec(peer) is None:
        raise ImportError_(f"--verify runs {PEERS[job.task]}, and {peer} is not installed: pip install {peer}")


def comparable(recipe: dict[str, Any], workdir: Path, steps: int) -> tuple[dict[str, Any], list[str]]:
    """The imported recipe set up for the comparison, and what had to change for the two to be
    comparable at all (each with the keys that make the real runs agree)."""
    recipe = copy.deepcopy(recipe)
    causes = []
    data = recipe.setdefault("data", {})
    if data.pop("packing", None) is not False:  # accord packs by default; TRL's trainers here do not
        causes.append(
            "packing: accord packs rows (data.packing, on by default) by its own best fit over the global order; "
            "TRL packs in dataset order, and Trainer takes the rows it is given: compared with packing off on both "
            "sides (data.packing=false; TRL's packing: false)"
        )
    data["packing"] = False
    if data.get("group_by_length"):
        data["group_by_length"] = False
        causes.append(
            "group_by_length: the two group rows by length differently; compared without it "
            "(data.group_by_length=false, train_sampling_strategy: sequential)"
        )
    # No evaluation (it changes no update); a held-out share of the training data stays, so the
    # rows trained on are the job's.
    data.pop("eval", None)
    recipe["train"] = {**recipe.get("train", {}), "max_steps": steps, "log_every": 1, "eval_every": None}
    recipe["train"].pop("epochs", None)
    recipe["engine"] = {
        **recipe.get("engine", {}),
        "precision": "no",
        "processes": 1,
        "device": "cpu",
        "strategy": "ddp",
        "activation_checkpointing": False,
    }
    recipe["checkpoint"] = {"every_steps": None}
    recipe["output"] = {"dir": str(workdir / "accord"), "overwrite": True}
    recipe["resume"] = "never"
    return recipe, causes


def _dropout(recipe) -> list[str]:
    from transformers import AutoConfig

    from accord.models.build import model_folder

    folder = model_folder(recipe.model)
    if folder is None:
        return []
    config = AutoConfig.from_pretrained(folder).to_dict()
    on = {k: v for k, v in config.items() if "dropout" in k and isinstance(v, (int, float)) and v > 0}
    if not on:
        return []
    return [
        f"the model's config has dropout on ({', '.join(f'{k}={v}' for k, v in on.items())}): each side draws its "
        "own masks, so the losses cannot agree; set them to 0 in the model folder's config.json for the comparison "
        "(TRL's disable_dropout: true does it for DPO)"
    ]


def _step_examples(recipe, steps: int) -> list[int]:
    """The examples accord's steps 0..steps-1 train on, in order (by index into its prepared rows)."""
    from accord.data.order import GlobalOrder
    from accord.run.inputs import build_inputs
    from accord.tasks import task_config

    inputs = build_inputs(task_config(recipe), preparer=True)
    rows = inputs.rows
    order = GlobalOrder(len(rows), recipe.batch.global_batch_size, recipe.seed, recipe.data.shuffle)
    return [int(i) for step in range(steps) for i in order.batch(step)]


def _read_folder(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _train_accord(recipe) -> dict[int, float]:
    import os

    from accord.launch.start import start
    from accord.observe.metrics import read_metrics

    environment = dict(os.environ)
    try:
        ended = start(recipe)
    finally:  # the worker's rank variables would make a later Trainer in this process think it was launched
        os.environ.clear()
        os.environ.update(environment)
    if ended.status != "completed":
        raise ImportError_(f"--verify: accord's run ended {ended.status}: {ended.message}")
    return {r["step"]: float(r["loss"]) for r in read_metrics(recipe.output.dir) if r["kind"] == "train"}


def peer_arguments(job: Job, recipe, out: Path):
    """The original's config class with the original's keys, fixed for a 1-process fp32 run of
    recipe.train.max_steps steps in the given order."""
    module, name = CONFIG_CLASSES[job.task]
    cls = getattr(importlib.import_module(module), name)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, entry in job.entries.items():
        key = ALIASES.get(key, key)
        if key in names and key not in _NOT_CARRIED:
            values[key] = entry.value
    batch = recipe.batch
    micro = batch.micro_batch_size or batch.global_batch_size
    values |= {
        "output_dir": str(out),
        "max_steps": recipe.train.max_steps,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": batch.global_batch_size // micro,
        "warmup_steps": recipe.optim.warmup_steps,
        "seed": recipe.seed,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "train_sampling_strategy": "sequential",
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    # Recomputing activations changes no value; off for speed (under its current name where there is one).
    values["activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"] = False
    if "packing" in names:
        values["packing"] = False
    if "dataset_num_proc" in names:
        values["dataset_num_proc"] = None
    return cls(**{k: v for k, v in values.items() if k in names})


def _peer_rows(job: Job, recipe, examples: list[int], tokenizer):
    """The peer's training set: exactly the examples of accord's steps, in accord's order."""
    import datasets

    from accord.data.split import load_split
    from accord.data.streams import is_stream
    from accord.tasks import build_task, task_config

    if job.task == "trainer":  # the user's script tokenized: the Trainer gets accord's token rows
        from accord.run.inputs import build_inputs

        train = build_inputs(task_config(recipe), preparer=True).data.train
        rows = [train[i] for i in examples]
        return datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    task = build_task(task_config(recipe), tokenizer)
    raw, _ = task.fit(*load_split(recipe.data, recipe.seed, task.text_fields))
    if is_stream(raw):
        raise ImportError_("--verify reads the training data as a dataset: turn data.*.streaming off for it")
    keep = [c for c in raw.column_names if not c.startswith("_")]
    return raw.select_columns(keep).select(examples)


def _loss_keeper(store: dict[int, float]):
    """A TrainerCallback keeping each step's logged loss (transformers is imported only here)."""
    from transformers import TrainerCallback

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                store[state.global_step] = float(logs["loss"])

    return Keep()


def _train_peer(job: Job, recipe, examples: list[int], out: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from accord.models.build import build_tokenizer, model_folder

    tokenizer = build_tokenizer(recipe.model)
    model = AutoModelForCausalLM.from_pretrained(model_folder(recipe.model), dtype=torch.float32)
    args = peer_arguments(job, recipe, out)
    rows = _peer_rows(job, recipe, examples, tokenizer)
    losses: dict[int, float] = {}
    callbacks = [_loss_keeper(losses)]
    if job.task == "sft":
        from trl import SFTTrainer

        trainer = SFTTrainer(
            model=model, args=args, train_dataset=rows, processing_class=tokenizer, callbacks=callbacks
        )
    elif job.task == "dpo":
        from trl import DPOTrainer

        trainer = DPOTrainer(
            model=model, args=args, train_dataset=rows, processing_class=tokenizer, callbacks=callbacks
        )
    else:
        from transformers import DataCollatorForSeq2Seq, Trainer

        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=rows,
            data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
            callbacks=callbacks,
        )
    trainer.train()
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return losses, params


def _first_difference(job: Job, recipe, examples: list[int]) -> str:
    """Why the losses part: the first example whose tokens or targets differ, or the settings to check."""
    if job.task != "sft":
        return (
            "the rows agree in order; check the tokens (BOS/EOS of prompt and answers), the loss type and beta, "
            "and TRL's max_prompt_length / max_length against data.max_length"
        )
    from trl import SFTTrainer

    from accord.models.build import build_tokenizer
    from accord.run.inputs import build_inputs
    from accord.tasks import task_config

    tokenizer = build_tokenizer(recipe.model)
    ours = build_inputs(task_config(recipe), preparer=True).data.train
    rows = _peer_rows(job, recipe, examples, tokenizer)
    trainer = SFTTrainer(
        model=str(_model_path(recipe)),
        args=peer_arguments(job, recipe, Path(recipe.output.dir).parent / "peer-tokens"),
        train_dataset=rows,
        processing_class=tokenizer,
    )
    for position, index in enumerate(examples):
        mine, theirs = ours[index], trainer.train_dataset[position]
        if "labels" in theirs:
            mask = [label != -100 for label in theirs["labels"]]
        else:
            mask = theirs.get("completion_mask") or theirs.get("assistant_masks") or [1] * len(theirs["input_ids"])
        targets = [label != -100 for label in mine["labels"]]
        if list(mine["input_ids"]) != list(theirs["input_ids"]):
            return (
                f"example {index} is tokenized differently: accord {list(mine['input_ids'])[:12]}..., "
                f"TRL {list(theirs['input_ids'])[:12]}... (check data.add_bos and the tokenizer's EOS)"
            )
        if targets[1:] != [bool(m) for m in mask][1:]:
            return (
                f"example {index} trains on other tokens: accord {sum(targets)} targets, TRL {sum(mask)} "
                "(data.completion_only_loss against TRL's completion_only_loss / assistant_only_loss)"
            )
    return "the tokens and targets agree; check the optimizer settings (lr, betas, weight decay, max_grad_norm)"


def _model_path(recipe) -> Path:
    from accord.models.build import model_folder

    return model_folder(recipe.model)
