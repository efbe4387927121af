"""The GPU check: one prepared command for a lent GPU machine (one H200: under 5 minutes).

    python benchmarks/gpu_check.py [--out gpu_check.json]

Prints a table of:
  1. bf16 training throughput and MFU of a ~0.5B Llama built from a config, packed
     2048-token rows, with engine.compile off and on (target: MFU >= 45%);
  2. one short run each of zero2, zero3 and fsdp on one GPU (they start, step and export);
  3. `accord plan`'s predicted peak memory next to torch.cuda.max_memory_allocated, when
     `accord plan` is available;
  4. per phase (build, train steps, checkpoint, export, then a resume for one more step) of
     the zero3 and fsdp runs: the run's own `memory` records (max_memory_allocated up to the
     end of the phase) next to `accord plan`'s per-phase peak (its highest up to that phase).
  5. long context: the longest row (16k, 32k, ... 512k tokens, doubling until a run fails)
     that a ~0.5B Llama with a 32k vocabulary trains on one GPU for two steps with the
     chunked loss (train.loss_chunk_size auto), offloaded activation checkpointing and the
     tiled MLP, with its tokens/s and peak memory (`--long-context` runs this phase alone).
  6. against the peers at their best: benchmarks/throughput.py (SFT: Trainer plain and with
     group_by_length, TRL SFTTrainer padded, wrapped and bfd packing) and benchmarks/grpo.py
     (TRL GRPOTrainer's transformers generation, not vLLM, with and without gradient
     checkpointing) on the GPU with the ~0.5B Llama in bf16, tokens (prompts) per second of wall
     time, each with its `accord / best peer` line.
  7. tensor parallelism (engine.tensor_parallel 2, which needs 2 GPUs: on one it says it skips
     and why): the ~0.5B Llama under fsdp alone and fsdp x TP 2 on the same GPUs (an even
     number of them), tokens/s and each rank's peak memory.
  8. a mixture-of-experts model (Qwen3-MoE, 16 experts, top-2, built from a config) under ddp and
     fsdp in bf16 with the router's balancing loss over the global batch: tokens/s, peak memory,
     router imbalance; then fsdp x engine.expert_parallel 2 on the GPUs (an even number of them;
     on one GPU it says it skips and why), each rank's peak memory.
  9. pipeline parallelism (engine.pipeline_parallel 2, which needs 2 GPUs: on one it says it
     skips and why): the ~0.5B Llama under ddp alone and ddp x PP 2 (1f1b, 4 micro-batches per
     step) on the same GPUs (an even number of them), tokens/s, each rank's peak memory (a stage
     holds half of the layers) and the final loss next to the data-parallel run's.
Phases 1-5, 7 and 8 run through `accord train` itself; figures come from each run's metrics.jsonl.
`--out` writes every figure as JSON, `--markdown` the tables as markdown (for docs/benchmarks.md).
`--dry-run` needs no GPU (a few minutes on a CPU): it writes the recipes, prints the plan's
figures, runs phase 6's plumbing on the CPU with the tiny model (one step, two contenders
each), phase 7's on 2 gloo processes with a tiny Llama (fsdp, then fsdp x TP 2), phase 8's MoE
on one process and fsdp x EP 2 on 2 gloo processes, and phase 9's (ddp, then ddp x PP 2), writing
the same JSON and markdown.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpu_check_moe  # phase 8 (beside this script)
import gpu_check_parallel  # phases 7 and 9
import yaml
from gpu_check_parallel import pp_gpus, tp_gpus  # noqa: F401 (importable from here as before)

MODEL = {  # ~0.45B parameters with the byte-level vocabulary
    "architecture": "llama",
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 2048,
}
SEQ = 2048


def write_corpus(folder: Path, documents: int = 400) -> Path:
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from his her they were this are which be had".split()
    docs = folder / "docs"
    docs.mkdir(parents=True)
    for d in range(documents):
        (docs / f"{d:04d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(500, 3000))))
    return docs


def recipe(folder: Path, name: str, strategy: str, steps: int, compile_: bool, batch: int) -> Path:
    data = {
        "seed": 0,
        "task": "pretrain",
        "model": {"config": MODEL, "tokenizer": "byte", "attn_implementation": "sdpa"},
        "data": {"train": str(folder / "docs"), "max_length": SEQ, "cache_dir": str(folder / "cache")},
        "batch": {"global_batch_size": batch, "micro_batch_size": batch},
        "optim": {"lr": 3e-4, "warmup_steps": 2},
        "train": {"max_steps": steps, "log_every": 1},
        "engine": {"strategy": strategy, "precision": "bf16", "compile": compile_},
        "checkpoint": {"keep_last": 1},
        "output": {"dir": str(folder / name), "overwrite": True},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


LONG_MODEL = {  # ~0.5B parameters: a 32k vocabulary, so that the logits matter
    "architecture": "llama",
    "hidden_size": 1280,
    "intermediate_size": 3584,
    "num_hidden_layers": 20,
    "num_attention_heads": 10,
    "num_key_value_heads": 10,
    "vocab_size": 32000,
}
LONG_LENGTHS = (16384, 32768, 65536, 131072, 262144, 524288)


def long_recipe(folder: Path, length: int) -> Path:
    """Two steps on one row of `length` tokens with every long-row lever on."""
    path = recipe(folder, f"long-{length}", "fsdp", 2, False, 1)
    data = yaml.safe_load(path.read_text())
    data["model"]["config"] = LONG_MODEL | {"max_position_embeddings": length}
    data["data"]["max_length"] = length
    data["engine"] |= {"activation_checkpointing": "offload", "tiled_mlp": True}
    path.write_text(yaml.safe_dump(data))
    return path


def long_context(folder: Path, dry_run: bool) -> list[dict]:
    """Phase 5: each length until one fails (out of memory, or past the time limit)."""
    print(
        f"\nlong context: Llama {LONG_MODEL['hidden_size']}x{LONG_MODEL['num_hidden_layers']}, vocabulary "
        f"{LONG_MODEL['vocab_size']}, bf16 fsdp on 1 GPU, checkpointing offloaded, tiled MLP, chunked loss"
    )
    results = []
    for length in LONG_LENGTHS:
        path = long_recipe(folder, length)
        planned = planned_peak(path)
        planned_text = f"{planned:.1f}" if planned is not None else "-"
        if dry_run:
            print(f"{length:>8} tokens: planned peak {planned_text} GiB")
            continue
        try:
            seconds, summary = train(path, timeout=300)
        except subprocess.TimeoutExpired:
            seconds, summary = 300.0, {"error": "past the 300 s limit of a run"}
        summary |= {"run": f"long context {length}", "length": length, "wall_s": seconds, "planned_gib": planned}
        results.append(summary)
        if "error" in summary:
            print(f"{length:>8} tokens: failed after {seconds:.0f} s: {summary['error']}")
            break
        print(
            f"{length:>8} tokens: {summary['tokens_per_s']:,.0f} tokens/s, peak {summary['peak_memory_gib']:.1f} GiB "
            f"(planned {planned_text}), loss {summary['final_loss']:.3f}"
        )
    fitted = [r["length"] for r in results if "error" not in r]
    if not dry_run:
        print(f"longest row trained: {max(fitted) if fitted else 'none'} tokens")
    return results


PHASES = ("build", "train", "checkpoint", "export", "resume")


def train(path: Path, timeout: int, *overrides: str, env: dict[str, str] | None = None) -> tuple[float, dict]:
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "accord", "train", str(path), *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0:
        return time.time() - start, {"error": (proc.stdout + proc.stderr).strip().splitlines()[-1][:200]}
    out = Path(yaml.safe_load(path.read_text())["output"]["dir"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    throughput = [r for r in records if r["kind"] == "throughput"]
    steady = throughput[len(throughput) // 2 :] or throughput  # after compile / warm-up
    summary = {
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "mfu": sum(r.get("mfu") or 0.0 for r in steady) / len(steady),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in throughput),
        "final_loss": [r for r in records if r["kind"] == "train"][-1]["loss"],
    }
    trained = [r for r in records if r["kind"] == "memory" and r["phase"] == "train"]
    if trained:  # every rank's peak, where the run recorded it (phase 7 compares them)
        summary["peak_gib_per_rank"] = trained[0]["peak_gib_per_rank"]
    return time.time() - start, summary


def planned_row(path: Path) -> dict | None:
    proc = subprocess.run(
        [sys.executable, "-m", "accord", "plan", str(path), "--gpus", "1", "--json"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return None
    data = json.loads(proc.stdout)
    strategy = yaml.safe_load(path.read_text())["engine"]["strategy"]
    return next((row for row in data["strategies"] if row["strategy"] == strategy), None)


def planned_peak(path: Path) -> float | None:
    row = planned_row(path)
    return row["total_gib"] if row else None


def planned_phases(path: Path) -> dict[str, float]:
    """The plan's peak of each phase as a record reports it: the highest up to that phase
    (the resume is a new process: its own)."""
    row = planned_row(path)
    phases = (row or {}).get("phases_gib", {})
    out, so_far = {}, 0.0
    for phase in PHASES:
        if phase in phases:
            so_far = phases[phase] if phase == "resume" else max(so_far, phases[phase])
            out[phase] = so_far
    return out


def measured_phases(path: Path) -> dict[str, float]:
    """The largest rank's peak at the end of each phase; the resumed run's build is `resume`."""
    from accord.observe.memory import phase_peaks

    return phase_peaks(Path(yaml.safe_load(path.read_text())["output"]["dir"]) / "metrics.jsonl")


def print_phases(label: str, measured: dict[str, float], planned: dict[str, float]) -> None:
    cell = lambda d, p: f"{d[p]:.2f}" if p in d else "-"  # noqa: E731
    print(f"{label:24} " + " ".join(f"{cell(measured, p) + ' / ' + cell(planned, p):>13}" for p in PHASES))


def tensor_parallel(folder: Path, dry_run: bool, visible: int) -> list[dict]:
    """Phase 7 (gpu_check_parallel.py) with this script's recipe and run."""
    return gpu_check_parallel.tensor_parallel(folder, dry_run, visible, recipe, train)


def pipeline_parallel(folder: Path, dry_run: bool, visible: int) -> list[dict]:
    """Phase 9 (gpu_check_parallel.py) with this script's recipe and run."""
    return gpu_check_parallel.pipeline_parallel(folder, dry_run, visible, recipe, train)


def peers(dry_run: bool) -> list[dict]:
    """Phase 6: throughput.py and grpo.py on the GPU (the dry run: their plumbing on the CPU, tiny)."""
    here = Path(__file__).resolve().parent
    if dry_run:
        runs = [
            ("SFT throughput", "throughput.py", ["--steps", "1", "--only", "accord", "trl-wrapped"]),
            ("GRPO", "grpo.py", ["--steps", "1", "--prompts", "2", "--group", "2", "--only", "accord", "trl"]),
        ]
    else:
        gpu = ["--device", "cuda", "--model-size", "0.5b"]
        runs = [
            ("SFT throughput", "throughput.py", [*gpu, "--steps", "16"]),
            ("GRPO", "grpo.py", [*gpu, "--steps", "4"]),
        ]
    results = []
    for label, script, options in runs:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, str(here / script), *options, "--rounds", "1", "--json", out.name]
            try:
                proc = subprocess.run(command, capture_output=True, text=True, timeout=240)
            except subprocess.TimeoutExpired:
                results.append({"run": label, "error": "past the 240 s limit"})
                print(f"{label}: past the 240 s limit")
                continue
            if proc.returncode != 0:
                error = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["failed"]
                results.append({"run": label, "error": error[0][:200]})
                print(f"{label}: failed: {error[0][:200]}")
                continue
            data = json.loads(Path(out.name).read_text())
        table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
        shown = " ".join([f"benchmarks/{script}", *options])
        summaries = {name: _plain(s) for name, s in data["summaries"].items()}
        results.append(
            {"run": label, "command": shown, "table": table, "verdict": data["verdict"], "summaries": summaries}
        )
        print(f"\n{label} ({'CPU plumbing only' if dry_run else 'GPU'}):")
        print("\n".join(table))
        print(data["verdict"])
    return results


def _plain(summary: dict) -> dict:
    """A contender's summary without its per-round runs (the JSON stays readable)."""
    return {k: v for k, v in summary.items() if k != "runs"}


def markdown(results: list[dict], peer_results: list[dict], device: str) -> str:
    lines = [f"GPU check on {device}:", ""]
    own = [r for r in results if "tokens_per_s" in r or "error" in r or "skipped" in r]
    if own:
        lines += ["| run | tokens/s | MFU | peak GiB | planned GiB | loss |", "|---|---|---|---|---|---|"]
        for r in own:
            if "error" in r or "skipped" in r:
                what = f"failed: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
                lines.append(f"| {r['run']} | {what} | | | | |")
                continue
            planned = f"{r['planned_gib']:.1f}" if r.get("planned_gib") is not None else "-"
            ranks = r.get("peak_gib_per_rank", [])  # several ranks: each one's peak
            peak = " / ".join(f"{p:.2f}" for p in ranks) if len(ranks) > 1 else f"{r['peak_memory_gib']:.1f}"
            lines.append(
                f"| {r['run']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {peak} | "
                f"{planned} | {r['final_loss']:.3f} |"
            )
        lines.append("")
    for r in peer_results:
        if "error" in r:
            lines += [f"{r['run']}: failed: {r['error']}", ""]
            continue
        lines += [f"{r['run']} (`{r['command']}`):", "", *r["table"], "", r["verdict"], ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the results as JSON")
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU needed: write the recipes and print the plan's per-phase figures"
    )
    parser.add_argument("--long-context", action="store_true", help="run only phase 5 (the longest row)")
    parser.add_argument("--markdown", help="also write the tables as markdown")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit("gpu_check: no CUDA device visible (--dry-run prints the plan only)")
    folder = Path(tempfile.mkdtemp(prefix="accord-gpu-check-"))
    try:
        check(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # runs of a few GiB each: not left in /tmp


def check(args: argparse.Namespace, folder: Path) -> None:
    import torch

    write_corpus(folder)
    runs = [
        ("bf16 ddp, compile off", "ddp", 24, False, 8),
        ("bf16 ddp, compile on", "ddp", 24, True, 8),
        ("zero2 (1 GPU)", "zero2", 4, False, 4),
        ("zero3 (1 GPU)", "zero3", 4, False, 4),
        ("fsdp (1 GPU)", "fsdp", 4, False, 4),
    ]
    if args.long_context:
        results = long_context(folder, args.dry_run)
        if args.out and not args.dry_run:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return
    if args.dry_run:
        print(f"planned peak per phase on 1 GPU (GiB): {' '.join(PHASES)}")
        for label, strategy, steps, compile_, batch in runs:
            path = recipe(
                folder,
                label.split()[0] + ("-compiled" if compile_ else "") + f"-{strategy}",
                strategy,
                steps,
                compile_,
                batch,
            )
            planned = planned_phases(path)
            print(f"{label:24} " + " ".join(f"{planned.get(p, float('nan')):>10.2f}" for p in PHASES))
        long_context(folder, dry_run=True)
        tp = (
            tensor_parallel(folder, dry_run=True, visible=0)
            + gpu_check_moe.mixture_of_experts(folder, True, recipe, train)
            + pipeline_parallel(folder, dry_run=True, visible=0)
        )
        write_outputs(args, tp, peers(dry_run=True), "the CPU (dry run: plumbing only, tiny model)")
        return
    results = []
    print(
        f"device: {torch.cuda.get_device_name(0)}; "
        f"model: Llama {MODEL['hidden_size']}x{MODEL['num_hidden_layers']}, rows of {SEQ} tokens"
    )
    header = f"{'run':24} {'wall s':>7} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'planned GiB':>11} {'loss':>7}"
    print(header)
    print("-" * len(header))
    for label, strategy, steps, compile_, batch in runs:
        path = recipe(
            folder,
            label.split()[0] + ("-compiled" if compile_ else "") + f"-{strategy}",
            strategy,
            steps,
            compile_,
            batch,
        )
        seconds, summary = train(path, timeout=240)
        summary |= {"run": label, "wall_s": seconds, "planned_gib": planned_peak(path)}
        results.append(summary)
        if "error" in summary:
            print(f"{label:24} {seconds:>7.0f}  failed: {summary['error']}")
            continue
        planned = f"{summary['planned_gib']:.1f}" if summary["planned_gib"] is not None else "-"
        print(
            f"{label:24} {seconds:>7.0f} {summary['tokens_per_s']:>10,.0f} {100 * summary['mfu']:>5.1f}% "
            f"{summary['peak_memory_gib']:>9.1f} {planned:>11} {summary['final_loss']:>7.3f}"
        )
    print("\nper phase, measured / planned peak GiB (max_memory_allocated; the plan's highest up to the phase):")
    print(f"{'run':24} " + " ".join(f"{p:>13}" for p in PHASES))
    for (label, strategy, steps, compile_, batch), summary in zip(runs, results):
        if strategy not in ("zero3", "fsdp") or "error" in summary:
            continue
        path = recipe(folder, label.split()[0] + f"-{strategy}", strategy, steps, compile_, batch)
        _, resumed = train(path, 240, f"train.max_steps={steps + 1}", "output.overwrite=false", "--resume")
        summary["phases_gib"] = measured_phases(path) | (
            {"resume_error": resumed["error"]} if "error" in resumed else {}
        )
        summary["planned_phases_gib"] = planned_phases(path)
        print_phases(
            label, {k: v for k, v in summary["phases_gib"].items() if k in PHASES}, summary["planned_phases_gib"]
        )
    results += long_context(folder, dry_run=False)
    results += tensor_parallel(folder, dry_run=False, visible=torch.cuda.device_count())
    results += gpu_check_moe.mixture_of_experts(folder, False, recipe, train, torch.cuda.device_count())
    results += pipeline_parallel(folder, dry_run=False, visible=torch.cuda.device_count())
    write_outputs(args, results, peers(dry_run=False), torch.cuda.get_device_name(0))


def write_outputs(args: argparse.Namespace, results: list[dict], peer_results: list[dict], device: str) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "runs": results, "peers": peer_results}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, peer_results, device))


if __name__ == "__main__":
    main()
