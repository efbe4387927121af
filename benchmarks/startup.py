"""Start to the first optimizer step, against transformers.Trainer and TRL's SFTTrainer, in one run.

    python benchmarks/startup.py [--processes 2] [--repeat 3] [--baseline-src PATH/src] [--write-docs] [--json FILE]

The workload is throughput.py's model and data (a 4-layer Llama saved once, 640 prompt ->
completion examples), 8 sequences per process per step, trained for 2 steps: accord with
`accord train` (packed rows), the peers under torchrun with their documented defaults
(Trainer with a padding collator, SFTTrainer on the prompt/completion rows). Each contender
runs as its own program, in turn, `--repeat` times (interleaved, so a change in the machine's
load hits all alike); the table gives the median and the range of the seconds from the
command's start to the end of its first optimizer step. For accord it also gives the median
time to each of its stage lines on stderr (first output, workers started, data check, model
loading), read as they are printed, and for everyone the time the command took to exit
(training 2 steps and saving the model included) and the CPU seconds all its processes used
(less sensitive to the machine's load than wall time). `--baseline-src` adds accord from
another source tree (e.g. a checkout of main) as "accord (baseline)", for a before/after in
the same run. accord's data cache is warm after the first round (every contender reads the
same files), as on a second run. The last line is `accord / best peer: R.RRx (PEER)`, R
being the best peer's median first step over accord's: 1.00x or more, accord's comes first.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
import harness  # noqa: E402
import throughput  # noqa: E402 - the same model and rows

HERE = Path(__file__).resolve()
SECTION = "startup"  # docs/benchmarks.md: <!-- startup:start --> ... <!-- startup:end -->
STAGES = {
    "first output": "accord: checking recipe",
    "workers started": "accord: starting",
    "data check": "accord: preparing data",  # the first worker's checks reached the data (after its imports)
    "loading model": "accord: loading model",  # the checks passed, every worker joined the group
}
STEPS = 2
EXAMPLES = 640
PEERS = {"transformers.Trainer": "trainer", "TRL SFTTrainer": "trl"}


# ---------------------------------------------------------------- the workload and the commands


def make_workload(folder: Path) -> None:
    from accord.models.build import build_byte_tokenizer, build_model
    from accord.recipe.schema import ModelConfig

    tokenizer = build_byte_tokenizer()
    model = build_model(ModelConfig(config=harness.MODELS["tiny"], tokenizer="byte"), tokenizer, seed=0)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rows = throughput.prompt_completion_rows(EXAMPLES)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def accord_recipe(folder: Path, processes: int, out: Path) -> Path:
    import yaml

    recipe = throughput.sft_recipe(folder, processes) | {
        "train": {"max_steps": STEPS, "log_every": 1},
        "engine": {"processes": processes},
        "checkpoint": {"every_steps": None, "keep_last": 1},
        "output": {"dir": str(out), "overwrite": True},
    }
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(recipe))
    return path


def command_for(name: str, folder: Path, processes: int, log: Path, out: Path) -> list[str]:
    if name.startswith("accord"):
        return [sys.executable, "-m", "accord", "train", str(accord_recipe(folder, processes, out))]
    # Option names that are no prefix of any of torchrun's own (its parser matches abbreviations).
    inner = [str(HERE), "--bench-run", PEERS[name], "--bench-folder", str(folder), "--bench-log", str(log)]
    inner += ["--bench-out", str(out)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *inner]


# ---------------------------------------------------------------- a peer, in each of its processes


def run_peer(key: str, folder: Path, log: Path, out: Path) -> None:
    """Trainer or SFTTrainer for STEPS steps; rank 0 writes the wall time at the end of each
    optimizer step to `log` and saves the model in `out`."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    times: list[float] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.time())

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    common = throughput.common_arguments(log.parent, key, argparse.Namespace(device="cpu")) | {"max_steps": STEPS}
    if key == "trainer":
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=datasets.Dataset.from_list(throughput.encoded_rows(folder, "train")),
            data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
            callbacks=[Steps()],
        )
    else:
        from trl import SFTConfig, SFTTrainer

        rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, max_length=throughput.MAX_LENGTH),
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[Steps()],
        )
    trainer.train()
    if trainer.is_world_process_zero():
        model.save_pretrained(out)
        log.write_text(json.dumps(times))


# ---------------------------------------------------------------- the parent


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
    seen: dict[str, float] = {}
    cpu_before = _children_cpu()
    start = time.time()
    command = command_for(name, folder, processes, log, out)
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
    if name.startswith("accord"):
        from accord.observe.metrics import read_metrics

        first = next(r["time"] for r in read_metrics(out) if r["kind"] == "train")
    else:
        first = json.loads(log.read_text())[0]
    shutil.rmtree(work, ignore_errors=True)
    return {"first step": first - start, "exit": ended, "CPU s": _children_cpu() - cpu_before, **seen}


def _children_cpu() -> float:
    """User + system CPU seconds of the finished commands (their processes' included): what a
    contender costs in all, which a busy machine does not inflate as it does wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def table(results: dict[str, list[dict]], processes: int) -> list[str]:
    columns = [*STAGES, "first step", "range", "exit", "CPU s"]
    widths = [max(len(c), 9) for c in columns]
    name_width = max(22, *map(len, results))
    lines = [f"{'contender':{name_width}} {'proc':>4} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths))]
    for name, runs in results.items():
        cells = []
        for column, width in zip(columns, widths):
            if column == "range":
                steps = [r["first step"] for r in runs]
                cells.append(f"{f'{min(steps):.1f}-{max(steps):.1f}':>{width}}")
                continue
            values = [r[column] for r in runs if column in r]
            cells.append(f"{statistics.median(values):>{width}.1f}" if values else " " * width)
        lines.append(f"{name:{name_width}} {processes:>4} " + " ".join(cells).rstrip())
    return lines


def verdict(results: dict[str, list[dict]]) -> str:
    """The best peer's median first step over accord's: 1.00x or more, accord's comes first."""
    median = {name: statistics.median(r["first step"] for r in runs) for name, runs in results.items()}
    best = min(PEERS, key=median.__getitem__)
    return f"accord / best peer: {median[best] / median['accord']:.2f}x ({best}; its first step over accord's)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--baseline-src", help="another accord source tree (its src/ folder), measured as 'accord (baseline)'"
    )
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite the {SECTION} section of {harness.DOCS}")
    parser.add_argument("--docs", default=str(harness.DOCS), help=argparse.SUPPRESS)  # another file (tests)
    parser.add_argument("--json", help="also write every round's measurements here")
    for option in ("--bench-run", "--bench-folder", "--bench-log", "--bench-out"):
        parser.add_argument(option, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bench_run:  # in one of a peer's processes
        run_peer(args.bench_run, Path(args.bench_folder), Path(args.bench_log), Path(args.bench_out))
        return
    if args.write_docs:
        harness.check_markers(SECTION, Path(args.docs))
    folder = Path(tempfile.mkdtemp(prefix="accord-startup-"))
    try:
        measure_all(folder, args, list(argv if argv is not None else sys.argv[1:]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a model and a run per round: not left in the temp folder


def measure_all(folder: Path, args: argparse.Namespace, given: list[str]) -> None:
    load_before, started = os.getloadavg()[0], time.time()
    make_workload(folder)
    here = str(HERE.parents[1] / "src")
    contenders = {"accord": here, **dict.fromkeys(PEERS)}
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
    load_after = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    lines = table(results, args.processes)
    last = verdict(results)
    heading = (
        f"seconds from the command's start, median of {args.repeat} interleaved rounds (CPU s: the whole "
        f"process tree's); load average {load_before:.1f} before and {load_after:.1f} after"
    )
    if args.write_docs:
        command = harness.shown_command(HERE, [a for a in given if a != "--write-docs"])
        body = [
            f"`{command}`, {datetime.date.today().isoformat()}, {harness.machine()}, {args.processes} processes "
            f"per contender, {args.repeat} interleaved rounds after one unmeasured; seconds from the command's "
            f"start (median; range of the first step), CPU s is the whole process tree's; load average "
            f"{load_before:.1f} before and {load_after:.1f} after ({time.time() - started:.0f} s):",
            "",
            "```",
            *lines,
            "```",
            "",
            last,
        ]
        harness.write_docs(SECTION, body, Path(args.docs))
    print(heading)
    print("\n".join(lines))
    print(last)


if __name__ == "__main__":
    main()
