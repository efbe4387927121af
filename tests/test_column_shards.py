"""classify, dpo and reward prepared as multi-column token shards (data/columns.py): the same
examples the Arrow encoding gave, read by reference, refused when damaged."""

from __future__ import annotations

import numpy as np
import pytest

from accord.data.columns import ColumnShards, ColumnWriter, Schema, encode_columns
from accord.data.fetch import fetch
from accord.data.prepare import _encode, cache_folder, prepare_data, reads_datasets
from accord.data.sources import DataError
from accord.data.split import load_split
from accord.models.build import build_byte_tokenizer
from accord.recipe.schema import validate_recipe
from accord.tasks import build_task, task_class, task_config
from conftest import recipe_for, write_jsonl


def _arrow_examples(recipe, tokenizer, split: str):
    """The examples (and counts) of the Arrow path these shards replace (prepare._encode)."""
    task = build_task(task_config(recipe), tokenizer)
    train, eval_ds = task.fit(*load_split(recipe.data, recipe.seed, task.text_fields))
    key = cache_folder(recipe.data, recipe.seed, tokenizer, task).name
    encoded, counts = _encode(train if split == "train" else eval_ds, task, recipe.data, split, key)
    return fetch(encoded, range(len(encoded))), counts


@pytest.mark.parametrize("name", ["classify", "dpo", "reward", "classify-pair"])
def test_shards_hold_the_examples_the_arrow_encoding_gave(tmp_path, name):
    task_name = name.split("-")[0]
    recipe = recipe_for(task_name, tmp_path)
    recipe["data"] |= {"max_length": 9, "truncation": "truncate", "prepare_workers": 2}
    if name == "classify-pair":  # token types of an encoder's text pairs, and integer labels 0-11
        rows = [{"text": f"row {i} " * (i % 5), "text_pair": "pair" * (i % 3), "label": i % 12} for i in range(40)]
        recipe["data"]["train"] = str(write_jsonl(tmp_path / "pairs.jsonl", rows))
    recipe = validate_recipe(recipe)
    tokenizer = build_byte_tokenizer()
    if name == "classify-pair":
        tokenizer.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    task = build_task(task_config(recipe), tokenizer)
    data = prepare_data(recipe.data, recipe.seed, tokenizer, task, preparer=True)
    assert isinstance(data.train, ColumnShards) and isinstance(data.eval, ColumnShards)
    for split, shards in (("train", data.train), ("eval", data.eval)):
        old, counts = _arrow_examples(recipe, tokenizer, split)
        assert fetch(shards, range(len(shards))) == [{k: e[k] for k in shards.column_names} for e in old]
        if split == "train":
            assert {k: data.report[k] for k in counts} == counts and counts["train_over_length"] > 0
    if name == "classify-pair":
        assert "token_type_ids" in data.train.column_names and data.train["label_id"].max() == 11
    assert not reads_datasets(recipe.data, task_class(recipe.task, recipe.model))  # the workers never import datasets


def test_dropped_examples_leave_every_column_aligned(tmp_path):
    rows = [{"prompt": "p" * (i % 7), "chosen": "c" * (i % 11), "rejected": f"r{i}"} for i in range(60)]
    recipe = recipe_for("dpo", tmp_path)
    recipe["data"] |= {
        "train": str(write_jsonl(tmp_path / "d.jsonl", rows)),
        "max_length": 12,
        "truncation": "drop",
        "eval_fraction": 0,
    }
    recipe = validate_recipe(recipe)
    tokenizer = build_byte_tokenizer()
    data = prepare_data(recipe.data, recipe.seed, tokenizer, build_task(task_config(recipe), tokenizer), preparer=True)
    old, counts = _arrow_examples(recipe, tokenizer, "train")
    assert counts["train_dropped"] > 0 and len(data.train) == len(old) == 60 - counts["train_dropped"]
    assert fetch(data.train, range(len(old))) == [{k: e[k] for k in data.train.column_names} for e in old]
    assert data.train.add_column("ref_logp", np.ones((len(old), 2)))[[3]]["ref_logp"] == [[1.0, 1.0]]


def test_a_truncated_column_file_or_another_tokenizer_is_refused(tmp_path):
    schema = Schema(("a_ids", "b_ids"), labels={"a_labels": "a_ids"}, values={"label_id": "int32"})
    writer = ColumnWriter(tmp_path / "s", schema, np.dtype(np.uint16))
    out = {
        "a_ids": [[1, 2, 3], [4]],
        "a_labels": [[-100, 2, 3], [4]],
        "b_ids": [[5], [6, 7]],
        "label_id": [1, 0],
        "length": [3, 2],
        "num_targets": [1, 1],
        "over_length": [False, False],
    }
    writer.add_chunk(encode_columns(schema, out, np.dtype(np.uint16)), np.array([True, True]))
    writer.close("tok")
    assert ColumnShards(tmp_path / "s", "tok")[1] == {
        "a_ids": [4],
        "b_ids": [6, 7],
        "a_labels": [4],
        "label_id": 0,
        "length": 2,
        "num_targets": 1,
    }
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        ColumnShards(tmp_path / "s", "other")
    with open(tmp_path / "s" / "b_ids.ids.bin", "r+b") as f:
        f.truncate(2)
    with pytest.raises(DataError, match=r"b_ids.ids.bin: truncated or damaged \(2 bytes, expected 6\)"):
        ColumnShards(tmp_path / "s", "tok")
