"""Several nodes preparing one cache without a process group (data/nodeshare.py): each takes
its share of the work units, and the sealed cache is the one-node cache byte for byte."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys

import pytest

from accord.data import chunks
from accord.data.chunks import tokenise_share
from accord.data.nodeshare import SEAL, NodeShare, claim_seal, node_share
from accord.data.prepare import cache_folder, prepare_data
from accord.data.split import load_split
from accord.models.build import build_byte_tokenizer
from accord.recipe.schema import validate_recipe
from accord.tasks import build_task, task_config
from conftest import TINY_RECIPE, write_jsonl

ROWS = [{"text": f"document {i}: " + "some words, then more words. " * (1 + i % 6)} for i in range(40)]


def recipe(tmp_path, cache: str, **data):
    raw = TINY_RECIPE | {
        "task": "pretrain",
        "data": {
            "train": str(tmp_path / "docs.jsonl"),
            "max_length": 16,
            "cache_dir": str(tmp_path / cache),
            "prepare_workers": 1,
            **data,
        },
    }
    return validate_recipe(raw)


def prepare(r, share: NodeShare):
    tokenizer = build_byte_tokenizer()
    return prepare_data(r.data, r.seed, tokenizer, build_task(task_config(r), tokenizer), preparer=True, share=share)


def folder_bytes(r) -> dict[str, bytes]:
    tokenizer = build_byte_tokenizer()
    folder = cache_folder(r.data, r.seed, tokenizer, build_task(task_config(r), tokenizer))
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def small_units(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "docs.jsonl", ROWS)
    monkeypatch.setattr(chunks, "UNIT_CHARS", 300)  # ~15 units of text


def test_node_share_comes_from_the_launchers_environment():
    assert node_share({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == NodeShare(1, 2)
    assert node_share({"NNODES": "3", "NODE_RANK": "2"}) == NodeShare(2, 3)
    assert node_share({"SLURM_NNODES": "2", "SLURM_NODEID": "1"}) == NodeShare(1, 2)
    assert node_share({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}) == NodeShare()
    assert node_share({}) == NodeShare()


@pytest.mark.subprocess
def test_the_first_claim_seals_and_a_dead_local_claim_is_taken_over(tmp_path):
    assert claim_seal(tmp_path) and not claim_seal(tmp_path)
    dead = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    (tmp_path / SEAL).write_text(f"{socket.gethostname()}:{dead.pid}")
    assert claim_seal(tmp_path)
    (tmp_path / SEAL).write_text("another-host:1")
    assert not claim_seal(tmp_path)
    assert not claim_seal(tmp_path / "sealed-and-removed")


def test_a_node_tokenises_only_what_the_other_node_left_and_the_union_is_the_one_node_cache(
    tmp_path, small_units, monkeypatch
):
    one = recipe(tmp_path, "one", eval_fraction=0.1)
    prepare(one, NodeShare())
    shared = recipe(tmp_path, "shared", eval_fraction=0.1)
    # Node 1 tokenises its share of the training units into the shared cache's work folder...
    tokenizer = build_byte_tokenizer()
    task = build_task(task_config(shared), tokenizer)
    train, _ = load_split(shared.data, shared.seed, task.text_fields)
    folder = cache_folder(shared.data, shared.seed, tokenizer, task)
    work = folder.with_name(folder.name + ".partial") / "train"
    tokenise_share(train, task, "train", work, 1, NodeShare(1, 2), lambda: False, rest=False)
    written = sorted(int(p.stem[-7:]) for p in work.glob("chunk-*.npz"))
    assert written == list(range(1, 2 * len(written) + 1, 2))  # units 1, 3, 5, ...: node 1's share
    # ...then node 0 does its own, finds node 1's and seals the cache.
    encoded: list[str] = []
    real = chunks._encode_unit
    monkeypatch.setattr(
        chunks,
        "_encode_unit",
        lambda payload, path: (encoded.append(path.parent.name + path.stem[-2:]), real(payload, path)),
    )
    prepare(shared, NodeShare(0, 2))
    train_units = sorted(int(e[-2:]) for e in encoded if e.startswith("train"))
    assert train_units and all(i % 2 == 0 for i in train_units)  # node 1's units were not tokenised again
    assert len(train_units) >= 6
    assert folder_bytes(shared) == folder_bytes(one)
    assert not folder.with_name(folder.name + ".partial").exists()


def test_pairs_tokenised_by_two_nodes_give_the_one_node_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(chunks, "UNIT_ROWS", 4)  # 7 units of pairs
    write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(30)]
    )
    data = {"train": str(tmp_path / "pairs.jsonl"), "eval_fraction": 0.1, "max_length": 16, "prepare_workers": 1}
    one, shared = (
        validate_recipe(TINY_RECIPE | {"task": "dpo", "data": data | {"cache_dir": str(tmp_path / c)}})
        for c in ("one", "shared")
    )
    prepare(one, NodeShare())
    tokenizer = build_byte_tokenizer()
    task = build_task(task_config(shared), tokenizer)
    train, _ = task.fit(*load_split(shared.data, shared.seed, task.text_fields))
    folder = cache_folder(shared.data, shared.seed, tokenizer, task)
    work = folder.with_name(folder.name + ".partial") / "train"
    tokenise_share(train, task, "train", work, 1, NodeShare(1, 2), lambda: False, rest=False)
    assert sorted(int(p.stem[-7:]) for p in work.glob("chunk-*.npz")) == [1, 3, 5]  # node 1's share of 7 units
    prepare(shared, NodeShare(0, 2))
    assert folder_bytes(shared) == folder_bytes(one) and any(
        name.endswith("columns.json") for name in folder_bytes(one)
    )


def test_a_node_alone_on_its_own_cache_prepares_everything(tmp_path, small_units):
    one, alone = recipe(tmp_path, "one"), recipe(tmp_path, "node-local")
    prepare(one, NodeShare())
    prepare(alone, NodeShare(1, 2))  # node-local cache: no other node's chunks ever appear
    assert folder_bytes(alone) == folder_bytes(one)


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_nodes_preparing_at_once_into_one_cache_give_the_one_node_cache(tmp_path, small_units):
    one = recipe(tmp_path, "one", eval_fraction=0.1)
    prepare(one, NodeShare())
    shared = recipe(tmp_path, "shared", eval_fraction=0.1, prepare_workers=2)
    other = multiprocessing.get_context("fork").Process(target=prepare, args=(shared, NodeShare(1, 2)))
    other.start()
    prepare(shared, NodeShare(0, 2))
    other.join(timeout=300)
    assert other.exitcode == 0
    assert folder_bytes(shared) == folder_bytes(one)


@pytest.mark.slow
@pytest.mark.subprocess
def test_accord_prepare_on_two_nodes_at_once_writes_the_one_node_cache(tmp_path):
    import yaml

    from conftest import accord_env, finish, run_accord, start_process

    write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": f"{i}*3=", "completion": str(3 * i)} for i in range(4500)]
    )  # 5 units
    recipes = {}
    for name in ("one", "shared"):
        raw = TINY_RECIPE | {
            "data": {"train": str(tmp_path / "pairs.jsonl"), "max_length": 24, "cache_dir": str(tmp_path / name)}
        }
        recipes[name] = tmp_path / f"{name}.yaml"
        recipes[name].write_text(yaml.safe_dump(raw))
    assert run_accord("prepare", recipes["one"], cwd=tmp_path).returncode == 0
    nodes = [
        start_process(
            [sys.executable, "-m", "accord", "prepare", str(recipes["shared"]), "--nnodes", "2", "--node-rank", str(r)],
            cwd=tmp_path,
            env=accord_env(),
        )
        for r in (0, 1)
    ]
    for node in nodes:
        finish(node, timeout=300)
        assert node.returncode == 0
    caches = {
        name: {
            str(p.relative_to(tmp_path / name)): p.read_bytes()
            for p in sorted((tmp_path / name).rglob("*"))
            if p.is_file()
        }
        for name in recipes
    }
    assert caches["shared"] == caches["one"] and len(caches["one"]) >= 5
    bad = run_accord("prepare", recipes["one"], "--nnodes", "2", "--node-rank", "2", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--node-rank 2" in bad.stderr


def test_accord_prepare_refuses_a_node_rank_outside_the_nodes_in_one_line(tmp_path):
    from conftest import run_accord_here, write_recipe

    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+1=", "completion": "2"}])
    path = write_recipe(
        tmp_path / "r.yaml",
        TINY_RECIPE | {"data": {"train": str(tmp_path / "pairs.jsonl"), "cache_dir": str(tmp_path / "cache")}},
    )
    bad = run_accord_here("prepare", path, "--nnodes", "2", "--node-rank", "2")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--node-rank 2" in bad.stderr, bad.stderr
    assert not (tmp_path / "cache").exists()
