"""Optional features whose library is an extra (`accord[lora]`, `accord[report]`) say which extra to install, in one
line and before any work, when it is missing."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import TINY_RECIPE, run_accord_here


@pytest.fixture
def without(monkeypatch):
    def hide(package: str) -> None:
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a, **k: None if name == package else real(name, *a, **k)
        )

    return hide


def test_a_lora_recipe_without_peft_names_the_lora_extra(without):
    from accord.launch.preflight import check_environment
    from accord.recipe.schema import validate_recipe

    without("peft")
    assert check_environment(validate_recipe(TINY_RECIPE)) == []  # no adapters, no peft needed
    assert check_environment(validate_recipe(TINY_RECIPE | {"lora": {"r": 4}})) == [
        "lora needs peft, which is not installed: pip install 'accord[lora]' (or drop the lora section)"
    ]


def test_report_without_matplotlib_names_the_report_extra(tmp_path, without):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0}) + "\n")
    without("matplotlib")
    proc = run_accord_here("report", tmp_path)
    assert proc.returncode == 2
    assert "pip install 'accord[report]'" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "report.html").exists()
