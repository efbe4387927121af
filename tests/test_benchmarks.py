"""The peer benchmarks still run end to end (slow tier): every contender of throughput.py and
grpo.py trains for a step in its own pinned process, none fails, the last line is the verdict,
and --write-docs rewrites only the text between the section's markers; gpu_check's --dry-run
runs its peer phase's plumbing on the CPU and writes its JSON and markdown."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

VERDICT = re.compile(r"accord / best peer: \d+\.\d\dx \(.+\)")


def run_benchmark(tmp_path, script: str, section: str, *options: str) -> tuple[list[str], str]:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"before\n<!-- {section}:start -->\nSTALE-TABLE\n<!-- {section}:end -->\nafter\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *options, "--rounds", "1", "--write-docs"]
        + ["--docs", str(docs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines(), docs.read_text()


def check(lines: list[str], written: str, contenders: list[str]) -> None:
    assert VERDICT.fullmatch(lines[-1]), lines[-1]
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| contender")]
    assert len(rows) == len(contenders)
    for name, row in zip(contenders, rows):
        assert name in row and "failed" not in row, row
    assert written.startswith("before\n") and written.endswith("after\n") and "STALE-TABLE" not in written
    assert lines[-1] in written


@pytest.mark.slow
@pytest.mark.distributed
def test_throughput_benchmark_runs_every_contender_and_writes_its_docs_section(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import throughput

    lines, written = run_benchmark(tmp_path, "throughput.py", "throughput", "--steps", "1")
    check(lines, written, [c.name for c in throughput.CONTENDERS])


@pytest.mark.slow
@pytest.mark.distributed
def test_grpo_benchmark_runs_every_contender_and_writes_its_docs_section(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import grpo

    lines, written = run_benchmark(tmp_path, "grpo.py", "grpo", "--steps", "1", "--prompts", "4", "--group", "4")
    check(lines, written, [c.name for c in grpo.CONTENDERS])


@pytest.mark.subprocess
def test_write_docs_without_markers_stops_before_any_run(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("no markers here\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "grpo.py"), "--write-docs", "--docs", str(docs)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        timeout=120,
    )
    assert proc.returncode == 2 and "markers" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_gpu_check_dry_run_writes_its_json_and_markdown_on_a_cpu(tmp_path):
    out, table = tmp_path / "gpu.json", tmp_path / "gpu.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)]
        + ["--markdown", str(table)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [p["run"] for p in data["peers"]] == ["SFT throughput", "GRPO"]
    for peer in data["peers"]:
        assert "error" not in peer, peer
        assert VERDICT.fullmatch(peer["verdict"]) and peer["verdict"] in table.read_text()
