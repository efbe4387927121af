"""Token shards: compact prepared data read by reference, prepared in resumable chunks, in an
order that no world size changes."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from accord.cli.main import main
from accord.data import chunks
from accord.data.order import GlobalOrder
from accord.data.packing import Rows, training_rows
from accord.data.prepare import cache_folder, prepare_data
from accord.data.shards import ShardWriter, TokenShards
from accord.distributed.batch_plan import BatchPlan
from accord.launch import refusal_relay as refusals
from accord.models.build import build_byte_tokenizer
from accord.recipe.schema import validate_recipe
from accord.tasks import build_task, task_config
from accord.tasks.base import IGNORE, text_prefix, token_ids
from conftest import TINY_RECIPE, write_recipe

WORDS = "the of and to in a that was he she it with for as his her on be at by had not but from".split()


def _text(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words))


def _recipe(tmp_path, task: str, train, **data):
    recipe = json.loads(json.dumps(TINY_RECIPE))
    recipe["task"] = task
    recipe["data"] = {
        "train": train,
        "max_length": 64,
        "cache_dir": str(tmp_path / "cache"),
        "prepare_workers": 1,
    } | data
    return validate_recipe(recipe)


def _prepare(recipe):
    tokenizer = build_byte_tokenizer()
    task = build_task(task_config(recipe), tokenizer)
    return prepare_data(recipe.data, recipe.seed, tokenizer, task, preparer=True), cache_folder(
        recipe.data, recipe.seed, tokenizer, task
    )


def test_shards_store_ids_compactly_and_give_back_ids_and_labels(tmp_path):
    rng = np.random.default_rng(0)
    examples = [(rng.integers(0, 259, n), rng.random(n) < 0.6) for n in rng.integers(2, 200, 300)]
    writer = ShardWriter(tmp_path / "s", np.dtype(np.uint16))
    for part in (examples[:7], examples[7:]):  # pieces whose mask bits do not end on a byte
        writer.add_examples(
            np.concatenate([ids for ids, _ in part]),
            np.concatenate([m for _, m in part]),
            np.array([len(ids) for ids, _ in part]),
            np.array([int(m[1:].sum()) for _, m in part]),
        )
    meta = writer.close("tok")
    shards = TokenShards(tmp_path / "s", "tok")
    assert len(shards) == 300 and shards["length"].tolist() == [len(ids) for ids, _ in examples]
    got = shards[[5, 299, 0]]
    for k, i in enumerate([5, 299, 0]):
        ids, mask = examples[i]
        assert got["input_ids"][k] == ids.tolist()
        assert got["labels"][k] == np.where(mask, ids, IGNORE).tolist()
    per_token = sum(meta["bytes"].values()) / meta["tokens"]
    assert per_token < 2.3, per_token  # uint16 ids + 1 bit + 12 index bytes per ~100-token example


def test_a_stream_written_in_pieces_is_cut_into_the_same_blocks_as_whole(tmp_path):
    stream = np.random.default_rng(1).integers(0, 259, 1000)
    writer = ShardWriter(tmp_path / "s", np.dtype(np.uint16), block_length=64)
    for piece in np.split(stream, [3, 100, 101, 640]):
        writer.add_stream(piece)
    writer.close("tok")
    shards = TokenShards(tmp_path / "s")
    blocks = [stream[i : i + 64].tolist() for i in range(0, 1000, 64)]
    assert shards[list(range(len(shards)))]["input_ids"] == blocks
    assert shards["num_targets"].tolist() == [len(b) - 1 for b in blocks]


@pytest.mark.subprocess
def test_a_huge_document_prepares_in_pieces_like_whole_and_any_worker_count_gives_the_same_shards(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(chunks, "UNIT_CHARS", 2000)  # a 30 kB document becomes ~15 units
    docs = [_text(0, 6000), _text(1, 50), _text(2, 300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    serial, _ = _prepare(_recipe(tmp_path / "1", "pretrain", str(tmp_path / "d.jsonl")))
    parallel, _ = _prepare(_recipe(tmp_path / "2", "pretrain", str(tmp_path / "d.jsonl"), prepare_workers=2))
    tokenizer = build_byte_tokenizer()
    eos = tokenizer.eos_token_id
    whole = [
        t for d in docs for t in text_prefix(tokenizer) + tokenizer(d, add_special_tokens=False)["input_ids"] + [eos]
    ]
    assert serial.train[list(range(len(serial.train)))]["input_ids"] == [
        whole[i : i + 64] for i in range(0, len(whole), 64)
    ]
    assert np.array_equal(parallel.train.tokens, serial.train.tokens) and np.array_equal(
        parallel.train.offsets, serial.train.offsets
    )


def test_a_killed_preparation_keeps_its_finished_chunks_and_continues(tmp_path, monkeypatch):
    monkeypatch.setattr(chunks, "UNIT_CHARS", 2000)
    (tmp_path / "d.txt").write_text(_text(3, 8000))
    recipe = _recipe(tmp_path, "pretrain", str(tmp_path / "d.txt"))
    real, calls = chunks._encode_unit, []

    def killed_on_the_fourth(payload, path):
        calls.append(path.name)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real(payload, path)

    monkeypatch.setattr(chunks, "_encode_unit", killed_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        _prepare(recipe)
    calls.clear()
    monkeypatch.setattr(chunks, "_encode_unit", lambda payload, path: (calls.append(path.name), real(payload, path)))
    resumed, folder = _prepare(recipe)
    assert calls and "chunk-0000000.npz" not in calls and calls[0] == "chunk-0000003.npz"
    assert not folder.with_name(folder.name + ".partial").exists()  # chunks go once the cache is complete
    fresh, _ = _prepare(_recipe(tmp_path / "fresh", "pretrain", str(tmp_path / "d.txt")))
    assert np.array_equal(resumed.train.tokens, fresh.train.tokens)


def test_packed_shard_rows_give_every_world_size_the_same_global_batches(tmp_path):
    rows_ = [{"prompt": _text(i, int(i % 9) + 1), "completion": _text(1000 + i, int(i % 4) + 1)} for i in range(400)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_[:300]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_[300:]))
    sources = [{"path": str(tmp_path / "a.jsonl"), "weight": 1.0}, {"path": str(tmp_path / "b.jsonl"), "weight": 3.0}]
    data, _ = _prepare(_recipe(tmp_path, "sft", sources))
    assert isinstance(data.train, TokenShards)
    rows = training_rows(data.train, 64)
    assert isinstance(rows.targets, np.memmap)  # packed by the preparation, mapped here
    assert list(rows.members) == list(
        Rows.build(np.asarray(data.train["length"]), np.asarray(data.train["num_targets"]), 64).members
    )
    order = GlobalOrder(len(rows), 8, seed=7)

    def seen(world: int, micro: int, steps: range) -> list[list[int]]:
        """Examples each global batch trains on, gathered from every rank's micro-batches."""
        plan = BatchPlan.derive(8, micro, world)
        out = []
        for step in steps:
            batch = order.batch(step)
            out.append(
                [
                    i
                    for r in range(world)
                    for m in range(plan.grad_accum)
                    for row in batch[plan.micro_slice(r, m)]
                    for i in rows.members[row]
                ]
            )
        return out

    total = range(order.steps_per_epoch + 3)  # into the second epoch
    uninterrupted = seen(1, 8, total)
    assert seen(4, 1, total) == uninterrupted
    # Stopped after 5 steps on 2 processes, resumed on 1: the position is the step number.
    assert seen(2, 2, range(5)) + seen(1, 4, range(5, len(total))) == uninterrupted


def test_a_truncated_shard_or_another_tokenizers_shard_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "d.txt").write_text(_text(4, 3000))
    recipe = json.loads(json.dumps(TINY_RECIPE)) | {"task": "pretrain"}
    recipe["data"] = {
        "train": str(tmp_path / "d.txt"),
        "max_length": 64,
        "cache_dir": str(tmp_path / "cache"),
        "prepare_workers": 1,
    }
    path = write_recipe(tmp_path / "r.yaml", recipe)
    assert main(["prepare", str(path)]) == 0
    assert main(["prepare", str(path)]) == 0
    assert "reusing the prepared data" in capsys.readouterr().err
    tokens = next((tmp_path / "cache").glob("*/train/tokens.bin"))
    meta_path = tokens.with_name("shards.json")
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(meta | {"tokenizer": "another"}))
    monkeypatch.setattr(
        refusals, "_said", threading.Lock()
    )  # a process prints one refusal: keep the real one unclaimed
    assert main(["prepare", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "reusing" not in line]
    assert len(err) == 1 and "another tokenizer" in err[0] and str(tokens.parent) in err[0]
    meta_path.write_text(json.dumps(meta))
    tokens.write_bytes(tokens.read_bytes()[:-10])
    monkeypatch.setattr(refusals, "_said", threading.Lock())  # a process prints one refusal; this is a second
    assert main(["prepare", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "reusing" not in line]
    assert len(err) == 1 and f"{tokens}: truncated" in err[0]


# Two training runs; test_packed_shard_rows_give_every_world_size_the_same_global_batches is the default sibling.
@pytest.mark.slow
@pytest.mark.distributed
def test_a_packed_weighted_mixture_resumed_from_2_processes_on_1_ends_as_the_uninterrupted_run(tmp_path):
    from conftest import assert_ok, final_params, max_param_diff, run_accord, step_losses

    rows_ = [{"prompt": f"{i}+{i % 7}=", "completion": str(i + i % 7)} for i in range(300)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_[:100]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_[100:]))
    recipe = json.loads(json.dumps(TINY_RECIPE))
    recipe["data"] = {
        "train": [
            {"path": str(tmp_path / "a.jsonl"), "weight": 1.0},
            {"path": str(tmp_path / "b.jsonl"), "weight": 3.0},
        ],
        "max_length": 32,
        "cache_dir": str(tmp_path / "cache"),
    }
    recipe["train"] = {"max_steps": 8, "log_every": 1}
    path = write_recipe(tmp_path / "mix.yaml", recipe)
    reference = tmp_path / "reference"
    assert_ok(run_accord("train", path, "engine.processes=2", "checkpoint.every_steps=4", f"output.dir={reference}"))
    resumed = tmp_path / "resumed"
    proc = run_accord(
        "train",
        path,
        "engine.processes=1",
        f"resume={reference / 'checkpoints' / 'step-000004'}",
        f"output.dir={resumed}",
    )
    assert_ok(proc)
    assert "packing fills" in proc.stdout + proc.stderr
    assert max_param_diff(final_params(reference), final_params(resumed)) <= 1e-5
    after, original = step_losses(resumed), step_losses(reference)
    assert sorted(after) == [5, 6, 7, 8] and max(abs(after[s] - original[s]) for s in after) <= 1e-5


def test_unpacked_rows_read_lengths_from_the_mapped_offsets_not_an_array_per_example(tmp_path):
    writer = ShardWriter(tmp_path / "s", np.dtype(np.uint16), block_length=16)
    writer.add_stream(np.arange(1000) % 259)
    writer.close("tok")
    shards = TokenShards(tmp_path / "s")
    rows = training_rows(shards, None)
    assert not isinstance(rows.lengths, np.ndarray) and np.shares_memory(rows.targets, shards.num_targets)
    assert rows.lengths[np.array([0, 62])].tolist() == [16, 8] and rows.lengths[-1] == 8
    assert rows.lengths.sum() == 1000 and np.asarray(rows.lengths).tolist() == [16] * 62 + [8]


def test_token_ids_are_the_plain_calls_ids_with_merges_specials_a_backend_left_truncating_and_an_own_encoding():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    class Lowering(PreTrainedTokenizerFast):  # a model's tokenizer that encodes its own way
        def _encode_plus(self, text, **kwargs):
            return super()._encode_plus(text=[t.lower() for t in text], **kwargs)

    texts = [_text(i, 40) + (" <|eos|> X" if i % 2 else "") for i in range(6)] + [""]
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<|eos|>"], show_progress=False)
    )
    for tokenizer in (
        build_byte_tokenizer(),
        PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|eos|>"),
        Lowering(tokenizer_object=bpe),
    ):
        plain = tokenizer(texts, add_special_tokens=False)["input_ids"]
        assert token_ids(tokenizer, texts) == plain
        tokenizer.backend_tokenizer.enable_truncation(8)  # as a tokenizer.json saved with truncation
        assert token_ids(tokenizer, texts) == plain
