"""Expert parallelism on the CPU: each rank's peak memory and tokens per CPU-second, against 1 process.

    python benchmarks/expert_parallel.py [--hidden 128] [--expert-size 512] [--experts 16] [--layers 4]
        [--steps 2 6] [--batch 16] [--layouts ...] [--jobs 1] [--write-docs]

Trains a Qwen3-MoE built from a config whose experts hold nearly all the parameters (each token
routed to 2 of --experts experts of --expert-size features) through `accord train` itself, in
each layout: 1 process; ddp on 2; ddp with engine.expert_parallel 2 on 2 and 4 on 4; fsdp on 2;
fsdp with expert_parallel 2 on 2 and on 4. The balancing loss is on (over the global batch), as
it is by default. The measurement is benchmarks/tensor_parallel.py's: each rank's peak RSS from
the run's own `memory` records (engine.release_host_memory on, so RSS follows live tensors), and
tokens per CPU-second from the difference between a short and a long run's CPU time (the whole
process tree). Every process runs one thread. --write-docs rewrites the expert-parallel section
of docs/benchmarks.md (between its markers).

--all-to-all also measures the all-to-all's share of a step under each expert-parallel layout
given: the layout runs under torchrun, and each worker profiles itself (torch.profiler, CPU)
from the end of its first optimizer step to the end of its last; the share is the time spent in
the all-to-all operators (the token exchange and the split sizes before it) and in waiting on
them over that span's wall time, per rank (the waits counted are every functional collective's,
the gradient norm's few included: an upper bound).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import tensor_parallel  # noqa: E402

SECTION = "expert-parallel"

LAYOUTS = {
    "1 process": ["engine.processes=1"],
    "ddp (2)": ["engine.processes=2"],
    "ddp x ep2 (2)": ["engine.processes=2", "engine.expert_parallel=2"],
    "ddp x ep4 (4)": ["engine.processes=4", "engine.expert_parallel=4"],
    "fsdp (2)": ["engine.processes=2", "engine.strategy=fsdp"],
    "fsdp x ep2 (2)": ["engine.processes=2", "engine.strategy=fsdp", "engine.expert_parallel=2"],
    "fsdp x ep2 (4)": ["engine.processes=4", "engine.strategy=fsdp", "engine.expert_parallel=2"],
}


def write_recipe(folder: Path, hidden: int, expert_size: int, experts: int, layers: int, batch: int = 16) -> Path:
    """tensor_parallel.py's recipe on a Qwen3-MoE instead of a Llama."""
    path = tensor_parallel.write_recipe(folder, hidden, 4 * hidden, layers, batch)
    data = yaml.safe_load(path.read_text())
    heads = max(4, hidden // 64)
    data["model"]["config"] = {
        "architecture": "qwen3_moe",
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "moe_intermediate_size": expert_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden // heads,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 64,
    }
    path = folder / "ep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def parameters(hidden: int, expert_size: int, experts: int, layers: int) -> tuple[int, int]:
    """(all parameters, the experts' share of them)."""
    vocab = 262  # the byte tokenizer's ids, untied head
    expert = layers * experts * 3 * hidden * expert_size
    dense = layers * (4 * hidden * hidden + experts * hidden + 2 * hidden + 2 * hidden // max(4, hidden // 64))
    return expert + dense + 2 * vocab * hidden + hidden, expert


# The profiler's names for what the all-to-all dispatch runs: the split sizes' all_to_all_single
# (c10d), the token exchange (functional collectives) and the waits on it.
ALL_TO_ALL_OPS = ("alltoall", "all_to_all")


def profile_worker(out: Path, recipe: str, overrides: list[str], steps: int) -> None:
    """Inside one torchrun worker: train the recipe as accord does under an outer launcher,
    profiling steps 2..`steps`; write this rank's all-to-all time and span to out/rank-R.json."""
    import torch.distributed
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile

    import accord

    seen = {"steps": 0, "profile": None, "start": 0.0}

    def after_step(optimizer, args, kwargs) -> None:
        seen["steps"] += 1
        if seen["steps"] == 1:
            seen["profile"] = profile(activities=[ProfilerActivity.CPU])
            seen["profile"].__enter__()
            # Every rank's profiler is running before any rank's span starts: one rank's slower
            # start would otherwise show as the others' waiting.
            torch.distributed.barrier()
            seen["start"] = time.perf_counter()
        elif seen["steps"] == steps and seen["profile"] is not None:
            span = time.perf_counter() - seen["start"]
            prof, seen["profile"] = seen["profile"], None
            prof.__exit__(None, None, None)
            events = prof.key_averages()
            exchange = sum(e.self_cpu_time_total for e in events if any(op in e.key for op in ALL_TO_ALL_OPS))
            waits = sum(e.self_cpu_time_total for e in events if "wait_tensor" in e.key)
            rank = int(os.environ.get("RANK", 0))
            record = {"span_s": span, "all_to_all_s": exchange / 1e6, "wait_s": waits / 1e6}
            (out / f"rank-{rank}.json").write_text(json.dumps(record))

    register_optimizer_step_post_hook(after_step)
    accord.train(recipe, [f"train.max_steps={steps}", *overrides])


def all_to_all_share(recipe: Path, work: Path, name: str, steps: int) -> dict:
    """One expert-parallel layout under torchrun, each worker profiling itself: per rank, the
    all-to-all's share of the profiled steps."""
    layout = LAYOUTS[name]
    processes = next(int(o.split("=")[1]) for o in layout if o.startswith("engine.processes="))
    out = work / ("a2a-" + name.replace(" ", "-").replace("(", "").replace(")", ""))
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command += [str(Path(__file__).resolve()), "--profile-worker", str(out), str(recipe)]
    command += [*layout, f"output.dir={out / 'run'}", "output.overwrite=true"]
    command += ["--profile-steps", str(steps)]
    log = out.with_suffix(".log")
    with log.open("w") as stream:
        code = subprocess.call(command, stdout=stream, stderr=subprocess.STDOUT, env=harness.child_environment(None))
    if code != 0:
        sys.exit(f"{' '.join(command)} failed (exit {code}):\n{log.read_text()[-3000:]}")
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(processes)]
    return {"layout": name, "steps": steps - 1, "ranks": ranks}


def share_rows(results: list[dict]) -> list[str]:
    lines = [
        "| layout | profiled steps | all-to-all share of a step (per rank) | of which waiting | step s (per rank) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        shares = " ".join(f"{(x['all_to_all_s'] + x['wait_s']) / x['span_s']:.0%}" for x in r["ranks"])
        waits = " ".join(f"{x['wait_s'] / x['span_s']:.0%}" for x in r["ranks"])
        times = " ".join(f"{x['span_s'] / r['steps']:.2f}" for x in r["ranks"])
        lines.append(f"| {r['layout']} | {r['steps']} | {shares} | {waits} | {times} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    given = list(argv if argv is not None else sys.argv[1:])
    if given[:1] == ["--profile-worker"]:  # inside a torchrun worker (all_to_all_share)
        steps = int(given[given.index("--profile-steps") + 1])
        rest = [a for a in given[3:] if a not in ("--profile-steps", str(steps))]
        profile_worker(Path(given[1]), given[2], rest, steps)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate features")
    parser.add_argument("--experts", type=int, default=16, help="experts per MoE layer (each token takes 2)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, nargs=2, default=[2, 6], metavar=("SHORT", "LONG"))
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows of <= 32 tokens), a multiple of 4")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--jobs", type=int, default=1, help="layouts measured at once (CPU time and RSS are per run; wall time is not)"
    )
    parser.add_argument(
        "--all-to-all", action="store_true", help="also measure the all-to-all's share of a step (torch.profiler)"
    )
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite the {SECTION} section of {harness.DOCS}")
    parser.add_argument("--docs", default=str(harness.DOCS), help=argparse.SUPPRESS)  # another file (tests)
    args = parser.parse_args(argv)
    if args.write_docs:
        harness.check_markers(SECTION, Path(args.docs))
    short, long = args.steps
    if not 0 < short < long:
        parser.error(f"--steps {short} {long}: the second count must be larger than the first, both above 0")
    if args.experts % 4:
        parser.error(f"--experts {args.experts}: the layouts split them over 4 ranks; give a multiple of 4")
    tensor_parallel.LAYOUTS.update(LAYOUTS)  # its measure() runs a layout by name
    work = Path(tempfile.mkdtemp(prefix="accord-ep-"))
    recipe = write_recipe(work, args.hidden, args.expert_size, args.experts, args.layers, args.batch)
    n, experts = parameters(args.hidden, args.expert_size, args.experts, args.layers)
    model = (
        f"Qwen3-MoE hidden {args.hidden}, {args.layers} layers of {args.experts} experts × {args.expert_size} "
        f"features (top-2), {n / 1e6:.1f}M parameters ({experts / n:.0%} in the experts); training state "
        f"(16 B/param) {16 * n / 2**30:.2f} GiB"
    )
    print(f"model: {model}; runs in {work}", flush=True)
    results, load_before, started = tensor_parallel.measure_layouts(
        recipe, work, args.layouts, (short, long), args.jobs
    )
    shares = []
    if args.all_to_all:
        for name in (n for n in args.layouts if any("expert_parallel" in o for o in LAYOUTS[n])):
            shares.append(all_to_all_share(recipe, work, name, long))
            print(f"  {name}: all-to-all measured", flush=True)
    load_after = os.getloadavg()
    shutil.rmtree(work, ignore_errors=True)
    lines = tensor_parallel.rows(results)
    if shares:
        lines += ["", *share_rows(shares)]
    print("\n".join(lines))
    footer = tensor_parallel.measured_how(short, long)
    if shares:
        footer += (
            f" All-to-all share: steps 2..{long} of each expert-parallel layout under torchrun, each worker "
            "profiling itself (torch.profiler, CPU): the all-to-all operators' time and the waits on them over "
            "the steps' wall time."
        )
    print(footer)
    if args.write_docs:
        setting = f"{model}; one thread per process, {args.jobs} layout(s) at a time"
        when = (load_before, load_after, started)
        tensor_parallel.write_section(SECTION, Path(__file__), argv, args.docs, when, setting, lines, footer)


if __name__ == "__main__":
    main()
