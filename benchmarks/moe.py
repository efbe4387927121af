"""A mixture-of-experts model's SFT throughput and memory: accord (ddp, fsdp; the router's
balancing loss over the global batch or per forward) against transformers.Trainer with the
model's own balancing loss (`output_router_logits=True`).

    python benchmarks/moe.py [--steps 6] [--rounds 3] [--write-docs]

The workload is throughput.py's (prompt -> completion rows of 32-256 tokens, loss on the
completion, one pass over the examples that fill `--steps` steps of 8 packed 256-token rows,
AdamW at a constant rate, clipping at 1.0, fp32), on a Qwen3-MoE built from a config (8
experts, each token routed to 2, fused 3-D expert weights as transformers 5 stores them) and
saved once. Every contender runs in its own pinned single-thread process (benchmarks/harness.py),
in interleaved rounds; peak RSS is each contender's whole process. accord's global_batch form
runs one gradient-free forward per step more than the others (it counts the routing of the whole
global batch before the step's micro-batches); the per_forward row shows what that pass costs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import throughput  # noqa: E402

# The MoE every contender trains: throughput.py's Llama's width and depth, its MLP as 8 experts.
MOE = {
    "architecture": "qwen3_moe",
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.01,
}
harness.MODELS["moe"] = MOE

CONTENDERS = [
    harness.Contender("accord ddp (balancing loss over the global batch)", "accord-ddp", kind="accord"),
    harness.Contender("accord fsdp (balancing loss over the global batch)", "accord-fsdp", kind="reference"),
    harness.Contender("accord ddp (moe.balance_loss=per_forward)", "accord-per-forward", kind="reference"),
    harness.Contender("transformers.Trainer (padding, output_router_logits=True)", "trainer"),
]


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=6, help="8-row steps of 256 tokens the training examples fill")
    parser.add_argument(
        "--model-size", choices=["moe"], default="moe", help="the model every contender trains (Qwen3-MoE, 8 experts)"
    )


def run_accord(folder: Path, key: str, args, recorder) -> dict:
    from transformers import AutoModelForCausalLM

    out = folder / f"{key}-{os.getpid()}"
    strategy = "fsdp" if key == "accord-fsdp" else "ddp"
    balance = "per_forward" if key == "accord-per-forward" else "global_batch"
    recipe = throughput.sft_recipe(folder) | {
        "train": {"epochs": 1, "log_every": 1000},
        "moe": {"balance_loss": balance},
    }
    result, steps = harness.train_accord(recipe, out, args.device, recorder, engine={"strategy": strategy})
    recorder.count(sum(r["targets"] for r in steps))
    model = AutoModelForCausalLM.from_pretrained(result.final).to(args.device)
    return {
        "held_out_loss": throughput.held_out_loss(folder, model),
        "imbalance": f"{steps[-1]['router_imbalance']:.2f}",
    }


def run_trainer(folder: Path, args, recorder) -> dict:
    """transformers.Trainer with the model's own balancing loss on, a padding collator."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model", output_router_logits=True)
    training = TrainingArguments(**throughput.common_arguments(folder, "trainer", args))
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=datasets.Dataset.from_list(throughput.encoded_rows(folder, "train")),
        data_collator=harness.CountingCollator(collator, recorder),
    )
    trainer.train()
    recorder.stop()
    model.config.output_router_logits = False
    return {"held_out_loss": throughput.held_out_loss(folder, model), "imbalance": ""}


def run_child(key: str, folder: Path, args, recorder) -> dict:
    if key == "trainer":
        return run_trainer(folder, args, recorder)
    return run_accord(folder, key, args, recorder)


def notes(args) -> str:
    return (
        "Useful tokens are the completion tokens that carry loss (the same examples, one pass, for every "
        "contender); the held-out loss is throughput.py's computation on 64 unseen rows, identical for all. "
        "Router imbalance: the busiest expert's tokens over the mean, in the worst layer, at the last step "
        "(accord's `router_imbalance`). accord trains packed rows (8 per step), the Trainer padded sequences "
        "(8 per step): the Trainer takes more, smaller steps over the same examples. fsdp on one process "
        "shards nothing; its row shows FSDP2's own cost on this model. Every figure is one thread on one core "
        "of a machine shared with other jobs."
    )


BENCHMARK = harness.Benchmark(
    section="moe",
    unit="useful tokens",
    contenders=CONTENDERS,
    prepare=throughput.make_workload,
    child=run_child,
    columns=[
        harness.Column("held-out loss", "held_out_loss", "{:.3f}"),
        harness.Column("router imbalance", "imbalance", "{}"),
    ],
    add_arguments=add_arguments,
    notes=notes,
)

if __name__ == "__main__":
    harness.main(BENCHMARK)
