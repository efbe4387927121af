"""engine.launcher=ray: the workers are Ray Train workers (`ray.train.torch.TorchTrainer`), each
running accord's one worker entry point (`accord.launch.worker.train_worker`) in the process
group Ray Train created. The launcher (`launch/start.py`) checks the recipe and the data
before Ray starts; this module starts Ray (or joins the cluster at engine.ray.address /
RAY_ADDRESS) and refuses a cluster that cannot hold the workers, both before the launcher
takes the output folder, then runs the workers.

Ray runs the worker function in a thread of its worker actor, so what accord's own launcher
does through process signals and environment variables goes through a small actor instead
(`_RunControl`): which attempt this is (Ray restarts the whole group after a lost worker,
under FailureConfig(max_failures=engine.max_restarts); a restarted group resumes from the
latest checkpoint), a stop request from the driver (SIGTERM / SIGUSR1 / SIGINT: finish the
step, checkpoint, end "preempted"), and how the run ended, from rank 0.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import tempfile
import threading
from typing import TYPE_CHECKING, Any

from accord.errors import UserInputError
from accord.recipe.schema import PROCESS_GROUP_TIMEOUT_S, Recipe
from accord.stopping import STOP_SIGNALS, StopRequest

if TYPE_CHECKING:
    from accord.launch.plan import LaunchPlan

RAY_MISSING = (
    "engine.launcher=ray needs Ray Train, which is not installed here: pip install 'accord[ray]' "
    "(or 'ray[train]'), or leave engine.launcher at accord"
)
_STOP_POLL_S = 0.5  # how often a worker asks whether the driver was told to stop
_CONNECT_TIMEOUT_S = 10  # a Ray head that takes no TCP connection in this long is not there


def world_size(recipe: Recipe) -> int:
    """The run's workers: engine.ray.nodes × engine.processes."""
    return recipe.engine.ray.nodes * recipe.engine.processes


def cluster_address(recipe: Recipe) -> str | None:
    """The Ray cluster the run joins: engine.ray.address, else RAY_ADDRESS (None: a local Ray)."""
    return recipe.engine.ray.address or os.environ.get("RAY_ADDRESS")


def refusal(recipe: Recipe, outer_launcher: str | None, multi_node_flags: bool) -> str | None:
    """What stops a Ray run before anything starts (one line), or None."""
    if outer_launcher is not None:
        return (
            f"engine.launcher=ray starts its own workers through Ray, but {outer_launcher} already started this "
            "process as one worker of many: run `accord train` once, outside the launcher"
        )
    if multi_node_flags:
        return (
            "engine.launcher=ray: Ray places the workers on its nodes; leave out --nnodes, --node-rank and the "
            "NNODES / SLURM environment and set engine.ray.nodes instead"
        )
    if importlib.util.find_spec("ray") is None:
        return RAY_MISSING
    address = cluster_address(recipe)
    unreachable = _unreachable(address) if address else None
    return _no_cluster(recipe, address, unreachable) if unreachable else None


class RaySession:
    """Ray, up and checked for the run: `RaySession(plan)` starts a local Ray or joins the
    cluster and refuses (UserInputError, Ray stopped again) one that cannot hold the workers,
    before the output folder is taken; `run()` trains; `close()` stops a Ray started here."""

    def __init__(self, plan: LaunchPlan) -> None:
        import ray

        from accord.observe.progress import announce

        recipe = plan.recipe
        announce("joining the Ray cluster…" if cluster_address(recipe) else "starting Ray…")
        self.started_here = _connect(recipe)
        try:
            self.gpus = _gpus_per_worker(recipe, ray.cluster_resources())
            _check_cluster_fits(recipe, self.gpus)
        except BaseException:
            self.close()
            raise
        # The workers pick their device from engine.device: settled here, where the cluster is known
        # (the driver itself may have no GPU).
        engine = recipe.engine.model_copy(update={"device": "cuda" if self.gpus else "cpu"})
        self.plan = plan.with_recipe(recipe.model_copy(update={"engine": engine}))

    def run(self) -> str:
        """Train on Ray Train workers; how the run ended: completed | preempted | stopped |
        refused. WorkerFailed when a worker failed past engine.max_restarts."""
        import ray
        from ray.train import TrainingFailedError

        from accord.observe.progress import announce

        recipe = self.plan.recipe
        control = ray.remote(num_cpus=0)(_RunControl).remote()
        workers = world_size(recipe)
        announce(f"starting {workers} Ray Train worker{'s' if workers != 1 else ''}…")
        with _stop_forwarded(control), tempfile.TemporaryDirectory(prefix="accord-ray-") as storage:
            try:
                _trainer(self.plan, self.gpus, control, storage).fit()
            except TrainingFailedError as e:
                from accord.launch.agent import WorkerFailed

                restarts = recipe.engine.max_restarts
                left = f", with no restart left of engine.max_restarts={restarts}" if restarts else ""
                raise WorkerFailed(
                    f"a Ray worker failed ({type(e).__name__}{left}; its error is printed above); "
                    "--resume continues from the latest checkpoint, if one was written"
                ) from None
            return ray.get(control.result.remote()) or "completed"

    def close(self) -> None:
        import ray

        if self.started_here:
            self.started_here = False
            ray.shutdown()


def _connect(recipe: Recipe) -> bool:
    """ray.init: the cluster at engine.ray.address or RAY_ADDRESS, else a local instance with at
    least the CPUs the workers reserve (logical CPUs: a scheduling count, not cores). Whether
    this call started Ray here."""
    import ray

    cfg = recipe.engine.ray
    address = cluster_address(recipe)
    options: dict[str, Any] = dict(
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=True,
        runtime_env={"worker_process_setup_hook": f"{__name__}.quiet_ray_process"},
    )
    if ray.is_initialized():  # accord.train called from a program that joined a cluster already
        return False
    if address is None:
        need = world_size(recipe) * cfg.cpus_per_worker
        options["num_cpus"] = max(int(-(-need // 1)), os.cpu_count() or 1)
        ray.init(address="local", **options)  # a new instance, even beside one `ray start` left running
        return True
    try:
        ray.init(address=address, **options)
    except (ConnectionError, ValueError) as e:
        raise UserInputError(_no_cluster(recipe, address, _first_line(e))) from None
    return True


def _no_cluster(recipe: Recipe, address: str, why: str) -> str:
    source = "engine.ray.address" if recipe.engine.ray.address else "RAY_ADDRESS"
    return (
        f"{source}={address}: no Ray cluster answers there ({why}); start one (`ray start --head`) "
        "or leave engine.ray.address and RAY_ADDRESS unset for a local Ray"
    )


def _unreachable(address: str) -> str | None:
    """Why HOST:PORT takes no connection, found in seconds: ray.init retries a silent address
    for minutes. None for the other forms (auto, ray://...), which ray.init resolves itself."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror}" if e.strerror else type(e).__name__


def quiet_ray_process() -> None:
    """Run in each of the job's Ray processes as it starts. Ray Train's placement-group cleaner
    asks Ray's state API, served by the dashboard, whether the run's controller still lives;
    without the dashboard (ray[train] alone) it warns every second that it cannot tell."""
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)


def _gpus_per_worker(recipe: Recipe, resources: dict[str, float]) -> float:
    cfg = recipe.engine
    if cfg.ray.gpus_per_worker is not None:
        return cfg.ray.gpus_per_worker
    if cfg.device == "cuda" or (cfg.device == "auto" and resources.get("GPU", 0) > 0):
        return 1.0
    return 0.0


def _check_cluster_fits(recipe: Recipe, gpus: float) -> None:
    """Refuse a run the cluster cannot place (Ray would wait for resources for ever)."""
    import ray

    cfg = recipe.engine.ray
    workers = world_size(recipe)
    alive = [node for node in ray.nodes() if node.get("Alive")]
    if len(alive) < cfg.nodes:
        raise UserInputError(
            f"engine.ray.nodes={cfg.nodes}: the Ray cluster has {len(alive)} node{'s' if len(alive) != 1 else ''}; "
            "add nodes or lower engine.ray.nodes"
        )
    total = ray.cluster_resources()
    need = {"CPU": cfg.cpus_per_worker, **({"GPU": gpus} if gpus else {}), **cfg.resources_per_worker}
    for name, each in need.items():
        if each and total.get(name, 0) < workers * each - 1e-9:
            setting = {"CPU": "cpus_per_worker", "GPU": "gpus_per_worker"}.get(name, f"resources_per_worker.{name}")
            raise UserInputError(
                f"the Ray cluster has {total.get(name, 0):g} {name}; the run's {workers} workers need "
                f"{workers * each:g} ({each:g} each, engine.ray.{setting}); lower engine.processes / engine.ray.nodes "
                "or add nodes"
            )


def _trainer(plan: LaunchPlan, gpus: float, control, storage: str):
    """Ray Train's trainer for the run; each worker is handed the plan (as accord's launcher
    hands it to its workers)."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    recipe, cfg = plan.recipe, plan.recipe.engine.ray
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": gpus} if gpus else {}), **cfg.resources_per_worker}
    scaling = ScalingConfig(
        num_workers=world_size(recipe),
        use_gpu=bool(gpus),
        resources_per_worker=resources,
        placement_strategy=cfg.placement_strategy or ("PACK" if cfg.nodes == 1 else "SPREAD"),
    )
    # Ray Train creates the process group itself (TorchConfig's backend, in each worker before the
    # function runs); accord's worker joins it as it is. The timeout is accord's own.
    backend = "nccl" if gpus else "gloo"
    return TorchTrainer(
        _train_function,
        train_loop_config={"plan": plan.to_json(), "control": control, "cwd": os.getcwd()},
        scaling_config=scaling,
        torch_config=TorchConfig(backend=backend, timeout_s=PROCESS_GROUP_TIMEOUT_S),
        run_config=RunConfig(
            name="accord",
            storage_path=storage,  # Ray's own run records; accord's checkpoints are in output.dir
            failure_config=FailureConfig(max_failures=recipe.engine.max_restarts),
            # accord's lines are printed once, as they are (Ray's print patch would also log each
            # again), and Ray Train's own INFO lines (placement, process group) stay out of them.
            worker_runtime_env={"env_vars": {**_passed_on(), "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}},
            logging_config=LoggingConfig(log_level="ERROR"),
        ),
    )


# What the workers see of the driver's environment where Ray did not start them from it (a
# cluster's nodes): accord's and Hugging Face's own settings (HF_HUB_OFFLINE, HF_HOME, ...).
_PASSED_ON = ("ACCORD_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")


def _passed_on() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(_PASSED_ON)}


class _RunControl:
    """The run's shared state, one Ray actor: each rank's start count (a restarted group's
    attempt), the driver's stop request and the status rank 0 ended with."""

    def __init__(self) -> None:
        self.starts: dict[int, int] = {}
        self.stop: str | None = None
        self.status: str | None = None

    def start(self, rank: int) -> int:
        attempt = self.starts.get(rank, 0)
        self.starts[rank] = attempt + 1
        return attempt

    def request_stop(self, name: str) -> None:
        self.stop = name

    def stop_requested(self) -> str | None:
        return self.stop

    def finish(self, status: str) -> None:
        self.status = status

    def result(self) -> str | None:
        return self.status


class _stop_forwarded:
    """While the workers run: a stop signal to the driver asks every worker, through the
    control actor, to finish its step and checkpoint (as accord's launcher forwards it to its
    workers). A second SIGINT is Ray's (KeyboardInterrupt: the workers are killed)."""

    def __init__(self, control) -> None:
        self.control, self.previous = control, {}

    def __enter__(self) -> _stop_forwarded:
        if threading.current_thread() is threading.main_thread():
            for sig in (*STOP_SIGNALS, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._forward)
        return self

    def _forward(self, signum: int, frame) -> None:
        self.control.request_stop.remote(signal.Signals(signum).name)
        if signum == signal.SIGINT:  # the next Ctrl-C stops at once
            signal.signal(signal.SIGINT, self.previous.get(signal.SIGINT, signal.default_int_handler))

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _train_function(config: dict[str, Any]) -> None:
    """One Ray Train worker: accord's worker in the process group Ray Train created."""
    import ray
    import ray.train

    from accord.distributed import group as dist
    from accord.launch.plan import LaunchPlan
    from accord.launch.worker import train_worker

    control = config["control"]
    # Ray Train moves each worker into a folder of its own session: the recipe's relative paths
    # (output.dir, data, model) mean what they meant where `accord train` ran, as under accord's
    # launcher; on another node that folder must exist too (a shared file system).
    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])
    rank = ray.train.get_context().get_world_rank()
    dist.set_restart_count(ray.get(control.start.remote(rank)))
    plan = LaunchPlan.from_json(config["plan"])
    stop = StopRequest()
    done = threading.Event()
    poller = threading.Thread(target=_poll_stop, args=(control, stop, done), name="accord-ray-stop", daemon=True)
    poller.start()
    try:
        result = train_worker(plan.recipe, plan.batch, stop=stop)
    finally:
        done.set()
    if rank == 0:
        ray.get(control.finish.remote(result.status))


def _poll_stop(control, stop, done: threading.Event) -> None:
    import ray

    while not done.wait(_STOP_POLL_S):
        name = ray.get(control.stop_requested.remote())
        if name is not None:
            stop.signal_name = name
            return


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
