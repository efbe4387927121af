"""The `accord` command line: its commands, arguments and help."""

from __future__ import annotations

import argparse

from accord import __version__
from accord.cli import commands as command

TRAIN_EPILOG = """\
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
RECIPE_COMMANDS = ("train", "slurm", "k8s", "config", "plan", "doctor", "data", "prepare")


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
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    recipe_arguments(train, "recipe overrides, e.g. optim.lr=1e-3")
    train.add_argument("--overwrite", action="store_true", help="replace an earlier run in output.dir")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in output.dir (same as resume=auto)",
    )
    train.add_argument(
        "--devices", type=gpu_indices, metavar="0,1", help="GPU indices to use (same as engine.devices=[0,1])"
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
    train.set_defaults(func=command.train)

    slurm = commands.add_parser(
        "slurm",
        help="write a SLURM job script that runs a recipe on N nodes (checkpoints before the time limit, requeues)",
        description="Write an sbatch script: one accord per node (srun --ntasks-per-node=1), SIGUSR1 two minutes "
        "before the time limit so accord checkpoints and exits 75, then the job requeues itself and resumes.",
    )
    job_arguments(slurm)
    slurm.add_argument("--partition", metavar="P")
    slurm.add_argument("--time", metavar="T", help="time limit, e.g. 04:00:00")
    slurm.add_argument("--account", metavar="A")
    slurm.add_argument("--cpus-per-task", type=int, metavar="C")
    slurm.add_argument("--job-name", metavar="NAME")
    slurm.add_argument("--out", metavar="FILE", help="script path (default: <recipe name>.sbatch)")
    slurm.set_defaults(func=command.slurm)

    k8s = commands.add_parser(
        "k8s",
        help="print a Kubeflow TrainJob (or PyTorchJob) that runs a recipe on N pods through torchrun",
        description="Print a Kubernetes manifest: one pod per node running `torchrun -m accord train RECIPE "
        "resume=auto`, the output folder on a volume, a grace period for the stop checkpoint. Apply with kubectl.",
    )
    job_arguments(k8s)
    k8s.add_argument("--image", required=True, metavar="IMAGE", help="container image with accord and the recipe")
    k8s.add_argument("--pvc", metavar="CLAIM", help="PersistentVolumeClaim for output.dir (shared by the pods)")
    k8s.add_argument("--mount", default="/mnt/accord", metavar="PATH", help="where the claim is mounted")
    k8s.add_argument("--kind", default="trainjob", choices=("trainjob", "pytorchjob"))
    k8s.add_argument("--name", metavar="NAME", help="job name (default: accord-<recipe name>)")
    k8s.add_argument("--namespace", metavar="NS")
    k8s.add_argument("--out", metavar="FILE", help="write the manifest here instead of printing it")
    k8s.set_defaults(func=command.k8s)

    plan = commands.add_parser(
        "plan",
        help="per-GPU memory of each strategy for a recipe, and what fits",
        description="Estimate, for each strategy, the bytes per GPU of parameters, gradients, optimizer state, "
        "master weights and activations, and recommend the cheapest strategy and largest micro batch that fit.",
    )
    recipe_arguments(plan)
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
    plan.set_defaults(func=command.plan)

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
    recipe_arguments(doctor)
    doctor.add_argument("--no-self-test", action="store_true", help="skip the 2-step equivalence run")
    doctor_nodes = doctor.add_argument_group("several nodes (as for accord train)")
    doctor_nodes.add_argument("--nnodes", type=int, metavar="N")
    doctor_nodes.add_argument("--node-rank", type=int, metavar="R")
    doctor_nodes.add_argument("--master-addr", metavar="HOST")
    doctor_nodes.add_argument("--master-port", type=int, metavar="PORT")
    doctor_nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT")
    doctor.set_defaults(func=command.doctor)

    prepare = commands.add_parser(
        "prepare",
        help="tokenize a recipe's data into its cache now, with every local core (accord train does the same first)",
        description="Prepare (tokenize) the recipe's data into data.cache_dir, as accord train would before it starts "
        "its workers: data.prepare_workers processes (default every core), a progress bar with MB/s, and a killed "
        "preparation continues where it stopped. Prints the cache folder and its counts.",
    )
    recipe_arguments(prepare)
    prepare.add_argument(
        "--nnodes",
        type=int,
        metavar="N",
        help="nodes preparing this cache together, each with its own share (env NNODES)",
    )
    prepare.add_argument("--node-rank", type=int, metavar="R", help="this node's rank, 0..N-1 (env NODE_RANK)")
    prepare.set_defaults(func=command.prepare)

    data = commands.add_parser(
        "data",
        help="prepare a recipe's data and show examples with the loss-carrying tokens marked, plus counts",
        description="Prepare the data as accord train would (or reuse its cache), print the first N training examples "
        "with the tokens that carry loss marked (green on a terminal, else [[between brackets]]), then the counts: "
        "examples, tokens, targets, truncations and packing fill.",
    )
    recipe_arguments(data)
    data.add_argument(
        "--show", type=int, default=3, metavar="N", help="examples to print (default 3; 0 for the counts only)"
    )
    data.set_defaults(func=command.data)

    report = commands.add_parser("report", help="render a run's metrics as PNG plots and an HTML page")
    report.add_argument("output_dir", metavar="OUTPUT_DIR", help="a run's output.dir")
    report.set_defaults(func=command.report)

    imports = commands.add_parser(
        "import",
        help="write a recipe from a TRL / transformers.Trainer job (YAML, command line, train.py, DeepSpeed JSON, "
        "accelerate config), with a table of what became of every key",
        description="Read the job's inputs (any mix), account for every key (mapped, changed, dropped or refused) "
        "and write a recipe. A TRL command goes after --: accord import --devices 8 -- trl sft --learning_rate ...",
    )
    imports.add_argument("inputs", nargs="*", metavar="FILE|KEY=VALUE", help="inputs, then recipe overrides")
    imports.add_argument("--devices", type=int, metavar="N", help="devices per node the original ran on")
    imports.add_argument("--nodes", type=int, metavar="M", help="nodes the original ran on (default 1)")
    imports.add_argument("--task", metavar="TASK", help="the TRL task when the inputs do not say (default sft)")
    imports.add_argument("--out", default="recipe.yaml", metavar="FILE", help="recipe to write (default recipe.yaml)")
    imports.add_argument(
        "--verify",
        type=int,
        metavar="N",
        help="then train N steps with the original's trainer (TRL's SFTTrainer / DPOTrainer, transformers.Trainer) "
        "and with accord side by side (1 process, fp32, the same model, rows and order) and compare each step's loss",
    )
    imports.set_defaults(func=command.import_job, command_line=[])

    config = commands.add_parser(
        "config",
        help="write the accelerate config matching a recipe (for `accelerate launch --config_file`)",
        description="Write an accelerate config file that launches the recipe as `accord train` would: "
        "`accelerate launch --config_file FILE -m accord train RECIPE` is then the same run.",
    )
    recipe_arguments(config)
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
    config.set_defaults(func=command.config)
    return parser


def recipe_arguments(parser: argparse.ArgumentParser, overrides_help: str = "recipe overrides") -> None:
    """The recipe file and its dotted overrides, as every recipe-reading command takes them."""
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help)


def job_arguments(parser: argparse.ArgumentParser) -> None:
    """What every job writer (`accord slurm`, `accord k8s`) takes: the recipe for `accord train` and the nodes."""
    recipe_arguments(parser, "recipe overrides, passed on to accord train")
    parser.add_argument("--nodes", type=int, required=True, metavar="N")
    parser.add_argument(
        "--gpus-per-node", type=int, required=True, metavar="G", help="0 for CPU nodes (then engine.processes per node)"
    )


def gpu_indices(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices such as 0,1, got {text!r}") from None
