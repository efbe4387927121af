"""Data preparation at scale: throughput, memory, cache size, first step and resume.

    python benchmarks/data_scale.py [--sizes 0.2,1] [--shapes small,huge,mixture] [--workers 1,2]
                                    [--scratch DIR] [--limit S] [--no-trl] [--no-train] [--task dpo|reward]

For each corpus size (GB of text, generated once under --scratch, deleted at the end) and
shape — many small documents (JSONL rows of 1-20 kB), a few huge ones (4 .txt files), a
mixture of two JSONL sources weighted 1:3 — it runs, each as its own program:
- `accord prepare` (task pretrain, byte tokenizer, 256-token blocks) with each worker count
  and a cold cache: MB/s of text, peak RSS of the largest process (VmHWM sampled over the
  process tree); with --limit each preparation is stopped after that many seconds and what
  it tokenised by then is reported (for corpora too large for the time at hand);
- `accord train` for one step on the prepared cache (2 CPU processes, a tiny Llama): seconds
  to the end of the first step and the largest process's peak RSS;
- the data side of a resume at 90% of an epoch (rows, order, the global batch fetched);
- datasets.map(num_proc=2) + TRL's pack_dataset (bfd) on the same corpus (a mixture drawn
  as accord draws it), as the baseline; MB per CPU second of each process tree, and each
  side's throughput per core against the baseline's (target >= 0.8).
`--task dpo` (or reward) prepares preference pairs instead (shape `pairs`: JSONL rows of
prompt / chosen / rejected, max_length PAIR_LENGTH, over-long pairs truncated); its baseline
is datasets.map(num_proc=2) tokenising the three columns, without packing.
Prints one Markdown table. Timings on a shared machine: quote the load average with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "the of and to in a that was he she it with for as his her on be at by had not but from this which "
    "Elizabeth Darcy letter sister would could very said much every man moment house"
).split()
BLOCK = 256
PAIR_LENGTH = 1024  # max_length of the preference-pair tasks (byte tokens)


def make_corpus(folder: Path, gb: float, shape: str) -> list[dict]:
    """The corpus files and the recipe's data.train sources. Text is drawn from a pool of
    ~16 MB of random paragraphs (or rows), written in a new random order every pass, so a
    4 GB corpus is written at disk speed."""
    folder.mkdir(parents=True, exist_ok=True)
    total = int(gb * 1e9)
    rng = np.random.default_rng(0)
    if shape == "huge":
        pool = [_words(rng, int(n)) + ".\n\n" for n in rng.integers(20, 200, 16_000)]
        for i in range(4):
            _write(folder / f"doc{i}.txt", total // 4, pool, rng)
        return [{"path": str(folder)}]
    if shape == "pairs":
        pool = [
            json.dumps({"prompt": _words(rng, int(a)), "chosen": _words(rng, int(b)), "rejected": _words(rng, int(c))})
            + "\n"
            for a, b, c in rng.integers([10, 5, 5], [200, 120, 120], (4_000, 3))
        ]
        _write(folder / "pairs.jsonl", total, pool, rng)
        return [{"path": str(folder / "pairs.jsonl")}]
    pool = [json.dumps({"text": _words(rng, int(n))}) + "\n" for n in rng.integers(200, 3500, 1_400)]
    parts = [("a", 0.25, 1.0), ("b", 0.75, 3.0)] if shape == "mixture" else [("all", 1.0, 1.0)]
    sources = []
    for name, share, weight in parts:
        _write(folder / f"{name}.jsonl", int(total * share), pool, rng)
        sources.append({"path": str(folder / f"{name}.jsonl"), "weight": weight})
    return sources


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def _write(path: Path, size: int, pool: list[str], rng: np.random.Generator) -> None:
    """At least `size` bytes of whole pool items, in a fresh random order each pass."""
    with path.open("w") as f:
        written = 0
        while written < size:
            block = "".join(pool[i] for i in rng.permutation(len(pool)))
            f.write(block)
            written += len(block)


def recipe(folder: Path, sources: list[dict], cache: Path, task: str = "pretrain") -> Path:
    length = BLOCK if task == "pretrain" else PAIR_LENGTH
    text = json.dumps(
        {
            "seed": 7,
            "model": {
                "config": {
                    "architecture": "llama",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": length,
                },
                "tokenizer": "byte",
            },
            "task": task,
            "data": {"train": sources, "max_length": length, "cache_dir": str(cache)}
            | ({} if task == "pretrain" else {"truncation": "truncate"}),
            "batch": {"global_batch_size": 16},
            "engine": {"device": "cpu", "processes": 2},
            "train": {"max_steps": 1, "log_every": 1},
            "output": {"dir": str(folder / "run")},
        }
    )
    path = folder / "recipe.yaml"
    path.write_text(text)  # JSON is YAML
    return path


def timed(command: list[str], env: dict | None = None, limit: float | None = None) -> tuple[float, float, bool, float]:
    """(wall seconds, peak RSS MB of the largest process, finished, CPU seconds) of a command
    stopped (SIGINT to its process group) after `limit` seconds. The peak is each process's
    VmHWM, sampled every 0.2 s over the command's process tree; the CPU seconds (user +
    system) are the whole tree's, workers included: MB per CPU second is throughput per
    core, which a loaded machine changes far less than MB/s."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # SIGINT back to its default in the child: a job started in the background (nohup ... &)
    # inherits it ignored, and the stop below would go unheard.
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    peaks: dict[int, float] = {}
    ANON.clear()
    stopped = False
    while proc.poll() is None:
        for pid in _tree(proc.pid):
            peaks[pid] = max(peaks.get(pid, 0.0), _hwm_mb(pid))
            ANON[pid] = max(ANON.get(pid, 0.0), _hwm_mb(pid, "RssAnon"))
        if limit is not None and time.perf_counter() - start > limit and not stopped:
            os.killpg(proc.pid, signal.SIGINT)  # a killed preparation keeps its finished chunks
            stopped = True
        time.sleep(0.2)
    wall = time.perf_counter() - start
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0 and not stopped:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-4000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # a process's reaped descendants count towards it
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, max(peaks.values(), default=0.0), not stopped, cpu


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


ANON: dict[int, float] = {}  # the largest RssAnon seen per process: RSS without mapped file pages


def _hwm_mb(pid: int, field: str = "VmHWM") -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    found = re.search(rf"{field}:\s+(\d+) kB", status)
    return int(found.group(1)) / 1024 if found else 0.0


def accord(*args: str) -> list[str]:
    return [sys.executable, "-m", "accord", *args]


def _chunk_mb(cache: Path) -> float:
    """MB of text an interrupted preparation tokenised: its finished chunks (of UNIT_CHARS
    characters, ASCII here) kept for the next run."""
    from accord.data.chunks import UNIT_CHARS

    return len(list(cache.glob("*.partial/train/chunk-*.npz"))) * UNIT_CHARS / 1e6


def cache_facts(cache: Path) -> tuple[float | None, int | None]:
    """(bytes per token of the training shards, tokens); (None, None) for an Arrow cache
    (the code before preference pairs were token shards)."""
    found = next(cache.glob("*/train/shards.json"), None) or next(cache.glob("*/train/columns.json"), None)
    if found is None:
        return None, None
    meta = json.loads(found.read_text())
    return sum(meta["bytes"].values()) / meta["tokens"], meta["tokens"]


def cache_mb(cache: Path) -> float:
    return sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 1e6


def resume_seconds(recipe_path: Path) -> float:
    """The data side of resuming at 90% of an epoch: load the prepared cache, build the rows
    and the global order, fetch that step's global batch."""
    code = f"""
import time; t = time.perf_counter()
from accord.recipe.schema import load_recipe
from accord.models.build import build_tokenizer
from accord.tasks import build_task, task_config
from accord.data.prepare import prepare_data
from accord.data.packing import training_rows
from accord.data.order import GlobalOrder
from accord.data.fetch import fetch
r = load_recipe({str(recipe_path)!r}); tok = build_tokenizer(r.model); task = build_task(task_config(r), tok)
t = time.perf_counter()
d = prepare_data(r.data, r.seed, tok, task, preparer=False); rows = training_rows(d.train, task.row_capacity)
order = GlobalOrder(len(rows), r.batch.global_batch_size, r.seed)
batch = order.batch(int(0.9 * order.steps_per_epoch))
fetch(d.train, [i for row in batch for i in rows.members[row]])
print(time.perf_counter() - t)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


PAIRS_BASELINE = """
import datasets
from accord.models.build import build_byte_tokenizer
datasets.disable_progress_bars()
tok = build_byte_tokenizer()
ds = datasets.load_dataset("json", data_files={file!r}, split="train", cache_dir={cache!r})
ds = ds.map(
    lambda b: {{k + "_ids": tok(b[k])["input_ids"] for k in ("prompt", "chosen", "rejected")}},
    batched=True,
    num_proc=2,
    remove_columns=ds.column_names,
)
print(len(ds))
"""


def pairs_baseline(sources: list[dict], folder: Path) -> tuple[float, float, float]:
    """(seconds, peak RSS MB, CPU seconds) of datasets.map(num_proc=2) tokenising the three
    columns of the pairs (what TRL's DPOTrainer does before its collator)."""
    wall, rss, _, cpu = timed(
        [sys.executable, "-c", PAIRS_BASELINE.format(file=sources[0]["path"], cache=str(folder / "hf"))]
    )
    return wall, rss, cpu


def trl_baseline(sources: list[dict], folder: Path) -> tuple[float, float, float]:
    """(seconds, peak RSS MB, CPU seconds) of datasets.map(num_proc=2) tokenising + TRL's
    pack_dataset. A weighted mixture is drawn as accord draws it (interleave_datasets with
    the weights as probabilities until every source was seen once), so both tokenise the
    same text."""
    files = [s["path"] for s in sources]
    weights = [s.get("weight", 1.0) for s in sources]
    code = f"""
import datasets, os, glob
from trl.data_utils import pack_dataset
from accord.models.build import build_byte_tokenizer
datasets.disable_progress_bars()
tok = build_byte_tokenizer()
files = {files!r}
if os.path.isdir(files[0]):
    ds = datasets.load_dataset(
        "text",
        data_files=sorted(glob.glob(files[0] + "/*.txt")),
        sample_by="document",
        split="train",
        cache_dir={str(folder / "hf")!r},
    )
else:
    parts = [
        datasets.load_dataset("json", data_files=f, split="train", cache_dir={str(folder / "hf")!r}) for f in files
    ]
    w = {weights!r}
    if len(parts) == 1:
        ds = parts[0]
    else:
        ds = datasets.interleave_datasets(
            parts, probabilities=[x / sum(w) for x in w], seed=7, stopping_strategy="all_exhausted"
        )
ds = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=2, remove_columns=ds.column_names)
ds = pack_dataset(ds, {BLOCK}, strategy="bfd", map_kwargs={{"num_proc": 2}})
print(len(ds))
"""
    wall, rss, _, cpu = timed([sys.executable, "-c", code])
    return wall, rss, cpu


PLAN_CODE = """
import json, os, resource, sys, time
import numpy as np
folder, rows, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
from accord.data.shards import TokenShards
from accord.data.packing import training_rows
from accord.data.order import GlobalOrder
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
train = TokenShards(__import__("pathlib").Path(folder))
if kind == "stored":  # what a run held before: lengths as an array and the epoch's whole permutation
    lengths = np.diff(train.offsets).astype(np.int32)
    order = np.random.default_rng([7, 0]).permutation(rows)
    batch = order[int(0.9 * rows) // 16 * 16:][:16]
else:
    r = training_rows(train, None)
    batch = GlobalOrder(len(r), 16, 7).batch(int(0.9 * len(r)) // 16)
    _ = int(r.lengths[batch].sum()), float(r.lengths.mean())
mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({"MB": mb, "s": time.perf_counter() - t}))
"""


def plan_memory(folder: Path, rows: int) -> list[dict]:
    """Memory a rank adds for the plan of `rows` unpacked 256-token rows (the index of a
    prepared corpus of rows * 256 tokens, its token file sparse): the previous stored
    permutation and length array against the bijection and mapped lengths."""
    folder.mkdir(parents=True, exist_ok=True)
    offsets = np.arange(rows + 1, dtype=np.int64) * BLOCK
    offsets.tofile(folder / "offsets.bin")
    np.full(rows, BLOCK - 1, dtype=np.int32).tofile(folder / "num_targets.bin")
    sizes = {"tokens.bin": rows * BLOCK * 2, "targets.bin": rows * BLOCK // 8}
    for name, size in sizes.items():
        _sparse(folder / name, size)  # never read: only the index is
    sizes |= {"offsets.bin": (rows + 1) * 8, "num_targets.bin": rows * 4}
    (folder / "shards.json").write_text(
        json.dumps({"dtype": "uint16", "examples": rows, "tokens": rows * BLOCK, "tokenizer": "x", "bytes": sizes})
    )
    out = []
    for kind in ("stored", "bijection"):
        proc = subprocess.run(
            [sys.executable, "-c", PLAN_CODE, str(folder), str(rows), kind], capture_output=True, text=True, check=True
        )
        out.append({"plan": kind, "rows": rows} | json.loads(proc.stdout.strip().splitlines()[-1]))
    shutil.rmtree(folder)
    return out


def _sparse(path: Path, size: int) -> None:
    with path.open("wb") as f:
        f.truncate(size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.2,1", help="corpus sizes in GB, comma-separated")
    parser.add_argument("--shapes", default="small,huge,mixture")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument(
        "--scratch", default=str(Path.home() / "data_scale"), help="where corpora and caches go (deleted at the end)"
    )
    parser.add_argument(
        "--limit",
        type=float,
        default=None,
        help="stop each preparation after this many seconds (SIGINT) and report "
        "what it tokenised by then and its peak RSS; the other columns need a whole cache",
    )
    parser.add_argument("--no-trl", action="store_true", help="skip the datasets.map + TRL packing baseline")
    parser.add_argument("--no-train", action="store_true", help="skip the one-step training run")
    parser.add_argument(
        "--task",
        default="pretrain",
        choices=["pretrain", "dpo", "reward"],
        help="dpo or reward: preference pairs (shape pairs, the default shape then)",
    )
    parser.add_argument(
        "--plan-rows",
        type=int,
        default=0,
        help="also measure the memory a rank adds for the plan of this many "
        "256-token rows (e.g. 16000000: a 4 GB byte-level corpus), stored permutation against the bijection",
    )
    args = parser.parse_args()
    scratch = Path(args.scratch)
    shapes = "pairs" if args.task != "pretrain" and args.shapes == parser.get_default("shapes") else args.shapes
    if args.plan_rows:
        for r in plan_memory(scratch / "plan", args.plan_rows):
            print(f"| plan of {r['rows']} rows: {r['plan']} | +{r['MB']:.0f} MB peak RSS | {r['s']:.2f} s |")
    # datasets' own copy of a source (its Arrow cache) goes with the corpus and is deleted with it.
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", HF_DATASETS_CACHE=str(scratch / "hf"))
    rows = []
    try:
        for gb in (float(x) for x in args.sizes.split(",") if x):  # --sizes "": only --plan-rows
            for shape in shapes.split(","):
                folder = scratch / f"{shape}-{gb:g}GB"
                sources = make_corpus(folder / "corpus", gb, shape)
                mb = sum(f.stat().st_size for f in (folder / "corpus").rglob("*") if f.is_file()) / 1e6
                row = {"corpus": f"{shape} {gb:g} GB", "MB": mb}
                finished = True
                for workers in map(int, args.workers.split(",")):
                    cache = folder / f"cache-{workers}"
                    path = recipe(folder, sources, cache, args.task)
                    wall, rss, finished, cpu = timed(
                        accord("prepare", str(path), f"data.prepare_workers={workers}"), env, args.limit
                    )
                    done = mb if finished else _chunk_mb(cache)
                    row[f"prep MB/s ({workers}w)"] = done / wall
                    row[f"prep MB/CPU-s ({workers}w)"] = done / cpu
                    row[f"prep peak RSS MB ({workers}w)"] = rss
                    row[f"prep peak anonymous RSS MB ({workers}w)"] = max(ANON.values(), default=0.0)
                    if not finished:
                        row[f"stopped after (s, MB tokenised) ({workers}w)"] = f"{wall:.0f}, {done:.0f}"
                if not finished:  # the rest needs a whole cache
                    rows.append(row)
                    shutil.rmtree(folder)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    continue
                row["cache bytes/token"], row["tokens"] = cache_facts(cache)
                row["cache MB"] = cache_mb(cache)
                row["resume at 90% (s)"] = resume_seconds(path)
                if not args.no_train:
                    wall, rss, _, _ = timed(accord("train", str(path), "--overwrite"), env)
                    row["first step (s)"], row["train peak RSS MB"] = wall, rss
                if not args.no_trl:
                    wall, rss, cpu = (trl_baseline if args.task == "pretrain" else pairs_baseline)(sources, folder)
                    (
                        row["datasets.map(2)+TRL MB/s"],
                        row["datasets.map(2)+TRL MB/CPU-s"],
                        row["datasets.map(2)+TRL peak RSS MB"],
                    ) = mb / wall, mb / cpu, rss
                    for workers in map(int, args.workers.split(",")):  # the target: >= 0.8 on both
                        row[f"per core vs baseline, wall ({workers}w)"] = (row[f"prep MB/s ({workers}w)"] / workers) / (
                            mb / wall / 2
                        )
                        row[f"per core vs baseline, CPU ({workers}w)"] = row[f"prep MB/CPU-s ({workers}w)"] / (mb / cpu)
                rows.append(row)
                shutil.rmtree(folder)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not rows:
        return
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
