#!/usr/bin/env bash
# Re-measure the quickstart's figures and print them as the table in docs/benchmarks.md ("The
# quickstart"), to paste there before a release (on an otherwise idle machine: the figures are timings).
#
#   ./scripts/measure-readme.sh [KEY=VALUE ...]     # overrides for a quick trial, e.g. train.max_steps=250
#
# Runs the README's command, `accord train recipes/quickstart.yaml --overwrite`, into a
# temporary output.dir (runs/quickstart is left alone) and reads: the time to the first line
# on stderr, the wall time, the training time and the packed rows from the run's own lines,
# eval loss and exact match at each evaluation from metrics.jsonl, and the peak RSS of the
# largest process (the launcher or a worker: getrusage of the waited-for children, what
# `/usr/bin/time -v` reports). Uses .venv/bin/python when present (PYTHON=... overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" - "$@" <<'EOF'
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

overrides = sys.argv[1:]
out = Path(tempfile.mkdtemp(prefix="accord-readme-")) / "quickstart"
shown = " ".join(["accord", "train", "recipes/quickstart.yaml", "--overwrite", *overrides])
command = [sys.executable, "-m", "accord", "train", "recipes/quickstart.yaml", "--overwrite", f"output.dir={out}", *overrides]
print(f"measure-readme: running {shown} (about 1-2 minutes on 2 idle cores)…", file=sys.stderr, flush=True)
load_before = os.getloadavg()[0]
start = time.perf_counter()
proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
first_output, lines = None, []
for line in proc.stderr:
    if first_output is None and line.strip():
        first_output = time.perf_counter() - start
    lines.append(line.rstrip())
code = proc.wait()
wall = time.perf_counter() - start
peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9  # kB on Linux
if code != 0:
    sys.exit("measure-readme: the run failed (exit %d):\n%s" % (code, "\n".join(lines[-15:])))


def found(pattern):
    for line in lines:
        match = re.search(pattern, line)
        if match:
            return match
    sys.exit(f"measure-readme: no line matching {pattern!r} in the run's output")


trained = found(r"accord: trained (\d+) steps in ([\d.]+) s")
rows = found(r"accord: (\d+) training examples in (\d+) packed rows")
held_out = found(r"(\d+) held out")
evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
shutil.rmtree(out.parent, ignore_errors=True)
if not evals:
    sys.exit("measure-readme: the run logged no evaluation")
steps = " / ".join(str(r["step"]) for r in evals)
losses = " / ".join(f"{r['loss']:#.2g}" for r in evals)
matches = [f"{100 * r['exact_match_accuracy']:.1f}%" for r in evals]
matches[-1] = f"**{matches[-1]}**"
n_eval = int(evals[-1].get("generated", held_out.group(1)))

# Timings mean something only on an idle machine: say how busy it was.
print(f"Measured {date.today().isoformat()} with `{shown}` ({os.cpu_count()} cores; "
      f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after)")
print()
print("| | |")
print("|---|---|")
print(f"| first output (`accord: checking recipe…`) | {first_output:.1f} s |")
print(f"| wall time, command start to exit | {wall:.0f} s ({float(trained.group(2)):.0f} s of it training "
      f"{int(trained.group(1)):,} steps; {int(rows.group(1)):,} sums packed into {int(rows.group(2)):,} rows) |")
print(f"| eval loss on {held_out.group(1)} held-out sums (steps {steps}) | {losses} |")
print(f"| greedy exact match on the {n_eval} held-out sums (same steps) | {' / '.join(matches)} |")
print(f"| peak RSS of the largest process | {peak_gb:.2f} GB |")
EOF
