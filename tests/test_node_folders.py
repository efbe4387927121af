"""The bookkeeping of output folders shared by all nodes or one per node (accord.checkpoint.node_folders);
the runs themselves are in test_multinode.py (two network namespaces as two hosts)."""

from __future__ import annotations

import json

import pytest

from accord.checkpoint import node_folders as nodefolders


@pytest.mark.parametrize(
    "relative, rank",
    [
        ("state/__3_0.distcp", 3),
        ("state/__12_1.distcp", 12),
        ("rng/rank-00005.pt", 5),
        ("state/.metadata", 0),
        ("schedule.pt", 0),
    ],
)
def test_each_checkpoint_file_is_credited_to_the_rank_that_writes_it(relative, rank):
    assert nodefolders.writer_of(relative) == rank


def _node_local_checkpoint(folder, this_folder: int):
    (folder / "state").mkdir(parents=True, exist_ok=True)
    folders = [
        {"dir": "/disk/out0", "host": "node-a", "nodes": [0], "ranks": [0, 1], "leader": 0},
        {"dir": "/disk/out1", "host": "node-b", "nodes": [1], "ranks": [2, 3], "leader": 2},
    ]
    layout = {"layout": nodefolders.NODE_LOCAL, "folder": this_folder, "folders": folders, "files": {}}
    (folder / nodefolders.LAYOUT_FILE).write_text(json.dumps(layout))
    return folder


def test_a_missing_file_another_node_wrote_is_named_with_its_rank_host_and_folder(tmp_path):
    """Through the check a resume runs (state_problems), as complete_from_peers calls it."""
    import torch

    from accord.engine.state import state_problems, write_sharded

    folder = tmp_path / "step-000004"
    write_sharded({"model": {"w": torch.ones(4, 4)}, "optim": {}}, folder)  # one process: rank 0's shard
    _node_local_checkpoint(folder, this_folder=1)  # node 1's folder; rank 0 is on node 0
    shard = folder / "state" / "__0_0.distcp"
    shard.unlink()
    (named,) = state_problems(folder, missing=lambda path: nodefolders._missing_here(path, folder))
    assert named.startswith(f"{shard} is missing here: rank 0 wrote it into /disk/out0/checkpoints/step-000004")
    assert "node 0 (host node-a)" in named and "\n" not in named


def test_a_node_local_checkpoint_is_checked_when_the_nodes_meet_not_before(tmp_path):
    assert nodefolders.checked_when_nodes_meet(_node_local_checkpoint(tmp_path / "a", this_folder=1))
    (tmp_path / "b").mkdir()
    assert not nodefolders.checked_when_nodes_meet(tmp_path / "b")  # one node's (or a shared) checkpoint


def test_one_node_runs_write_no_layout_and_rank_zero_writes_the_folder(tmp_path, monkeypatch):
    from accord.distributed.group import DistInfo

    monkeypatch.setattr(nodefolders, "_current", None)  # the layout is this process's: none found yet
    assert not nodefolders.writes_folder(DistInfo(rank=1, world_size=2, local_rank=1, local_world_size=2))
    layout = nodefolders.detect(tmp_path, DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2))
    assert layout == nodefolders.Layout(leader=True) and nodefolders.describe(layout) is None
    nodefolders.record(tmp_path)
    assert not (tmp_path / nodefolders.LAYOUT_FILE).exists()
