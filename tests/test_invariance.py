"""Contract 2: the updates depend on (recipe, seed) only, not on world × micro × accumulation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY_RECIPE, assert_ok, final_params, max_param_diff, run_accord, step_losses, write_recipe

pytestmark = pytest.mark.distributed

# world × micro × accumulation, all = 32 sequences per step
LAYOUTS = {"1x8x4": (1, 8), "2x8x2": (2, 8), "2x4x4": (2, 4)}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_reference, one_process_reference) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("invariance")
    recipe = write_recipe(root / "tiny.yaml", TINY_RECIPE)
    outs = {"2x8x2": tiny_reference[1], "1x8x4": one_process_reference[1]}  # the session's shared runs
    for name, (world, micro) in LAYOUTS.items():
        if name in outs:
            continue
        out = root / name
        assert_ok(
            run_accord(
                "train", recipe, f"engine.processes={world}", f"batch.micro_batch_size={micro}", f"output.dir={out}"
            )
        )
        outs[name] = out
    return outs


def test_every_layout_ends_with_the_same_parameters(runs):
    reference = final_params(runs["1x8x4"])
    for name in ("2x8x2", "2x4x4"):
        diff = max_param_diff(reference, final_params(runs[name]))
        print(f"max |Δparam| 1x8x4 vs {name}: {diff:.2e}")
        assert diff <= TOLERANCE, f"{name}: {diff}"


def test_every_layout_logs_the_same_step_losses(runs):
    reference = step_losses(runs["1x8x4"])
    assert sorted(reference) == list(range(1, TINY_RECIPE["train"]["max_steps"] + 1))
    for name in ("2x8x2", "2x4x4"):
        losses = step_losses(runs[name])
        diff = max(abs(reference[s] - losses[s]) for s in reference)
        print(f"max |Δloss| 1x8x4 vs {name}: {diff:.2e}")
        assert len(losses) == len(reference) and diff <= TOLERANCE


def test_training_moved_the_weights(runs):
    # Guards the equalities above against a run that never updated anything.
    losses = step_losses(runs["1x8x4"])
    assert losses[max(losses)] < losses[1] - 0.5


def test_run_under_torchrun_equals_the_self_launched_run(runs, tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    out = tmp_path / "torchrun"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = run_accord(
        "train", recipe, "batch.micro_batch_size=8", "engine.processes=4", f"output.dir={out}", launcher=torchrun
    )
    assert_ok(proc)
    assert (proc.stdout + proc.stderr).count("accord: batch 2 processes") == 1  # one world of 2, not 2 worlds of 2
    # The recipe's engine.processes gave way to torchrun's 2: said once, and recorded as what ran.
    overruled = "engine.processes=4 is overruled by torchrun, which started 2 processes per node (2 in all)"
    assert proc.stderr.count(overruled) == 1, proc.stderr
    assert yaml.safe_load((out / "recipe.yaml").read_text())["engine"]["processes"] == 2
    assert json.loads((out / "run-status.json").read_text()) == {"status": "completed", "step": 10}
    assert max_param_diff(final_params(runs["2x8x2"]), final_params(out)) <= TOLERANCE
