"""The checkpoint folder protocol and resume rules, without starting processes."""

from __future__ import annotations

import json

from accord.checkpoint import COMPLETE, complete_checkpoints, identity_changes, incomplete_checkpoints, prune
from accord.observe.metrics import MetricsWriter, read_metrics
from accord.recipe import validate_recipe
from conftest import TINY_RECIPE


def _fake_checkpoint(root, step, complete=True):
    folder = root / f"step-{step:06d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / COMPLETE).write_text("")
    return folder


def test_only_sealed_checkpoints_count_and_the_rest_are_reported(tmp_path):
    _fake_checkpoint(tmp_path, 10)
    _fake_checkpoint(tmp_path, 20, complete=False)  # a crash before sealing
    (tmp_path / ".tmp-step-000030").mkdir()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000010"]
    assert [p.name for p in incomplete_checkpoints(tmp_path)] == [".tmp-step-000030", "step-000020"]


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    for step in (5, 10, 15, 20):
        _fake_checkpoint(tmp_path, step)
    prune(tmp_path, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000015", "step-000020"]


def test_identity_changes_name_the_field_and_ignore_safe_ones():
    saved = validate_recipe(TINY_RECIPE).model_dump(mode="json")
    safe = TINY_RECIPE | {"train": TINY_RECIPE["train"] | {"max_steps": 99, "log_every": 1}}
    safe["batch"] = TINY_RECIPE["batch"] | {"micro_batch_size": 4}
    assert identity_changes(saved, validate_recipe(safe)) == []
    model = TINY_RECIPE["model"] | {"config": TINY_RECIPE["model"]["config"] | {"hidden_size": 64}}
    changed = TINY_RECIPE | {"model": model, "batch": {"global_batch_size": 64}}
    assert identity_changes(saved, validate_recipe(changed)) == [
        "model.config.hidden_size (checkpoint: 32, recipe: 64)",
        "batch.global_batch_size (checkpoint: 32, recipe: 64)",
    ]


def test_resumed_metrics_drop_the_steps_trained_again(tmp_path):
    lines = [{"kind": "train", "step": s, "loss": 1.0} for s in range(1, 9)] + [{"kind": "eval", "step": 8, "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    writer = MetricsWriter(tmp_path, resume_step=5)
    writer.write({"kind": "train", "step": 6, "loss": float("nan")})
    writer.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] is None  # strict JSON for a non-finite value


def test_disk_space_warning_when_checkpoints_would_not_fit(tmp_path):
    from accord.checkpoint import disk_space_warning

    assert disk_space_warning(tmp_path, num_params=1000, keep_last=2) is None
    warning = disk_space_warning(tmp_path, num_params=10**15, keep_last=2)
    assert warning and "3 checkpoints" in warning and "GiB free" in warning
