"""docs/recipe-reference.md is what `python -m accord.recipe.reference` renders from the schema."""

import subprocess
import sys
from typing import Literal

import pytest
from pydantic import Field

from accord.recipe import reference
from accord.recipe.schema import Recipe
from accord.recipe.section import Section
from conftest import REPO, accord_env

PAGE = REPO / "docs" / "recipe-reference.md"


def test_the_reference_page_is_up_to_date():
    assert PAGE.read_text(encoding="utf-8") == reference.render(), (
        f"{PAGE.relative_to(REPO)} is stale: regenerate it with `python -m accord.recipe.reference`"
    )


def test_every_section_and_field_is_on_the_page():
    page = reference.render()
    for section in ("model", "data", "batch", "optim", "train", "engine", "checkpoint", "output", "grpo", "lora"):
        assert f"## `{section}`" in page
    for key, field in Recipe.model_fields.items():
        assert f"| `{field.alias or key}` |" in page
    assert "| `async` |" in page  # the alias, not the Python attribute async_
    assert "sequence_parallel" in page and "release_host_memory" in page


class _Inner(Section):
    """An inner section."""

    mode: Literal["a", "b"] = Field("a", description="Which mode.")


class _Outer(Section):
    """An outer section."""

    size: int = Field(..., gt=0, description="How big.")
    inner: _Inner = _Inner()
    names: list[str] | None = Field(None, description="Some names.")


def test_render_shows_types_defaults_choices_and_nested_sections():
    page = reference.render(_Outer)
    assert "| `size` | int (> 0) | `required` | How big. |" in page
    assert '| `mode` | "a" \\| "b" | `"a"` | Which mode. |' in page
    assert "| `names` | list of str \\| null | `null` | Some names. |" in page
    assert "## `inner`" in page and "An inner section." in page


@pytest.mark.subprocess
def test_check_names_the_stale_file_and_the_command(tmp_path):
    stale = tmp_path / "recipe-reference.md"
    stale.write_text("old\n", encoding="utf-8")
    command = [sys.executable, "-m", "accord.recipe.reference"]
    proc = subprocess.run([*command, "--check", str(stale)], capture_output=True, text=True, env=accord_env())
    assert proc.returncode == 1 and str(stale) in proc.stderr and "python -m accord.recipe.reference" in proc.stderr
    assert subprocess.run([*command, str(stale)], capture_output=True, env=accord_env()).returncode == 0
    assert stale.read_text(encoding="utf-8") == reference.render()
    assert subprocess.run([*command, "--check", str(stale)], capture_output=True, env=accord_env()).returncode == 0
