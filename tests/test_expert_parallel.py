"""Expert parallelism (engine.expert_parallel): each MoE layer's experts split over groups of N
consecutive ranks, the tokens dispatched to them and combined with transformers' all-to-all, the
rest of the model data-parallel over every rank (ddp or fsdp). The contract holds: the ranks of
an EP group take different rows, and fp32 runs with the balancing loss on end with the
1-process run's parameters and losses; checkpoints resume across layouts and onto ddp, and the
export is a plain transformers MoE model. What cannot be split is refused in one line before any
worker starts."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from accord.recipe.schema import RecipeError, validate_recipe
from conftest import MOE_CONFIG, assert_ok, final_params, max_param_diff, moe_recipe, records, run_accord, step_losses

TOLERANCE = 1e-5


def _recipe(lora: dict | None = None, **changes):
    raw = moe_recipe()
    raw["engine"] = raw["engine"] | {"expert_parallel": 2}
    for key, value in changes.items():
        if key == "task":
            raw["task"] = value
        else:
            raw["engine"][key] = value
    if lora:
        raw["lora"] = lora
    return validate_recipe(raw)


# ---------------------------------------------------------------- unit: refusals, plan, doctor


@pytest.mark.parametrize(
    "change, message",
    [
        ({"strategy": "zero3"}, "composes with engine.strategy=ddp or fsdp"),
        ({"tensor_parallel": 2}, "with engine.tensor_parallel=2 is not supported yet"),
        ({"pipeline_parallel": 2}, "with engine.pipeline_parallel=2 is not supported yet"),
        ({"sequence_parallel": 2}, "with engine.sequence_parallel=2 is not supported yet"),
        ({"tiled_mlp": 2}, "with engine.tiled_mlp is not supported"),
        ({"task": "dpo"}, "supports task sft and pretrain, not dpo"),
        ({"lora": {"r": 4}}, "with lora is not supported yet (peft's adapters on the fused experts are not split)"),
    ],
)
def test_combinations_expert_parallelism_cannot_carry_are_one_line_recipe_errors(change, message):
    with pytest.raises(RecipeError) as error:
        _recipe(**change)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_experts_world_dense_models_and_plans_are_checked_against_n():
    """Before any worker starts, from the model's config (no weights)."""
    from transformers import AutoConfig

    from accord.engine.expert_parallel import check_expert_parallel
    from accord.launch.preflight import check_expert_parallel as preflight_check

    recipe = _recipe()
    settings = {k: v for k, v in MOE_CONFIG.items() if k != "architecture"}
    config = AutoConfig.for_model("qwen3_moe", **settings)
    assert (
        check_expert_parallel(recipe.engine.expert_parallel, config, 2)
        == check_expert_parallel(recipe.engine.expert_parallel, config, 4)
        == []
    )
    [line] = check_expert_parallel(recipe.engine.expert_parallel, config, 3)
    assert line.startswith("engine.expert_parallel=2 does not divide the 3 processes")
    three = AutoConfig.for_model("qwen3_moe", **(settings | {"num_experts": 3}))
    [line] = check_expert_parallel(recipe.engine.expert_parallel, three, 2)
    assert line == "engine.expert_parallel=2 must divide the model's 3 experts per layer; set it to 1"
    [line] = check_expert_parallel(recipe.engine.expert_parallel, three, 6)
    assert line == "engine.expert_parallel=2 must divide the model's 3 experts per layer; use 3 or 1"
    dense = AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4)
    [line] = check_expert_parallel(recipe.engine.expert_parallel, dense, 2)
    assert line.startswith("engine.expert_parallel=2: LlamaConfig is a dense model (no routed experts")
    no_plan = AutoConfig.for_model("qwen3_moe", **settings)
    no_plan.base_model_ep_plan = None
    [line] = check_expert_parallel(recipe.engine.expert_parallel, no_plan, 2)
    assert "has no expert-parallel plan accord can run" in line
    # the preflight reads the recipe's own model config
    assert preflight_check(recipe, 2) == []
    [line] = preflight_check(recipe, 3)
    assert line.startswith("engine.expert_parallel=2 does not divide the 3 processes")


def test_plan_counts_each_ranks_experts():
    """ddp under EP holds E/N experts whole; fsdp shards them over the ranks holding the same
    experts, which is the unsplit model's share over the world."""
    from accord import api

    plain = {r.strategy: r for r in api.plan(_recipe(expert_parallel=1), gpus=4).rows}
    split = api.plan(_recipe(), gpus=4)
    rows = {r.strategy: r for r in split.rows}
    assert sorted(rows) == ["ddp", "fsdp"]
    settings = {k: v for k, v in MOE_CONFIG.items() if k != "architecture"}
    # 2 layers × (gate_up 4×64×32 + down 4×32×32) fp32 expert values; ddp keeps half of them
    experts = 2 * (4 * 2 * settings["moe_intermediate_size"] * 32 + 4 * 32 * settings["moe_intermediate_size"]) * 4
    assert plain["ddp"].params - rows["ddp"].params == experts // 2
    assert rows["fsdp"].params == pytest.approx(plain["fsdp"].params, rel=0.05)
    assert rows["ddp"].expert_shards == 2
    from accord.planner.estimate import expert_line

    assert expert_line(split.rows).startswith("accord: expert parallel: each rank holds 2 experts of each MoE layer")


def test_doctor_checks_where_each_ep_group_lies_and_self_tests_against_one_process_without_it():
    from accord.cli.doctor import FAIL, OK, WARN, expert_parallel_line, one_process

    assert one_process(_recipe()) == ["engine.expert_parallel=1"]
    assert one_process(_recipe(expert_parallel=1)) == []
    assert expert_parallel_line(2, 4, 8).verdict == OK
    assert expert_parallel_line(4, 2, 4).verdict == WARN  # all-to-all over the network: slower, not wrong
    assert expert_parallel_line(4, 4, 6).verdict == FAIL


# ---------------------------------------------------------------- ep=2 on 2 processes against 1 process


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory, moe_reference) -> dict[str, Path]:
    """The tiny Qwen3-MoE with its balancing and z-loss on: 1 process × 8 × 4 (the session's
    moe_reference), and expert_parallel=2 on 2 processes × 4 × 4 (each rank holding 2 of the 4
    experts of each layer)."""
    recipe, one = moe_reference
    out = tmp_path_factory.mktemp("ep") / "ep2"
    overrides = ["engine.processes=2", "engine.expert_parallel=2", "batch.micro_batch_size=4"]
    assert_ok(run_accord("train", recipe, f"output.dir={out}", "checkpoint.every_steps=2", *overrides))
    return {"recipe": recipe, "one": one, "ep2": out}


@pytest.mark.distributed
def test_ep2_on_2_processes_trains_as_one_process(ep_runs):
    one, ep2 = ep_runs["one"], ep_runs["ep2"]
    assert max_param_diff(final_params(one), final_params(ep2)) <= TOLERANCE
    losses_one, losses_ep = step_losses(one), step_losses(ep2)
    assert max(abs(losses_one[s] - losses_ep[s]) for s in losses_one) <= TOLERANCE
    for a, b in zip(records(one, "train"), records(ep2, "train"), strict=True):
        for key in ("router_balance_loss", "router_z_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


@pytest.mark.distributed
def test_ep2_checkpoint_holds_whole_experts_by_name(ep_runs):
    """DCP records each expert tensor's global shape: any layout reads back what it needs."""
    from accord.engine.state import stored_keys

    stored = stored_keys(ep_runs["ep2"] / "checkpoints" / "step-000002")
    shape, _ = stored["model.model.layers.0.mlp.experts.gate_up_proj"]
    assert tuple(shape) == (4, 2 * MOE_CONFIG["moe_intermediate_size"], MOE_CONFIG["hidden_size"])
    assert "optim.model.layers.1.mlp.experts.down_proj.exp_avg" in stored


@pytest.mark.distributed
def test_plan_predicts_an_ep_ranks_parameters_and_optimizer_state(ep_runs):
    """What `accord plan` says rank 0 holds under ddp x ep2 is what the run's engine held."""
    from accord import api

    [held] = records(ep_runs["ep2"], "model_state")
    [ddp] = [r for r in api.plan(_recipe(), gpus=2).rows if r.strategy == "ddp"]
    assert (ddp.params, ddp.optimizer) == (held["params_bytes"], held["optimizer_bytes"])
    [whole] = records(ep_runs["one"], "model_state")
    assert held["params_bytes"] < whole["params_bytes"]


@pytest.mark.distributed
def test_ep2_final_folder_is_a_plain_transformers_moe_with_the_trained_logits(ep_runs):
    from transformers import AutoModelForCausalLM

    one, ep2 = (AutoModelForCausalLM.from_pretrained(ep_runs[n] / "final") for n in ("one", "ep2"))
    assert type(ep2).__name__ == "Qwen3MoeForCausalLM"
    assert ep2.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4  # every expert, gathered
    ids = torch.tensor([[257, 49, 50, 43, 51, 61]])
    with torch.no_grad():
        torch.testing.assert_close(one(ids).logits, ep2(ids).logits, rtol=0, atol=1e-4)


# ---------------------------------------------------------------- 4 processes and resumes (slow)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy", ["fsdp", pytest.param("ddp engine.activation_checkpointing=true", id="ddp-checkpointing")]
)
def test_dp2_by_ep2_on_4_processes_trains_as_one_process(ep_runs, tmp_path, strategy):
    """fsdp x ep: the experts sharded over the 2 ranks holding the same ones, the rest over all 4;
    ddp x ep with each layer recomputed in backward (its all-to-alls run again there)."""
    out = tmp_path / "run"
    strategy, *more = strategy.split()
    overrides = ["engine.processes=4", "engine.expert_parallel=2", "batch.micro_batch_size=2", *more]
    assert_ok(run_accord("train", ep_runs["recipe"], f"output.dir={out}", f"engine.strategy={strategy}", *overrides))
    assert max_param_diff(final_params(ep_runs["one"]), final_params(out)) <= TOLERANCE
    losses_one, losses = step_losses(ep_runs["one"]), step_losses(out)
    assert max(abs(losses_one[s] - losses[s]) for s in losses_one) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(["engine.processes=2", "batch.micro_batch_size=4"], id="ddp-on-2"),
        pytest.param(["engine.processes=1"], id="ddp-on-1"),
        pytest.param(
            ["engine.processes=4", "engine.expert_parallel=4", "engine.strategy=fsdp", "batch.micro_batch_size=2"],
            id="fsdp-ep4-on-4",
        ),
    ],
)
def test_an_ep2_checkpoint_resumes_under_another_layout(ep_runs, tmp_path, layout):
    checkpoint = ep_runs["ep2"] / "checkpoints" / "step-000002"
    out = tmp_path / "resumed"
    assert_ok(run_accord("train", ep_runs["recipe"], f"resume={checkpoint}", f"output.dir={out}", *layout))
    assert max_param_diff(final_params(ep_runs["one"]), final_params(out)) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.distributed
def test_a_one_process_checkpoint_resumes_under_ep2(ep_runs, tmp_path):
    checkpoint = ep_runs["one"] / "checkpoints" / "step-000002"
    out = tmp_path / "resumed"
    overrides = ["engine.processes=2", "engine.expert_parallel=2", "batch.micro_batch_size=4"]
    assert_ok(run_accord("train", ep_runs["recipe"], f"resume={checkpoint}", f"output.dir={out}", *overrides))
    assert max_param_diff(final_params(ep_runs["one"]), final_params(out)) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.subprocess
def test_ep_on_a_dense_model_stops_accord_train_in_one_line(tmp_path):
    from conftest import TINY_RECIPE, write_recipe

    recipe = copy.deepcopy(TINY_RECIPE)
    recipe["engine"] |= {"expert_parallel": 2}
    proc = run_accord("train", write_recipe(tmp_path / "dense.yaml", recipe), f"output.dir={tmp_path / 'out'}")
    assert proc.returncode == 2
    assert "engine.expert_parallel=2: LlamaConfig is a dense model" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()
