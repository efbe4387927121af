"""Streamed data sources (streaming: true, function: pkg.mod:fn): walked once into token
shards that hold the same tokens as the same rows read from a file."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from accord.data import chunks
from accord.data.sources import DataError
from accord.recipe.schema import RecipeError, validate_recipe
from conftest import TINY_RECIPE, write_jsonl
from test_data_formats import prepared, recipe

SFT_ROWS = [{"prompt": f"{i}+{i % 7}=", "completion": str(i + i % 7)} for i in range(23)]
CHAT_ROWS = [
    {"conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": f"hello {i}"}]} for i in range(9)
]
TEXT_ROWS = [{"text": f"document {i} " + "words and more words " * (i % 5)} for i in range(17)]

MODULE = """
import json
import datasets

def rows():
    with open({path!r}) as f:
        for line in f:
            yield json.loads(line)

def iterable():
    return datasets.IterableDataset.from_generator(rows)

def generator():
    return rows()

def broken():
    raise ValueError("no such bucket")

def not_rows():
    return 42
"""


@pytest.fixture
def data_module(tmp_path, monkeypatch):
    """A module `streamdata` whose functions give the rows of tmp_path/rows.jsonl."""
    (tmp_path / "streamdata.py").write_text(MODULE.replace("{path!r}", repr(str(tmp_path / "rows.jsonl"))))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "streamdata", raising=False)  # another test's module of that name
    return tmp_path / "rows.jsonl"


def prepare(r):
    return prepared(r)[0]


def tokens_of(data):
    shards = data.train
    return [shards.example(i) for i in range(len(shards))], np.asarray(shards.num_targets)


def assert_same(a, b):
    (examples_a, targets_a), (examples_b, targets_b) = tokens_of(a), tokens_of(b)
    assert len(examples_a) == len(examples_b) > 0
    for (ids_a, labels_a), (ids_b, labels_b) in zip(examples_a, examples_b):
        assert ids_a.tolist() == ids_b.tolist() and labels_a.tolist() == labels_b.tolist()
    assert targets_a.tolist() == targets_b.tolist()


@pytest.mark.parametrize("task, rows", [("sft", SFT_ROWS), ("pretrain", TEXT_ROWS)])
@pytest.mark.subprocess
def test_a_streamed_source_gives_the_tokens_of_the_same_rows_from_a_file(tmp_path, data_module, task, rows):
    write_jsonl(data_module, rows)
    from_file = prepare(recipe(tmp_path / "a", task, train=str(data_module)))
    for source in (
        {"path": str(data_module), "streaming": True},
        {"function": "streamdata:iterable"},
        {"function": "streamdata:generator"},
    ):
        assert_same(prepare(recipe(tmp_path / str(len(str(source))), task, train=[source])), from_file)


@pytest.mark.subprocess
def test_streamed_dpo_pairs_and_their_eval_give_the_shards_of_the_same_rows_from_a_file(
    tmp_path, data_module, monkeypatch
):
    rows = [{"prompt": f"{i}+{i % 7}=", "chosen": str(i + i % 7), "rejected": str(i)} for i in range(23)]
    write_jsonl(data_module, rows)
    monkeypatch.setattr(chunks, "UNIT_ROWS", 8)  # 3 units
    from_file = prepare(recipe(tmp_path / "a", "dpo", train=str(data_module), eval=str(data_module)))
    streamed = prepare(
        recipe(
            tmp_path / "b",
            "dpo",
            train=[{"function": "streamdata:iterable"}],
            eval=[{"path": str(data_module), "streaming": True}],
        )
    )
    for split in ("train", "eval"):
        a, b = getattr(from_file, split), getattr(streamed, split)
        assert len(a) == len(b) == len(rows) and a[list(range(len(a)))] == b[list(range(len(b)))]


@pytest.mark.subprocess
def test_streamed_chat_rows_in_several_units_and_workers_match_the_file(tmp_path, data_module, monkeypatch):
    write_jsonl(data_module, CHAT_ROWS)
    monkeypatch.setattr(chunks, "UNIT_ROWS", 4)  # 3 units, tokenised by 2 forked workers
    from_file = prepare(recipe(tmp_path / "a", train=str(data_module)))
    streamed = prepare(recipe(tmp_path / "b", train=[{"function": "streamdata:iterable"}], prepare_workers=2))
    assert_same(streamed, from_file)
    assert streamed.report["train_examples"] == len(CHAT_ROWS)


@pytest.mark.subprocess
def test_a_streamed_eval_source_is_prepared_for_sft(tmp_path, data_module):
    write_jsonl(data_module, SFT_ROWS)
    data = prepare(
        recipe(
            tmp_path, train=[{"function": "streamdata:iterable"}], eval=[{"path": str(data_module), "streaming": True}]
        )
    )
    assert data.report["eval_examples"] == len(SFT_ROWS) == len(data.eval)


def test_a_source_needs_a_path_or_a_function_not_both():
    with pytest.raises(RecipeError, match="either a path or a function"):
        validate_recipe(TINY_RECIPE | {"data": {"train": [{"path": "a.jsonl", "function": "m:f"}]}})


@pytest.mark.parametrize(
    "source, extra, task, message",
    [
        (
            {"function": "streamdata:broken"},
            {},
            "sft",
            r"streamdata:broken: the data function raised ValueError: no such bucket",
        ),
        ({"function": "streamdata:not_rows"}, {}, "sft", r"returned int; return a datasets IterableDataset"),
        ({"function": "nosuchmodule:rows"}, {}, "sft", r"cannot import 'nosuchmodule'"),
        (
            {"function": "streamdata:iterable"},
            {"eval_fraction": 0.1},
            "sft",
            r"eval_fraction=0.1: a streamed source has no random access",
        ),
        (
            {"function": "streamdata:iterable"},
            {},
            "classify",
            r"task classify: a streamed data source .* only sft, pretrain and dpo",
        ),
    ],
)
def test_bad_streamed_sources_are_one_line(tmp_path, data_module, source, extra, task, message):
    write_jsonl(data_module, SFT_ROWS)
    with pytest.raises((DataError, RecipeError, Exception), match=message) as caught:
        prepare(recipe(tmp_path, task, train=[source], **extra))
    assert "\n" not in str(caught.value)


def test_a_bad_row_in_a_stream_names_its_row(tmp_path, data_module):
    rows = SFT_ROWS[:5] + [{"prompt": None, "completion": "x"}] + SFT_ROWS[5:]
    data_module.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"streamdata:iterable: row 6: field 'prompt' is missing or null"):
        prepare(recipe(tmp_path, train=[{"function": "streamdata:iterable"}]))


@pytest.mark.subprocess
def test_a_stream_mixes_with_a_file_source(tmp_path, data_module):
    write_jsonl(data_module, SFT_ROWS)
    files = prepare(recipe(tmp_path / "a", train=[str(data_module), str(data_module)]))
    mixed = prepare(recipe(tmp_path / "b", train=[str(data_module), {"function": "streamdata:iterable"}]))
    assert_same(mixed, files)
    weighted = prepare(
        recipe(tmp_path / "c", train=[str(data_module), {"function": "streamdata:iterable", "weight": 3}])
    )
    assert weighted.report["train_examples"] > 2 * len(SFT_ROWS)  # the smaller share repeats until both were seen
