"""sft on a vision-language model: image rows, their labels and cached pixels, the same run on
1 and 2 processes, TRL's SFTTrainer on the same rows, final/ in plain transformers, and each
bad input as one line."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch

from conftest import (
    TINY_RECIPE,
    assert_ok,
    final_params,
    max_param_diff,
    run_accord,
    run_accord_here,
    step_losses,
    write_jsonl,
    write_recipe,
)

IMAGE_SIZE, PATCH = 16, 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # CLIP's class token is dropped by the "default" strategy
TINY_VLM = {
    "architecture": "llava",
    "vision_feature_layer": -1,
    "text_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
    },
}


def answer(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def write_image_rows(folder: Path, count: int, seed: int = 0, name: str = "train.jsonl") -> Path:
    """Chat rows with PNG files beside them (paths relative to the data file): most with one
    picture, every fifth with two (placeholders given), one text-only row."""
    from accord.data.generated import QUESTION, shape_picture

    rng = random.Random(seed)
    (folder / "pictures").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        pictures = []
        for k in range(2 if i % 5 == 4 else 1):
            image, caption = shape_picture(rng, IMAGE_SIZE)
            path = f"pictures/{name}-{i}-{k}.png"
            image.save(folder / path)
            pictures.append((path, caption))
        if len(pictures) == 1:  # TRL's shape: string content, the image placed before the user's text
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": QUESTION},
                        {"role": "assistant", "content": pictures[0][1]},
                    ],
                    "images": [pictures[0][0]],
                }
            )
        else:
            rows.append(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "first"},
                                {"type": "image"},
                                {"type": "text", "text": "then"},
                                {"type": "image"},
                            ],
                        },
                        answer(" and ".join(c for _, c in pictures)),
                    ],
                    "images": [p for p, _ in pictures],
                }
            )
    return write_jsonl(folder / name, rows)


def vlm_recipe(folder: Path, data_file: Path, **sections) -> dict:
    recipe = copy.deepcopy(TINY_RECIPE)
    recipe["model"] = {"config": TINY_VLM}
    recipe["data"] = {"train": [{"path": str(data_file)}], "max_length": 96, "shuffle": False} | (
        {"cache_dir": TINY_RECIPE["data"]["cache_dir"]} if "cache_dir" in TINY_RECIPE["data"] else {}
    )
    recipe["batch"] = {"global_batch_size": 8, "micro_batch_size": 8}
    recipe["optim"] = {"lr": 3.0e-3, "warmup_steps": 0, "schedule": "constant", "max_grad_norm": 1.0}
    recipe["train"] = {"max_steps": 4, "log_every": 1}
    recipe["engine"] = recipe["engine"] | {"processes": 1}
    recipe["output"] = {"dir": str(folder / "out")}
    for name, section in sections.items():
        recipe[name] = recipe.get(name, {}) | section
    return recipe


def _task(recipe: dict):
    from accord.models.build import build_tokenizer
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    valid = validate_recipe(recipe)
    tokenizer = build_tokenizer(valid.model)
    return build_task(task_config(valid), tokenizer), tokenizer, valid


# ---------------------------------------------------------------- unit tier


def test_labels_follow_the_text_through_the_expansion_and_image_tokens_are_never_targets():
    from accord.tasks.vision_sft import IGNORE, expand_labels

    image = 99
    ids = [1, 2, image, 3, image, image, 4, 5]
    labels = [IGNORE, IGNORE, image, IGNORE, image, image, 4, 5]
    expanded = [1, 2, *[image] * 3, 3, *[image] * 6, 4, 5]
    out = expand_labels(ids, labels, expanded, image, "f: row 1")
    assert out == [IGNORE] * 12 + [4, 5]
    from accord.data.rows import DataError

    with pytest.raises(DataError, match="f: row 1: the processor's expansion"):
        expand_labels(ids, labels, [1, 2, image, 7, image, 4, 5], image, "f: row 1")


def test_image_rows_encode_with_the_answer_as_the_only_targets_and_the_pixels_batched(tmp_path):
    import numpy as np

    data = write_image_rows(tmp_path, 5)
    task, tokenizer, _ = _task(vlm_recipe(tmp_path, data))
    import datasets

    from accord.data.sources import ROW, SOURCE

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    batch = {
        "messages": [r["messages"] for r in rows],
        "images": [r["images"] for r in rows],
        SOURCE: [str(data)] * len(rows),
        ROW: list(range(1, len(rows) + 1)),
    }
    loaded = datasets.load_dataset("json", data_files=str(data), split="train")
    task.fit(loaded.add_column(SOURCE, batch[SOURCE]).add_column(ROW, batch[ROW]), None)
    encoded = task.encode_batch(batch)
    for i, row in enumerate(rows):
        ids, labels = encoded["input_ids"][i], encoded["labels"][i]
        assert ids.count(task.image_token_id) == IMAGE_TOKENS * len(row["images"])
        targets = [t for t, label in zip(ids, labels) if label != -100]
        answer = row["messages"][-1]["content"]
        answer = answer if isinstance(answer, str) else answer[0]["text"]
        assert tokenizer.decode(targets) == answer + "<|eos|>"
        assert encoded["num_targets"][i] == len(targets)
    assert encoded["image_names"][4] == rows[4]["images"]
    # `accord data --show`: each image where it sits, with its token count; the answer marked.
    from accord.cli.data_view import render_example

    shown = render_example({k: v[4] for k, v in encoded.items()}, task, tokenizer, color=False)
    first, second = rows[4]["images"]
    assert shown == [
        f"<|user|>first<image 1: {first}, {IMAGE_TOKENS} tokens>then<image 2: {second}, {IMAGE_TOKENS} tokens>"
        f"<|eos|><|assistant|>[[{rows[4]['messages'][1]['content'][0]['text']}<|eos|>]]"
    ]
    examples = [[{k: v[i] for k, v in encoded.items()}] for i in range(len(rows))]
    collated = task.collate(examples)
    assert collated["pixel_values"].shape == (6, 3, IMAGE_SIZE, IMAGE_SIZE)  # rows' images one after another
    # The same pixels as the processor makes of the files, in the rows' order.
    from PIL import Image

    first = task.processor.image_processor(images=[Image.open(tmp_path / rows[4]["images"][1])], return_tensors="np")
    assert np.allclose(collated["pixel_values"][5].numpy(), first["pixel_values"][0])


def test_replacing_an_image_under_its_name_prepares_the_data_again_with_its_pixels(tmp_path):
    """The cache key holds each row's image files (size and mtime, as for the data files): a
    picture replaced under the same name is not read from the stale cache."""
    import numpy as np
    from PIL import Image

    from accord.data.prepare import cache_folder, prepare_data
    from accord.tasks.vision_sft import IMAGE_INPUTS, _unpack_arrays

    data = write_image_rows(tmp_path, 3)
    recipe = vlm_recipe(tmp_path, data, data={"cache_dir": str(tmp_path / "cache")})
    picture = tmp_path / json.loads(data.read_text().splitlines()[0])["images"][0]

    task, tokenizer, valid = _task(recipe)

    def pixels():
        prepared = prepare_data(valid.data, valid.seed, tokenizer, task, preparer=True)
        return cache_folder(valid.data, valid.seed, tokenizer, task), _unpack_arrays(prepared.train[0][IMAGE_INPUTS])[
            "pixel_values"
        ]

    first_folder, first = pixels()
    assert pixels()[0] == first_folder  # nothing changed: the cache is reused
    Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255)).save(picture)  # all white now
    folder, replaced = pixels()
    assert folder != first_folder
    expected = task.processor.image_processor(images=[Image.open(picture)], return_tensors="np")["pixel_values"]
    assert not np.allclose(first, replaced) and np.allclose(replaced, expected)


def test_generated_shape_rows_hold_png_bytes_that_encode_to_their_caption(tmp_path):
    """data.generate kind shapes: pictures as {bytes, path} (as datasets stores an Image in
    parquet / arrow), read from the bytes; eval pictures are other draws."""
    from accord.data.generated import generate
    from accord.data.sources import ROW, SOURCE
    from accord.recipe.schema import GeneratedData

    cfg = GeneratedData(kind="shapes", train_examples=3, eval_examples=1, image_size=IMAGE_SIZE)
    train, held_out = generate(cfg, seed=0)
    assert len(train) == 3 and len(held_out) == 1
    assert train[0]["images"][0]["bytes"].startswith(b"\x89PNG")
    recipe = vlm_recipe(tmp_path, tmp_path / "unused.jsonl")
    recipe["data"] = {"generate": {"kind": "shapes", "train_examples": 3, "eval_examples": 1, "image_size": 16}}
    task, tokenizer, _ = _task(recipe)
    batch = {key: [row[key] for row in train] for key in ("messages", "images", SOURCE, ROW)}
    encoded = task.encode_batch(batch)
    targets = [t for t, label in zip(encoded["input_ids"][0], encoded["labels"][0]) if label != -100]
    assert tokenizer.decode(targets) == train[0]["messages"][1]["content"][0]["text"] + "<|eos|>"
    assert encoded["image_names"][0] == ["(bytes)"]


def test_model_freeze_names_the_parts_and_a_wrong_name_lists_them():
    from accord.errors import UserInputError
    from accord.models.build import build_model, build_tokenizer
    from accord.models.vision import freeze, leaves_parameters_unused
    from accord.recipe.schema import ModelConfig

    cfg = ModelConfig(config=TINY_VLM)
    model = build_model(cfg, build_tokenizer(cfg), seed=0, kind="image_text_to_text", meta=True)
    # DDP looks for unused parameters while the image side trains (a micro-batch may have no image).
    assert leaves_parameters_unused(model)
    frozen = freeze(model, ["vision_tower", "projector"])
    assert not leaves_parameters_unused(model)
    assert frozen == ["model.vision_tower", "model.multi_modal_projector"]
    trained = {n.split(".")[1] for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {"language_model", "weight"}  # and lm_head.weight
    with pytest.raises(UserInputError, match=r"model.freeze: .* no part 'vision' \(parts: vision_tower, projector"):
        freeze(model, ["vision"])


def test_lora_all_linear_on_a_vision_language_model_adapts_the_language_model_only():
    from accord.models.build import apply_lora, build_model, build_tokenizer
    from accord.recipe.schema import LoraConfig, ModelConfig

    cfg = ModelConfig(config=TINY_VLM)
    model = build_model(cfg, build_tokenizer(cfg), seed=0, kind="image_text_to_text", meta=True)
    wrapped = apply_lora(model, LoraConfig(r=4), "image_text_to_text", seed=0)
    adapted = {n for n, _ in wrapped.named_parameters() if ".lora_" in n}
    assert adapted and all(".language_model." in n for n in adapted)


def _refusal(tmp_path: Path, recipe: dict) -> str:
    proc = run_accord_here("train", write_recipe(tmp_path / "r.yaml", recipe))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accord: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_bad_image_rows_are_one_line_naming_file_and_row(tmp_path):
    data = write_image_rows(tmp_path, 5)
    rows = [json.loads(line) for line in data.read_text().splitlines()]

    missing = copy.deepcopy(rows)
    missing[2]["images"] = ["pictures/nowhere.png"]
    line = _refusal(tmp_path, vlm_recipe(tmp_path, write_jsonl(tmp_path / "missing.jsonl", missing)))
    assert "missing.jsonl: row 3: image file" in line and "nowhere.png does not exist" in line

    (tmp_path / "pictures" / "broken.png").write_bytes(b"not a picture")
    broken = copy.deepcopy(rows)
    broken[1]["images"] = ["pictures/broken.png"]
    line = _refusal(tmp_path, vlm_recipe(tmp_path, write_jsonl(tmp_path / "broken.jsonl", broken)))
    assert "broken.jsonl: row 2: image file" in line and "cannot be read as an image" in line

    extra = copy.deepcopy(rows)
    extra[4]["images"] = extra[4]["images"] + extra[0]["images"]  # the two-placeholder row given three
    line = _refusal(tmp_path, vlm_recipe(tmp_path, write_jsonl(tmp_path / "extra.jsonl", extra)))
    assert "extra.jsonl: row 5: 2 image placeholder(s)" in line and "but 3 image(s)" in line

    video = copy.deepcopy(rows)
    video[4]["messages"][0]["content"].append({"type": "video"})
    line = _refusal(tmp_path, vlm_recipe(tmp_path, write_jsonl(tmp_path / "video.jsonl", video)))
    assert "video.jsonl: row 5: a content part of type 'video'" in line

    text_model = vlm_recipe(tmp_path, data)
    text_model["model"] = copy.deepcopy(TINY_RECIPE["model"])
    line = _refusal(tmp_path, text_model)
    assert "train.jsonl: row 1: image rows" in line and "llama is text-only" in line

    packed = vlm_recipe(tmp_path, data, data={"packing": True})
    assert "data.packing: rows with images are not packed" in _refusal(tmp_path, packed)

    text_row = copy.deepcopy(rows)
    text_row[1]["images"] = []
    sharded = vlm_recipe(tmp_path, write_jsonl(tmp_path / "text_row.jsonl", text_row), engine={"strategy": "fsdp"})
    line = _refusal(tmp_path, sharded)
    assert "text_row.jsonl: row 2: a row without images, which engine.strategy=fsdp cannot mix" in line


def test_a_wrong_freeze_name_is_one_line_before_the_data_is_prepared(tmp_path):
    """accord train checks model.freeze on the model built from its config on the meta device:
    exit 2, one line listing the parts, no prepared data and no output folder."""
    data = write_image_rows(tmp_path, 2)
    cache = tmp_path / "cache"
    recipe = vlm_recipe(tmp_path, data, model={"freeze": ["vision_tower", "vision"]}, data={"cache_dir": str(cache)})
    line = _refusal(tmp_path, recipe)
    assert "model.freeze: LlavaForConditionalGeneration has no part 'vision' (parts: vision_tower, projector" in line
    assert not cache.exists() and not (tmp_path / "out").exists()
    # A text model's module name, misspelt.
    text = copy.deepcopy(TINY_RECIPE) | {"output": {"dir": str(tmp_path / "text-out")}}
    text["model"] = text["model"] | {"freeze": ["model.embed_token"]}
    text["engine"] = text["engine"] | {"processes": 1}  # the launcher's own checks (cli.main, this process)
    line = _refusal(tmp_path, text)
    assert "model.freeze: LlamaForCausalLM has no part 'model.embed_token'" in line
    assert not (tmp_path / "text-out").exists()


# ---------------------------------------------------------------- one shared pair of runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 16 image rows, 6 steps: 1 process × 8 (the TRL comparison's layout) and
    2 processes × 2 × 2 accumulation steps, both evaluating held-out rows at steps 3 and 6."""
    folder = tmp_path_factory.mktemp("vlm")
    data = write_image_rows(folder, 16)
    held_out = write_image_rows(folder, 8, seed=1, name="eval.jsonl")
    out = {}
    for name, processes, micro in (("one", 1, 8), ("two", 2, 2)):
        recipe = vlm_recipe(
            folder / name,
            data,
            data={"eval": [{"path": str(held_out)}]},
            batch={"global_batch_size": 8, "micro_batch_size": micro},
            train={"max_steps": 6, "eval_every": 3},
            engine={"processes": processes},
            checkpoint={"every_steps": 3},
        )
        assert_ok(run_accord("train", write_recipe(folder / f"{name}.yaml", recipe), timeout=600))
        out[name] = folder / name / "out"
    return folder, data, out


def _variant(runs, name: str, **sections) -> Path:
    """The 2-process run again with `sections` changed; its output folder."""
    folder, data, out = runs
    held_out = folder / "eval.jsonl"
    recipe = vlm_recipe(
        folder / name,
        data,
        data={"eval": [{"path": str(held_out)}]},
        batch={"global_batch_size": 8, "micro_batch_size": 2},
        train={"max_steps": 6, "eval_every": 3},
        engine={"processes": 2},
    )
    for key, section in sections.items():
        recipe[key] = recipe.get(key, {}) | section
    assert_ok(run_accord("train", write_recipe(folder / f"{name}.yaml", recipe), timeout=900))
    return folder / name / "out"


@pytest.mark.slow  # four more 2-process runs
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp", "zero3"])
def test_sharded_strategies_make_the_ddp_updates(runs, strategy):
    """The vision tower sharded layer by layer (fsdp) or by DeepSpeed (zero3): the same
    parameters and losses as DDP's run."""
    _, _, out = runs
    sharded = _variant(runs, strategy, engine={"strategy": strategy})
    assert max_param_diff(final_params(out["two"]), final_params(sharded)) < 1e-5
    ddp, other = step_losses(out["two"]), step_losses(sharded)
    assert max(abs(ddp[s] - other[s]) for s in ddp) < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_on_one_process_ends_as_the_uninterrupted_two_process_run(runs, tmp_path):
    folder, _, out = runs
    checkpoint = out["two"] / "checkpoints" / "step-000003"
    resumed = tmp_path / "resumed"
    proc = run_accord(
        "train", folder / "two.yaml", "engine.processes=1", f"resume={checkpoint}", f"output.dir={resumed}"
    )
    assert_ok(proc)
    assert "resumed from" in proc.stderr
    assert max_param_diff(final_params(out["two"]), final_params(resumed)) < 1e-5
    assert sorted(step_losses(resumed)) == [4, 5, 6]


@pytest.mark.slow
@pytest.mark.distributed
def test_frozen_tower_with_checkpointing_under_fsdp_trains_the_language_model_only(runs):
    """model.freeze with activation checkpointing, sharded: the vision tower and projector end
    as they started, the rest trains."""
    _, _, out = runs
    frozen = _variant(
        runs,
        "frozen",
        model={"freeze": ["vision_tower", "projector"]},
        engine={"strategy": "fsdp", "activation_checkpointing": True},
        checkpoint={"every_steps": None},
    )
    trained, start = final_params(frozen), final_params(out["two"])
    from accord.models.build import build_model, build_tokenizer
    from accord.recipe.schema import ModelConfig

    cfg = ModelConfig(config=TINY_VLM)
    initial = build_model(cfg, build_tokenizer(cfg), seed=TINY_RECIPE["seed"], kind="image_text_to_text").state_dict()
    for name, value in trained.items():
        moved = (value - initial[name]).abs().max().item()
        if ".vision_tower." in name or ".multi_modal_projector." in name:
            assert moved == 0.0, name
    assert any((trained[n] - start[n]).abs().max() > 0 for n in trained if ".language_model." in n)


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_on_the_language_model_exports_a_merged_model_transformers_loads(runs):
    """LoRA (all-linear: the language model's layers) on 2 processes: final/ is the merged
    model with its processor; the vision tower is the starting one."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _, _, out = runs
    adapted = _variant(runs, "lora", lora={"r": 4, "alpha": 8}, checkpoint={"every_steps": None})
    model = AutoModelForImageTextToText.from_pretrained(adapted / "final")
    assert AutoProcessor.from_pretrained(adapted / "final").image_processor is not None
    merged, trained = final_params(adapted), final_params(out["two"])
    assert merged.keys() == trained.keys()
    from accord.models.build import build_model, build_tokenizer
    from accord.recipe.schema import ModelConfig

    cfg = ModelConfig(config=TINY_VLM)
    initial = build_model(cfg, build_tokenizer(cfg), seed=TINY_RECIPE["seed"], kind="image_text_to_text").state_dict()
    tower = [n for n in merged if ".vision_tower." in n]
    assert tower and all(torch.equal(merged[n], initial[n]) for n in tower)
    moved = [n for n in merged if ".language_model." in n and not torch.equal(merged[n], initial[n])]
    assert moved and all("proj" in n for n in moved)
    assert model.config.model_type == "llava"


@pytest.mark.slow  # the example recipe end to end: a few minutes on 2 cores
@pytest.mark.distributed
def test_example_recipe_learns_the_captions(tmp_path):
    """recipes/vision-shapes.yaml as shipped: the held-out caption loss falls well below its
    start, and final/ names the colour of a picture it never saw."""
    from conftest import REPO

    out = tmp_path / "run"
    proc = run_accord("train", REPO / "recipes" / "vision-shapes.yaml", "engine.device=cpu", f"output.dir={out}")
    assert_ok(proc)
    from accord.observe.metrics import read_metrics

    evals = [r["loss"] for r in read_metrics(out) if r["kind"] == "eval"]
    assert evals[-1] < 0.5 * evals[0], evals


@pytest.mark.distributed
def test_one_and_two_processes_end_with_the_same_parameters(runs):
    _, _, out = runs
    assert max_param_diff(final_params(out["one"]), final_params(out["two"])) < 1e-5


@pytest.mark.distributed
def test_held_out_caption_loss_falls(runs):
    from accord.observe.metrics import read_metrics

    _, _, out = runs
    evals = {r["step"]: r["loss"] for r in read_metrics(out["two"]) if r["kind"] == "eval"}
    assert evals[6] < evals[3], evals


@pytest.mark.distributed
def test_final_loads_in_plain_transformers_and_generates(runs):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _, _, out = runs
    processor = AutoProcessor.from_pretrained(out["two"] / "final")
    model = AutoModelForImageTextToText.from_pretrained(out["two"] / "final")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    picture = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (220, 40, 40))
    inputs = processor(text=[text], images=[[picture]], add_special_tokens=False, return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 6 or processor.tokenizer.eos_token_id in generated[0]


@pytest.mark.distributed
def test_losses_equal_trl_sft_trainer_on_the_same_rows_and_order(runs, tmp_path):
    """TRL's SFTTrainer (its vision-language collator, assistant_only_loss through the
    template's generation markers) from the same starting weights, fp32, one process, rows
    in file order, the same optimizer: the same per-step losses as accord's 1-process run."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from accord.models.build import build_model

    folder, data, out = runs
    task, tokenizer, recipe = _task(vlm_recipe(folder / "one", data))
    model = build_model(recipe.model, tokenizer, recipe.seed, "image_text_to_text")
    # The file as TRL users load it: content strings and part lists mixed (datasets' Json
    # feature), the images as datasets' Image feature.
    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    dataset = dataset.map(lambda row: {"images": [str(data.parent / p) for p in row["images"]]})
    dataset = dataset.cast_column("images", datasets.List(datasets.Image()))
    config = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        learning_rate=3.0e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        max_steps=6,
        assistant_only_loss=True,
        max_length=None,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        logging_steps=1,
        report_to=[],
        remove_unused_columns=False,  # the images column reaches TRL's collator
        save_strategy="no",
        seed=recipe.seed,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=task.processor)
    trainer.train()
    trl = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ours = step_losses(out["one"])
    assert len(trl) == 6
    for step, loss in enumerate(trl, start=1):
        assert abs(loss - ours[step]) < 1e-5, (step, loss, ours[step])
