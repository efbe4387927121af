"""Tensor parallelism on the CPU: per-rank peak memory and tokens per CPU-second, against fsdp.

    python benchmarks/tensor_parallel.py [--hidden 256] [--intermediate 8192] [--layers 4] [--steps 2 8]

Trains a Llama whose MLP is wide (intermediate size 32 × hidden: the layers TP splits hold
nearly all the parameters) through `accord train` itself, in each layout: 1 process; ddp with
engine.tensor_parallel 2 and 4; fsdp on 2 and 4 processes; fsdp × TP 2 on 4. Each rank's peak
RSS comes from the run's own `memory` records (metrics.jsonl, engine.release_host_memory on,
so RSS follows live tensors). Tokens per CPU-second: each layout runs twice, for the two
--steps counts; the difference in the CPU time of the whole process tree (getrusage of the
waited children) over the difference in trained tokens leaves start-up, data and export out.
A table, not a test: 4 processes on 2 cores is fine for memory and for CPU time (not for
wall time).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

LAYOUTS = {
    "1 process": ["engine.processes=1"],
    "ddp x tp2 (2)": ["engine.processes=2", "engine.tensor_parallel=2"],
    "ddp x tp4 (4)": ["engine.processes=4", "engine.tensor_parallel=4"],
    "fsdp (2)": ["engine.processes=2", "engine.strategy=fsdp"],
    "fsdp (4)": ["engine.processes=4", "engine.strategy=fsdp"],
    "fsdp x tp2 (4)": ["engine.processes=4", "engine.strategy=fsdp", "engine.tensor_parallel=2"],
}


def write_recipe(folder: Path, hidden: int, intermediate: int, layers: int) -> Path:
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
        "batch": {"global_batch_size": 16, "micro_batch_size": 4},
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


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train(recipe: Path, out: Path, steps: int, layout: list[str]) -> tuple[float, dict]:
    """CPU seconds of the whole run (every process it waited for) and its metrics records."""
    before = children_cpu()
    command = [sys.executable, "-m", "accord", "train", str(recipe), *layout]
    command += [f"train.max_steps={steps}", f"output.dir={out}", "--overwrite"]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = children_cpu() - before
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return cpu, {
        "tokens": sum(r["tokens"] for r in records if r["kind"] == "train"),
        "train_peaks": next(r["peak_gib_per_rank"] for r in records if r["kind"] == "memory" and r["phase"] == "train"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, nargs=2, default=[2, 8], metavar=("SHORT", "LONG"))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="accord-tp-"))
    recipe = write_recipe(work, args.hidden, args.intermediate, args.layers)
    n = parameters(args.hidden, args.intermediate, args.layers)
    print(
        f"model: Llama hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
        f"{n / 1e6:.1f}M parameters; training state (16 B/param) {16 * n / 2**30:.2f} GiB; runs in {work}",
        flush=True,
    )
    short, long = args.steps
    rows = []
    for name in args.layouts:
        layout = LAYOUTS[name]
        cpu_short, first = train(recipe, work / "short", short, layout)
        cpu_long, second = train(recipe, work / "long", long, layout)
        tokens = second["tokens"] - first["tokens"]
        rows.append((name, second["train_peaks"], tokens / max(cpu_long - cpu_short, 1e-9)))
        print(f"  {name}: done", flush=True)
    header = f"{'layout':16} {'peak RSS per rank (GiB)':>26} {'largest':>8} {'tokens / CPU-s':>15}"
    print(header)
    print("-" * len(header))
    for name, peaks, rate in rows:
        per_rank = " ".join(f"{p:.2f}" for p in peaks)
        print(f"{name:16} {per_rank:>26} {max(peaks):>8.2f} {rate:>15.0f}")
    print(f"peak RSS: the training phase's high-water mark; tokens / CPU-s: steps {short + 1}..{long}")


if __name__ == "__main__":
    main()
