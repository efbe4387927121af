"""The `accord` command: parse, call, and show user mistakes as one line each."""

from __future__ import annotations

import argparse
import sys

from accord import __version__
from accord.errors import AccordError, UserInputError

_TRAIN_EPILOG = """\
examples:
  accord train recipes/quickstart.yaml
  accord train recipes/quickstart.yaml batch.micro_batch_size=8 train.max_steps=50
  accord train recipes/quickstart.yaml engine.processes=4 output.dir=runs/four --overwrite
  torchrun --nproc_per_node 2 -m accord train recipes/quickstart.yaml
  deepspeed --num_gpus 2 --module accord train recipes/quickstart.yaml --deepspeed ds.json

Every recipe key can be overridden as section.key=value (values are read as YAML).
Without an outer launcher accord starts one worker per GPU, or engine.processes
workers on the CPU; under torchrun / accelerate launch / torch.distributed.launch /
deepspeed it runs as the worker it is (their --local_rank=N is accepted anywhere and
--deepspeed FILE means engine.deepspeed_config=FILE). Everything a run says is on stderr.
"""


# Commands that take a recipe and KEY=VALUE overrides.
_RECIPE_COMMANDS = ("train", "slurm", "k8s", "config", "plan", "doctor", "data", "prepare")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accord",
        description="Train transformer models on one device, many GPUs or many nodes from one recipe, "
        "with the same result whatever the hardware.",
    )
    parser.add_argument("--version", action="version", version=f"accord {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    train = commands.add_parser(
        "train",
        help="train a recipe on all local devices (or as a worker of torchrun / accelerate launch)",
        description="Train a recipe. The global batch is fixed by the recipe; gradient accumulation "
        "is derived from the number of processes, so results do not depend on the hardware.",
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _recipe_arguments(train, "recipe overrides, e.g. optim.lr=1e-3")
    train.add_argument("--overwrite", action="store_true", help="replace an earlier run in output.dir")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in output.dir (same as resume=auto)",
    )
    train.add_argument(
        "--devices", type=_gpu_indices, metavar="0,1", help="GPU indices to use (same as engine.devices=[0,1])"
    )
    train.add_argument("--processes", type=int, metavar="N", help="CPU worker processes (same as engine.processes=N)")
    nodes = train.add_argument_group(
        "several nodes (run the same command on each; SLURM's environment is read by itself)"
    )
    nodes.add_argument("--nnodes", type=int, metavar="N", help="number of nodes (env NNODES)")
    nodes.add_argument("--node-rank", type=int, metavar="R", help="this node's rank, 0..N-1 (env NODE_RANK)")
    nodes.add_argument("--master-addr", metavar="HOST", help="address of node 0 (env MASTER_ADDR)")
    nodes.add_argument(
        "--master-port", type=int, metavar="PORT", help="port on node 0 (default 29500; env MASTER_PORT)"
    )
    nodes.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="meet through a c10d rendezvous instead of a fixed node 0"
    )
    train.set_defaults(func=_train)

    slurm = commands.add_parser(
        "slurm",
        help="write a SLURM job script that runs a recipe on N nodes (checkpoints before the time limit, requeues)",
        description="Write an sbatch script: one accord per node (srun --ntasks-per-node=1), SIGUSR1 two minutes "
        "before the time limit so accord checkpoints and exits 75, then the job requeues itself and resumes.",
    )
    _job_arguments(slurm)
    slurm.add_argument("--partition", metavar="P")
    slurm.add_argument("--time", metavar="T", help="time limit, e.g. 04:00:00")
    slurm.add_argument("--account", metavar="A")
    slurm.add_argument("--cpus-per-task", type=int, metavar="C")
    slurm.add_argument("--job-name", metavar="NAME")
    slurm.add_argument("--out", metavar="FILE", help="script path (default: <recipe name>.sbatch)")
    slurm.set_defaults(func=_slurm)

    k8s = commands.add_parser(
        "k8s",
        help="print a Kubeflow TrainJob (or PyTorchJob) that runs a recipe on N pods through torchrun",
        description="Print a Kubernetes manifest: one pod per node running `torchrun -m accord train RECIPE "
        "resume=auto`, the output folder on a volume, a grace period for the stop checkpoint. Apply with kubectl.",
    )
    _job_arguments(k8s)
    k8s.add_argument("--image", required=True, metavar="IMAGE", help="container image with accord and the recipe")
    k8s.add_argument("--pvc", metavar="CLAIM", help="PersistentVolumeClaim for output.dir (shared by the pods)")
    k8s.add_argument("--mount", default="/mnt/accord", metavar="PATH", help="where the claim is mounted")
    k8s.add_argument("--kind", default="trainjob", choices=("trainjob", "pytorchjob"))
    k8s.add_argument("--name", metavar="NAME", help="job name (default: accord-<recipe name>)")
    k8s.add_argument("--namespace", metavar="NS")
    k8s.add_argument("--out", metavar="FILE", help="write the manifest here instead of printing it")
    k8s.set_defaults(func=_k8s)

    plan = commands.add_parser(
        "plan",
        help="per-GPU memory of each strategy for a recipe, and what fits",
        description="Estimate, for each strategy, the bytes per GPU of parameters, gradients, optimizer state, "
        "master weights and activations, and recommend the cheapest strategy and largest micro batch that fit.",
    )
    _recipe_arguments(plan)
    plan.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="GPUs per node (default: this machine's GPUs; without any, "
        "engine.processes CPU processes sharing the RAM)",
    )
    plan.add_argument("--nodes", type=int, default=1, metavar="M")
    plan.add_argument(
        "--gpu-memory",
        metavar="80GB",
        help="memory per GPU (e.g. 80GB, 24GiB); default: the smallest visible GPU's (on the CPU: RAM / processes)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(func=_plan)

    doctor = commands.add_parser(
        "doctor",
        help="check this machine or cluster before a long run: versions, paths, GPUs, disk, network, bandwidth, "
        "equivalence",
        description="Run on every node like accord train. Prints one line per check with a verdict (ok, warn, FAIL): "
        "every node's accord/torch/transformers/DeepSpeed versions and view of the recipe's model and data, GPUs and "
        "CUDA_VISIBLE_DEVICES, free disk for the checkpoints, the interface towards the master, "
        "an all-reduce bandwidth per pair of nodes, and a 2-step run on all processes against 1 process "
        "(equal to 1e-5). Exit 1 if a line failed.",
    )
    _recipe_arguments(doctor)
    doctor.add_argument("--no-self-test", action="store_true", help="skip the 2-step equivalence run")
    doctor_nodes = doctor.add_argument_group("several nodes (as for accord train)")
    doctor_nodes.add_argument("--nnodes", type=int, metavar="N")
    doctor_nodes.add_argument("--node-rank", type=int, metavar="R")
    doctor_nodes.add_argument("--master-addr", metavar="HOST")
    doctor_nodes.add_argument("--master-port", type=int, metavar="PORT")
    doctor_nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT")
    doctor.set_defaults(func=_doctor)

    prepare = commands.add_parser(
        "prepare",
        help="tokenize a recipe's data into its cache now, with every local core (accord train does the same first)",
        description="Prepare (tokenize) the recipe's data into data.cache_dir, as accord train would before it starts "
        "its workers: data.prepare_workers processes (default every core), a progress bar with MB/s, and a killed "
        "preparation continues where it stopped. Prints the cache folder and its counts.",
    )
    _recipe_arguments(prepare)
    prepare.add_argument(
        "--nnodes",
        type=int,
        metavar="N",
        help="nodes preparing this cache together, each with its own share (env NNODES)",
    )
    prepare.add_argument("--node-rank", type=int, metavar="R", help="this node's rank, 0..N-1 (env NODE_RANK)")
    prepare.set_defaults(func=_prepare)

    data = commands.add_parser(
        "data",
        help="prepare a recipe's data and show examples with the loss-carrying tokens marked, plus counts",
        description="Prepare the data as accord train would (or reuse its cache), print the first N training examples "
        "with the tokens that carry loss marked (green on a terminal, else [[between brackets]]), then the counts: "
        "examples, tokens, targets, truncations and packing fill.",
    )
    _recipe_arguments(data)
    data.add_argument(
        "--show", type=int, default=3, metavar="N", help="examples to print (default 3; 0 for the counts only)"
    )
    data.set_defaults(func=_data)

    report = commands.add_parser("report", help="render a run's metrics as PNG plots and an HTML page")
    report.add_argument("output_dir", metavar="OUTPUT_DIR", help="a run's output.dir")
    report.set_defaults(func=_report)

    config = commands.add_parser(
        "config",
        help="write the accelerate config matching a recipe (for `accelerate launch --config_file`)",
        description="Write an accelerate config file that launches the recipe as `accord train` would: "
        "`accelerate launch --config_file FILE -m accord train RECIPE` is then the same run.",
    )
    _recipe_arguments(config)
    config.add_argument("--out", required=True, metavar="FILE", help="accelerate config YAML to write")
    config.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="processes in all (default: what accord would start here, times --nodes)",
    )
    config.add_argument("--nodes", type=int, default=1, metavar="N")
    config.add_argument("--node-rank", type=int, default=0, metavar="R")
    config.add_argument("--master-addr", metavar="HOST")
    config.add_argument("--master-port", type=int, default=29500, metavar="PORT")
    config.set_defaults(func=_config)
    return parser


def _recipe_arguments(parser: argparse.ArgumentParser, overrides_help: str = "recipe overrides") -> None:
    """The recipe file and its dotted overrides, as every recipe-reading command takes them."""
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help)


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    """What every job writer (`accord slurm`, `accord k8s`) takes: the recipe for `accord train` and the nodes."""
    _recipe_arguments(parser, "recipe overrides, passed on to accord train")
    parser.add_argument("--nodes", type=int, required=True, metavar="N")
    parser.add_argument(
        "--gpus-per-node", type=int, required=True, metavar="G", help="0 for CPU nodes (then engine.processes per node)"
    )


def launcher_arguments(argv: list[str]) -> list[str]:
    """argv without what launchers put into a script's arguments, wherever they put it:
    `--local_rank=N` / `--local-rank=N` (torch.distributed.launch, DeepSpeed's launcher; the
    rank is read from the environment they also set) and `--deepspeed FILE` (DeepSpeed's
    convention, read as engine.deepspeed_config=FILE)."""
    out: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        i += 1
        name, eq, value = item.partition("=")
        if name in ("--local_rank", "--local-rank"):
            if not eq and i < len(argv) and argv[i].isdigit():
                i += 1
        elif name in ("--deepspeed", "--deepspeed_config", "--deepspeed-config"):
            if not eq and i < len(argv):
                value, i = argv[i], i + 1
            if not value:
                raise SystemExit(_fail(f"{name} needs a DeepSpeed JSON file"))
            overrides.append(f"engine.deepspeed_config={value}")
        else:
            out.append(item)
    return out + overrides


def entry() -> None:
    """The `accord` command (and `python -m accord`)."""
    code = main()
    # Only a process that imported accord.distributed.group can have joined a group; importing it up front
    # would cost torch's import (~2 s) before the command's first line of output.
    dist = sys.modules.get("accord.distributed.group")
    if (
        dist is not None and dist.left_a_group()
    ):  # a worker ran in this process (under torchrun, accelerate launch, srun ...)
        dist.exit_after_shutdown(code)
    launch = sys.modules.get("accord.launch.agent")
    if launch is not None and (launch.ran_workers() or launch.trained_here()):
        # The launcher, its workers ended (or it trained as the only worker, ending as a worker
        # process does): the lock is released, the run's folder removed and nothing else is
        # open but stdout/stderr. The interpreter's teardown (torch's modules and C++ objects)
        # would take seconds more on a busy machine (4-5 s at load 20; ~1 s idle on 1 process).
        dist.exit_after_shutdown(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = launcher_arguments(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    # Overrides may come before or after options; argparse collects the ones it meets
    # after an option as unknown arguments.
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown or (extra and args.command not in _RECIPE_COMMANDS):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if args.command in _RECIPE_COMMANDS:
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except AccordError as e:
        return _fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", code=130)


def _gpu_indices(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices such as 0,1, got {text!r}") from None


def _train(args: argparse.Namespace) -> int:
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
        return _fail(result.message, code=PREEMPTED_EXIT_CODE)
    if result.status == "refused":
        return 2  # bad input the workers found (the reason is printed); nothing was written
    return 1 if result.status == "stopped" else 0  # a stopped run's worker printed why


def _job_recipe(args: argparse.Namespace):
    """(recipe, processes per node) of a job script or manifest for --nodes × --gpus-per-node
    (CPU nodes: engine.processes each); a batch that does not split over that world is refused
    here rather than in the queue."""
    from accord.distributed.batch_plan import BatchPlan
    from accord.recipe.schema import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    per_node = args.gpus_per_node or recipe.engine.processes
    BatchPlan.for_recipe(recipe, args.nodes * per_node)
    return recipe, per_node


def _slurm(args: argparse.Namespace) -> int:
    from pathlib import Path

    from accord.launch.slurm_script import JobRequest, job_script

    recipe, per_node = _job_recipe(args)
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


def _k8s(args: argparse.Namespace) -> int:
    from pathlib import Path

    import yaml

    from accord.launch.k8s_manifest import PodJob, job_name, manifest

    recipe, per_node = _job_recipe(args)
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


def _plan(args: argparse.Namespace) -> int:
    import json

    from accord.observe.progress import announce

    announce("planning (the model is built on the meta device: nothing is loaded)…")  # before torch's import: seconds
    from accord import api
    from accord.planner.estimate import format_phases, format_table

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


def _doctor(args: argparse.Namespace) -> int:
    from accord import api
    from accord.cli import doctor
    from accord.launch.cluster import resolve_topology

    recipe = api.load(args.recipe, args.overrides)
    topology = resolve_topology(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_endpoint)
    return doctor.run(recipe, topology, with_self_test=not args.no_self_test)


def _prepare(args: argparse.Namespace) -> int:
    import time

    from accord.data.nodeshare import NodeShare
    from accord.data.prepare import cache_folder, prepare_data
    from accord.models.build import build_tokenizer
    from accord.recipe.schema import load_recipe
    from accord.tasks import build_task

    share = None
    if args.nnodes is not None or args.node_rank is not None:
        nodes, rank = args.nnodes or 1, args.node_rank or 0
        if nodes < 1 or not 0 <= rank < nodes:
            raise UserInputError(f"--nnodes {nodes} --node-rank {rank}: give N >= 1 nodes and a rank in 0..N-1")
        share = NodeShare(rank, nodes)
    recipe = load_recipe(args.recipe, args.overrides)
    tokenizer = build_tokenizer(recipe.model)
    task = build_task(recipe, tokenizer)
    start = time.perf_counter()
    data = prepare_data(recipe, tokenizer, task, preparer=True, share=share)
    report = data.report
    tokens = f", {report['train_tokens']} tokens" if "train_tokens" in report else ""
    size = sum(f.stat().st_size for f in cache_folder(recipe, tokenizer, task).rglob("*") if f.is_file())
    print(
        f"accord: {report['train_examples']} training examples{tokens}, {report['eval_examples']} held out; "
        f"{size / 1e6:.1f} MB in {cache_folder(recipe, tokenizer, task)} ({time.perf_counter() - start:.1f} s)"
    )
    return 0


def _data(args: argparse.Namespace) -> int:
    from accord import api
    from accord.cli.data_view import data_view

    if args.show < 0:
        raise UserInputError(f"--show {args.show}: give a number of examples, 0 or more")
    recipe = api.load(args.recipe, args.overrides)
    for line in data_view(recipe, args.show, color=sys.stdout.isatty()):
        print(line)
    return 0


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from accord.observe.progress import announce

    announce(f"rendering the report of {args.output_dir}…")  # before matplotlib's import: seconds
    if not (Path(args.output_dir) / "metrics.jsonl").is_file():
        raise UserInputError(f"{args.output_dir}: no metrics.jsonl here (give the output.dir of a run)")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UserInputError(
            "accord report draws with matplotlib, which is not installed: pip install 'accord[report]'"
        )
    from accord.observe.report import render_report

    page = render_report(args.output_dir)
    print(f"accord: wrote {page} and its plots in {page.parent}/")
    return 0


def _config(args: argparse.Namespace) -> int:
    from pathlib import Path

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


def _fail(message: str, code: int = 2) -> int:
    from accord.distributed import rank_env
    from accord.launch import refusal_relay as refusals

    # A process that never imported accord.distributed.group never joined a group: its rank is the
    # launcher's, and the line is printed without importing torch (a second sooner).
    dist = sys.modules.get("accord.distributed.group")
    rank0 = dist.is_main() if dist is not None else rank_env.leads()
    grouped = dist is not None and (dist.left_a_group() or dist.in_group())
    # Global rank 0, and under a multi-node outer launcher each node's local rank 0: every
    # node's log says why it stopped, not only the launcher's ChildFailedError.
    if (rank0 or rank_env.env_info().leads_node) and refusals.claim():
        for line in message.splitlines():
            print(f"accord: error: {line}", file=sys.stderr, flush=True)
    if not grouped:
        refusals.publish(message)  # refused before the nodes met: tell the other nodes
    return code


if __name__ == "__main__":
    sys.exit(main())
