"""Launchers that put their own arguments into the script's argv: torch.distributed.launch
(`--local-rank=N`) and DeepSpeed's launcher (`--local_rank=N` before the subcommand, and the
`--deepspeed FILE` convention) run the same training as `accord train` on 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys

import pytest

from conftest import accord_env, assert_ok, final_params, max_param_diff, run_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--local_rank=0", "train", "r.yaml", "a.b=1"], ["train", "r.yaml", "a.b=1"]),
        (["train", "r.yaml", "--local-rank=1", "--overwrite"], ["train", "r.yaml", "--overwrite"]),
        (["train", "--local_rank", "3", "r.yaml"], ["train", "r.yaml"]),
        (["train", "r.yaml", "--deepspeed", "ds.json"], ["train", "r.yaml", "engine.deepspeed_config=ds.json"]),
        (["--local_rank=0", "train", "r.yaml", "--deepspeed=ds.json"], ["train", "r.yaml", "engine.deepspeed_config=ds.json"]),
    ],
)
def test_launcher_arguments_are_read_wherever_they_are(argv, expected):
    from accord.cli import launcher_arguments

    assert launcher_arguments(argv) == expected


def test_deepspeed_flag_sets_the_recipe_field(tmp_path, tiny_recipe):
    """`--deepspeed FILE` reaches the recipe as engine.deepspeed_config (a missing file is one line)."""
    from conftest import run_accord

    proc = run_accord("--local_rank=0", "train", tiny_recipe, "--deepspeed", str(tmp_path / "missing.json"), f"output.dir={tmp_path / 'o'}", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "missing.json" in proc.stderr and proc.stderr.count("accord: error:") == 1


@pytest.mark.distributed
def test_torch_distributed_launch_equals_accord_train(tiny_reference, tmp_path):
    recipe, reference = tiny_reference
    out = tmp_path / "tdl"
    launcher = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    proc = run_process(launcher + ["-m", "accord", "train", str(recipe), f"output.dir={out}"], env=accord_env(), timeout=300)
    assert_ok(proc)
    assert proc.stderr.count("accord: batch 2 processes × 8 sequences × 2 accumulation steps") == 1
    assert max_param_diff(final_params(reference), final_params(out)) <= 1e-5


@pytest.mark.distributed
@pytest.mark.slow  # ~75 s on 2 cores: DeepSpeed's launcher and its imports in every worker
def test_deepspeed_launcher_on_cpu_equals_accord_train(tiny_reference, tmp_path):
    """`deepspeed --num_gpus 2 --module accord train R.yaml` with DS_ACCELERATOR=cpu starts 2
    gloo processes (its launcher passes --local_rank=N before `train`)."""
    pytest.importorskip("deepspeed")
    runner = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    if runner is None:
        pytest.skip("no deepspeed launcher next to this Python")
    recipe, reference = tiny_reference
    out = tmp_path / "ds"
    env = accord_env() | {"DS_ACCELERATOR": "cpu", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    command = [runner, "--num_gpus", "2", "--master_port", str(_free_port()), "--module", "accord", "train", str(recipe), f"output.dir={out}"]
    proc = run_process(command, env=env, timeout=300)
    assert_ok(proc)
    assert proc.stderr.count("accord: batch 2 processes × 8 sequences × 2 accumulation steps") == 1
    assert max_param_diff(final_params(reference), final_params(out)) <= 1e-5
