"""Data preparation at scale: throughput, memory, cache size, first step and resume.

    python benchmarks/data_scale.py [--sizes 0.2,1] [--shapes small,huge,mixture] [--workers 1,2]
                                    [--scratch DIR] [--no-trl] [--no-train]

For each corpus size (GB of text, generated once under --scratch, deleted at the end) and
shape — many small documents (JSONL rows of 1-20 kB), a few huge ones (4 .txt files), a
mixture of two JSONL sources weighted 1:3 — it runs, each as its own program:
- `accord prepare` (task pretrain, byte tokenizer, 256-token blocks) with each worker count
  and a cold cache: MB/s of text, peak RSS of the largest process (GNU time);
- `accord train` for one step on the prepared cache (2 CPU processes, a tiny Llama): seconds
  to the end of the first step and the largest process's peak RSS;
- the data side of a resume at 90% of an epoch (rows, order, the global batch fetched);
- datasets.map(num_proc=2) + TRL's pack_dataset (bfd) on the same corpus, as the baseline.
Prints one Markdown table. Timings on a shared machine: quote the load average with them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the of and to in a that was he she it with for as his her on be at by had not but from this which "
         "Elizabeth Darcy letter sister would could very said much every man moment house").split()
BLOCK = 256


def make_corpus(folder: Path, gb: float, shape: str) -> list[dict]:
    """The corpus files and the recipe's data.train sources."""
    folder.mkdir(parents=True, exist_ok=True)
    total = int(gb * 1e9)
    rng = random.Random(0)
    if shape == "huge":
        for i in range(4):
            _write_text(folder / f"doc{i}.txt", total // 4, rng)
        return [{"path": str(folder)}]
    parts = [("a", 0.25, 1.0), ("b", 0.75, 3.0)] if shape == "mixture" else [("all", 1.0, 1.0)]
    sources = []
    for name, share, weight in parts:
        path = folder / f"{name}.jsonl"
        with path.open("w") as f:
            size = 0
            while size < total * share:
                line = json.dumps({"text": _words(rng, rng.randint(200, 3500))}) + "\n"
                f.write(line)
                size += len(line)
        sources.append({"path": str(path), "weight": weight})
    return sources


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _write_text(path: Path, size: int, rng: random.Random) -> None:
    with path.open("w") as f:
        written = 0
        while written < size:
            paragraph = _words(rng, rng.randint(20, 200)) + ".\n\n"
            f.write(paragraph)
            written += len(paragraph)


def recipe(folder: Path, sources: list[dict], cache: Path) -> Path:
    text = json.dumps({
        "seed": 7,
        "model": {"config": {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": BLOCK}, "tokenizer": "byte"},
        "task": "pretrain",
        "data": {"train": sources, "max_length": BLOCK, "cache_dir": str(cache)},
        "batch": {"global_batch_size": 16},
        "engine": {"device": "cpu", "processes": 2},
        "train": {"max_steps": 1, "log_every": 1},
        "output": {"dir": str(folder / "run")},
    })
    path = folder / "recipe.yaml"
    path.write_text(text)  # JSON is YAML
    return path


def timed(command: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB of the largest process, stderr) of a finished command."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024
    return wall, rss, proc.stderr


def accord(*args: str) -> list[str]:
    return [sys.executable, "-m", "accord", *args]


def cache_facts(cache: Path) -> tuple[float, int]:
    """(bytes per token of the training shards, tokens)."""
    meta = json.loads(next(cache.glob("*/train/shards.json")).read_text())
    return sum(meta["bytes"].values()) / meta["tokens"], meta["tokens"]


def resume_seconds(recipe_path: Path) -> float:
    """The data side of resuming at 90% of an epoch: load the prepared cache, build the rows
    and the global order, fetch that step's global batch."""
    code = f"""
import time; t = time.perf_counter()
from accord.recipe import load_recipe; from accord.models import build_tokenizer; from accord.tasks import build_task
from accord.data.prepare import prepare_data; from accord.data.packing import training_rows; from accord.data.order import GlobalOrder
from accord.batches import fetch
r = load_recipe({str(recipe_path)!r}); tok = build_tokenizer(r.model); task = build_task(r, tok)
t = time.perf_counter()
d = prepare_data(r, tok, task, preparer=False); rows = training_rows(d.train, task.row_capacity)
order = GlobalOrder(len(rows), r.batch.global_batch_size, r.seed)
batch = order.batch(int(0.9 * order.steps_per_epoch))
fetch(d.train, [i for row in batch for i in rows.members[row]])
print(time.perf_counter() - t)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def trl_baseline(sources: list[dict], folder: Path) -> tuple[float, float]:
    """(seconds, peak RSS MB) of datasets.map(num_proc=2) tokenising + TRL's pack_dataset."""
    files = [s["path"] for s in sources]
    code = f"""
import datasets, os, glob
from trl.data_utils import pack_dataset
from accord.models import build_byte_tokenizer
datasets.disable_progress_bars()
tok = build_byte_tokenizer()
files = {files!r}
if os.path.isdir(files[0]):
    ds = datasets.load_dataset("text", data_files=sorted(glob.glob(files[0] + "/*.txt")), sample_by="document", split="train", cache_dir={str(folder / 'hf')!r})
else:
    ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir={str(folder / 'hf')!r})
ds = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=2, remove_columns=ds.column_names)
ds = pack_dataset(ds, {BLOCK}, strategy="bfd", map_kwargs={{"num_proc": 2}})
print(len(ds))
"""
    wall, rss, _ = timed([sys.executable, "-c", code])
    return wall, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.2,1", help="corpus sizes in GB, comma-separated")
    parser.add_argument("--shapes", default="small,huge,mixture")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--scratch", default="/work/scratch/data_scale")
    parser.add_argument("--no-trl", action="store_true", help="skip the datasets.map + TRL packing baseline")
    parser.add_argument("--no-train", action="store_true", help="skip the one-step training run")
    args = parser.parse_args()
    scratch = Path(args.scratch)
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    rows = []
    try:
        for gb in map(float, args.sizes.split(",")):
            for shape in args.shapes.split(","):
                folder = scratch / f"{shape}-{gb:g}GB"
                sources = make_corpus(folder / "corpus", gb, shape)
                mb = sum(f.stat().st_size for f in (folder / "corpus").rglob("*") if f.is_file()) / 1e6
                row = {"corpus": f"{shape} {gb:g} GB", "MB": mb}
                for workers in map(int, args.workers.split(",")):
                    cache = folder / f"cache-{workers}"
                    path = recipe(folder, sources, cache)
                    wall, rss, _ = timed(accord("prepare", str(path), f"data.prepare_workers={workers}"), env)
                    row[f"prep MB/s ({workers}w)"] = mb / wall
                    row[f"prep peak RSS MB ({workers}w)"] = rss
                row["cache bytes/token"], row["tokens"] = cache_facts(cache)
                row["resume at 90% (s)"] = resume_seconds(path)
                if not args.no_train:
                    wall, rss, _ = timed(accord("train", str(path), "--overwrite"), env)
                    row["first step (s)"], row["train peak RSS MB"] = wall, rss
                if not args.no_trl:
                    wall, rss = trl_baseline(sources, folder)
                    row["datasets.map(2)+TRL MB/s"], row["datasets.map(2)+TRL peak RSS MB"] = mb / wall, rss
                rows.append(row)
                shutil.rmtree(folder)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if value < 10 else f"{value:.0f}"
    return "" if value is None else str(value)


if __name__ == "__main__":
    main()
