"""Vision-language SFT against TRL's SFTTrainer: useful (caption) tokens per CPU-second and peak RSS.

    python benchmarks/vlm.py [--rows 64] [--rounds 3] [--write-docs]

The same for both: a LLaVA built from a config (a CLIP vision tower at 64×64 pixels in 8×8
patches, a projector, a 4-layer Llama with accord's byte tokenizer), saved once with its
processor and loaded by each; chat rows asking what a picture shows, answered by its caption
(`a red circle`), the pictures as PNG files beside the JSONL; one pass over the rows, 8 rows a
step, AdamW at the same learning rate (constant, no weight decay, clipping at 1.0), fp32, no
gradient checkpointing, the loss on the assistant's tokens (TRL: `assistant_only_loss` through
the template's generation markers). The harness (benchmarks/harness.py) runs each in its own
pinned single-thread process, in interleaved rounds.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

LR = 1e-3
BATCH = 8
IMAGE_SIZE = 64
MODEL = {
    "architecture": "llava",
    "vision_feature_layer": -1,
    "text_config": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": 8,
    },
}

CONTENDERS = [
    harness.Contender("accord (images prepared once, cached)", "accord", kind="accord"),
    harness.Contender("TRL SFTTrainer (fp32, assistant_only_loss)", "trl"),
]


def add_arguments(parser) -> None:
    parser.add_argument("--rows", type=int, default=64, help="training rows (one pass, 8 a step)")


def make_workload(folder: Path, args) -> None:
    """The model folder (weights, config, processor) and train.jsonl with its pictures."""
    from accord.data.generated import QUESTION, shape_picture
    from accord.models.build import build_config, build_model, build_tokenizer
    from accord.models.vision import build_processor
    from accord.recipe.schema import ModelConfig

    cfg = ModelConfig(config=MODEL)
    tokenizer = build_tokenizer(cfg)
    model = build_model(cfg, tokenizer, seed=0, kind="image_text_to_text")
    model.save_pretrained(folder / "model")
    build_processor(cfg, tokenizer, build_config(cfg, tokenizer, "image_text_to_text")).save_pretrained(
        folder / "model"
    )
    rng = random.Random(0)
    (folder / "pictures").mkdir()
    rows = []
    for i in range(args.rows):
        image, caption = shape_picture(rng, IMAGE_SIZE)
        image.save(folder / "pictures" / f"{i}.png")
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                    {"role": "assistant", "content": [{"type": "text", "text": caption}]},
                ],
                "images": [f"pictures/{i}.png"],
            }
        )
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_accord(folder: Path, args, recorder) -> dict:
    out = folder / f"accord-{os.getpid()}"
    recipe = {
        "seed": 0,
        "model": {"path": str(folder / "model")},
        "task": "sft",
        "data": {
            "train": str(folder / "train.jsonl"),
            "max_length": 128,
            "cache_dir": str(folder / f"cache-{os.getpid()}"),  # each round prepares its pictures again
        },
        "batch": {"global_batch_size": BATCH, "micro_batch_size": BATCH},
        "optim": {"lr": LR, "schedule": "constant", "max_grad_norm": 1.0, "weight_decay": 0.0},
        "train": {"epochs": 1, "log_every": 1000},
    }
    _, steps = harness.train_accord(recipe, out, args.device, recorder)
    recorder.count(sum(r["targets"] for r in steps))
    return {}


def run_trl(folder: Path, args, recorder) -> dict:
    import datasets
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    processor = AutoProcessor.from_pretrained(folder / "model")
    model = AutoModelForImageTextToText.from_pretrained(folder / "model")
    dataset = datasets.load_dataset("json", data_files=str(folder / "train.jsonl"), split="train")
    dataset = dataset.map(lambda row: {"images": [str(folder / p) for p in row["images"]]})
    dataset = dataset.cast_column("images", datasets.List(datasets.Image()))
    config = SFTConfig(
        output_dir=str(folder / f"trl-{os.getpid()}"),
        per_device_train_batch_size=BATCH,
        num_train_epochs=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        assistant_only_loss=True,
        max_length=128,
        bf16=args.device == "cuda",
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=args.device == "cpu",
        remove_unused_columns=False,
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=processor)
    trainer.data_collator = harness.CountingCollator(trainer.data_collator, recorder)
    trainer.train()
    recorder.stop()
    return {}


def run_child(key: str, folder: Path, args, recorder) -> dict:
    return run_accord(folder, args, recorder) if key == "accord" else run_trl(folder, args, recorder)


def notes(args) -> str:
    return (
        "Useful tokens are the caption tokens that carry loss. The timed span runs from the first forward pass to "
        "the last optimizer step: accord decodes and processes the pictures once, when it prepares the data (before "
        "that span, and cached for the next run), while TRL's collator decodes and processes each batch's pictures "
        "inside it; the whole-process CPU column counts both, preparation included. Peak RSS is the largest the "
        "contender's process reached. One thread on one core per process."
    )


BENCHMARK = harness.Benchmark(
    section="vlm",
    unit="useful tokens",
    contenders=CONTENDERS,
    prepare=make_workload,
    child=run_child,
    add_arguments=add_arguments,
    notes=notes,
)

if __name__ == "__main__":
    harness.main(BENCHMARK)
