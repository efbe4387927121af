"""`accord doctor`: a verdict per check (versions, the recipe's model and data, GPUs, disk,
network, all-reduce bandwidth, a 2-step equivalence run), exit 1 when one fails."""

from __future__ import annotations

import pytest

from accord.cli.doctor import FAIL, OK, lines_from
from accord.recipe.schema import validate_recipe
from conftest import TINY_RECIPE, run_accord

VERSIONS = {"python": "3.11.2", "accord": "0.1.0", "torch": "2.13.0", "transformers": "5.24.0", "deepspeed": "0.19.8"}


def _view(node: int, **changes) -> dict:
    view = {
        "node": node,
        "host": f"host{node}",
        "versions": dict(VERSIONS),
        "problems": [],
        "cuda": {"wanted": False, "count": 0, "visible": None},
        "disk": {"free": 10 * 2**30, "needed": 2**20, "dir": f"/out{node}"},
        "network": {"master": "10.0.0.1", "interface": "eth0", "address": f"10.0.0.{node + 1}", "loopback": False},
    }
    for key, value in changes.items():
        view[key] = view[key] | value if isinstance(value, dict) else value
    return view


def test_a_node_with_other_versions_or_no_route_to_the_master_fails_its_line():
    picture = {
        "views": [_view(0), _view(1, versions={"torch": "2.12.0"}, network={"interface": None})],
        "bandwidth": {"0-1": 1.25},
        "world": 2,
        "local_world": 1,
    }
    lines = {(line.check, line.where): line for line in lines_from(picture, validate_recipe(TINY_RECIPE))}
    versions = lines[("versions", "all nodes")]
    assert versions.verdict == FAIL and versions.result == "node 1: torch 2.12.0 (node 0: 2.13.0)"
    assert lines[("network", "node 0 (host0)")].verdict == OK
    assert (
        lines[("network", "node 1 (host1)")].verdict == FAIL
        and "10.0.0.1" in lines[("network", "node 1 (host1)")].result
    )
    assert lines[("all-reduce bandwidth", "nodes 0 and 1")].result.startswith("1.25 GB/s")


def test_a_gpu_recipe_on_a_node_without_gpus_fails_and_a_full_disk_warns():
    picture = {
        "views": [_view(0, cuda={"wanted": True, "count": 0, "visible": ""}, disk={"free": 0})],
        "bandwidth": {},
        "world": 1,
        "local_world": 1,
    }
    lines = {line.check: line for line in lines_from(picture, validate_recipe(TINY_RECIPE))}
    assert lines["GPUs"].verdict == FAIL and "CUDA_VISIBLE_DEVICES=" in lines["GPUs"].result
    assert lines["disk for checkpoints"].verdict == "warn"


@pytest.mark.distributed
@pytest.mark.slow  # ~35 s on 2 loaded cores: the probe's workers
def test_doctor_names_a_missing_data_file_on_its_node_and_exits_1(tmp_path, tiny_recipe):
    missing = tmp_path / "missing.jsonl"
    proc = run_accord(
        "doctor",
        tiny_recipe,
        f"data.train={missing}",
        "data.generate=null",
        f"output.dir={tmp_path / 'o'}",
        "--no-self-test",
        timeout=240,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith(FAIL)]
    assert len(failed) == 1 and "recipe, model and data" in failed[0] and "missing.jsonl" in failed[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.distributed
@pytest.mark.slow  # ~90 s on 2 loaded cores: the probe's 2 workers, then 2 short trainings
def test_doctor_on_one_host_passes_every_check_and_the_equivalence_self_test(tmp_path, tiny_recipe):
    proc = run_accord("doctor", tiny_recipe, f"output.dir={tmp_path / 'o'}", timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    table = proc.stdout.splitlines()
    checks = [
        "versions",
        "recipe, model and data",
        "GPUs",
        "disk for checkpoints",
        "network",
        "all-reduce bandwidth",
        "2-step equivalence",
    ]
    for check in checks:
        assert any(line.startswith(OK) and f"  {check}  " in line for line in table), "\n".join(table)
    assert any("2 processes vs 1 process" in line and "max |Δparam|" in line for line in table)
    # The self-test's two runs stay quiet when they agree: no training log naming a deleted temporary folder.
    assert "accord-doctor-" not in proc.stdout + proc.stderr and "accord: batch" not in proc.stderr
