"""Start a training run from a validated Recipe, as the steps of a launch: plan (the nodes, the
output folder's lock, the launcher's settings, the batch plan, the hub commits: launch/plan.py),
hold the output folder once the checks passed, check (where the plan says), run (spawn the
workers, Ray's, or train here), leave. `accord.train` and `accord train` both come here; the
recipe is not validated again on the way."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from accord.errors import UserInputError
from accord.launch import agent, ray_train
from accord.launch import refusal_relay as refusals
from accord.launch.agent import Interrupted, PendingChecks
from accord.launch.fork_call import call_in_fork
from accord.launch.plan import ChecksRun, LaunchPlan, Where, run_checks
from accord.launch.planning import plan_launch
from accord.launch.worker_start import WorkerChecks
from accord.observe.progress import announce
from accord.output.folder import (
    check_output_dir,
    earlier_run,
    remove_refused_run,
    restore_earlier_run,
    set_aside_earlier_run,
)
from accord.output.lock import acquire
from accord.recipe.schema import OutputConfig, Recipe

__all__ = ["Ended", "Where", "start"]


@dataclass(frozen=True)
class Ended:
    """How the run ended: status completed | preempted | stopped | refused, and for preempted
    where the run can continue from."""

    status: str
    message: str = ""


_THIS_NODE = Where()  # the flags left out: the environment's nodes, or SLURM's, or this one


def start(recipe: Recipe, where: Where = _THIS_NODE, resume_requested: bool = False) -> Ended:
    """Train `recipe` (validated) on this node: every check before any worker trains or
    anything is written, then the workers (or this process as the worker).

    resume_requested: --resume (refused when there is nothing to continue from).
    Raises a UserInputError naming what to fix, WorkerFailed, or Interrupted."""
    if resume_requested:
        _check_something_to_resume(recipe.output, recipe.resume)
    plan = plan_launch(recipe, where)
    hold = _OutputHold(plan)
    refusals.watch(then=hold.refused_elsewhere)  # another node's refusal ends this node's part too
    ray_session = None
    try:
        pending, ray_session = _check(plan, hold)
        refusals.launching()
        status = ray_session.run() if ray_session else agent.run(plan, pending)
        hold.refused = status == "refused"
    except Interrupted as e:
        raise Interrupted(f"{e}; {_resume_hint(plan.out_dir)}") from None
    finally:
        _leave(plan, hold, ray_session)
    return Ended(status, f"stopped early on request; {_resume_hint(plan.out_dir)}" if status == "preempted" else "")


def _check(plan: LaunchPlan, hold: _OutputHold) -> tuple[PendingChecks | None, ray_train.RaySession | None]:
    """The checks, where the plan runs them, then the hold on the output folder: raises a
    UserInputError with their problems. Run in the first worker, they are still pending when
    the workers start (they pass their gate once the checks passed and the folder is held)."""
    if plan.checks is ChecksRun.FIRST_WORKER:
        return WorkerChecks(then=hold.enter), None
    if plan.checks is ChecksRun.FORKED_CHILD:
        problems = call_in_fork(run_checks, plan)
    else:
        problems = run_checks(plan, keep_for_run=plan.trains_here)  # the run takes what they built
    session = None
    if not problems and plan.launcher == "ray":
        # Before Ray starts its threads here (fork copies one thread), then Ray, refused if it
        # cannot hold the workers.
        session = ray_train.RaySession(plan)
    problems = problems or hold.enter()
    if problems:
        if session is not None:
            session.close()
        raise UserInputError("\n".join(problems))
    return None, session


def _leave(plan: LaunchPlan, hold: _OutputHold, ray_session: ray_train.RaySession | None) -> None:
    """However the run ended: the output folder's hold released (an earlier run put back where
    this one never stepped), the node's hub handoff file and a Trainer checkpoint brought in
    removed, a Ray started here stopped."""
    hold.leave()
    if plan.hub_handoff is not None and plan.holder.locks:
        Path(plan.hub_handoff).unlink(missing_ok=True)
    if plan.brought_in is not None and plan.holder.locks:
        shutil.rmtree(Path(plan.brought_in).parent, ignore_errors=True)
    if ray_session:
        ray_session.close()


def _check_something_to_resume(output: OutputConfig, resume: str) -> None:
    """--resume asks to continue a run: with nothing to continue, a typo in output.dir would
    otherwise start a fresh (maybe days-long) run. `resume: auto` in a recipe starts fresh."""
    from accord.checkpoint.store import CHECKPOINTS, latest_checkpoint  # the checkpoint format: only for --resume

    out_dir = Path(output.dir)
    if resume != "auto" or latest_checkpoint(out_dir) is not None:
        return
    where = (
        f"{out_dir} does not exist" if not out_dir.exists() else f"no complete checkpoint in {out_dir}/{CHECKPOINTS}"
    )
    raise UserInputError(
        f"--resume: nothing to resume ({where}); check output.dir=..., or leave out --resume to start a fresh run"
    )


class _OutputHold:
    """The run's hold on output.dir, taken only once the checks passed (a bad input leaves
    no folder and no lock behind) and before any worker is let through its gate: the lock,
    and for --overwrite the earlier run set aside. The workers delete the set-aside run
    after their first good step; if the run ends before that, `leave` puts it back."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.recipe, self.run_id = plan.recipe, plan.run_id
        self.locks_here, self.writer = plan.holder.locks, plan.holder.writes
        self.out_dir = plan.out_dir
        self.lock = None
        self.set_aside = False
        self.fresh = False  # output.dir held no run when this one took it
        self.refused = False  # the workers refused the run before its first step

    def enter(self) -> list[str]:
        if self.locks_here:
            self.lock = acquire(self.out_dir, self.run_id)
        if not self.writer:
            return []
        # Checked again under the lock: another run may have finished here since the checks.
        problems = check_output_dir(self.recipe.output, self.recipe.resume, self.run_id)
        if problems:
            return problems
        self.fresh = not earlier_run(self.out_dir)
        if self.recipe.output.overwrite and set_aside_earlier_run(self.out_dir):
            self.set_aside = True
            announce(
                f"--overwrite: the earlier run is set aside in {self.out_dir}/.previous-run "
                "until this run completes a step"
            )
        return []

    def refused_elsewhere(self) -> None:
        self.refused = True
        self.leave()

    def leave(self) -> None:
        try:
            if self.refused and self.fresh:
                remove_refused_run(self.out_dir)
            if self.set_aside and restore_earlier_run(self.out_dir):
                announce(
                    f"the run ended before its first good step: the earlier run in {self.out_dir} is back as it was"
                )
        finally:
            if self.lock is not None:
                self.lock.release()


def _resume_hint(out_dir: Path) -> str:
    from accord.checkpoint.resume import resume_hint  # the checkpoint format's imports: only when needed

    return resume_hint(out_dir)
