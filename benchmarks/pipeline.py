"""Pipeline parallelism on the CPU: the measured bubble of each schedule against its theory, and
each rank's peak RSS and tokens per CPU-second under engine.pipeline_parallel against 1 process.

    python benchmarks/pipeline.py [--hidden 256] [--layers 8] [--micro-batches 2 4 8] [--rounds 3]
        [--schedules 1f1b gpipe interleaved-1f1b zero-bubble zbv] [--memory | --memory-only] [--write-docs]

Bubble: 2 processes (one thread each, one core each when the machine has them) run accord's
own stage split of a Llama (engine/pipeline: keep_stages, StageModule, the schedule's stage
placement) through torch's schedule with accord's loss, for m micro-batches of 4 rows x 32
tokens. Each rank times what it computes (the stage's forward_one_chunk, backward_one_chunk and
backward_weight_one_chunk) inside a step; the measured bubble is 1 - busy / step wall time,
the mean over the ranks and the median over --rounds steps (after a warm-up step). The
theory is (p - 1) / (m + p - 1) for gpipe and 1f1b, (p - 1) / (v·m + p - 1) with v stages
per rank for the interleaved ones (equal stage times, free communication); the zero-bubble
schedules aim below it. Wall time on a shared machine is noisy: the bubble is a ratio inside
one step, less so, but compare rows of one run.

--memory also trains through `accord train` (benchmarks/tensor_parallel.py's measurement):
1 process, pp=2 on 2 processes and fsdp x pp=2 on 4, each rank's peak RSS from the run's own
`memory` records and tokens per CPU-second (--memory-only: that alone). --write-docs rewrites
what was measured: the pipeline section of docs/benchmarks.md (the bubble) and the
pipeline-memory section (between their markers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

SECTION, MEMORY_SECTION = "pipeline", "pipeline-memory"
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv"]
ROWS, WIDTH = 4, 32  # a micro-batch: rows x tokens
MEMORY_LAYOUTS = {
    "1 process": ["engine.processes=1"],
    "pp2 (2)": ["engine.processes=2", "engine.pipeline_parallel=2"],
    "fsdp (2)": ["engine.processes=2", "engine.strategy=fsdp"],
    "fsdp x pp2 (4)": ["engine.processes=4", "engine.strategy=fsdp", "engine.pipeline_parallel=2"],
}


# ------------------------------------------------------------------ child: one pipeline rank


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from transformers import LlamaConfig, LlamaForCausalLM

    from accord.engine.pipeline.schedule import SINGLE, rank_stages, schedule_class
    from accord.engine.pipeline.stages import StageModule, keep_stages, stage_layers
    from accord.run.pipeline_step import causal_loss_sum

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    per_rank = 1 if args.schedule in SINGLE else 2
    stages_total = pp * per_rank
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(4, args.hidden // 64),
        vocab_size=262,
        max_position_embeddings=WIDTH,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids_held = rank_stages(args.schedule, rank, pp, per_rank)
    keep_stages(model, ids_held, stages_total)
    split = stage_layers(args.layers, stages_total)
    busy = [0.0]

    def timed(method):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                busy[0] += time.perf_counter() - start

        return run

    m = args.micro_batches
    stages = []
    for s in ids_held:
        module = StageModule(model, split[s], s == 0, s == stages_total - 1, torch.float32)
        given = (
            torch.empty(ROWS, WIDTH, dtype=torch.long, device="meta")
            if s == 0
            else torch.empty(ROWS, WIDTH, args.hidden, device="meta", requires_grad=True)
        )
        shape = (ROWS, WIDTH, 262) if s == stages_total - 1 else (ROWS, WIDTH, args.hidden)
        stage = PipelineStage(
            module,
            s,
            stages_total,
            torch.device("cpu"),
            input_args=given,
            output_args=torch.empty(shape, device="meta", requires_grad=True),
        )
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, timed(getattr(stage, name)))
        stages.append(stage)
    targets = m * ROWS * (WIDTH - 1)
    schedule = schedule_class(args.schedule)(
        stages[0] if args.schedule in SINGLE else stages,
        n_microbatches=m,
        loss_fn=lambda logits, labels: causal_loss_sum(logits, labels) / targets,
        scale_grads=False,
    )
    ids = torch.randint(0, 262, (m * ROWS, WIDTH), generator=torch.Generator().manual_seed(0))
    bubbles = []
    for step in range(args.rounds + 1):
        busy[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        schedule.step(
            *((ids,) if 0 in ids_held else ()),
            target=ids if stages_total - 1 in ids_held else None,
            losses=[] if stages_total - 1 in ids_held else None,
            return_outputs=False,
        )
        wall = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        if step:  # the first step builds the stages' buffers
            bubbles.append(1 - busy[0] / wall)
    gathered = [None] * pp
    dist.all_gather_object(gathered, statistics.median(bubbles))
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def measure_bubble(schedule: str, micro_batches: int, args: argparse.Namespace, work: Path) -> list[float]:
    result = work / f"{schedule}-{micro_batches}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.pp),
        __file__,
        "--child",
        "--schedule",
        schedule,
        "--micro-batches-one",
        str(micro_batches),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--rounds",
        str(args.rounds),
        "--result",
        str(result),
    ]
    env = harness.child_environment(None) | {"PYTHONPATH": str(harness.ROOT / "src")}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{schedule} m={micro_batches} failed:\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def bubble_rows(results: list[dict]) -> list[str]:
    lines = [
        "| schedule | stages per rank | micro-batches m | theory (p - 1) / (v·m + p - 1) | measured (per rank) "
        "| measured, mean |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['schedule']} | {r['v']} | {r['m']} | {r['theory']:.2f} | "
            f"{' '.join(f'{b:.2f}' for b in r['measured'])} | {statistics.mean(r['measured']):.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers: a multiple of 2 x pp")
    parser.add_argument("--pp", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per measurement (median)")
    parser.add_argument("--memory", action="store_true", help="also each rank's peak RSS through accord train")
    parser.add_argument("--memory-only", action="store_true", help="only each rank's peak RSS (no bubble)")
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite the {SECTION} section of {harness.DOCS}")
    parser.add_argument("--docs", default=str(harness.DOCS), help=argparse.SUPPRESS)  # another file (tests)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--micro-batches-one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.micro_batches = args.micro_batches_one
        child(args)
        return
    from accord.engine.pipeline.schedule import SINGLE, theoretical_bubble

    args.memory = args.memory or args.memory_only
    if args.write_docs:
        for section in ([] if args.memory_only else [SECTION]) + ([MEMORY_SECTION] if args.memory else []):
            harness.check_markers(section, Path(args.docs))
    work = Path(tempfile.mkdtemp(prefix="accord-pp-"))
    load_before, started = os.getloadavg(), time.time()
    results = []
    for schedule in [] if args.memory_only else args.schedules:
        v = 1 if schedule in SINGLE else 2
        for m in args.micro_batches:
            if schedule == "1f1b" and m < args.pp:
                continue
            measured = measure_bubble(schedule, m, args, work)
            results.append(
                {
                    "schedule": schedule,
                    "v": v,
                    "m": m,
                    "theory": theoretical_bubble(args.pp, m, v),
                    "measured": measured,
                }
            )
            print(f"  {schedule} m={m}: {measured}", flush=True)
    lines = bubble_rows(results)
    if results:
        print("\n".join(lines))
    memory_lines: list[str] = []
    if args.memory:
        import tensor_parallel

        tensor_parallel.LAYOUTS.update(MEMORY_LAYOUTS)
        recipe = tensor_parallel.write_recipe(work, args.hidden, 3 * args.hidden, args.layers)
        prepare = [sys.executable, "-m", "accord", "prepare", str(recipe)]
        subprocess.run(prepare, check=True, capture_output=True, env=harness.child_environment(None))
        memory = [tensor_parallel.measure(recipe, work, name, (2, 6)) for name in MEMORY_LAYOUTS]
        memory_lines = tensor_parallel.rows(memory)
        print("\n".join(memory_lines))
    load_after = os.getloadavg()
    shutil.rmtree(work, ignore_errors=True)
    model = f"Llama hidden {args.hidden}, {args.layers} layers"
    if not args.write_docs:
        return
    command = harness.shown_command(Path(__file__), list(argv if argv is not None else sys.argv[1:]))
    when = (
        f"`{command}`, {datetime.date.today().isoformat()}, {harness.machine()}, load average "
        f"{load_before[0]:.1f} before and {load_after[0]:.1f} after ({time.time() - started:.0f} s); {model}"
    )
    if results:
        body = [
            f"{when}, p = {args.pp} processes, micro-batches of {ROWS} rows x {WIDTH} tokens, one thread per process:",
            "",
            *lines,
            "",
            "Measured: 1 - (time in the stage's forward and backward) / (step wall time) on each rank, the median "
            f"of {args.rounds} steps.",
        ]
        harness.write_docs(SECTION, body, Path(args.docs))
    if memory_lines:
        body = [
            f"{when}, intermediate {3 * args.hidden}; each rank's peak RSS and tokens per CPU-second through "
            "`accord train` (steps 3..6 over the CPU time they added; benchmarks/tensor_parallel.py's measurement):",
            "",
            *memory_lines,
        ]
        harness.write_docs(MEMORY_SECTION, body, Path(args.docs))


if __name__ == "__main__":
    main()
