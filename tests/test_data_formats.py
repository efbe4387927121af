"""Data formats people bring (ShareGPT, content parts, text cut into documents, globbed folders,
relative paths, integer labels) and what a run says about its data. Pure: no worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import accord
from accord.data.prepare import prepare_data
from accord.data.sources import DataError, load_source
from accord.data.split import held_out_warning, load_split
from accord.models.build import build_byte_tokenizer
from accord.recipe.schema import SourceConfig, load_recipe, validate_recipe
from accord.tasks import build_task, task_config
from conftest import TINY_RECIPE, write_jsonl, write_recipe

CHAT = [
    [("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4")],
    [("user", "Say hi"), ("assistant", "hi"), ("user", "again"), ("assistant", "hi!")],
]
SHAREGPT_NAMES = {"system": "system", "user": "human", "assistant": "gpt"}


def recipe(tmp_path, task="sft", **data):
    raw = TINY_RECIPE | {"task": task, "data": {"max_length": 64, "cache_dir": str(tmp_path / "cache"), **data}}
    return validate_recipe(raw)


def prepared(r):
    tokenizer = build_byte_tokenizer()
    task = build_task(task_config(r), tokenizer)
    return prepare_data(r.data, r.seed, tokenizer, task, preparer=True), task


def test_sharegpt_and_content_parts_give_the_same_tokens_as_messages(tmp_path):
    shapes = {
        "messages": [{"messages": [{"role": r, "content": c} for r, c in chat]} for chat in CHAT],
        "sharegpt": [{"conversations": [{"from": SHAREGPT_NAMES[r], "value": c} for r, c in chat]} for chat in CHAT],
        "parts": [
            {"messages": [{"role": r, "content": [{"type": "text", "text": c}]} for r, c in chat]} for chat in CHAT
        ],
    }
    encoded = {}
    for name, rows in shapes.items():
        data, _ = prepared(recipe(tmp_path, train=str(write_jsonl(tmp_path / f"{name}.jsonl", rows))))
        encoded[name] = (data.train["input_ids"], data.train["labels"])
    assert encoded["sharegpt"] == encoded["messages"] and encoded["parts"] == encoded["messages"]
    assert sum(label != -100 for label in encoded["messages"][1][1]) > 0  # assistant turns carry the loss
    two_parts = write_jsonl(
        tmp_path / "two.jsonl",
        [{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}],
    )
    assert load_source(SourceConfig(path=str(two_parts)), ())[0]["messages"][0]["content"] == "a\nb"


def test_a_sharegpt_role_outside_the_mapping_and_a_non_text_part_name_the_file_and_row(tmp_path):
    bad = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "narrator", "value": "hello"}]},
        ],
    )
    with pytest.raises(DataError, match=r"c\.jsonl: row 2: ShareGPT role 'narrator' is not one of human, user, gpt"):
        load_source(SourceConfig(path=str(bad)), ())
    image = write_jsonl(
        tmp_path / "i.jsonl", [{"messages": [{"role": "user", "content": [{"type": "image_url", "text": None}]}]}]
    )
    with pytest.raises(DataError, match=r"i\.jsonl: row 1: a message content part of type 'image_url'"):
        load_source(SourceConfig(path=str(image)), ())


def test_text_is_cut_into_documents_by_line_paragraph_or_separator(tmp_path):
    path = tmp_path / "fortunes.txt"
    path.write_text("A penny saved.\nIs a penny earned.\n%\n\nHe who hesitates\n  \nis lost, 50% of the time.\n%\n")

    def docs(document):
        return load_source(SourceConfig(path=str(path), document=document), ("text",))["text"]

    assert docs("file") == [path.read_text()]
    assert docs("line") == [
        "A penny saved.",
        "Is a penny earned.",
        "%",
        "He who hesitates",
        "is lost, 50% of the time.",
        "%",
    ]  # blank lines are no documents
    assert docs("paragraph") == [
        "A penny saved.\nIs a penny earned.\n%",
        "He who hesitates",
        "is lost, 50% of the time.\n%",
    ]
    assert docs({"separator": "\n%\n"}) == [
        "A penny saved.\nIs a penny earned.",
        "He who hesitates\n  \nis lost, 50% of the time.",
    ]
    with pytest.raises(DataError, match=r"fortunes\.txt: the document separator '@@' never occurs in this file"):
        docs({"separator": "@@"})
    with pytest.raises(DataError, match=r"document: line splits text files; this source is jsonl"):
        load_source(
            SourceConfig(path=str(write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])), document="line"), ("text",)
        )


def test_a_folder_glob_picks_the_files_and_one_matching_nothing_is_an_error(tmp_path):
    (tmp_path / "docs" / "deep").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("alpha")
    (tmp_path / "docs" / "deep" / "b.md").write_text("beta")
    (tmp_path / "docs" / "notes.txt").write_text("gamma")
    folder = str(tmp_path / "docs")
    assert load_source(SourceConfig(path=folder), ("text",))["text"] == [
        "gamma"
    ]  # default: the folder's format's suffixes
    assert load_source(SourceConfig(path=folder, glob="**/*.md"), ("text",))["text"] == ["alpha", "beta"]
    with pytest.raises(DataError, match=r"docs: glob: '\*\*/\*\.rst' matches no files in this folder"):
        load_source(SourceConfig(path=folder, glob="**/*.rst"), ("text",))


def test_relative_paths_are_read_beside_the_recipe_and_the_error_says_where_it_looked(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    write_jsonl(project / "rows.jsonl", [{"prompt": "1+1=", "completion": "2"}])
    raw = TINY_RECIPE | {"data": {"train": "rows.jsonl", "eval": "missing.jsonl", "cache_dir": str(tmp_path / "cache")}}
    path = write_recipe(project / "r.yaml", raw)
    monkeypatch.chdir(tmp_path)
    loaded = load_recipe(path)
    assert loaded.data.train[0].path == str(project / "rows.jsonl")
    with pytest.raises(
        DataError, match=rf"data.eval: data source 'missing.jsonl' not found \(looked in {tmp_path} and {project}; "
    ):
        load_split(loaded.data, 0, ("prompt", "completion"))
    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "from the", "completion": "current folder"}])
    assert load_recipe(path).data.train[0].path == "rows.jsonl"  # as before: the current folder first


def classify_fit(tmp_path, rows, labels=None):
    """(task after fit, the label ids it encodes the rows with); `rows`: a list, or a source path."""
    r = recipe(
        tmp_path, "classify", train=rows if isinstance(rows, str) else str(write_jsonl(tmp_path / "labels.jsonl", rows))
    )
    if labels:
        r = validate_recipe(r.model_dump(mode="json") | {"classify": {"labels": labels}})
    task = build_task(task_config(r), build_byte_tokenizer())
    train, _ = load_split(r.data, 0, task.text_fields)
    task.fit(train, None)
    return task, task.encode_batch(train[:])["label_id"]


def test_integer_labels_keep_their_ids_and_can_be_named(tmp_path):
    rows = [{"text": f"t{i}", "label": i} for i in (11, 2, 0, 10, 1, 3, 4, 5, 6, 7, 8, 9)]
    task, ids = classify_fit(tmp_path, rows)
    assert task.model_kwargs()["id2label"] == {i: str(i) for i in range(12)} and ids == [r["label"] for r in rows]
    task, ids = classify_fit(
        tmp_path, [{"text": "a", "label": 1}, {"text": "b", "label": 0}], labels=["different", "same"]
    )
    assert task.model_kwargs()["id2label"] == {0: "different", 1: "same"} and ids == [1, 0]
    with pytest.raises(DataError, match=r"row 2: label 2 is not in the label set ids 0=different, 1=same"):
        classify_fit(tmp_path, [{"text": "a", "label": 1}, {"text": "b", "label": 2}], labels=["different", "same"])
    task, ids = classify_fit(tmp_path, [{"text": "a", "label": "10"}, {"text": "b", "label": "9"}])
    assert task.labels == ["9", "10"] and ids == [1, 0]  # numbers written as text: numeric order


def test_labels_are_read_a_batch_at_a_time_and_a_bad_one_names_its_own_row(tmp_path, monkeypatch):
    from accord.tasks import classify

    monkeypatch.setattr(classify, "LABEL_BATCH_ROWS", 4)  # 11 rows: three batches
    rows = [{"text": f"t{i}", "label": i % 3} for i in range(11)]
    task, ids = classify_fit(tmp_path, rows)
    assert task.labels == ["0", "1", "2"] and ids == [i % 3 for i in range(11)]
    rows[9]["label"] = 5
    with pytest.raises(DataError, match=r"row 10: label 5 is not in the label set ids 0=different, 1=same, 2=other"):
        classify_fit(tmp_path, rows, labels=["different", "same", "other"])


def test_a_save_to_disk_folder_with_a_class_label_column_brings_its_names(tmp_path):
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    rows = datasets.Dataset.from_list(
        [{"text": "bad", "label": 0}, {"text": "good", "label": 1}, {"text": "fine", "label": 1}], features=features
    )
    datasets.DatasetDict({"train": rows}).save_to_disk(str(tmp_path / "saved"))
    task, ids = classify_fit(tmp_path, str(tmp_path / "saved"))
    assert task.model_kwargs()["id2label"] == {0: "neg", 1: "pos"} and ids == [0, 1, 1]


def test_eval_fraction_over_documents_holds_out_that_share_of_the_text(tmp_path):
    folder = tmp_path / "novels"
    folder.mkdir()
    for k, lines in enumerate([400, 900, 150, 1200, 700, 300, 1000, 500]):  # one novel is ~20% of the text
        (folder / f"novel{k}.txt").write_text("".join(f"novel {k} line {n} of some words\n" for n in range(lines)))
    train, held = load_split(recipe(tmp_path, "pretrain", train=str(folder), eval_fraction=0.05).data, 0, ("text",))
    sizes = [sum(map(len, ds["text"])) for ds in (train, held)]
    assert 0.045 < sizes[1] / sum(sizes) < 0.055 and all(t.endswith("\n") for t in held["text"])  # cut at a line break
    assert "".join(list(train["text"]) + list(held["text"])).count("\n") == sum(
        [400, 900, 150, 1200, 700, 300, 1000, 500]
    )
    assert held_out_warning(0.05, 900, 100) is None
    assert "held-out split has 15.0% of the tokens, over twice data.eval_fraction=0.05" in held_out_warning(
        0.05, 850, 150
    )


def test_saving_a_lora_adapter_looks_nothing_up_on_the_hub(tmp_path, monkeypatch):
    import os
    import warnings

    from transformers import AutoModelForCausalLM, LlamaConfig

    from accord.models.build import adapter_saving, apply_lora
    from accord.recipe.schema import LoraConfig

    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.name_or_path = str(tmp_path / ".cache" / "converted-gguf")  # where transformers loaded it from
    wrapped = apply_lora(model, LoraConfig(r=2, target_modules=["q_proj"]), "causal_lm", seed=0)
    wrapped.peft_config["default"].base_model_name_or_path = "models/tiny.gguf"  # no folder: peft would ask the hub
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    requests = []
    monkeypatch.setattr("peft.utils.other.file_exists", lambda *a, **k: requests.append(a) or True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*config file")  # nor a warning about the base
        with adapter_saving():
            wrapped.save_pretrained(tmp_path / "adapter")
    assert requests == [] and "HF_HUB_OFFLINE" not in os.environ  # no hub lookup of the base, and the setting restored
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "models/tiny.gguf"


def test_a_lora_adapter_names_a_base_that_loads_from_any_folder(tmp_path, monkeypatch):
    """A hub cache snapshot by hub id and revision, a plain folder or `pkg:` folder by absolute
    path; a .gguf file, a model built from a config or a rescaled RoPE: None (the run writes base/)."""
    from accord.models.build import adapter_base
    from accord.recipe.schema import ModelConfig

    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert adapter_base(ModelConfig(path=str(snapshot))) == ("HuggingFaceTB/SmolLM2-135M", "abc123")
    assert adapter_base(ModelConfig(path="hub")) == (str(tmp_path.resolve() / "hub"), None)
    assert adapter_base(ModelConfig(path="pkg:accord/recipe")) == (str(Path(accord.__file__).parent / "recipe"), None)
    assert adapter_base(ModelConfig(path="tiny.gguf")) is None
    assert adapter_base(ModelConfig(config={"architecture": "llama"})) is None
    assert adapter_base(ModelConfig(path="hub", rope_scaling={"rope_type": "linear", "factor": 2.0})) is None


def test_accord_data_shows_the_loss_tokens_and_the_counts(tmp_path, capsys):
    from accord.cli.main import main

    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(6)] + [
        {"prompt": "long:", "completion": "y" * 40}
    ]
    train = write_jsonl(tmp_path / "rows.jsonl", rows)
    path = write_recipe(
        tmp_path / "r.yaml",
        TINY_RECIPE | {"data": {"train": str(train), "max_length": 32, "cache_dir": str(tmp_path / "cache")}},
    )
    assert main(["data", str(path), "--show", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:5] == ["--- example 1", "<|bos|>0+1=[[1<|eos|>]]", "--- example 2", "<|bos|>1+1=[[2<|eos|>]]"]
    assert "examples: 7 training, 0 held out" in out
    # 6 × 7 tokens (BOS, 4 of prompt, answer, EOS) + 32 (the last, cut); 6 × 2 + 32 - 6 targets
    assert "tokens: 74 training (38 target tokens, 51.4%), 0 held out" in out
    assert "truncations: 1 longer than data.max_length=32 (0 dropped, data.truncation=truncate)" in out
    assert "packing: 7 examples in 3 rows of 32 tokens, 77.1% filled" in out  # 32 | 4 × 7 | 2 × 7
    # The one row the seeded split holds out (seed 7, as in TINY_RECIPE) is the long one: 28 of 64 tokens.
    rows = [{"prompt": "a", "completion": "b"}] * 10
    rows[np.random.default_rng([7, 0x5EED]).permutation(10)[0]] = {"prompt": "long " * 5, "completion": "x"}
    skewed = write_jsonl(tmp_path / "skewed.jsonl", rows)
    assert main(["data", str(path), f"data.train={skewed}", "data.eval_fraction=0.1", "--show", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("warning: the held-out split has 43.8% of the tokens, over twice data.eval_fraction=0.1")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "narrator", "value": "x"}]}])
    assert main(["data", str(path), f"data.train={bad}"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
