"""What each `accord` command does, called with its parsed arguments; returns the exit code."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from accord.cli.errors import fail
from accord.errors import UserInputError


def train(args: argparse.Namespace) -> int:
    from accord import api
    from accord.stopping import PREEMPTED_EXIT_CODE

    result = api.train(
        args.recipe,
        args.overrides,
        overwrite=args.overwrite,
        resume=args.resume,
        processes=args.processes,
        devices=args.devices,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
    )
    if result.status == "preempted":
        return fail(result.message, code=PREEMPTED_EXIT_CODE)
    if result.status == "refused":
        return 2  # bad input the workers found (the reason is printed); nothing was written
    return 1 if result.status == "stopped" else 0  # a stopped run's worker printed why


def job_recipe(args: argparse.Namespace):
    """(recipe, processes per node) of a job script or manifest for --nodes × --gpus-per-node
    (CPU nodes: engine.processes each); a batch that does not split over that world is refused
    here rather than in the queue."""
    from accord.distributed.batch_plan import BatchPlan
    from accord.recipe.schema import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    per_node = args.gpus_per_node or recipe.engine.processes
    BatchPlan.of(recipe.batch, recipe.engine, args.nodes * per_node)
    return recipe, per_node


def slurm(args: argparse.Namespace) -> int:
    from accord.launch.slurm_script import JobRequest, job_script

    recipe, per_node = job_recipe(args)
    job = JobRequest(
        Path(args.recipe),
        tuple(args.overrides),
        args.nodes,
        args.gpus_per_node,
        args.partition,
        args.time,
        args.account,
        args.cpus_per_task,
        args.job_name,
    )
    script = job_script(job, output_dir=str(Path(recipe.output.dir).resolve()), workdir=Path.cwd())
    out = Path(args.out or f"{Path(args.recipe).stem}.sbatch")
    out.write_text(script)
    Path(recipe.output.dir).mkdir(parents=True, exist_ok=True)  # SLURM opens its log there at job start
    out.chmod(0o755)
    print(
        f"accord: wrote {out} ({args.nodes} node(s) × {per_node} {'GPUs' if args.gpus_per_node else 'processes'}); "
        f"submit with: sbatch {out}"
    )
    return 0


def k8s(args: argparse.Namespace) -> int:
    import yaml

    from accord.launch.k8s_manifest import PodJob, job_name, manifest

    recipe, per_node = job_recipe(args)
    job = PodJob(
        recipe=args.recipe,
        overrides=tuple(args.overrides),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        processes_per_node=per_node,
        image=args.image,
        name=args.name or job_name(Path(args.recipe).stem),
        output_dir=recipe.output.dir,
        pvc=args.pvc,
        mount=args.mount,
        kind=args.kind,
        namespace=args.namespace,
    )
    text = yaml.safe_dump(manifest(job), sort_keys=False)
    if args.pvc is None:
        print(
            f"accord: warning: no --pvc: output.dir ({recipe.output.dir}) stays inside each pod and is lost with it, "
            "and a restarted pod starts over; give a PersistentVolumeClaim to keep checkpoints and the model",
            file=sys.stderr,
        )
    if args.out:
        Path(args.out).write_text(text)
        print(f"accord: wrote {args.out}; submit with: kubectl apply -f {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def plan(args: argparse.Namespace) -> int:
    from accord.observe.progress import announce

    announce("planning (the model is built on the meta device: nothing is loaded)…")  # before torch's import: seconds
    from accord import api
    from accord.planner.estimate import expert_line, format_phases, format_table

    result = api.plan(args.recipe, args.overrides, gpus=args.gpus, nodes=args.nodes, gpu_memory=args.gpu_memory)
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    memory = f" with {result.gpu_memory_gib:.1f} GiB each" if result.gpu_memory_gib else ""
    source = f" ({result.memory_source})" if result.memory_source else ""
    devices = f"{result.per_node} {result.device}" + (
        "" if result.per_node == 1 else "es" if result.device.endswith("s") else "s"
    )
    print(f"accord plan: {args.recipe} on {args.nodes} node(s) × {devices}{memory}{source}, per {result.device} (GiB):")
    print(format_table(result.rows, result.gpu_memory_gib))
    if result.rows and result.rows[0].expert_shards:
        print(expert_line(result.rows))
    print(f"peak per {result.device} in each phase of a run (GiB above an empty process's):")
    print(format_phases(result.rows))
    if result.device != "GPU":
        print(
            "accord: on the CPU these are live bytes; a process's RSS can exceed them by what glibc's heap keeps "
            "(measured up to ~1.7x per process under fsdp/zero3) unless engine.release_host_memory=true "
            "(docs/memory-and-plan.md: memory on the CPU)"
        )
    print(f"accord: {result.advice}")  # last: the answer
    return 0


def doctor(args: argparse.Namespace) -> int:
    from accord import api
    from accord.cli import doctor
    from accord.launch.cluster import resolve_topology

    recipe = api.load(args.recipe, args.overrides)
    topology = resolve_topology(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_endpoint)
    return doctor.run(recipe, topology, with_self_test=not args.no_self_test)


def prepare(args: argparse.Namespace) -> int:
    from accord.data.nodeshare import NodeShare
    from accord.data.prepare import cache_folder
    from accord.recipe.hub import pin
    from accord.recipe.schema import load_recipe
    from accord.run.inputs import build_inputs
    from accord.tasks import task_config

    share = None
    if args.nnodes is not None or args.node_rank is not None:
        nodes, rank = args.nnodes or 1, args.node_rank or 0
        if nodes < 1 or not 0 <= rank < nodes:
            raise UserInputError(f"--nnodes {nodes} --node-rank {rank}: give N >= 1 nodes and a rank in 0..N-1")
        share = NodeShare(rank, nodes)
    recipe = pin(load_recipe(args.recipe, args.overrides))  # hub names fetched (or found cached) here
    start = time.perf_counter()
    inputs = build_inputs(task_config(recipe), preparer=True, share=share)
    tokenizer, task, report = inputs.tokenizer, inputs.task, inputs.data.report
    tokens = f", {report['train_tokens']} tokens" if "train_tokens" in report else ""
    folder = cache_folder(recipe.data, recipe.seed, tokenizer, task)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(
        f"accord: {report['train_examples']} training examples{tokens}, {report['eval_examples']} held out; "
        f"{size / 1e6:.1f} MB in {folder} ({time.perf_counter() - start:.1f} s)"
    )
    return 0


def data(args: argparse.Namespace) -> int:
    from accord import api
    from accord.cli.data_view import data_view

    if args.show < 0:
        raise UserInputError(f"--show {args.show}: give a number of examples, 0 or more")
    recipe = api.load(args.recipe, args.overrides)
    for line in data_view(recipe, args.show, color=sys.stdout.isatty()):
        print(line)
    return 0


def report(args: argparse.Namespace) -> int:
    from accord.observe.progress import announce

    announce(f"rendering the report of {args.output_dir}…")  # before matplotlib's import: seconds
    if not (Path(args.output_dir) / "metrics.jsonl").is_file():
        raise UserInputError(f"{args.output_dir}: no metrics.jsonl here (give the output.dir of a run)")

    if importlib.util.find_spec("matplotlib") is None:
        raise UserInputError(
            "accord report draws with matplotlib, which is not installed: pip install 'accord[report]'"
        )
    from accord.observe.report import render_report

    page = render_report(args.output_dir)
    print(f"accord: wrote {page} and its plots in {page.parent}/")
    return 0


def config(args: argparse.Namespace) -> int:
    from accord.launch.accelerate_config import accelerate_config, write_accelerate_config
    from accord.launch.agent import local_world_size
    from accord.recipe.schema import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    processes = args.processes or args.nodes * local_world_size(recipe.engine)
    if args.nodes > 1 and not args.master_addr:
        raise UserInputError("--nodes > 1 needs --master-addr (the address of node 0)")
    config = accelerate_config(recipe, processes, args.nodes, args.node_rank, args.master_addr, args.master_port)
    write_accelerate_config(config, Path(args.out))
    print(
        f"accord: wrote {args.out} ({config['distributed_type']}, {processes} processes); "
        f"launch with: accelerate launch --config_file {args.out} -m accord train {args.recipe}"
    )
    return 0


def import_job(args: argparse.Namespace) -> int:
    from accord.interop.convert import RefusedKeys
    from accord.interop.job import build_job, import_recipe, write_recipe
    from accord.interop.report import format_table

    files = [item for item in args.inputs if "=" not in item]
    overrides = [item for item in args.inputs if "=" in item]
    job = build_job(files, args.command_line, devices=args.devices, nodes=args.nodes, task=args.task)
    if args.verify is not None:
        from accord.interop.verify import check_verifiable

        check_verifiable(job, args.verify)
    try:
        recipe, rows = import_recipe(job, overrides)
    except RefusedKeys as e:
        print(format_table(e.rows))
        raise
    print(format_table(rows))
    write_recipe(recipe, Path(args.out))
    print(f"accord: wrote {args.out}; check it with: accord plan {args.out}", file=sys.stderr)
    if args.verify is None:
        return 0
    import tempfile

    from accord.interop.verify import verify

    with tempfile.TemporaryDirectory(prefix="accord-verify-") as workdir:
        result = verify(job, recipe, args.verify, Path(workdir))
    print(result.table())
    return 0 if result.matches else 1
