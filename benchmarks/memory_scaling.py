"""Per-rank memory of the sharded strategies as the world grows: does every phase shrink?

    python benchmarks/memory_scaling.py [--layers 18] [--strategies fsdp zero3] [--worlds 1 2 4] [--release-host-memory]

For each strategy and world size it trains a ~0.5B-parameter Llama built from a config on
the CPU (2 steps, a checkpoint, the export to final/), then resumes it for one more step,
through `accord train` itself. Each rank's peak memory at the end of every phase comes from
the run's own `memory` records in metrics.jsonl (RSS high-water mark on the CPU,
max_memory_allocated on a GPU). It prints, per phase, the largest rank's peak and the host
total (sum over ranks), next to the unsharded training state (16 bytes per parameter: fp32
weights, gradients and two AdamW moments) and each process's empty-run baseline (the same
launch with a tiny model), then how long the first checkpoint blocked training against the
training step before it (a ratio within one run). A table, not a test: 4 processes on 2
cores is fine for memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

PHASES = ("build", "train", "checkpoint", "export", "resume")


def model_config(hidden: int, layers: int) -> dict:
    return {
        "architecture": "llama",
        "hidden_size": hidden,
        "intermediate_size": 8 * hidden // 3 // 64 * 64,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 128),
        "num_key_value_heads": max(1, hidden // 128),
        "max_position_embeddings": 64,
    }


def parameters(config: dict) -> int:
    """Parameters of a Llama with the byte vocabulary (262 ids, untied head)."""
    h, f, layers, vocab = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], 262
    return layers * (4 * h * h + 3 * h * f + 2 * h) + 2 * vocab * h + h


def write_recipe(folder: Path, name: str, config: dict) -> Path:
    data = {
        "seed": 0,
        "task": "sft",
        "model": {"config": config, "tokenizer": "byte"},
        "data": {
            "generate": {"kind": "addition", "train_examples": 64, "eval_examples": 0, "max_digits": 2},
            "max_length": 32,
            "cache_dir": str(folder / "cache"),
        },
        "batch": {"global_batch_size": 4, "micro_batch_size": 1},
        "train": {"max_steps": 2, "log_every": 1},
        "engine": {"device": "cpu"},
        "checkpoint": {"keep_last": 1},
        "output": {"dir": str(folder / name)},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def accord(*args: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "accord", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"accord {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def peaks(out: Path) -> dict[str, list[float]]:
    """Each phase's per-rank peak (GiB); the resumed run's build is the `resume` phase."""
    found: dict[str, list[float]] = {}
    builds = 0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] != "memory":
            continue
        phase = record["phase"]
        if phase == "build":
            builds += 1
            phase = "build" if builds == 1 else "resume"
        found.setdefault(phase, record["peak_gib_per_rank"])
    return found


def finished(out: Path) -> bool:
    """Whether `out` holds whole runs: each (the first and the resumed one; a baseline's
    one) recorded its export."""
    if not (out / "metrics.jsonl").is_file():
        return False
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    exports = sum(1 for r in records if r["kind"] == "memory" and r["phase"] == "export")
    return exports >= (1 if out.name.startswith("baseline-") else 2)


def checkpoint_wait(out: Path) -> tuple[float, float] | None:
    """The first checkpoint's blocking time (s, from its record) and the training step before
    it (s): a ratio within one run, comparable between loaded runs."""
    step_seconds = None
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "throughput":
            step_seconds = record["seconds_per_step"]
        elif record["kind"] == "checkpoint" and "seconds" in record and step_seconds:
            return record["seconds"], step_seconds
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--strategies", nargs="+", default=["fsdp", "zero3"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--work", type=Path, default=None, help="folder for runs (default: a temporary one)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take the peaks of runs already finished in --work instead of running them again",
    )
    parser.add_argument(
        "--release-host-memory",
        action="store_true",
        help="engine.release_host_memory=true in every run (baselines too): RSS follows live tensors",
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="accord-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    config = model_config(args.hidden, args.layers)
    n = parameters(config)
    state_gib = 16 * n / 2**30
    tiny = write_recipe(work, "baseline", model_config(128, 1))
    big = write_recipe(work, "big", config)
    print(
        f"model: Llama hidden {args.hidden} x {args.layers} layers, {n / 1e6:.0f}M parameters; "
        f"unsharded training state (16 B/param) {state_gib:.2f} GiB; runs in {work}"
        f"{'; engine.release_host_memory' if args.release_host_memory else ''}",
        flush=True,
    )

    rows = []
    for strategy in args.strategies:
        for world in args.worlds:
            common = [
                f"engine.strategy={strategy}",
                f"engine.processes={world}",
                f"engine.release_host_memory={str(args.release_host_memory).lower()}",
            ]
            base_out = work / f"baseline-{strategy}-{world}"
            out = work / f"{strategy}-{world}"
            if args.reuse and finished(base_out) and finished(out):
                print(f"  {strategy} x{world}: reusing the runs in {out} and {base_out}", flush=True)
            else:
                accord("train", str(tiny), *common, f"output.dir={base_out}", "--overwrite")
                seconds = accord("train", str(big), *common, f"output.dir={out}", "--overwrite")
                seconds += accord("train", str(big), *common, f"output.dir={out}", "train.max_steps=3", "--resume")
                print(f"  {strategy} x{world}: done in {seconds:.0f} s", flush=True)
            for folder in (base_out, out):  # the table needs metrics.jsonl only; a 0.5B run writes ~8 GB
                for written in ("checkpoints", "final"):
                    shutil.rmtree(folder / written, ignore_errors=True)
            rows.append((strategy, world, max(peaks(base_out)["build"]), peaks(out), out))

    header = (
        f"{'strategy':8} {'world':>5} {'baseline':>9} "
        + " ".join(f"{p + ' max':>14} {'total':>7}" for p in PHASES)
        + f" {'vs state+base':>13}"
    )
    print(header)
    print("-" * len(header))
    for strategy, world, baseline, found, _ in rows:
        cells = []
        worst_total = 0.0
        for phase in PHASES:
            values = found.get(phase, [])
            cells.append(f"{max(values):>14.2f} {sum(values):>7.2f}" if values else f"{'-':>14} {'-':>7}")
            worst_total = max(worst_total, sum(values))
        budget = 1.3 * state_gib + world * baseline
        print(f"{strategy:8} {world:>5} {baseline:>9.2f} " + " ".join(cells) + f" {worst_total / budget:>12.2f}x")
    print("GiB; 'max' is the largest rank's peak up to the end of the phase, 'total' the sum over ranks;")
    print(
        f"'vs state+base' is the largest host total over 1.3 x the unsharded state ({state_gib:.2f} GiB) "
        "plus world x baseline (target <= 1.00x)."
    )
    for strategy, world, _, _, out in rows:
        wait = checkpoint_wait(out)
        if wait:
            print(
                f"{strategy} x{world}: the checkpoint blocked training {wait[0]:.1f} s = "
                f"{wait[0] / wait[1]:.1f} x the step before it ({wait[1]:.1f} s)"
            )
    for strategy in args.strategies:
        by_world = {w: max(max(v) for v in f.values()) for s, w, _, f, _ in rows if s == strategy}
        if 2 in by_world and 4 in by_world:
            print(
                f"{strategy}: largest rank's peak at world 4 / world 2 = {by_world[4] / by_world[2]:.2f} "
                "(target <= 0.60)"
            )


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
