"""The post-training methods against TRL's trainer of each: optimizer steps per CPU-second.

    python benchmarks/methods.py [--steps 8] [--batch 16] [--rounds 3] [--methods dpo kto ...] [--write-docs]

One row per method (METHODS below; a method is a name, accord's recipe section and TRL's
trainer and config): dpo (sigmoid), kto, orpo, cpo with SimPO's loss and no NLL term (pure
SimPO), rloo, distill (off-policy GKD). accord's task of the method against the TRL trainer of
the same method (DPOTrainer, KTOTrainer, trl.experimental's ORPOTrainer, CPOTrainer and
GKDTrainer, RLOOTrainer), each on the same saved model (a 4-layer Llama from a config, byte-
level; the reference model, where the method has one, a copy of it; distill's teacher a second
model of the same config and vocabulary, other weights, saved beside it), the same rows in the
same order (one pass, no shuffling, exactly steps x batch rows), the same global batch in one
micro-batch, the method's settings (beta and the like) equal, AdamW at the same constant
learning rate with clipping at 1.0, fp32 (TRL's bf16 off), one process. TRL at its best for
speed on a CPU: gradient checkpointing off as accord's (TRL's default turns it on, which trades
speed for memory), the reference computed on the fly as accord does (precompute_ref_log_probs,
which TRL documents as a memory saving, would run the same forward passes earlier), no padding-
free batches (they need flash attention, which a CPU lacks), its own tokenisation and
collation. The harness (benchmarks/harness.py) runs each in its own pinned single-thread
process, in interleaved rounds, and reads its peak RSS; the last line is the geometric mean of
accord's ratio over the methods.

A new method is one more Method: its accord recipe section and its TRL trainer.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

SEED = 0
LR = 1e-4
MAX_LENGTH = 64
PATTERN = r"[\s\S]*\d[\s\S]*"  # rloo's reward: the completion contains a digit (as benchmarks/grpo.py)


@dataclass(frozen=True)
class Method:
    key: str  # as --methods and the contender keys name it
    label: str  # the table's method column
    rows: str  # the workload file it trains on (prepare writes it)
    accord: Callable[[Any], dict]  # args -> the recipe keys that make accord run this method
    trl: Callable[[Any], tuple[str, str, dict]]  # args -> (trainer "module:Class", config "module:Class", settings)
    trl_shown: str  # what the TRL contender was set to, for the table
    teacher: bool = False  # trains against the saved teacher (prepare writes it): distill


def _dpo(args) -> dict:
    return {"task": "dpo", "dpo": {"beta": 0.1, "loss_type": "sigmoid"}}


def _kto(args) -> dict:
    return {"task": "kto", "kto": {"beta": 0.1}}


def _orpo(args) -> dict:
    return {"task": "orpo", "orpo": {"beta": 0.1}}


def _simpo(args) -> dict:
    return {"task": "cpo", "cpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}}


def _rloo(args) -> dict:
    return {
        "task": "rloo",
        "grpo": {
            "group_size": args.group,
            "max_new_tokens": args.max_new_tokens,
            "beta": 0.05,
            "rewards": [{"kind": "regex", "pattern": PATTERN}],
        },
    }


def _distill(args) -> dict:
    # GKDTrainer's defaults for the divergence: beta 0.5, and temperature 1 (GKD's temperature only
    # samples, which lmbda 0 never does; its divergence compares at 1). Off-policy: the data's
    # completions, no sampling, so both do the same work.
    return {"task": "distill", "distill": {"beta": 0.5, "temperature": 1.0, "lmbda": 0.0, "seq_kd": False}}


METHODS = [
    Method(
        "dpo",
        "dpo (sigmoid)",
        "pairs.jsonl",
        _dpo,
        lambda a: ("trl:DPOTrainer", "trl:DPOConfig", {"beta": 0.1, "loss_type": "sigmoid"}),
        "DPOTrainer: loss_type sigmoid, beta 0.1, reference a copy of the model",
    ),
    Method(
        "kto",
        "kto",
        "unpaired.jsonl",
        _kto,
        lambda a: ("trl:KTOTrainer", "trl:KTOConfig", {"beta": 0.1}),
        "KTOTrainer: beta 0.1, weights 1, reference a copy of the model",
    ),
    Method(
        "orpo",
        "orpo",
        "pairs.jsonl",
        _orpo,
        lambda a: ("trl.experimental.orpo:ORPOTrainer", "trl.experimental.orpo:ORPOConfig", {"beta": 0.1}),
        "trl.experimental ORPOTrainer: beta 0.1",
    ),
    Method(
        "simpo",
        "cpo (simpo)",
        "pairs.jsonl",
        _simpo,
        lambda a: (
            "trl.experimental.cpo:CPOTrainer",
            "trl.experimental.cpo:CPOConfig",
            {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0},
        ),
        "trl.experimental CPOTrainer: loss_type simpo, beta 2, simpo_gamma 0.5, cpo_alpha 0",
    ),
    Method(
        "rloo",
        "rloo",
        "prompts.jsonl",
        _rloo,
        lambda a: (
            "trl:RLOOTrainer",
            "trl:RLOOConfig",
            {
                "num_generations": a.group,
                "max_completion_length": a.max_new_tokens,
                "beta": 0.05,
                "temperature": 1.0,
                "shuffle_dataset": False,
                # TRL's batch counts completions: the same prompts per step as accord's
                "per_device_train_batch_size": a.batch * a.group,
            },
        ),
        "RLOOTrainer: transformers generation (no vLLM), beta 0.05, one step per generation batch",
    ),
    Method(
        "distill",
        "distill (gkd, off-policy)",
        "chats.jsonl",
        _distill,
        lambda a: (
            "trl.experimental.gkd:GKDTrainer",
            "trl.experimental.gkd:GKDConfig",
            {"lmbda": 0.0, "beta": 0.5, "seq_kd": False},
        ),
        "trl.experimental GKDTrainer: lmbda 0 (off-policy), beta 0.5, seq_kd off, its ChatML collator, "
        "teacher a second model of the same vocabulary",
        teacher=True,
    ),
]
BY_KEY = {m.key: m for m in METHODS}


def _contenders(methods: list[Method]) -> list[harness.Contender]:
    out = []
    for m in methods:
        out.append(harness.Contender(f"{m.key}: accord", f"{m.key}-accord", kind="accord"))
        out.append(harness.Contender(f"{m.key}: TRL", f"{m.key}-trl"))
    return out


CONTENDERS = _contenders(METHODS)


def add_arguments(parser) -> None:
    parser.add_argument("--methods", nargs="+", choices=list(BY_KEY), help="only these methods (default: all)")
    parser.add_argument("--model-size", choices=sorted(harness.MODELS), default="tiny")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (one pass over steps x batch rows)")
    parser.add_argument("--batch", type=int, default=16, help="global batch: pairs, kto rows or rloo prompts per step")
    parser.add_argument("--group", type=int, default=4, help="rloo: completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="rloo: longest completion")


# ---------------------------------------------------------------- the workload


def prepare(folder: Path, args) -> None:
    """The model and distill's teacher (saved once, loaded by every contender) and each method's
    rows: accord's generated sums as pairs (a near miss rejected), unpaired for kto (a pair's
    chosen row then its rejected one, so every batch holds both classes), as prompts for rloo,
    and as two-turn chats (the sum asked, the answer given) for distill, the form GKDTrainer's
    own collator reads."""
    from accord.data.generated import generate
    from accord.models.build import build_byte_tokenizer, build_model
    from accord.recipe.schema import GeneratedData, ModelConfig

    tokenizer = build_byte_tokenizer()
    model = build_model(ModelConfig(config=harness.MODELS[args.model_size], tokenizer="byte"), tokenizer, seed=SEED)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    # The teacher: the same config and vocabulary, other weights (another seed).
    teacher = build_model(
        ModelConfig(config=harness.MODELS[args.model_size], tokenizer="byte"), tokenizer, seed=SEED + 1
    )
    teacher.save_pretrained(folder / "teacher")
    tokenizer.save_pretrained(folder / "teacher")
    need = args.steps * args.batch
    cfg = GeneratedData(kind="addition_pairs", train_examples=max(need, 16), eval_examples=0, max_digits=3)
    pairs = generate(cfg, SEED)[0][:need]
    unpaired = [
        {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
        for p in pairs[: (need + 1) // 2]
        for side in ("chosen", "rejected")
    ][:need]
    prompts = [{"prompt": p["prompt"], "answer": p["chosen"]} for p in pairs]
    chats = [
        {"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["chosen"]}]}
        for p in pairs
    ]
    files = {"pairs.jsonl": pairs, "unpaired.jsonl": unpaired, "prompts.jsonl": prompts, "chats.jsonl": chats}
    for name, rows in files.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---------------------------------------------------------------- the contenders


def run_accord(method: Method, folder: Path, args, recorder) -> dict:
    recipe = {
        "seed": SEED,
        "model": {"path": str(folder / "model")},
        "data": {
            "train": str(folder / method.rows),
            "max_length": MAX_LENGTH,
            "shuffle": False,
            "cache_dir": str(folder / "cache"),
        },
        "batch": {"global_batch_size": args.batch, "micro_batch_size": args.batch},
        "optim": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0},
        "train": {"max_steps": args.steps, "log_every": 1000},
    } | method.accord(args)
    if method.teacher:
        recipe[method.accord(args)["task"]]["teacher"] = str(folder / "teacher")
    if method.key == "rloo":
        del recipe["batch"]["micro_batch_size"]  # rloo's micro batch counts completions: its own default
    _, steps = harness.train_accord(recipe, folder / f"accord-{method.key}-{os.getpid()}", args.device, recorder)
    recorder.count(len(steps))
    return {"checkpointing": "off"}


def _load(spec: str):
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def run_trl(method: Method, folder: Path, args, recorder) -> dict:
    import re

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer_class, config_class, settings = method.trl(args)
    Trainer, Config = _load(trainer_class), _load(config_class)
    rows = datasets.load_dataset("json", data_files=str(folder / method.rows), split="train")
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    common = {
        "output_dir": str(folder / f"trl-{method.key}-{os.getpid()}"),
        "per_device_train_batch_size": args.batch,
        "gradient_accumulation_steps": 1,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "max_steps": args.steps,
        "gradient_checkpointing": False,  # matched: accord does not checkpoint here
        "use_cpu": args.device == "cpu",
        "bf16": args.device == "cuda",
        "fp16": False,
        "report_to": [],
        "logging_steps": 1000,
        "save_strategy": "no",
        "seed": SEED,
    }
    if method.key == "rloo":
        tokenizer.padding_side = "left"
    else:
        common |= {"max_length": MAX_LENGTH, "train_sampling_strategy": "sequential"}
    config = Config(**(common | settings))
    kwargs: dict[str, Any] = {}
    if method.key == "rloo":

        def has_digit(prompts, completions, **_):
            return [float(re.fullmatch(PATTERN, c) is not None) for c in completions]

        kwargs["reward_funcs"] = has_digit
    if method.teacher:
        kwargs["teacher_model"] = AutoModelForCausalLM.from_pretrained(folder / "teacher")
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(folder / "model"),
        args=config,
        train_dataset=rows,
        processing_class=tokenizer,
        **kwargs,
    )
    trainer.train()
    recorder.stop()
    recorder.count(recorder.steps)
    return {"checkpointing": "on" if config.gradient_checkpointing else "off"}


def run_child(key: str, folder: Path, args, recorder) -> dict:
    name, side = key.rsplit("-", 1)
    method = BY_KEY[name]
    return (run_accord if side == "accord" else run_trl)(method, folder, args, recorder)


# ---------------------------------------------------------------- the table


def _cell(summary: dict) -> str:
    if "error" in summary:
        return f"failed: {summary['error']}"
    low, high = summary["rate_range"]
    return f"{harness.rate(summary['rate'])} [{harness.rate(low)}, {harness.rate(high)}]"


def report(bench: harness.Benchmark, summaries: dict[str, dict], primary: str) -> tuple[list[str], str]:
    """One row per method: accord's and TRL's steps per CPU-second, their ratio and each one's
    peak RSS; the verdict is the geometric mean of the ratios over the methods both ran."""
    per = "per CPU-s" if primary == "cpu" else "per wall-s"
    header = [
        "method",
        f"accord steps {per}, median [min, max]",
        f"TRL steps {per}, median [min, max]",
        "accord / TRL",
        "accord peak RSS MiB",
        "TRL peak RSS MiB",
        "steps",
        "gradient checkpointing",
        "TRL set to",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ratios: list[tuple[str, float]] = []
    keys = {c.key for c in bench.contenders}
    for method in METHODS:
        if f"{method.key}-accord" not in keys:
            continue
        ours, theirs = summaries[f"{method.key}: accord"], summaries[f"{method.key}: TRL"]
        both = "error" not in ours and "error" not in theirs
        ratio = ours["rate"] / theirs["rate"] if both else None
        if ratio is not None:
            ratios.append((method.key, ratio))

        def rss(s: dict) -> str:
            return f"{s['peak_rss_mib']:,.0f}" if "error" not in s else ""

        cells = [
            f"**{method.label}**",
            _cell(ours),
            _cell(theirs),
            f"{ratio:.2f}x" if ratio is not None else "n/a",
            rss(ours),
            rss(theirs),
            str(ours.get("steps", theirs.get("steps", ""))),
            "off (both)",
            method.trl_shown,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if not ratios:
        return lines, "accord / best peer: n/a (accord or TRL failed on every method)"
    mean = math.exp(statistics.fmean(math.log(r) for _, r in ratios))
    each = ", ".join(f"{k} {r:.2f}x" for k, r in ratios)
    return lines, f"accord / best peer: {mean:.2f}x (geometric mean over the methods, against TRL's trainers: {each})"


def notes(args) -> str:
    return (
        f"{args.batch} rows per step ({args.batch} pairs for dpo, orpo and simpo; {args.batch} unpaired rows, half "
        f"desirable, for kto; {args.batch} prompts x {args.group} completions of <= {args.max_new_tokens} tokens for "
        f"rloo; {args.batch} two-turn chats for distill), one micro-batch per step, sequences up to "
        f"{MAX_LENGTH} tokens (the generated sums, a few tokens each). Both sides of a row run the same method with "
        "the same settings; steps are counted from the first forward pass to the last optimizer step, so loading "
        "the model and the data is not timed. The peak RSS is the whole process's (Python, torch, the library, "
        "the model and its reference copy or teacher where the method has one)."
    )


def _select(argv: list[str]) -> list[harness.Contender]:
    """The contenders of --methods (read before the harness parses the rest)."""
    if "--methods" not in argv:
        return CONTENDERS
    chosen = []
    for a in argv[argv.index("--methods") + 1 :]:
        if a.startswith("--"):
            break
        chosen.append(a)
    return _contenders([m for m in METHODS if m.key in chosen]) or CONTENDERS


BENCHMARK = harness.Benchmark(
    section="methods",
    unit="steps",
    contenders=CONTENDERS,
    prepare=prepare,
    child=run_child,
    add_arguments=add_arguments,
    notes=notes,
    report=report,
)

if __name__ == "__main__":
    BENCHMARK.contenders = _select(sys.argv[1:])
    harness.main(BENCHMARK)
