"""SFT throughput against the peers at their best: useful (target) tokens per CPU-second.

    python benchmarks/throughput.py [--steps 8] [--processes 1] [--rounds 3] [--write-docs]
    python benchmarks/throughput.py --device cuda --model-size 0.5b   # on a GPU: bf16, per wall-second

Contenders, each configured as its documentation recommends for training fast on
variable-length data: accord (packed rows, documents kept apart; on the CPU each micro-batch
is one unpadded sequence attended document by document, accord.models.documents), transformers.Trainer
(padding to the longest in the batch, and with `group_by_length=True`), TRL's SFTTrainer
(padding; `packing=True` with `packing_strategy="wrapped"`; with `packing_strategy="bfd"`,
which turns on padding-free batches), and a bare PyTorch loop over accord's packed rows
as padded micro-batches under a block-diagonal mask (a reference, not a peer: what accord's
step cost before the flattening, without accord's loop around it).

Everything else is the same for all: the model (a 4-layer Llama from a config, byte-level
vocabulary, saved once and loaded by each), the data (prompt -> completion rows of 32-256
tokens, the loss on the completion), one pass over the same examples (so the same training
tokens: `--steps` is the number of 8-row steps of 256 tokens those examples fill), AdamW at
the same learning rate (constant, no weight decay, gradient clipping at 1.0), fp32 everywhere
(bf16=False, fp16=False, no gradient checkpointing; with --device cuda bf16 autocast for all),
8 rows or sequences per step. The harness
(benchmarks/harness.py) runs each in its own pinned single-thread process, in interleaved rounds.
Beside speed: the held-out loss after the run (computed identically for all, on 64 unseen
rows), and whether a packed row lets its documents attend to each other.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

MODELS = harness.MODELS
MAX_LENGTH = 256
LR = 1e-3
BATCH = 8  # rows (packed contenders) or sequences (padded contenders) per optimizer step
HELD_OUT = 64
WORDS = "the of and to in is was for on that with as by at from his her they were this are which be had".split()

CONTENDERS = [
    harness.Contender("accord (packed, documents apart)", "accord", kind="accord"),
    harness.Contender("raw PyTorch loop on accord's packed rows, padded, block mask", "raw", kind="reference"),
    harness.Contender("transformers.Trainer (padding)", "trainer"),
    harness.Contender('transformers.Trainer (train_sampling_strategy="group_by_length")', "trainer-grouped"),
    harness.Contender("TRL SFTTrainer (fp32, padding)", "trl"),
    harness.Contender('TRL SFTTrainer (packing_strategy="wrapped")', "trl-wrapped"),
    harness.Contender('TRL SFTTrainer (packing_strategy="bfd", padding-free)', "trl-bfd"),
]
# Whether a packed row's documents see each other (the correctness cost of a packing scheme).
ATTEND = {
    "accord": "no (attention per document)",
    "raw": "no (block-diagonal mask)",
    "trainer": "no (one per row)",
    "trainer-grouped": "no (one per row)",
    "trl": "no (one per row)",
    "trl-wrapped": "**yes** (rows cut from the concatenated stream)",
    "trl-bfd": "no (position ids restart per document)",
}


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=8, help="8-row steps of 256 tokens the training examples fill")
    parser.add_argument("--model-size", choices=sorted(MODELS), default="tiny", help="the Llama every contender trains")
    parser.add_argument(
        "--processes",
        type=int,
        choices=[1],
        default=1,
        help="processes per contender (the harness pins one process to one core; only 1 for now)",
    )


# ---------------------------------------------------------------- the workload


def make_workload(folder: Path, args) -> None:
    """A saved model + tokenizer folder, and train/eval JSONL with a realistic length spread: as many
    training rows as fill `steps` steps of 8 packed 256-token rows."""
    from accord.models.build import build_byte_tokenizer, build_model
    from accord.recipe.schema import ModelConfig

    tokenizer = build_byte_tokenizer()
    built = build_model(ModelConfig(config=MODELS[args.model_size], tokenizer="byte"), tokenizer, seed=0)
    built.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rows = prompt_completion_rows(4000)
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:HELD_OUT]))
    pool = rows[HELD_OUT:]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pool))
    import numpy as np

    from accord.data.packing import Rows

    encoded = encoded_rows(folder, "train")
    lengths = np.array([len(r["input_ids"]) for r in encoded])
    targets = np.array([sum(t != -100 for t in r["labels"][1:]) for r in encoded])
    # The most examples that pack into exactly steps x 8 rows: every packed step is full, so the
    # packed contenders (which drop a last partial step) train on the same examples as the rest.
    count = 1
    while count < len(pool) and len(Rows.build(lengths[: count + 1], targets[: count + 1], MAX_LENGTH)) <= (
        args.steps * BATCH
    ):
        count += 1
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pool[:count]))


def prompt_completion_rows(count: int) -> list[dict]:
    """`count` prompt -> completion rows (the same ones every time): completions from a few words
    to a few hundred characters, lengths 32-256 tokens."""
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
        completion = " ".join(rng.choice(WORDS) for _ in range(int(rng.lognormvariate(3.0, 0.6))))[
            : MAX_LENGTH - len(prompt) - 3
        ]
        rows.append({"prompt": prompt + " =>", "completion": " " + completion})
    return rows


def encoded_rows(folder: Path, split: str) -> list[dict]:
    """prompt + completion as token ids with the prompt masked (what every contender trains on)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    out = []
    for line in (folder / f"{split}.jsonl").read_text().splitlines():
        row = json.loads(line)
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        prompt = bos + tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (prompt + completion)[:MAX_LENGTH]
        out.append({"input_ids": ids, "labels": ([-100] * len(prompt) + completion)[:MAX_LENGTH]})
    return out


def held_out_loss(folder: Path, model) -> float:
    """Mean loss per target token on the held-out rows, padded, the same computation for every contender."""
    import torch

    from accord.tasks.base import causal_token_loss, pad_rows

    model.eval()
    device = next(model.parameters()).device
    total = count = 0.0
    rows = encoded_rows(folder, "eval")
    with torch.no_grad():
        for i in range(0, len(rows), 16):
            chunk = rows[i : i + 16]
            ids = pad_rows([r["input_ids"] for r in chunk], 0)
            labels = pad_rows([r["labels"] for r in chunk], -100)
            mask = pad_rows([[1] * len(r["input_ids"]) for r in chunk], 0)
            with autocast(device):
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            loss_sum, n = causal_token_loss(logits.float(), labels.to(device))
            total, count = total + loss_sum.item(), count + n.item()
    return total / count


def autocast(device):
    """bf16 autocast on a GPU (what every contender's bf16 setting does), nothing on the CPU (fp32)."""
    import contextlib

    import torch

    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---------------------------------------------------------------- contenders (each in its own process)


def sft_recipe(folder: Path, processes: int = 1) -> dict:
    """accord's recipe for the workload in `folder` (packed SFT, BATCH sequences per process)."""
    return {
        "seed": 0,
        "model": {"path": str(folder / "model")},
        "task": "sft",
        "data": {
            "train": str(folder / "train.jsonl"),
            "max_length": MAX_LENGTH,
            "packing": True,
            "cache_dir": str(folder / "cache"),
        },
        "batch": {"global_batch_size": BATCH * processes, "micro_batch_size": BATCH},
        "optim": {"lr": LR, "schedule": "constant", "max_grad_norm": 1.0, "weight_decay": 0.0},
    }


def run_accord(folder: Path, args, recorder) -> dict:
    from transformers import AutoModelForCausalLM

    out = folder / f"accord-{os.getpid()}"
    recipe = sft_recipe(folder) | {"train": {"epochs": 1, "log_every": 1000}}
    result, steps = harness.train_accord(recipe, out, args.device, recorder)
    recorder.count(sum(r["targets"] for r in steps))
    model = AutoModelForCausalLM.from_pretrained(result.final).to(args.device)
    return {"held_out_loss": held_out_loss(folder, model)}


def run_raw(folder: Path, args, recorder) -> dict:
    """A minimal loop over accord's own packed micro-batches, made before the loop."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accord.data.packing import Rows
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config
    from accord.tasks.base import causal_token_loss

    model = AutoModelForCausalLM.from_pretrained(folder / "model").to(args.device)
    examples = encoded_rows(folder, "train")
    lengths = np.array([len(e["input_ids"]) for e in examples])
    targets = np.array([sum(t != -100 for t in e["labels"][1:]) for e in examples])
    rows = Rows.build(lengths, targets, MAX_LENGTH)
    # accord's own packed-SFT task collates the rows (built as a run builds it), padded with id 0.
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    recipe = validate_recipe(sft_recipe(folder) | {"train": {"epochs": 1}})
    task = build_task(task_config(recipe), tokenizer)
    task.pad_id, task.attn_implementation = 0, model.config._attn_implementation
    task.flatten = False  # padded rows under the block-diagonal mask: what accord did before flattening
    order = np.random.default_rng(0).permutation(len(rows))
    batches = [
        task.collate([[examples[i] for i in rows.members[r]] for r in order[start : start + BATCH]])
        for start in range(0, len(rows), BATCH)
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    for batch in batches:
        batch = {k: v.to(args.device) for k, v in batch.items()}
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with autocast(args.device):
            logits = model(**inputs).logits
        loss_sum, n = causal_token_loss(logits.float(), batch["labels"])
        (loss_sum / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recorder.count(int(n))
    recorder.stop()
    return {"held_out_loss": held_out_loss(folder, model)}


def common_arguments(folder: Path, key: str, args) -> dict:
    """What every Trainer-based contender shares: the same optimizer, schedule, precision and length of run."""
    return {
        "output_dir": str(folder / f"out-{key}"),
        "per_device_train_batch_size": BATCH,
        "num_train_epochs": 1,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "bf16": args.device == "cuda",
        "fp16": False,
        "gradient_checkpointing": False,
        "use_cpu": args.device == "cpu",
        "logging_steps": 1000,
        "save_strategy": "no",
        "report_to": [],
        "seed": 0,
        "dataloader_num_workers": 0,
    }


def run_trainer(folder: Path, key: str, args, recorder) -> dict:
    """transformers.Trainer as its docs show for causal-LM fine-tuning: a padding collator
    (and, for variable lengths, group_by_length)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    strategy = "group_by_length" if key == "trainer-grouped" else "random"
    training = TrainingArguments(**common_arguments(folder, key, args), train_sampling_strategy=strategy)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=datasets.Dataset.from_list(encoded_rows(folder, "train")),
        data_collator=harness.CountingCollator(collator, recorder),
    )
    trainer.train()
    recorder.stop()
    return {"held_out_loss": held_out_loss(folder, model)}


def run_trl(folder: Path, key: str, args, recorder) -> dict:
    """TRL's SFTTrainer on the prompt/completion rows (loss on the completion), fp32, no checkpointing."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    packing = {"trl": {}, "trl-wrapped": {"packing": True, "packing_strategy": "wrapped"}}.get(
        key, {"packing": True, "packing_strategy": "bfd"}
    )
    config = SFTConfig(**common_arguments(folder, key, args), max_length=MAX_LENGTH, **packing)
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    trainer.data_collator = harness.CountingCollator(trainer.data_collator, recorder)
    trainer.train()
    recorder.stop()
    return {"held_out_loss": held_out_loss(folder, model)}


def run_child(key: str, folder: Path, args, recorder) -> dict:
    if key == "accord":
        extra = run_accord(folder, args, recorder)
    elif key == "raw":
        extra = run_raw(folder, args, recorder)
    elif key.startswith("trainer"):
        extra = run_trainer(folder, key, args, recorder)
    else:
        extra = run_trl(folder, key, args, recorder)
    return extra | {"attend": ATTEND[key]}


def notes(args) -> str:
    return (
        "Useful tokens are the completion tokens that carry loss (the same examples, one pass, for every "
        "contender); the held-out loss is the harness's own computation on 64 unseen rows, padded, identical for "
        "all. `wrapped` packing cuts rows from the concatenated stream without a document mask, so its documents "
        "attend to each other (and a document's tail lands in the next row): its held-out loss is the price. "
        "`bfd` turns on padding-free batches (each batch flattened into one sequence, documents apart by their "
        "restarting position ids), which TRL documents for FlashAttention; on the CPU there is none, so SDPA "
        "attends the flattened batch as one long sequence under a mask: it runs, slowly, and that is CPU-specific. "
        "The padded contenders take more, smaller optimizer steps over the same examples (8 sequences a step "
        "against 8 packed rows): their lower held-out loss comes from more updates at the same learning rate. "
        "Every figure is one thread on one core; on a GPU the ratios will differ (see the GPU check)."
    )


BENCHMARK = harness.Benchmark(
    section="throughput",
    unit="useful tokens",
    contenders=CONTENDERS,
    prepare=make_workload,
    child=run_child,
    columns=[
        harness.Column("held-out loss", "held_out_loss", "{:.3f}"),
        harness.Column("documents attend to each other", "attend"),
    ],
    add_arguments=add_arguments,
    notes=notes,
)

if __name__ == "__main__":
    harness.main(BENCHMARK)
