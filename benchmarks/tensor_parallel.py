"""Tensor parallelism on the CPU: per-rank peak memory and tokens per CPU-second, against fsdp.

    python benchmarks/tensor_parallel.py [--hidden 256] [--intermediate 8192] [--layers 4] [--steps 2 8]
        [--batch 16] [--jobs 1] [--write-docs]

docs/benchmarks.md's table: --hidden 256 --intermediate 16384 --layers 2 --steps 2 8 --jobs 3
(5-8 minutes on a loaded 2-core machine).

Trains a Llama whose MLP is wide (intermediate size 32 × hidden: the layers TP splits hold
nearly all the parameters) through `accord train` itself, in each layout: 1 process; ddp with
engine.tensor_parallel 2 and 4; fsdp on 2 and 4 processes; fsdp × TP 2 on 4. Each rank's peak
RSS comes from the run's own `memory` records (metrics.jsonl, engine.release_host_memory on,
so RSS follows live tensors). Tokens per CPU-second: each layout runs twice, for the two
--steps counts; the difference in the CPU time of the whole process tree (os.wait4 on the
command) over the difference in trained tokens leaves start-up and export out, and the data's
cache is prepared before any timed run. --jobs N measures N layouts at once (each run's CPU
time and RSS are its own).
Every process runs one thread (OMP_NUM_THREADS=1, as the peer benchmarks' harness sets it), so
CPU time is not inflated by idle threads spinning. A table, not a test: 4 processes on 2 cores
is fine for memory and for CPU time (not for wall time). --write-docs rewrites the
tensor-parallel section of docs/benchmarks.md (between its markers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

SECTION = "tensor-parallel"

LAYOUTS = {
    "1 process": ["engine.processes=1"],
    "ddp x tp2 (2)": ["engine.processes=2", "engine.tensor_parallel=2"],
    "ddp x tp4 (4)": ["engine.processes=4", "engine.tensor_parallel=4"],
    "fsdp (2)": ["engine.processes=2", "engine.strategy=fsdp"],
    "fsdp (4)": ["engine.processes=4", "engine.strategy=fsdp"],
    "fsdp x tp2 (4)": ["engine.processes=4", "engine.strategy=fsdp", "engine.tensor_parallel=2"],
}


def write_recipe(folder: Path, hidden: int, intermediate: int, layers: int, batch: int = 16) -> Path:
    heads = max(4, hidden // 64)
    data = {
        "seed": 0,
        "task": "sft",
        "model": {
            "config": {
                "architecture": "llama",
                "hidden_size": hidden,
                "intermediate_size": intermediate,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "max_position_embeddings": 64,
            },
            "tokenizer": "byte",
        },
        "data": {
            "generate": {"kind": "addition", "train_examples": 512, "eval_examples": 0, "max_digits": 2},
            "max_length": 32,
            "cache_dir": str(folder / "cache"),
        },
        "batch": {"global_batch_size": batch, "micro_batch_size": batch // 4},  # 4 data-parallel ranks at most
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "train": {"max_steps": 2, "log_every": 1},
        "engine": {"device": "cpu", "release_host_memory": True},
        "checkpoint": {"keep_last": 1},
        "output": {"dir": str(folder / "run")},
    }
    path = folder / "tp.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def parameters(hidden: int, intermediate: int, layers: int) -> int:
    vocab = 262  # the byte tokenizer's ids, untied head
    return layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + 2 * vocab * hidden + hidden


def train(recipe: Path, out: Path, steps: int, layout: list[str]) -> tuple[float, dict]:
    """CPU seconds of the whole run (the command and every process it waited for) and its metrics records."""
    command = [sys.executable, "-m", "accord", "train", str(recipe), *layout]
    command += [f"train.max_steps={steps}", f"output.dir={out}", "--overwrite"]
    log = out.with_suffix(".log")
    with log.open("w") as stream:
        proc = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT, env=harness.child_environment(None))
        # wait4: this run's own tree, whatever else this script runs beside it (--jobs)
        _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{' '.join(command)} failed (exit {code}):\n{log.read_text()[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)  # checkpoint and export: not needed, and 4 runs of them add up
    return cpu, {
        "tokens": sum(r["tokens"] for r in records if r["kind"] == "train"),
        "train_peaks": next(r["peak_gib_per_rank"] for r in records if r["kind"] == "memory" and r["phase"] == "train"),
    }


def measure(recipe: Path, work: Path, name: str, steps: tuple[int, int]) -> dict:
    """One layout, run for both step counts: its peak RSS per rank and its tokens per CPU-second."""
    short, long = steps
    folder = work / name.replace(" ", "-").replace("(", "").replace(")", "")
    folder.mkdir()
    cpu_short, first = train(recipe, folder / "short", short, LAYOUTS[name])
    cpu_long, second = train(recipe, folder / "long", long, LAYOUTS[name])
    tokens, cpu = second["tokens"] - first["tokens"], cpu_long - cpu_short
    # Below zero (or about it) the extra steps cost less than the runs' own noise: no rate.
    return {
        "layout": name,
        "peaks": second["train_peaks"],
        "tokens": tokens,
        "cpu_s": cpu,
        "rate": tokens / cpu if cpu > 0.05 else None,
    }


def rows(results: list[dict]) -> list[str]:
    """The markdown table; "vs 1 process" relative to the first layout measured when it is the 1-process one."""
    base = results[0] if results and results[0]["layout"] == "1 process" else None
    lines = [
        "| layout | peak RSS per rank (GiB) | largest | largest vs 1 process | sum over ranks "
        "| tokens | CPU s | tokens per CPU-s | vs 1 process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        peaks, rate = r["peaks"], r["rate"]
        largest = max(peaks)
        memory_ratio = f"{largest / max(base['peaks']):.2f}x" if base else "-"
        speed_ratio = f"{rate / base['rate']:.2f}x" if base and rate and base["rate"] else "-"
        lines.append(
            f"| {r['layout']} | {' '.join(f'{p:.2f}' for p in peaks)} | {largest:.2f} | {memory_ratio} | "
            f"{sum(peaks):.2f} | {r['tokens']:,} | {r['cpu_s']:.1f} | {f'{rate:,.0f}' if rate else 'n/a (noise)'} "
            f"| {speed_ratio} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, nargs=2, default=[2, 8], metavar=("SHORT", "LONG"))
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows of <= 32 tokens), a multiple of 4")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--jobs", type=int, default=1, help="layouts measured at once (CPU time and RSS are per run; wall time is not)"
    )
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite the {SECTION} section of {harness.DOCS}")
    parser.add_argument("--docs", default=str(harness.DOCS), help=argparse.SUPPRESS)  # another file (tests)
    args = parser.parse_args(argv)
    if args.write_docs:
        harness.check_markers(SECTION, Path(args.docs))
    short, long = args.steps
    if not 0 < short < long:
        parser.error(f"--steps {short} {long}: the second count must be larger than the first, both above 0")
    work = Path(tempfile.mkdtemp(prefix="accord-tp-"))
    recipe = write_recipe(work, args.hidden, args.intermediate, args.layers, args.batch)
    n = parameters(args.hidden, args.intermediate, args.layers)
    model = (
        f"Llama hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
        f"{n / 1e6:.1f}M parameters; training state (16 B/param) {16 * n / 2**30:.2f} GiB"
    )
    print(f"model: {model}; runs in {work}", flush=True)
    results, load_before, started = measure_layouts(recipe, work, args.layouts, (short, long), args.jobs)
    load_after = os.getloadavg()
    shutil.rmtree(work, ignore_errors=True)
    lines = rows(results)
    print("\n".join(lines))
    footer = measured_how(short, long)
    print(footer)
    if args.write_docs:
        setting = f"{model}; one thread per process, {args.jobs} layout(s) at a time"
        write_section(
            SECTION, Path(__file__), argv, args.docs, (load_before, load_after, started), setting, lines, footer
        )


def measure_layouts(recipe: Path, work: Path, layouts: list[str], steps: tuple[int, int], jobs: int):
    """Each layout measured (`jobs` at once) after the data's cache is prepared, so that no
    run's CPU time includes preparing it (runs at once would race to); with the load average
    and the time before the first."""
    prepare = [sys.executable, "-m", "accord", "prepare", str(recipe)]
    subprocess.run(prepare, check=True, capture_output=True, env=harness.child_environment(None))
    load_before, started = os.getloadavg(), time.time()

    def one(name: str) -> dict:
        result = measure(recipe, work, name, steps)
        print(f"  {name}: done", flush=True)
        return result

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, layouts)), load_before, started


def measured_how(short: int, long: int) -> str:
    return (
        f"Peak RSS: each rank's high-water mark at the end of training (its `memory` record), each process's "
        f"empty baseline included. Tokens per CPU-s: the tokens of steps {short + 1}..{long} over the CPU time "
        f"(CPU s) they added to the whole process tree: the {long}-step run's against the {short}-step run's."
    )


def write_section(section, script: Path, argv, docs: str, when, setting: str, lines: list[str], footer: str) -> None:
    """The docs section: the command that made it, the machine and its load, `setting`, the table, `footer`."""
    load_before, load_after, started = when
    command = harness.shown_command(script, list(argv if argv is not None else sys.argv[1:]))
    body = [
        f"`{command}`, {datetime.date.today().isoformat()}, {harness.machine()}, load average "
        f"{load_before[0]:.1f} before and {load_after[0]:.1f} after ({time.time() - started:.0f} s); {setting}:",
        "",
        *lines,
        "",
        footer,
    ]
    harness.write_docs(section, body, Path(docs))


if __name__ == "__main__":
    main()
