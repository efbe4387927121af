"""`accord k8s`: a Kubeflow job that runs a recipe on N pods, one node each, through torchrun.

Two operators, one command in the container. Kubeflow Trainer's `TrainJob` (trainer.kubeflow.org/v1alpha1,
on its `torch-distributed` runtime) and the training operator's `PyTorchJob` (kubeflow.org/v1) both give each
pod PET_NNODES, PET_NODE_RANK and PET_NPROC_PER_NODE, which torchrun reads as its --nnodes, --node-rank and
--nproc-per-node; the TrainJob also sets PET_MASTER_ADDR/PORT, the PyTorchJob MASTER_ADDR/PORT, which the
command names as `$(MASTER_ADDR)`, expanded by the kubelet. accord runs under torchrun as under any outer
launcher, with `resume=auto`: a pod that is restarted (or a job that is resubmitted) continues from the
newest checkpoint in output.dir, which a volume (--pvc) shares between the pods and keeps after them.
A deleted or evicted pod gets SIGTERM, torchrun passes it to accord, which finishes the step, checkpoints
and exits: the grace period is the lead `accord slurm` gives SLURM's warning signal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from accord.errors import UserInputError
from accord.launch.slurm_script import SIGNAL_LEAD_S

KINDS = ("trainjob", "pytorchjob")
TRAINJOB_RUNTIME = "torch-distributed"  # the ClusterTrainingRuntime Kubeflow Trainer installs for torchrun
_CONTAINER = {"trainjob": "node", "pytorchjob": "pytorch"}  # the names each operator looks for
_VOLUME = "accord-output"
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1035 label: what both operators accept
BACKOFF_LIMIT = 3  # restarts before the job fails: a preempted pod comes back; a bad input does not loop forever


class K8sError(UserInputError):
    """A job request that cannot be written; the message says which value and why."""


@dataclass(frozen=True)
class PodJob:
    """What `accord k8s` was asked for. recipe: the recipe's path as the container sees it;
    output_dir: the recipe's output.dir (moved onto the volume when there is one)."""

    recipe: str
    overrides: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    processes_per_node: int
    image: str
    name: str
    output_dir: str
    pvc: str | None = None
    mount: str = "/mnt/accord"
    kind: str = "trainjob"
    namespace: str | None = None

    def check(self) -> None:
        if self.kind not in KINDS:
            raise K8sError(f"--kind {self.kind!r}: choose one of {', '.join(KINDS)}")
        if self.nodes < 1:
            raise K8sError(f"--nodes must be at least 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise K8sError(f"--gpus-per-node must be 0 or more, got {self.gpus_per_node}")
        if not self.image.strip():
            raise K8sError("--image is empty: name the container image that has accord and the recipe installed")
        if not _NAME.match(self.name):
            raise K8sError(
                f"job name {self.name!r}: use lower-case letters, digits and '-', starting with a letter "
                "(at most 63 characters); set it with --name"
            )
        if not PurePosixPath(self.mount).is_absolute():
            raise K8sError(f"--mount {self.mount!r}: the volume's mount path must be absolute, e.g. /mnt/accord")

    @property
    def run_output_dir(self) -> str:
        """output.dir inside the pods: on the volume when there is one."""
        if self.pvc is None:
            return self.output_dir
        return str(PurePosixPath(self.mount) / PurePosixPath(self.output_dir).name)


def job_name(recipe_stem: str) -> str:
    """A valid job name from a recipe's file name: accord-<stem>, lower-case, '-' for anything else."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"accord-{recipe_stem}".lower()).strip("-")
    return name[:63].rstrip("-")


def _literal(text: str) -> str:
    """A user's value as the kubelet must pass it: `$(...)` in command and args is expanded from the
    container's environment, `$$(` is how a literal `$(` is written."""
    return text.replace("$(", "$$(")


def container_command(job: PodJob) -> list[str]:
    """torchrun, told where node 0 is where the operator does not set PET_MASTER_ADDR itself."""
    command = ["torchrun", f"--rdzv-id={job.name}"]
    if job.kind == "pytorchjob":
        command += ["--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)"]
    overrides = [*job.overrides, *([f"output.dir={job.run_output_dir}"] if job.pvc else [])]
    return [*command, "-m", "accord", "train", _literal(job.recipe), "resume=auto", *map(_literal, overrides)]


def manifest(job: PodJob) -> dict[str, Any]:
    """The job's manifest as a dict (yaml.safe_dump prints it)."""
    job.check()
    metadata = {"name": job.name, **({"namespace": job.namespace} if job.namespace else {})}
    metadata["labels"] = {"app.kubernetes.io/created-by": "accord"}
    if job.kind == "trainjob":
        api, kind, spec = "trainer.kubeflow.org/v1alpha1", "TrainJob", _trainjob_spec(job)
    else:
        api, kind, spec = "kubeflow.org/v1", "PyTorchJob", _pytorchjob_spec(job)
    return {"apiVersion": api, "kind": kind, "metadata": metadata, "spec": spec}


def _resources(job: PodJob) -> dict[str, Any]:
    # A quantity is a string in the API (the models read 8 as "8").
    return {"limits": {"nvidia.com/gpu": str(job.gpus_per_node)}} if job.gpus_per_node else {}


def _volume_mounts(job: PodJob) -> list[dict[str, Any]]:
    return [{"name": _VOLUME, "mountPath": job.mount}] if job.pvc else []


def _volumes(job: PodJob) -> list[dict[str, Any]]:
    return [{"name": _VOLUME, "persistentVolumeClaim": {"claimName": job.pvc}}] if job.pvc else []


def _pod_spec(job: PodJob, container: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": SIGNAL_LEAD_S, "containers": [container]}
    if job.pvc:
        spec["volumes"] = _volumes(job)
    return spec


def _trainjob_spec(job: PodJob) -> dict[str, Any]:
    trainer: dict[str, Any] = {
        "image": job.image,
        "command": container_command(job),
        "numNodes": job.nodes,
        "numProcPerNode": job.processes_per_node,
    }
    if job.gpus_per_node:
        trainer["resourcesPerNode"] = _resources(job)
    container = {"name": _CONTAINER["trainjob"], **({"volumeMounts": _volume_mounts(job)} if job.pvc else {})}
    # The runtime's pods (its replicated job "node") get the grace period and the volume through a patch.
    pod = {"spec": _pod_spec(job, container)}
    patch = {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": pod}}}]}
    return {
        "runtimeRef": {"name": TRAINJOB_RUNTIME},
        "trainer": trainer,
        "runtimePatches": [{"manager": "accord", "trainingRuntimeSpec": {"template": {"spec": patch}}}],
    }


def _pytorchjob_spec(job: PodJob) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": _CONTAINER["pytorchjob"],
        "image": job.image,
        "command": container_command(job),
    }
    if job.gpus_per_node:
        container["resources"] = _resources(job)
    if job.pvc:
        container["volumeMounts"] = _volume_mounts(job)

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": _pod_spec(job, container)}}

    specs = {"Master": replicas(1), **({"Worker": replicas(job.nodes - 1)} if job.nodes > 1 else {})}
    return {
        "nprocPerNode": str(job.processes_per_node),
        "pytorchReplicaSpecs": specs,
        "runPolicy": {"backoffLimit": BACKOFF_LIMIT, "cleanPodPolicy": "None"},
    }
