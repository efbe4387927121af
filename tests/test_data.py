"""Data sources, bad data, and the tokenization cache — without starting workers."""

from __future__ import annotations

import json

import pytest

from accord.data.prepare import cache_folder, prepare_data
from accord.data.sources import DataError, load_source
from accord.data.split import load_split
from accord.models.build import build_byte_tokenizer
from accord.recipe.schema import SourceConfig, validate_recipe
from accord.tasks import build_task, task_config
from conftest import TINY_RECIPE, recipe_for, run_accord_here, write_jsonl, write_recipe

ROWS = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(12)]


def sft_recipe(tmp_path, **data):
    raw = TINY_RECIPE | {"data": {"max_length": 32, "cache_dir": str(tmp_path / "cache"), **data}}
    return validate_recipe(raw)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "tsv", "parquet", "arrow"])
def test_every_local_format_reads_the_same_rows(tmp_path, fmt):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, ROWS)
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt in ("csv", "tsv"):
        sep = "," if fmt == "csv" else "\t"
        path.write_text(f"prompt{sep}completion\n" + "".join(f"{r['prompt']}{sep}{r['completion']}\n" for r in ROWS))
    elif fmt == "parquet":
        ds.to_parquet(str(path))
    else:
        ds.save_to_disk(str(path))
    loaded = load_source(SourceConfig(path=str(path)), ("prompt", "completion"))
    assert [{k: str(r[k]) for k in ("prompt", "completion")} for r in loaded] == ROWS


def test_a_folder_of_text_files_is_one_document_per_file(tmp_path):
    (tmp_path / "a.txt").write_text("first document\nline two")
    (tmp_path / "b.txt").write_text("second")
    loaded = load_source(SourceConfig(path=str(tmp_path)), ("text",))
    assert sorted(loaded["text"]) == ["first document\nline two", "second"]


def test_latin_1_csv_and_text_files_are_decoded(tmp_path):
    (tmp_path / "rows.csv").write_bytes("sentence,sentiment\ncafé crème,positive\n".encode("latin-1"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "play.txt").write_bytes("naïve façade".encode("latin-1"))
    rows = load_source(
        SourceConfig(
            path=str(tmp_path / "rows.csv"), encoding="latin-1", fields={"text": "sentence", "label": "sentiment"}
        ),
        ("text", "label"),
    )
    assert (rows[0]["text"], rows[0]["label"]) == ("café crème", "positive")
    texts = load_source(SourceConfig(path=str(tmp_path / "texts"), format="text", encoding="latin-1"), ("text",))
    assert texts["text"] == ["naïve façade"]


def test_fields_rename_columns(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "q", "answer": "a"}])
    loaded = load_source(
        SourceConfig(path=str(path), fields={"prompt": "question", "completion": "answer"}), ("prompt", "completion")
    )
    assert loaded[0]["prompt"] == "q" and loaded[0]["completion"] == "a"


def test_a_package_path_resolves_inside_the_installed_package():
    from accord.recipe.paths import resolve_path

    assert resolve_path("pkg:accord/recipe/schema.py").is_file()
    with pytest.raises(DataError, match="Python package 'no_such_package_xyz' is not installed"):
        load_source(SourceConfig(path="pkg:no_such_package_xyz/data.csv"), ("text",))


def test_missing_field_names_the_field_and_the_fields_present(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"missing field 'prompt', 'completion' \(fields present: question, answer\)"):
        load_source(SourceConfig(path=str(path)), ("prompt", "completion"))


def test_weighted_sources_are_mixed_in_proportion(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "completion": str(i)} for i in range(100)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b", "completion": str(i)} for i in range(100)])
    cfg = sft_recipe(tmp_path, train=[{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}]).data
    train, _ = load_split(cfg, seed=0, required=("prompt", "completion"))
    share_a = train["prompt"].count("a") / len(train)
    assert 0.65 < share_a < 0.85 and set(train.filter(lambda r: r["prompt"] == "b")["completion"]) == {
        str(i) for i in range(100)
    }


def test_a_mixture_takes_each_sources_count_or_fraction_seeded_and_with_its_own_columns(tmp_path):
    """Three sources, each its own columns and share: `count` beyond a source's rows repeats it
    whole, `fraction` draws that share; the same seed gives the same rows, in the same order."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"q": "a", "r": str(i)} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b", "completion": str(i)} for i in range(40)])
    c = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "c", "completion": str(i)} for i in range(8)])
    sources = [
        {"path": str(a), "count": 25, "fields": {"prompt": "q", "completion": "r"}},
        {"path": str(b), "fraction": 0.25},
        {"path": str(c)},
    ]
    cfg = sft_recipe(tmp_path, train=sources).data
    train, _ = load_split(cfg, seed=3, required=("prompt", "completion"))
    again, _ = load_split(cfg, seed=3, required=("prompt", "completion"))
    assert [train["prompt"].count(x) for x in "abc"] == [25, 10, 8]
    from_a = train.filter(lambda r: r["prompt"] == "a")["completion"]
    assert set(from_a) == {str(i) for i in range(10)}  # every row once before any repeats
    assert train["completion"] == again["completion"] and train["__row"] == again["__row"]
    other, _ = load_split(cfg, seed=4, required=("prompt", "completion"))
    assert other["__row"] != train["__row"]


def test_a_source_with_both_fraction_and_count_is_refused():
    with pytest.raises(ValueError, match="fraction or count, not both"):
        SourceConfig(path="a.jsonl", fraction=0.5, count=3)


def test_generated_pairs_are_the_sums_each_chosen_over_a_one_digit_near_miss():
    """data.generate.kind addition_pairs: the prompts of kind addition with the same seed, in
    the same order and split; chosen the sum, rejected the sum with exactly one digit changed
    (never to a leading zero); the wrong answers are seeded like the sums."""
    from accord.data.generated import generate
    from accord.recipe.schema import GeneratedData

    def made(kind: str, seed: int = 0):
        return generate(GeneratedData(kind=kind, train_examples=2000, eval_examples=200, max_digits=2), seed)

    sums, pairs = made("addition"), made("addition_pairs")
    assert pairs == made("addition_pairs") and pairs != made("addition_pairs", seed=1)
    for sum_rows, pair_rows in zip(sums, pairs):
        assert [r["prompt"] for r in pair_rows] == [r["prompt"] for r in sum_rows]
        assert [r["chosen"] for r in pair_rows] == [r["completion"] for r in sum_rows]
        for row in pair_rows:
            chosen, rejected = row["chosen"], row["rejected"]
            assert len(rejected) == len(chosen) and sum(a != b for a, b in zip(chosen, rejected)) == 1, row
            assert rejected.isdigit() and (len(rejected) == 1 or rejected[0] != "0"), row
    train, held_out = pairs
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert {len(r["chosen"]) for r in train} == {1, 2, 3}  # one-digit sums get a near miss too


def test_held_out_fraction_is_seeded_and_disjoint(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ROWS * 5)
    cfg = sft_recipe(tmp_path, train=str(path), eval_fraction=0.2).data
    train, held = load_split(cfg, seed=0, required=("prompt", "completion"))
    again, held_again = load_split(cfg, seed=0, required=("prompt", "completion"))
    assert (len(train), len(held)) == (48, 12) and held["__row"] == held_again["__row"]
    assert not set(train["__row"]) & set(held["__row"])


def test_chatterbot_and_contrastive_adapters(tmp_path):
    (tmp_path / "c.yml").write_text("conversations:\n- - Hi\n  - Hello!\n- - How are you?\n  - Fine.\n  - Good.\n")
    chat = load_source(SourceConfig(path=str(tmp_path / "c.yml")), ())
    assert chat[0]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    pairs = tmp_path / "p.json"
    pairs.write_text(
        json.dumps(
            [
                {
                    "positive": "Question?\nChoices: (A) (B)\nAnswer: (A)",
                    "negative": "Question?\nChoices: (A) (B)\nAnswer: (B)",
                }
            ]
        )
    )
    row = load_source(SourceConfig(path=str(pairs), format="contrastive"), ("prompt", "chosen", "rejected"))[0]
    assert (row["prompt"], row["chosen"], row["rejected"]) == ("Question?\nChoices: (A) (B)\nAnswer: ", "(A)", "(B)")


# ---------------------------------------------------------------- bad data: one line, before training


def prepare(recipe):
    tokenizer = build_byte_tokenizer()
    task = build_task(task_config(recipe), tokenizer)
    return prepare_data(recipe.data, recipe.seed, tokenizer, task, preparer=True)


@pytest.mark.parametrize(
    "name, text, what",
    [
        ("empty.jsonl", "", "empty"),
        ("blank.jsonl", "\n  \n", "blank \\(only white space\\)"),
        ("empty.csv", "", "empty"),
        ("empty.json", "", "empty"),
        ("empty.parquet", "", "empty"),
    ],
)
def test_an_empty_data_file_is_named_with_its_cause(tmp_path, name, text, what):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=f"{name}: the file is {what}: it has no rows; fill it or leave it out"):
        prepare(sft_recipe(tmp_path, train=str(tmp_path / name)))


def test_label_outside_the_label_set(tmp_path):
    raw = recipe_for("classify", tmp_path)
    raw["classify"] = {"labels": ["pos", "neg"]}
    with pytest.raises(DataError, match=r"labels.csv: row \d+: label 'neu' is not in the label set \['pos', 'neg'\]"):
        prepare(validate_recipe(raw))


def test_example_without_targets(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"chat.jsonl: row 1: no assistant turn, so nothing to train on"):
        prepare(sft_recipe(tmp_path, train=str(path)))


def test_over_long_example_with_truncation_error(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", ROWS + [{"prompt": "x" * 100, "completion": "y"}])
    with pytest.raises(DataError, match=r"long.jsonl: row 13: 1 train example\(s\) are longer than data.max_length=32"):
        prepare(sft_recipe(tmp_path, train=str(path), truncation="error"))


def test_drop_and_truncate_policies_are_counted(tmp_path):
    path = write_jsonl(
        tmp_path / "long.jsonl",
        ROWS + [{"prompt": "x" * 100, "completion": "y"}, {"prompt": "1", "completion": "z" * 100}],
    )
    dropped = prepare(sft_recipe(tmp_path, train=str(path), truncation="drop")).report
    assert (dropped["train_examples"], dropped["train_over_length"], dropped["train_dropped"]) == (12, 2, 2)
    cut = prepare(sft_recipe(tmp_path, train=str(path), truncation="truncate")).report
    # the over-long prompt leaves no completion token: nothing to learn, so it is left out
    assert (cut["train_examples"], cut["train_over_length"], cut["train_dropped"]) == (13, 2, 1)


def test_bad_data_stops_the_cli_before_workers(tmp_path):
    raw = recipe_for("classify", tmp_path)
    raw["classify"] = {"labels": ["pos", "neg"]}
    raw["output"] = {"dir": str(tmp_path / "out")}
    # On 2 processes the first worker checks the data; on 1, the launcher itself (test_cli_errors).
    proc = run_accord_here("train", write_recipe(tmp_path / "r.yaml", raw), "engine.processes=1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is not in the label set" in proc.stderr and "accord: batch" not in proc.stderr


# ---------------------------------------------------------------- the cache


def test_prepared_data_is_cached_and_reused(tmp_path, monkeypatch):
    recipe = sft_recipe(tmp_path, train=str(write_jsonl(tmp_path / "a.jsonl", ROWS)))
    first = prepare(recipe)
    from accord.tasks.sft import SFTTask

    monkeypatch.setattr(SFTTask, "encode_batch", lambda self, batch: pytest.fail("re-tokenized despite the cache"))
    second = prepare(recipe)
    assert second.train["input_ids"] == first.train["input_ids"]


def test_cache_key_changes_with_data_tokenizer_settings(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ROWS)
    tokenizer = build_byte_tokenizer()
    base = sft_recipe(tmp_path, train=str(path))
    key = lambda r: cache_folder(r.data, r.seed, tokenizer, build_task(task_config(r), tokenizer)).name  # noqa: E731
    assert key(base) == key(sft_recipe(tmp_path, train=str(path)))
    assert key(base) != key(sft_recipe(tmp_path, train=str(path), max_length=64))
    assert key(base) != key(sft_recipe(tmp_path, train=str(path), completion_only_loss=False))
    before = key(base)
    path.write_text(path.read_text() + json.dumps({"prompt": "x", "completion": "y"}) + "\n")
    assert key(base) != before


def test_cache_key_of_a_recipe_stays_the_same_across_versions():
    """The prepared data is found again by this key: a change of what the fingerprint hashes
    (or how) re-prepares every user's data. On purpose only with FORMAT_VERSION (or when the
    tokenizer library describes the same tokenizer differently); then update the value here."""
    recipe = validate_recipe(TINY_RECIPE)
    tokenizer = build_byte_tokenizer()
    task = build_task(task_config(recipe), tokenizer)
    assert cache_folder(recipe.data, recipe.seed, tokenizer, task).name == "sft-816bcda6d38d6035"


def test_waiting_process_reports_the_preparers_error_and_times_out(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    recipe = sft_recipe(tmp_path, train=str(bad), prepare_timeout_s=1)
    with pytest.raises(DataError, match="no assistant turn"):
        prepare(recipe)
    tokenizer = build_byte_tokenizer()
    with pytest.raises(DataError, match="no assistant turn"):  # a waiting rank gets the same line
        prepare_data(recipe.data, recipe.seed, tokenizer, build_task(task_config(recipe), tokenizer), preparer=False)
    fresh = sft_recipe(tmp_path, train=str(write_jsonl(tmp_path / "fresh.jsonl", ROWS)), prepare_timeout_s=1)
    with pytest.raises(DataError, match="not prepared within data.prepare_timeout_s=1 s"):
        prepare_data(fresh.data, fresh.seed, tokenizer, build_task(task_config(fresh), tokenizer), preparer=False)
