"""The launch plan: decided once, before any check or worker, by the launcher where accord
starts the workers and by each worker where an outer launcher started it; handed to the
workers as data, the same plan on both sides."""

import pytest

from accord.launch.plan import ChecksRun, LaunchPlan, OutputHolder, Where
from accord.launch.planning import plan_launch
from accord.recipe.schema import validate_recipe
from conftest import TINY_RECIPE


def _recipe(tmp_path, **engine):
    return validate_recipe(TINY_RECIPE | {"engine": TINY_RECIPE["engine"] | engine, "output": {"dir": str(tmp_path)}})


def _torchrun_worker(monkeypatch, rank: int, world: int, local_world: int) -> None:
    # Set, then removed: monkeypatch puts back the absent value over what choose_gloo_interface writes.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    for name, value in {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % local_world),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "TORCHELASTIC_RUN_ID": "plan-test",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)


def test_accords_launcher_on_one_cpu_machine_lets_the_first_worker_check_and_hands_the_plan_over_as_is(tmp_path):
    plan = plan_launch(_recipe(tmp_path / "out", processes=2), Where())
    assert (plan.checks, plan.trains_here, plan.launcher, plan.world_size) == (
        ChecksRun.FIRST_WORKER,
        False,
        "accord",
        2,
    )
    assert plan.holder == OutputHolder(locks=True, writes=True)
    assert (plan.batch.world_size, plan.batch.grad_accum) == (2, 2)
    assert plan.hub_handoff is None and plan.topology.nnodes == 1
    assert LaunchPlan.from_json(plan.to_json()) == plan  # what the workers read is what was planned


def test_one_process_checks_and_trains_here(tmp_path):
    plan = plan_launch(_recipe(tmp_path / "out", processes=1), Where())
    assert (plan.checks, plan.trains_here, plan.world_size, plan.batch.grad_accum) == (ChecksRun.HERE, True, 1, 4)


def test_over_several_nodes_the_launcher_checks_in_a_forked_child(monkeypatch, tmp_path):
    from accord.launch import refusal_relay

    monkeypatch.setattr(refusal_relay, "_meeting", None)  # where the plan says the nodes meet: this test's only
    where = Where(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=29511)
    plan = plan_launch(_recipe(tmp_path / "out", processes=2), where)
    assert (plan.checks, plan.trains_here, plan.world_size) == (ChecksRun.FORKED_CHILD, False, 4)
    assert plan.holder == OutputHolder(locks=True, writes=False)  # node 1 locks its node, rank 0 writes


@pytest.mark.parametrize("rank, leads", [(0, True), (1, False)])
def test_under_torchrun_each_worker_plans_for_itself_and_the_nodes_first_rank_holds_the_lock(
    monkeypatch, tmp_path, rank, leads
):
    _torchrun_worker(monkeypatch, rank, world=2, local_world=2)
    recipe = _recipe(tmp_path / "out", processes=2)
    plan = plan_launch(recipe, Where())
    assert (plan.checks, plan.trains_here, plan.launcher, plan.world_size) == (ChecksRun.HERE, True, "torchrun", 2)
    assert plan.holder == OutputHolder(locks=leads, writes=rank == 0)
    assert plan.hub_handoff is not None and plan.run_id.startswith("launcher-")
    assert (plan.batch.world_size, plan.batch.grad_accum) == (2, 2)
