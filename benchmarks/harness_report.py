"""What the peer benchmarks' harness (harness.py) reports: the rounds of each contender
summarised (median and range), the markdown table and the verdict line, and the docs section
of docs/benchmarks.md they are written into (between the section's markers)."""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness import Benchmark, Contender

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"


def summarise(runs: list[dict], unit: str, primary: str = "cpu") -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run"}
    # `rate` ranks the contenders: units per CPU-second on the CPU; on a GPU, where the host's
    # CPU time says little, units per second of wall time. `other_rate` is the other one.
    per_cpu = [r["units"] / r["cpu_s"] for r in ok]
    per_wall = [r["units"] / r["wall_s"] for r in ok]
    rates, others = (per_wall, per_cpu) if primary == "wall" else (per_cpu, per_wall)
    summary = {
        "rounds": len(ok),
        "rate": statistics.median(rates),
        "rate_range": (min(rates), max(rates)),
        "other_rate": statistics.median(others),
        "process_cpu_s": statistics.median(r["process_cpu_s"] for r in ok),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
        "units": ok[0]["units"],
        "steps": ok[0]["steps"],
        "runs": ok,
    }
    for key in ok[0]:
        if key not in summary and key not in ("cpu_s", "wall_s"):
            values = [r[key] for r in ok]
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            summary[key] = statistics.median(values) if numeric else values[0]
    return summary


def rate(value: float) -> str:
    """Three significant figures or more (prompts per second are small numbers)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def table(bench: Benchmark, summaries: dict[str, dict], primary: str = "cpu") -> list[str]:
    unit = bench.unit
    gpu = any("peak_gpu_gib" in s for s in summaries.values())
    header = [
        "contender",
        f"{unit} per CPU-s, median [min, max]" if primary == "cpu" else f"{unit}/s wall, median [min, max]",
        f"{unit}/s wall" if primary == "cpu" else f"{unit} per CPU-s",
        "steps",
        f"{unit}",
        "process CPU s",
        "peak RSS MiB",
        *(["peak GPU GiB"] if gpu else []),
        *(c.header for c in bench.columns),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for contender in bench.contenders:
        s = summaries[contender.name]
        name = contender.name + (" (reference)" if contender.kind == "reference" else "")
        if contender.cannot_run:
            cells = [name, f"cannot run on CPU: {contender.cannot_run}"] + [""] * (len(header) - 2)
        elif "error" in s:
            cells = [name, f"failed: {s['error']}"] + [""] * (len(header) - 2)
        else:
            low, high = s["rate_range"]
            cells = [
                f"**{name}**" if contender.kind == "accord" else name,
                f"{rate(s['rate'])} [{rate(low)}, {rate(high)}]",
                rate(s["other_rate"]),
                str(s["steps"]),
                f"{s['units']:,}",
                f"{s['process_cpu_s']:.1f}",
                f"{s['peak_rss_mib']:,.0f}",
                *([f"{s.get('peak_gpu_gib', 0):.1f}"] if gpu else []),
                *(c.fmt.format(s.get(c.key, "")) for c in bench.columns),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def verdict(bench: Benchmark, summaries: dict[str, dict]) -> str:
    def ran(kind: str) -> list[Contender]:
        return [c for c in bench.contenders if c.kind == kind and "error" not in summaries[c.name]]

    accord, peers = ran("accord"), ran("peer")
    if not accord or not peers:
        return "accord / best peer: n/a (accord or every peer failed)"
    best = max(peers, key=lambda c: summaries[c.name]["rate"])
    ratio = summaries[accord[0].name]["rate"] / summaries[best.name]["rate"]
    return f"accord / best peer: {ratio:.2f}x ({best.name})"


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def check_markers(section: str, docs: Path) -> str:
    """The docs file's text, or one line saying why --write-docs cannot write it (checked before the runs)."""
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    try:
        text = docs.read_text()
    except OSError as error:
        print(f"--write-docs: cannot read {docs} ({error.strerror})", file=sys.stderr)
        raise SystemExit(2) from None
    if start not in text or end not in text:
        print(f"--write-docs: {docs} has no {start} ... {end} markers to write between; add them", file=sys.stderr)
        raise SystemExit(2)
    return text


def write_docs(section: str, body: list[str], docs: Path = DOCS) -> None:
    """Replace the text between the section's markers in `docs` with `body` (the rest stays as it is)."""
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    text = check_markers(section, docs)
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    docs.write_text(before + start + "\n" + "\n".join(body) + "\n" + end + after)


def shown_command(script: Path, given: list[str]) -> str:
    """The command as docs show it: without where this run's files went (--json, --docs, --keep)."""
    shown, skip = [], False
    for a in given:
        if skip or a == "--keep":
            skip = False
            continue
        if a in ("--json", "--docs"):
            skip = True
            continue
        shown.append(a)
    return shlex.join(["python", f"benchmarks/{script.name}", *shown])
