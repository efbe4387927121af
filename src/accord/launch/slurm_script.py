"""`accord slurm`: a job script that runs a recipe on N nodes, survives the time limit and
requeues itself.

One task per node runs `accord train ... resume=auto` (fresh at the first start); accord reads the node list and node id
from SLURM's environment. SLURM sends SIGUSR1 two minutes before the limit: accord
finishes the step, checkpoints and exits 75, and the script requeues the job, which then
resumes from that checkpoint. Every value written into the script is shell-quoted.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from accord.errors import UserInputError
from accord.stopping import PREEMPTED_EXIT_CODE

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # SLURM forms: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]
SIGNAL_LEAD_S = 120


class SlurmError(UserInputError):
    """A job request that cannot be written; the message says which value and why."""


@dataclass(frozen=True)
class JobRequest:
    recipe: Path
    overrides: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    job_name: str | None = None

    def check(self) -> None:
        if self.nodes < 1:
            raise SlurmError(f"--nodes must be at least 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise SlurmError(f"--gpus-per-node must be 0 or more, got {self.gpus_per_node}")
        if self.time is not None and not _TIME.match(self.time):
            raise SlurmError(f"--time {self.time!r}: use a SLURM time such as 30, 04:00:00 or 1-12:00:00")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise SlurmError(f"--cpus-per-task must be at least 1, got {self.cpus_per_task}")


def job_script(job: JobRequest, output_dir: str, workdir: Path, python: str = sys.executable) -> str:
    job.check()
    q = shlex.quote
    name = job.job_name or f"accord-{job.recipe.stem}"
    directives = [
        f"--job-name={q(name)}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
        *([f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []),
        *([f"--time={q(job.time)}"] if job.time else []),
        *([f"--partition={q(job.partition)}"] if job.partition else []),
        *([f"--account={q(job.account)}"] if job.account else []),
        f"--signal=USR1@{SIGNAL_LEAD_S}",
        "--requeue",
        "--open-mode=append",
        f"--output={q(str(Path(output_dir) / 'slurm-%j.out'))}",
    ]
    command = [python, "-m", "accord", "train", str(job.recipe.resolve()), "resume=auto", *job.overrides]
    lines = [
        "#!/bin/bash",
        f"# Written by `accord slurm` for {job.recipe}. Submit with: sbatch <this file>",
        *(f"#SBATCH {d}" for d in directives),
        "set -uo pipefail",
        f"cd {q(str(workdir))}",
        f"mkdir -p {q(output_dir)}",
        "# One accord per node; it starts that node's workers and reads the node list itself.",
        "srun --kill-on-bad-exit=1 " + " ".join(q(part) for part in command),
        "status=$?",
        f'if [ "$status" -eq {PREEMPTED_EXIT_CODE} ]; then',
        '    echo "accord: checkpointed before the time limit; requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)
