"""Start to the first optimizer step, against transformers.Trainer and TRL's SFTTrainer, in one run.

    python benchmarks/startup.py [--processes 2] [--repeat 3] [--baseline-src PATH/src]

The workload is throughput.py's (a 4-layer Llama saved once, 640 prompt -> completion
examples, 8 sequences per process per step), trained for 2 steps. Each contender runs as
its own program, in turn, `--repeat` times (interleaved, so a change in the machine's load
hits all alike); the table gives the median and the range of the seconds from the command's
start to the end of its first optimizer step. For accord it also gives the median time to
each of its stage lines on stderr (first output, workers started, data check, model loading), read as
they are printed, and for everyone the time the command took to exit (training 2 steps and
saving the model included) and the CPU seconds all its processes used (less sensitive to
the machine's load than wall time). `--baseline-src` adds accord from another source tree (e.g. a checkout of
main) as "accord (baseline)", for a before/after in the same run. accord's data cache is
warm after the first round (every contender reads the same files), as on a second run.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import _steps, command_for, make_workload  # noqa: E402 - the same workload and contenders

STAGES = {
    "first output": "accord: checking recipe",
    "workers started": "accord: starting",
    "data check": "accord: preparing data",  # the first worker's checks reached the data (after its imports)
    "loading model": "accord: loading model",  # the checks passed, every worker joined the group
}
STEPS = 2


def run_once(name: str, folder: Path, processes: int, src: str | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="startup-", dir=folder))
    log, out = work / "steps.json", work / "model"
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // processes)),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if src is not None:
        env["PYTHONPATH"] = src
    command = command_for("accord" if name.startswith("accord") else name, folder, STEPS, processes, log, out)
    seen: dict[str, float] = {}
    cpu_before = _children_cpu()
    start = time.time()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail = []
    for line in proc.stderr:
        for stage, prefix in STAGES.items():
            if stage not in seen and line.startswith(prefix):
                seen[stage] = time.time() - start
        tail = (tail + [line.rstrip()])[-3:]
    if proc.wait() != 0:
        raise SystemExit(f"{name} failed: {' | '.join(tail)}")
    ended = time.time() - start
    times = _steps("accord" if name.startswith("accord") else name, log, out, processes)[0]
    return {"first step": times[0] - start, "exit": ended, "CPU s": _children_cpu() - cpu_before, **seen}


def _children_cpu() -> float:
    """User + system CPU seconds of the finished commands (their processes' included): what a
    contender costs in all, which a busy machine does not inflate as it does wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--baseline-src", help="another accord source tree (its src/ folder), measured as 'accord (baseline)'"
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="accord-startup-"))
    try:
        measure_all(folder, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a model and a run per round: not left in the temp folder


def measure_all(folder: Path, args: argparse.Namespace) -> None:
    load_at_start = os.getloadavg()[0]
    make_workload(folder, "tiny")
    here = str(Path(__file__).resolve().parents[1] / "src")
    contenders = {"accord": here, "transformers.Trainer": None, "TRL SFTTrainer": None}
    if args.baseline_src:
        contenders = {"accord (baseline)": str(Path(args.baseline_src).resolve()), **contenders}
    # A first, unmeasured round: the data cache, the page cache and the saved model warm for all.
    for name, src in contenders.items():
        run_once(name, folder, args.processes, src)
    results: dict[str, list[dict]] = {name: [] for name in contenders}
    for round_ in range(args.repeat):
        for name, src in contenders.items():
            results[name].append(run_once(name, folder, args.processes, src))
            print(f"  round {round_ + 1}: {name} {results[name][-1]['first step']:.1f} s", file=sys.stderr, flush=True)
    columns = [*STAGES, "first step", "exit", "CPU s"]
    header = f"{'contender':22} {'proc':>4} " + " ".join(f"{c:>15}" for c in columns) + f" {'first step range':>17}"
    print(
        f"seconds from the command's start, median of {args.repeat} "
        f"(load average at the start: {load_at_start:.1f}, at the end: {os.getloadavg()[0]:.1f})"
    )
    print(header)
    print("-" * len(header))
    for name, runs in results.items():
        cells = []
        for column in columns:
            values = [r[column] for r in runs if column in r]
            cells.append(f"{statistics.median(values):>15.1f}" if values else f"{'-':>15}")
        steps = [r["first step"] for r in runs]
        print(f"{name:22} {args.processes:>4} " + " ".join(cells) + f" {min(steps):>8.1f}-{max(steps):<8.1f}")


if __name__ == "__main__":
    main()
