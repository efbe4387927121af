"""The shared harness of the peer benchmarks (throughput.py, grpo.py): every contender in its
own process, one thread pinned to one core, in interleaved rounds, timed by CPU time.

Wall-clock ratios on a shared machine swing with whatever else runs; the CPU time a process
spends training does not (much). So each contender runs as a fresh child process with
OMP_NUM_THREADS=1, torch.set_num_threads(1) and its affinity set to one core, and measures
itself: the CPU time (time.process_time) from the start of its first forward pass to the end
of its last optimizer step, found with torch's global module / optimizer hooks so that every
framework is timed at the same two points without its own callbacks. The parent runs the
contenders round-robin (`--rounds R`, the order rotated each round, so that a slow spell of
the machine falls on all of them), and reads each child's whole-process CPU time and peak RSS
from os.wait4. Reported per contender: the median and [min, max] over the rounds.

A script defines its contenders and a child runner; the harness does the rest:

    harness.main(Benchmark(section="throughput", unit="useful tokens", contenders=[...],
                           prepare=make_workload, child=run_child, columns=[...]))

The child runner gets (key, folder, args, recorder): it trains, calls recorder.count(n) with
the useful units (target tokens, prompts) it trained on, and returns extra columns (held-out
loss, ...). The last line printed is `accord / best peer: R.RRx (PEER CONFIGURATION)`, the best
peer being the peer configuration with the highest median units per CPU-second.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The report's half (summaries, tables, the docs section): importable from here as before.
from harness_report import (  # noqa: F401
    DOCS,
    ROOT,
    check_markers,
    machine,
    rate,
    shown_command,
    summarise,
    table,
    verdict,
    write_docs,
)

# The Llama every speed benchmark trains (--model-size): the same for accord and each peer.
MODEL = {
    "architecture": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# gpu_check's ~0.45B Llama (byte-level vocabulary), for --device cuda.
MODELS = {
    "tiny": MODEL,
    "0.5b": MODEL
    | {
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
    },
}


def train_accord(recipe: dict, out: Path, device: str, recorder, engine: dict | None = None) -> tuple[Any, list[dict]]:
    """accord's contender: `recipe` (its task, model, data, batch, optim, train) trained through
    `accord.train` in this process as one worker, in `out`, with the precision every contender
    shares on `device` (`engine`: further engine keys, e.g. the strategy); the recorder stopped
    at the end. Returns the run's result and its training records (metrics.jsonl)."""
    import yaml

    import accord
    from accord.observe.metrics import read_metrics

    recipe = recipe | {
        "engine": {"processes": 1, "device": device, "precision": "bf16" if device == "cuda" else "no"}
        | (engine or {}),
        "checkpoint": {"every_steps": None, "keep_last": 1},
        "output": {"dir": str(out), "overwrite": True},
    }
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(recipe))
    result = accord.train(path)
    recorder.stop()
    if result.status != "completed":
        raise SystemExit(f"accord: {result.status} {result.message}")
    return result, [r for r in read_metrics(out) if r["kind"] == "train"]


@dataclass(frozen=True)
class Contender:
    name: str  # as the table shows it: the framework and its configuration
    key: str  # what the child runner is told to run
    kind: str = "peer"  # accord | peer | reference (not a peer: e.g. a bare loop on accord's own batches)
    cannot_run: str = ""  # set: not run, listed as "cannot run on CPU: <why>"


@dataclass(frozen=True)
class Column:
    header: str
    key: str  # in the dict the child runner returns
    fmt: str = "{}"


@dataclass
class Benchmark:
    section: str  # the docs/benchmarks.md markers: <!-- SECTION:start --> ... <!-- SECTION:end -->
    unit: str  # what counts as useful work: "useful tokens", "prompts"
    contenders: list[Contender]
    prepare: Callable[[Path, argparse.Namespace], None]  # writes the shared workload into a folder, once
    child: Callable[[str, Path, argparse.Namespace, Recorder], dict]  # runs one contender inside its process
    columns: list[Column] = field(default_factory=list)
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    notes: Callable[[argparse.Namespace], str] = lambda args: ""  # a paragraph under the docs table
    # (bench, summaries, primary) -> (table lines, last line), for a table of another shape
    # (methods.py: a row per method, accord beside its peer); default: table() and verdict().
    report: Callable[[Benchmark, dict[str, dict], str], tuple[list[str], str]] | None = None


# ---------------------------------------------------------------- inside a contender's process


class Recorder:
    """CPU and wall time from the first forward pass to the last optimizer step, via torch's global hooks."""

    def __init__(self) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.units = 0
        self.first: tuple[float, float] | None = None  # (cpu, wall) at the first forward
        self.last: tuple[float, float] | None = None  # (cpu, wall) after the latest optimizer step
        self.steps = 0
        self._forward = torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward)
        self._step = register_optimizer_step_post_hook(self._on_step)
        self._profile = None
        if os.environ.get("BENCH_PROFILE"):
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU])

    def _on_forward(self, module, inputs) -> None:
        self._synchronize()
        self.first = (time.process_time(), time.perf_counter())
        self._forward.remove()
        if self._profile is not None:
            self._profile.__enter__()

    def _on_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        self._synchronize()
        self.last = (time.process_time(), time.perf_counter())

    @staticmethod
    def _synchronize() -> None:
        """On a GPU the step ends when its kernels do (the same wait for every contender)."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def count(self, units: int) -> None:
        self.units += int(units)

    def stop(self) -> None:
        """The training is over: what follows (held-out loss, saving) is not timed."""
        self._step.remove()
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            table = self._profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            Path(os.environ["BENCH_PROFILE"]).write_text(table)
            self._profile = None


class CountingCollator:
    """Wraps a collator to count the target tokens (labels after the shift) of each batch it builds."""

    def __init__(self, inner, recorder):
        self.inner, self.recorder = inner, recorder

    def __call__(self, features):
        batch = self.inner(features)
        self.recorder.count(int((batch["labels"][:, 1:] != -100).sum()))
        return batch


def pin_this_process() -> None:
    """One thread on one core (the core the parent chose), before torch starts its pools."""
    core = os.environ.get("BENCH_CORE")
    if core is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {int(core)})
        except OSError:  # a core the container does not grant: keep the inherited set
            pass
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set by something that ran first
        pass


def child_main(bench: Benchmark, args: argparse.Namespace) -> None:
    pin_this_process()
    recorder = Recorder()
    extra = bench.child(args.bench_child, Path(args.bench_folder), args, recorder)
    if recorder.first is None or recorder.last is None:
        raise SystemExit(f"{args.bench_child}: no forward pass and optimizer step were seen")
    import torch

    gpu = {"peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30} if torch.cuda.is_initialized() else {}
    Path(args.bench_result).write_text(
        json.dumps(
            {
                **gpu,
                "cpu_s": recorder.last[0] - recorder.first[0],
                "wall_s": recorder.last[1] - recorder.first[1],
                "units": recorder.units,
                "steps": recorder.steps,
                **extra,
            }
        )
    )


# ---------------------------------------------------------------- the parent


def child_environment(core: int | None) -> dict[str, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p),
    )
    if core is not None:
        env["BENCH_CORE"] = str(core)
    return env


def choose_core() -> int | None:
    """The last core this process may run on (the same one for every contender)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return max(os.sched_getaffinity(0))


def run_one(
    script: Path, contender: Contender, folder: Path, argv: list[str], log: Path, profile: Path | None = None
) -> dict:
    result = folder / f"result-{contender.key}-{time.monotonic_ns()}.json"
    command = [
        sys.executable,
        str(script),
        *argv,
        "--bench-child",
        contender.key,
        "--bench-folder",
        str(folder),
        "--bench-result",
        str(result),
    ]
    with log.open("a") as out:
        out.write(f"\n==== {contender.name}: {shlex.join(command)}\n")
        out.flush()
        env = child_environment(choose_core()) | ({"BENCH_PROFILE": str(profile)} if profile else {})
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not result.exists():
        tail = log.read_text().strip().splitlines()[-1:] or ["failed"]
        return {"error": f"exit {proc.returncode}: {tail[0][:200]}"}
    measured = json.loads(result.read_text())
    measured["process_cpu_s"] = usage.ru_utime + usage.ru_stime
    measured["peak_rss_mib"] = usage.ru_maxrss / 1024  # KiB on Linux
    return measured


def main(bench: Benchmark, argv: list[str] | None = None) -> None:
    script = Path(sys.argv[0]).resolve()
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each contender once per round)")
    parser.add_argument("--only", nargs="+", metavar="KEY", help="run only these contenders (their keys)")
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite the {bench.section} section of {DOCS}")
    parser.add_argument("--docs", default=str(DOCS), help=argparse.SUPPRESS)  # another file for --write-docs (tests)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: fp32, ranked by units per CPU-second; cuda: bf16 autocast, ranked by units per wall-second",
    )
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (its log names each command)")
    parser.add_argument(
        "--profile",
        nargs="+",
        metavar="KEY",
        help="instead: run these contenders once under torch.profiler and print their top operators by self CPU time",
    )
    parser.add_argument("--bench-child", help=argparse.SUPPRESS)
    parser.add_argument("--bench-folder", help=argparse.SUPPRESS)
    parser.add_argument("--bench-result", help=argparse.SUPPRESS)
    bench.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.bench_child:
        child_main(bench, args)
        return

    if args.write_docs:
        check_markers(bench.section, Path(args.docs))
    given = list(argv if argv is not None else sys.argv[1:])
    # The child parses the same options (and ignores the parent's own): its settings are the parent's.
    forwarded = [a for a in given if a != "--write-docs"]
    contenders = [c for c in bench.contenders if not args.only or c.key in args.only]
    bench.contenders = contenders
    folder = Path(tempfile.mkdtemp(prefix=f"accord-{bench.section}-"))
    log = folder / "children.log"
    load_before = os.getloadavg()
    started = time.time()
    bench.prepare(folder, args)
    if args.profile:
        for contender in contenders:
            if contender.key in args.profile:
                path = folder / f"profile-{contender.key}.txt"
                measured = run_one(script, contender, folder, forwarded, log, profile=path)
                print(f"## {contender.name}: {measured.get('error') or ''}")
                print(path.read_text() if path.exists() else "(no profile)")
        return
    runs: dict[str, list[dict]] = {c.name: [] for c in contenders}
    runnable = [c for c in contenders if not c.cannot_run]
    for round_index in range(args.rounds):
        shift = round_index % max(1, len(runnable))
        for contender in runnable[shift:] + runnable[:shift]:
            measured = run_one(script, contender, folder, forwarded, log)
            runs[contender.name].append(measured)
            status = measured.get("error") or f"{measured['units'] / measured['cpu_s']:,.0f} {bench.unit}/CPU-s"
            print(f"  round {round_index + 1}/{args.rounds}: {contender.name}: {status}", file=sys.stderr, flush=True)
    primary = "wall" if args.device == "cuda" else "cpu"
    summaries = {c.name: summarise(runs[c.name], bench.unit, primary) for c in contenders}
    load_after = os.getloadavg()
    if bench.report is not None:
        lines, last = bench.report(bench, summaries, primary)
    else:
        lines, last = table(bench, summaries, primary), verdict(bench, summaries)
    command = shown_command(script, given)
    if args.json:
        Path(args.json).write_text(json.dumps({"summaries": summaries, "verdict": last}, indent=1, default=str))
    if args.write_docs:
        when = datetime.date.today().isoformat()
        body = [
            f"`{command}`, {when}, {machine()}, load average {load_before[0]:.1f} before and "
            f"{load_after[0]:.1f} after ({time.time() - started:.0f} s); one thread pinned to one core per "
            f"process, {args.rounds} interleaved rounds{', on ' + args.device if args.device != 'cpu' else ''}:",
            "",
            *lines,
            "",
            last,
        ]
        notes = bench.notes(args)
        if notes:
            body += ["", notes]
        write_docs(bench.section, body, Path(args.docs))
    if not args.keep:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"  work folder: {folder}", file=sys.stderr)
    print("\n".join(lines))
    print(last)
