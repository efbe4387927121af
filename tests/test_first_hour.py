"""What a new user meets first: `accord plan` with no flags plans for this machine."""

from __future__ import annotations

import json

import pytest

from conftest import run_accord


@pytest.mark.subprocess
def test_plan_without_flags_plans_for_this_machine(tiny_recipe):
    """No GPU here (the tests hide them): engine.processes CPU processes, each with an equal
    share of the RAM, and the header says so."""
    proc = run_accord("plan", tiny_recipe, timeout=120)
    assert proc.returncode == 0, proc.stderr
    header, *rest = proc.stdout.splitlines()
    assert header.startswith(f"accord plan: {tiny_recipe} on 1 node(s) × 2 CPU processes with ")
    assert "GiB RAM / 2 processes" in header and header.endswith("per CPU process (GiB):")
    assert rest[-1].startswith("accord: recommended: engine.strategy=ddp") and rest[-1].endswith("GiB per CPU process")

    import accord
    from conftest import TINY_RECIPE

    result = accord.plan(TINY_RECIPE)  # the same from Python
    assert result.device == "CPU process" and result.world_size == 2 and result.gpu_memory_gib > 0
    assert json.loads(json.dumps(result.as_dict()))["memory_source"].endswith("GiB RAM / 2 processes")


FIRST_LINE = """
import os
import sys
import accord.observe.progress as progress
announce = progress.announce


def first(message):
    torch_imported = "torch" in sys.modules
    announce(message)
    print((torch_imported, message), flush=True)
    os._exit(0)  # what the command does next is not this test's business


progress.announce = first
sys.argv = ["accord", *sys.argv[1:]]
from accord.cli.main import entry
entry()
"""


@pytest.mark.parametrize(
    "command, first_line",
    [
        ("train", "checking recipe…"),
        ("plan", "planning (the model is built on the meta device: nothing is loaded)…"),
        ("report", "rendering the report of {}…"),
    ],
)
@pytest.mark.subprocess
def test_the_first_line_comes_before_torch_is_imported(tmp_path, command, first_line):
    """`accord train`, `plan` and `report` say what they do on stderr before importing torch or
    matplotlib (seconds), so something is visible within a second; the command's entry point
    must not import torch up front either."""
    import subprocess
    import sys

    from conftest import accord_env

    missing = str(
        tmp_path / ("missing-run" if command == "report" else "missing.yaml")
    )  # never read: the test ends at the first line
    first_line = first_line.format(missing)
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_LINE, command, missing],
        capture_output=True,
        text=True,
        env=accord_env(),
        timeout=120,
    )
    assert proc.stdout.strip() == repr((False, first_line)), proc.stdout + proc.stderr
    assert proc.stderr == f"accord: {first_line}\n"


def test_the_first_hour_script_times_what_the_readme_shows():
    """scripts/measure-first-hour.sh times the README's steps: every accord command and every
    line of Python it runs must be shown in README.md (with `accord` bare, as the README writes it)."""
    from conftest import REPO

    script = (REPO / "scripts" / "measure-first-hour.sh").read_text(encoding="utf-8")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    commands = [line.split(" .venv/bin/accord ", 1)[1] for line in script.splitlines() if " .venv/bin/accord " in line]
    assert len(commands) >= 5, commands
    for command in commands:
        assert f"accord {command}" in readme, f"measure-first-hour.sh runs `accord {command}`, not shown in README.md"
    snippet = script.split("python -c '", 1)[1].split("'", 1)[0].strip().splitlines()
    assert len(snippet) == 3 and all(line in readme for line in snippet), snippet
