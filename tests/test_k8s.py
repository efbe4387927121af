"""`accord k8s` prints a Kubeflow TrainJob or PyTorchJob that the operators' own published models
accept, and whose container command, run with the environment the operator gives each pod, trains
as `accord train` does on one host."""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import pytest
import yaml

from accord.launch.k8s_manifest import SIGNAL_LEAD_S, K8sError, PodJob, container_command, job_name, manifest
from conftest import accord_env, assert_ok, final_params, max_param_diff, run_accord_here, run_process

trainer_models = pytest.importorskip(
    "kubeflow_trainer_api.models", reason="the dev extra installs kubeflow-trainer-api"
)


def _job(**changes) -> PodJob:
    values = dict(
        recipe="recipes/quickstart.yaml",
        overrides=("batch.micro_batch_size=4",),
        nodes=2,
        gpus_per_node=8,
        processes_per_node=8,
        image="registry.example/accord:1",
        name="accord-quickstart",
        output_dir="runs/quickstart",
        pvc="runs",
    )
    return PodJob(**(values | changes))


# ---------------------------------------------------------------- the operators' schemas


def _trainjob_as_the_operator_reads_it(document: dict) -> dict:
    """Kubeflow Trainer's generated models (strict types; a key they do not know is dropped, so
    the round trip differs from the document)."""
    return trainer_models.TrainerV1alpha1TrainJob.from_dict(document).to_dict()


def _pytorchjob_as_the_operator_reads_it(document: dict) -> dict:
    """The training operator's generated client models, deserialised and serialised back."""
    from kubeflow.training import ApiClient

    class Response:
        data = json.dumps(document)

    client = ApiClient()
    return client.sanitize_for_serialization(client.deserialize(Response(), "KubeflowOrgV1PyTorchJob"))


VARIANTS = {
    "gpus-and-volume": {},
    "cpu-pods-without-volume": {"gpus_per_node": 0, "processes_per_node": 2, "pvc": None},
    "one-node-in-a-namespace": {"nodes": 1, "namespace": "ml"},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_trainjob_is_accepted_by_kubeflow_trainers_models(variant):
    document = yaml.safe_load(yaml.safe_dump(manifest(_job(**VARIANTS[variant]))))
    assert document["kind"] == "TrainJob" and document["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert _trainjob_as_the_operator_reads_it(document) == document


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pytorchjob_is_accepted_by_the_training_operators_models(variant):
    pytest.importorskip("kubeflow.training", reason="the dev extra installs kubeflow-training")
    document = yaml.safe_load(yaml.safe_dump(manifest(_job(kind="pytorchjob", **VARIANTS[variant]))))
    assert document["kind"] == "PyTorchJob" and document["apiVersion"] == "kubeflow.org/v1"
    assert _pytorchjob_as_the_operator_reads_it(document) == document


def test_the_schema_check_fails_on_a_misspelled_key_or_a_wrong_type():
    """The round trip is a real check: what the operator would drop or refuse shows."""
    document = manifest(_job())
    document["spec"]["trainer"]["numNode"] = document["spec"]["trainer"].pop("numNodes")
    assert _trainjob_as_the_operator_reads_it(document) != document
    document = manifest(_job())
    document["spec"]["trainer"]["numNodes"] = "2"
    with pytest.raises(ValueError):
        _trainjob_as_the_operator_reads_it(document)


# ---------------------------------------------------------------- what the pods run


def test_pods_resume_from_the_volume_and_have_the_stop_checkpoints_grace_period():
    document = manifest(_job())
    command = document["spec"]["trainer"]["command"]
    assert command[:2] == ["torchrun", "--rdzv-id=accord-quickstart"]
    assert command[command.index("-m") :] == [
        "-m", "accord", "train", "recipes/quickstart.yaml", "resume=auto",
        "batch.micro_batch_size=4", "output.dir=/mnt/accord/quickstart",
    ]  # fmt: skip
    pod = document["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    spec = pod["template"]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == SIGNAL_LEAD_S
    assert spec["volumes"] == [{"name": "accord-output", "persistentVolumeClaim": {"claimName": "runs"}}]
    assert spec["containers"][0]["volumeMounts"] == [{"name": "accord-output", "mountPath": "/mnt/accord"}]
    pytorch = manifest(_job(kind="pytorchjob", nodes=3))["spec"]
    assert pytorch["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
    assert pytorch["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2 and pytorch["nprocPerNode"] == "8"
    master = pytorch["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert master["terminationGracePeriodSeconds"] == SIGNAL_LEAD_S
    assert "--master-addr=$(MASTER_ADDR)" in master["containers"][0]["command"]


def test_a_users_dollar_parenthesis_reaches_accord_literally():
    """The kubelet expands $(NAME) in a container's command: a user's value is written with $$(."""
    command = container_command(_job(overrides=("output.dir=/data/$(USER)",), pvc=None))
    assert command[-1] == "output.dir=/data/$$(USER)"
    assert _kubelet_expands(command, {"USER": "x"})[-1] == "output.dir=/data/$(USER)"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"name": "Accord_Run"}, "job name 'Accord_Run': use lower-case letters"),
        ({"nodes": 0}, "--nodes must be at least 1"),
        ({"image": " "}, "--image is empty"),
        ({"mount": "data"}, "--mount 'data': the volume's mount path must be absolute"),
        ({"kind": "mpijob"}, "--kind 'mpijob': choose one of trainjob, pytorchjob"),
    ],
)
def test_a_job_that_cannot_be_written_is_one_line(change, message):
    with pytest.raises(K8sError, match=re.escape(message)):
        manifest(_job(**change))


def test_a_job_name_is_made_from_any_recipe_file_name():
    assert job_name("SmolLM2_chat.sft") == "accord-smollm2-chat-sft"
    assert len(job_name("x" * 80)) == 63


@pytest.mark.subprocess
def test_cli_prints_the_manifest_and_refuses_a_batch_the_pods_cannot_split(tiny_recipe, tmp_path):
    proc = run_accord_here("k8s", tiny_recipe, "--nodes", "2", "--gpus-per-node", "0", "--image", "img", "--pvc", "c")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["kind"] == "TrainJob" and proc.stderr == ""
    proc = run_accord_here("k8s", tiny_recipe, "--nodes", "3", "--gpus-per-node", "0", "--image", "img")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("accord: error:") == 1 and "6 processes" in proc.stderr


def _kubelet_expands(command: list[str], env: dict[str, str]) -> list[str]:
    """What the kubelet does to a container's command: $(NAME) from the container's environment
    (left as it is when NAME is not set), $$ for a literal $."""

    def expand(text: str) -> str:
        pattern = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
        return pattern.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)

    return [expand(part) for part in command]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_environment(kind: str, nodes: int, node_rank: int, processes: int, master: str, port: int) -> dict[str, str]:
    """The variables each operator sets in a pod's container (Kubeflow Trainer's torch plugin; the
    training operator's PyTorchJob controller, whose WORLD_SIZE counts processes and RANK counts pods)."""
    common = {"PET_NNODES": str(nodes), "PET_NODE_RANK": str(node_rank), "PET_NPROC_PER_NODE": str(processes)}
    if kind == "trainjob":
        return common | {"PET_MASTER_ADDR": master, "PET_MASTER_PORT": str(port)}
    return common | {
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nodes * processes),
        "RANK": str(node_rank),
        "PYTHONUNBUFFERED": "0",
    }


def pod_command(document: dict, env: dict[str, str]) -> list[str]:
    """The container's command as the pod runs it, torchrun being this Python's."""
    if document["kind"] == "TrainJob":
        command = document["spec"]["trainer"]["command"]
    else:
        command = document["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    expanded = _kubelet_expands(command, env)
    assert expanded[0] == "torchrun"
    return [sys.executable, "-m", "torch.distributed.run", *expanded[1:]]


@pytest.mark.distributed
def test_a_pytorchjob_pod_trains_as_accord_train_does(tiny_reference, tmp_path):
    """One pod of 2 processes, with the environment the training operator gives it, running the
    manifest's command: the same final weights as `accord train` on 2 processes."""
    recipe, reference = tiny_reference
    job = _job(
        recipe=str(recipe), overrides=(), nodes=1, gpus_per_node=0, processes_per_node=2, kind="pytorchjob",
        output_dir=str(tmp_path / "run"), pvc="claim", mount=str(tmp_path / "volume"),
    )  # fmt: skip
    document = manifest(job)
    env = pod_environment("pytorchjob", nodes=1, node_rank=0, processes=2, master="127.0.0.1", port=_free_port())
    proc = run_process(pod_command(document, env), env=accord_env() | env, cwd=tmp_path, timeout=300)
    assert_ok(proc)
    assert proc.stderr.count("accord: batch 2 processes × 8 sequences × 2 accumulation steps") == 1
    assert max_param_diff(final_params(reference), final_params(Path(job.run_output_dir))) <= 1e-5


@pytest.mark.distributed
@pytest.mark.slow  # two hosts, ~15 s each on 2 cores; one pod of 2 processes is in the default tier
@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_two_pods_on_two_hosts_train_as_one_host_does(namespaces, tiny_reference, tmp_path, kind):
    """Each pod's environment as its operator sets it, on two hosts (network namespaces), one
    volume shared by both: the final weights of `accord train` on one host with 2 processes."""
    from conftest import ADDRESSES, finish, start_process

    recipe, reference = tiny_reference
    job = _job(
        recipe=str(recipe), overrides=(), nodes=2, gpus_per_node=0, processes_per_node=1, kind=kind,
        output_dir=str(tmp_path / "run"), pvc="claim", mount=str(tmp_path / "volume"),
    )  # fmt: skip
    document, port = manifest(job), _free_port()
    pods = []
    for rank, namespace in enumerate(namespaces):
        env = pod_environment(kind, nodes=2, node_rank=rank, processes=1, master=ADDRESSES[0], port=port)
        command = ["ip", "netns", "exec", namespace, *pod_command(document, env)]
        pods.append(start_process(command, merge_output=True, env=accord_env() | env, cwd=tmp_path))
    outputs = [finish(pod, timeout=300)[0] for pod in pods]
    for pod, output in zip(pods, outputs):
        assert pod.returncode == 0, output[-3000:]
    assert max_param_diff(final_params(reference), final_params(Path(job.run_output_dir))) <= 1e-5
