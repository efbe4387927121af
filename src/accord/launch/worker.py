"""What each worker process runs: join the group, train (or resume), save, leave cleanly.

Started by accord's launcher through `python -m accord.launch.worker_start` (which reads the
LaunchPlan the launcher wrote), by Ray Train's workers (launch/ray_train.py), or called
directly when an outer launcher (torchrun, ...) started `accord train` itself. The exit code tells
the launcher how the run ended (see EXIT_CODES).
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

from transformers.utils import logging as hf_logging

from accord.checkpoint import node_folders as nodefolders
from accord.checkpoint.disk_space import disk_space_warning
from accord.checkpoint.resume import verified_resume_source
from accord.checkpoint.store import (
    CHECKPOINTS,
    CheckpointError,
    incomplete_checkpoints,
    read_state,
)
from accord.data.sources import DataError
from accord.distributed import group as dist
from accord.distributed.batch_plan import BatchPlan
from accord.engine.device import select_device
from accord.errors import UserInputError
from accord.launch.host_memory import release_freed_memory
from accord.launch.node_watch import watch_node
from accord.observe import heartbeat
from accord.observe.trackers import TrackerStartError, start_trackers
from accord.output.folder import discard_earlier_run, prepare_output_dir, write_run_status
from accord.recipe.observe import ObserveConfig
from accord.recipe.schema import Recipe, recipe_to_yaml
from accord.run.assemble import build_run, describe
from accord.run.trainer import Trainer
from accord.stopping import EXIT_CODES, RunResult, StartRefused, StopRequest, TrainingStopped


def run_worker(recipe: Recipe, plan: BatchPlan | None = None) -> int:
    """Train as this worker process; the exit code tells the launcher how the run ended."""
    try:
        result = train_worker(recipe, plan)
    except BaseException:
        # A crash: report it, then leave at once. Interpreter teardown after a failed
        # collective can abort in C++ destructors (exit -6) and hide the real exit code.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return EXIT_CODES[result.status]


def train_worker(recipe: Recipe, plan: BatchPlan | None = None, stop: StopRequest | None = None) -> RunResult:
    """Entry point of one worker: how the run ended (status completed | preempted | stopped);
    an unexpected exception propagates so the launcher reports the failed rank.

    `plan`: the batch plan this process derived already; else derived here, for the world
    size of the process group this worker joins. `stop`: where a stop request arrives when
    it is not this process's signals (a Ray worker, which runs in a thread of Ray's actor)."""
    info = dist.env_info()
    if plan is None:
        plan = BatchPlan.of(recipe.batch, recipe.engine, info.world_size)
    _quiet_libraries(info)
    if recipe.engine.release_host_memory and not release_freed_memory():
        dist.print0(
            "accord: warning: engine.release_host_memory: this C library is not glibc's; "
            "host memory is managed as usual"
        )
    stop = stop or StopRequest().install()
    device = select_device(recipe.engine, info.local_rank)
    restart = dist.restart_count()
    # Under an outer launcher: the node's own watcher, started by its local rank 0 (none under accord's).
    node = watch_node(recipe.engine.hang_timeout_s, info, restart, recipe.output.dir, nccl=device.type == "cuda")
    heartbeat.start(recipe.engine.hang_timeout_s, info.rank, info.local_rank, info.world_size, restart)
    if device.type == "cuda" and heartbeat.DUMP_DIR_ENV not in os.environ:  # the watchdog's are set
        heartbeat.enable_flight_recorder(recipe.output.dir, pipe=False)  # dumped on torch's timeout
    clean = False
    try:
        dist.init(device)
        from accord.launch import refusal_relay as refusals

        refusals.stop_watching()  # every rank met: from here on a stop is agreed collectively
        try:
            result = _run(recipe, plan, info, device, stop)
        except TrainingStopped as e:
            # Every rank raises this together (the cause is agreed collectively), so the
            # shutdown can still be orderly.
            if info.leads_node:  # on every node, so each node's log says why it stopped
                print(f"accord: error: {e}", file=sys.stderr, flush=True)
            result = RunResult(e.status, -1, message=str(e))
        clean = True
        out_dir = Path(recipe.output.dir)
        if info.is_main and result.status != "refused" and out_dir.is_dir():
            write_run_status(out_dir, result.status, result.step if result.step >= 0 else None)
        return result
    finally:
        # After an unexpected error a peer may never reach the barrier: only tear down.
        try:
            dist.shutdown(clean=clean)
        finally:
            if node is not None:  # every local rank has left the loop: its watcher can go
                node.close()


def _run(recipe: Recipe, plan: BatchPlan, info: dist.DistInfo, device, stop: StopRequest) -> RunResult:
    restarted = dist.restart_count() > 0
    folder, recipe_yaml = Path(recipe.output.dir), recipe_to_yaml(recipe)
    source = verified_resume_source(folder, recipe.resume, info, restarted=restarted)  # before anything is written
    out_dir = None
    if info.is_main:
        out_dir = prepare_output_dir(folder, recipe_yaml)
        write_run_status(out_dir, "running")
        for stale in incomplete_checkpoints(out_dir / CHECKPOINTS):
            dist.print0(f"accord: ignoring incomplete checkpoint {stale} (a crash while writing it); removing it")
            shutil.rmtree(stale, ignore_errors=True)
    if restarted:
        dist.print0(f"accord: worker group restarted ({dist.restart_count()} of {recipe.engine.max_restarts})")
    dist.barrier()
    source = _node_folders(folder, recipe_yaml, info, source)
    trackers = _start_trackers(recipe.observe, folder, recipe.model_dump(mode="json"), info, source)
    try:
        dist.print0("accord: loading model…")
        with _refused_on_every_rank():
            run = build_run(recipe, plan, info, device)
        _describe(run, info, out_dir, recipe.checkpoint.keep_last)
    except BaseException:
        for tracker in trackers or []:  # the run never started: its tracker runs end as failed
            tracker.finish({}, "failed")
        raise
    trainer = Trainer(run, trackers)
    ended = "failed"
    try:
        if source is not None:
            trainer.restore(source)
            from accord.checkpoint.lr_on_resume import apply_on_resume

            apply_on_resume(run, source, trainer.step)  # a changed train.max_steps: say and apply optim.extend
        result = trainer.train(stop, after_first_step=(lambda: _discard_earlier_run(out_dir)) if info.is_main else None)
        if result.status == "completed":
            final = trainer.save()
            if info.is_main:
                dist.print0(f"accord: outputs in {out_dir}/ ({_outputs(recipe, out_dir, final)})")
        ended = result.status
        return result
    except TrainingStopped:  # a non-finite loss, a failed checkpoint write: said on stderr
        ended = "stopped"
        raise
    finally:
        trainer.close(ended)


@contextmanager
def _refused_on_every_rank():
    """What stops the run's assembly in one line (bad data, weights that do not fit the
    config) is met by every rank alike: the run stops or is refused, with no traceback."""
    try:
        yield
    except DataError as e:
        raise TrainingStopped(str(e)) from None
    except UserInputError as e:
        raise StartRefused(str(e)) from None


def _describe(run, info: dist.DistInfo, out_dir: Path | None, keep_last: int) -> None:
    """The run's lines (model, layout, batch, data), and on rank 0 whether output.dir has
    room for checkpoint.keep_last checkpoints."""
    for line in describe(run):
        dist.print0(line)
    if info.is_main:
        warning = disk_space_warning(out_dir, run.model.num_params, run.model.trainable, keep_last)
        if warning:
            dist.print0(f"accord: warning: {warning}")


def _start_trackers(observe: ObserveConfig, out_dir: Path, config: dict, info: dist.DistInfo, source):
    """Rank 0 opens observe.report_to's trackers (`config`: the resolved recipe they record)
    before the model is built; one that cannot start (a bad MLFLOW_TRACKING_URI, an unknown
    WANDB_MODE) refuses the run on every rank."""
    trackers, refusal = None, None
    if info.is_main:
        try:
            step = read_state(source).step if source is not None else 0
            trackers = start_trackers(observe, out_dir, config, step)
        except TrackerStartError as e:
            refusal = str(e)
    refusal = dist.broadcast_object(refusal)
    if refusal:
        raise StartRefused(refusal)
    return trackers


def _outputs(recipe: Recipe, out_dir: Path, final: Path) -> str:
    """Where the run's outputs are, for its last line."""
    where = {
        "tensorboard": f"TensorBoard: {out_dir}/tensorboard",
        "mlflow": "MLflow: " + os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{out_dir}/mlflow.db"),
        "wandb": f"W&B: {os.environ.get('WANDB_DIR', out_dir)}/wandb",
        "trackio": f"Trackio: {os.environ.get('TRACKIO_DIR', out_dir / 'trackio')}",
    }
    named = [where[name] for name in recipe.observe.report_to]
    return ", ".join(
        [
            f"final model: {final}/",
            f"checkpoints: {out_dir}/{CHECKPOINTS}/",
            f"metrics: {out_dir}/metrics.jsonl",
            *named,
        ]
    )


def _discard_earlier_run(out_dir) -> None:
    """The run has proven it trains: the earlier run that --overwrite set aside can go."""
    if discard_earlier_run(out_dir):
        dist.print0(f"accord: first step done: removed the earlier run that --overwrite had set aside in {out_dir}")


def _node_folders(out_dir: Path, recipe_yaml: str, info: dist.DistInfo, source):
    """Multi-node: find whether the nodes share output.dir (collective); with a folder per
    node, each node's leader prepares its own (with recipe.yaml), and every node resumes from
    the checkpoint rank 0 chose, in its own folder. The checkpoint source, agreed."""
    layout = nodefolders.detect(out_dir, info)
    line = nodefolders.describe(layout)
    if line:
        dist.print0(f"accord: {line}")
    if layout.leader and not info.is_main:
        prepare_output_dir(out_dir, recipe_yaml)
        for stale in incomplete_checkpoints(out_dir / CHECKPOINTS):
            shutil.rmtree(stale, ignore_errors=True)
    try:
        return nodefolders.agreed_source(source, out_dir, info)
    except CheckpointError as e:
        raise TrainingStopped(str(e)) from None


def _quiet_libraries(info: dist.DistInfo) -> None:
    """accord draws its own progress bar; libraries' bars and per-rank chatter are noise."""
    hf_logging.disable_progress_bar()
    if not info.is_main:
        hf_logging.set_verbosity_error()
