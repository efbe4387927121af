"""GRPO against TRL's GRPOTrainer: prompts trained per CPU-second.

    python benchmarks/grpo.py [--model FOLDER] [--steps 4] [--prompts 16] [--group 8] [--rounds 3] [--write-docs]
    python benchmarks/grpo.py --device cuda --model-size 0.5b   # on a GPU: bf16, per wall-second

Contenders: accord's `task: grpo` (no gradient checkpointing), TRL's GRPOTrainer with the same
choice (gradient_checkpointing=False), and GRPOTrainer with its own default (gradient
checkpointing on). Everything else is the same for all: the starting model (FOLDER, e.g. the
quickstart's final/; by default a 4-layer Llama from a config, byte-level, saved once), the
same addition prompts in the same order, the reward (the completion contains a digit: a
regular expression both evaluate with re.fullmatch, which a random model satisfies often
enough to give groups non-zero advantages), group size, completion length, temperature 1,
beta (the KL weight to the reference), the DAPO normalisation (TRL's default loss_type, which
is accord's), AdamW at the same constant learning rate with clipping at 1.0, fp32 (TRL's bf16
default is turned off: identical precision; with --device cuda bf16 autocast for both), one
optimizer step per generation batch. The harness (benchmarks/harness.py) runs each in its own
pinned single-thread process, in interleaved rounds; the last column is the mean reward over the run's completions.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

SEED = 0
LR = 2e-4
MODELS = harness.MODELS
PATTERN = r"[\s\S]*\d[\s\S]*"  # the completion contains a digit

CONTENDERS = [
    harness.Contender("accord grpo (no gradient checkpointing)", "accord", kind="accord"),
    harness.Contender("TRL GRPOTrainer (gradient_checkpointing=False, as accord)", "trl"),
    harness.Contender("TRL GRPOTrainer (its default: gradient checkpointing on)", "trl-default"),
]


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="a saved model folder (default: a 4-layer Llama from a config)")
    parser.add_argument("--model-size", choices=sorted(MODELS), default="tiny", help="without --model: this Llama")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (one generation batch each)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--beta", type=float, default=0.04, help="KL weight (accord's default)")


def prepare(folder: Path, args) -> None:
    from accord.data.generated import generate
    from accord.recipe.schema import GeneratedData

    if args.model:
        (folder / "model").symlink_to(Path(args.model).resolve())
    else:
        from accord.models.build import build_byte_tokenizer, build_model
        from accord.recipe.schema import ModelConfig

        tokenizer = build_byte_tokenizer()
        build_model(
            ModelConfig(config=MODELS[args.model_size], tokenizer="byte"), tokenizer, seed=SEED
        ).save_pretrained(folder / "model")
        tokenizer.save_pretrained(folder / "model")
    train, _ = generate(GeneratedData(kind="addition", train_examples=4000, eval_examples=16, max_digits=2), SEED)
    rows = list(train)[: args.prompts * args.steps]
    (folder / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": r["prompt"], "answer": r["completion"]}) + "\n" for r in rows)
    )


def run_accord(folder: Path, args, recorder) -> dict:
    out = folder / f"accord-{os.getpid()}"
    recipe = {
        "seed": SEED,
        "model": {"path": str(folder / "model")},
        "task": "grpo",
        "data": {
            "train": str(folder / "prompts.jsonl"),
            "max_length": 32,
            "shuffle": False,
            "cache_dir": str(folder / "cache"),
        },
        "batch": {"global_batch_size": args.prompts},
        "optim": {"lr": LR, "schedule": "constant", "max_grad_norm": 1.0, "weight_decay": 0.0},
        "train": {"max_steps": args.steps, "log_every": 1000},
        "grpo": {
            "group_size": args.group,
            "max_new_tokens": args.max_new_tokens,
            "beta": args.beta,
            "rewards": [{"kind": "regex", "pattern": PATTERN}],
        },
    }
    _, steps = harness.train_accord(recipe, out, args.device, recorder)
    recorder.count(len(steps) * args.prompts)
    return {"reward": sum(r["reward"] for r in steps) / len(steps)}


def run_trl(folder: Path, key: str, args, recorder) -> dict:
    import re

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = datasets.load_dataset("json", data_files=str(folder / "prompts.jsonl"), split="train")
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    tokenizer.padding_side = "left"

    def has_digit(prompts, completions, **_):
        return [float(re.fullmatch(PATTERN, c) is not None) for c in completions]

    checkpointing = {} if key == "trl-default" else {"gradient_checkpointing": False}
    config = GRPOConfig(
        output_dir=str(folder / f"trl-{os.getpid()}"),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_new_tokens,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        beta=args.beta,
        loss_type="dapo",
        temperature=1.0,
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",
        fp16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=SEED,
        shuffle_dataset=False,
        **checkpointing,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder / "model"),
        reward_funcs=has_digit,
        args=config,
        train_dataset=rows,
        processing_class=tokenizer,
    )
    trainer.train()
    recorder.stop()
    recorder.count(recorder.steps * args.prompts)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "reward": sum(rewards) / max(len(rewards), 1),
        "checkpointing": "on" if config.gradient_checkpointing else "off",
    }


def run_child(key: str, folder: Path, args, recorder) -> dict:
    if key == "accord":
        return run_accord(folder, args, recorder) | {"checkpointing": "off"}
    return run_trl(folder, key, args, recorder)


def notes(args) -> str:
    return (
        f"{args.prompts} prompts x {args.group} completions of <= {args.max_new_tokens} tokens per step, beta "
        f"{args.beta} (so both compute the reference model's log-probabilities), one optimizer step per "
        "generation batch (so no old-policy log-probabilities are needed by either). TRL's generation here is "
        "its transformers path (no vLLM, which needs a GPU). The mean reward is over every sampled completion "
        "of the run; the two sample with different random streams, so it agrees only roughly."
    )


BENCHMARK = harness.Benchmark(
    section="grpo",
    unit="prompts",
    contenders=CONTENDERS,
    prepare=prepare,
    child=run_child,
    columns=[
        harness.Column("gradient checkpointing", "checkpointing"),
        harness.Column("mean reward", "reward", "{:.3f}"),
    ],
    add_arguments=add_arguments,
    notes=notes,
)

if __name__ == "__main__":
    harness.main(BENCHMARK)
