"""Pipeline parallelism (engine.pipeline_parallel) on torch.distributed.pipelining: the decoder
layers split into stages, a step's BatchPlan micro-batches run through torch's schedule with
accord's loss (summed token losses over the global batch's targets, the schedule's own
per-micro-batch scaling off). The contract holds: a pp=2 run ends with the 1-process run's
parameters and losses, resumes on 1 process, and its final/ is a plain transformers model with
the trained logits; what it cannot run yet is refused in one line before any worker starts."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from accord.distributed.batch_plan import BatchPlan
from accord.recipe.schema import RecipeError, validate_recipe
from conftest import (
    TINY_RECIPE,
    assert_ok,
    final_params,
    max_param_diff,
    recipe_for,
    run_accord,
    run_accord_here,
    step_losses,
    write_recipe,
)

TOLERANCE = 1e-5
LAYERS = 4


def _raw(**engine) -> dict:
    """TINY_RECIPE with 4 decoder layers and no held-out split (evaluation does not run
    through the stages yet)."""
    raw = copy.deepcopy(TINY_RECIPE)
    raw["model"]["config"]["num_hidden_layers"] = LAYERS
    raw["data"]["generate"]["eval_examples"] = 0
    raw["engine"] |= engine
    return raw


def _recipe(task: str | None = None, lora: dict | None = None, **engine):
    raw = _raw(**engine)
    if task:
        raw["task"] = task
    if lora:
        raw["lora"] = lora
    return validate_recipe(raw)


def _tiny_llama(layers: int = LAYERS, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        **over,
    )
    return LlamaForCausalLM(config).eval()


# ---------------------------------------------------------------- unit: plan, refusals, stages


def test_batch_plan_counts_pipelines_as_data_parallel_groups():
    plan = BatchPlan.derive(32, 8, 4, pipeline_parallel=2)
    assert (plan.world_size, plan.processes, plan.grad_accum) == (2, 4, 2)
    assert [plan.data_rank(r) for r in range(4)] == [0, 0, 1, 1]  # a pipeline's ranks take the same rows
    assert "2 data-parallel groups of 2 processes (pipeline parallel)" in plan.describe()
    recipe = _recipe(pipeline_parallel=2)
    assert BatchPlan.of(recipe.batch, recipe.engine, 2).pipeline_parallel == 2


def test_the_logged_padding_is_each_pipelines_rows_at_their_longest():
    import numpy as np

    from accord.run.pipeline_step import pipeline_padded

    plan = BatchPlan.derive(4, 1, 4, pipeline_parallel=2)  # 2 pipelines of 2 rows each
    lengths = np.array([5, 9, 3, 4])
    assert pipeline_padded(plan, lengths, np.array([0, 1, 2, 3])) == 2 * 9 + 2 * 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"strategy": "zero3"}, "composes with engine.strategy=ddp or fsdp"),
        ({"task": "dpo"}, "supports task sft and pretrain, not dpo"),
        ({"lora": {"r": 4}}, "with lora is not supported yet"),
        ({"tensor_parallel": 2}, "with engine.tensor_parallel=2 is not supported yet"),
        ({"sequence_parallel": 2}, "with engine.sequence_parallel=2 is not supported yet"),
        ({"pipeline_stages_per_rank": 2}, "pipeline_schedule=1f1b, which runs one stage per rank"),
        ({"pipeline_schedule": "zbv", "pipeline_stages_per_rank": 3}, "places exactly 2 stages per rank"),
        ({"compile": True}, "with engine.compile is not supported yet"),
    ],
)
def test_combinations_pipelining_cannot_carry_are_one_line_recipe_errors(change, message):
    with pytest.raises(RecipeError) as error:
        _recipe(pipeline_parallel=2, **change)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_command_refuses_a_task_the_schedule_cannot_run_in_one_line(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", _raw())
    proc = run_accord_here("train", recipe, "engine.pipeline_parallel=2", "task=dpo", f"output.dir={tmp_path / 'o'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if "pipeline_parallel" in x]
    assert "supports task sft and pretrain, not dpo" in line and not (tmp_path / "o").exists()


def test_held_out_data_and_schedule_keys_without_pipelining_are_refused():
    raw = _raw(pipeline_parallel=2)
    raw["data"]["generate"]["eval_examples"] = 8
    with pytest.raises(RecipeError, match=r"data.generate.eval_examples is not supported yet .* set it to 0"):
        validate_recipe(raw)
    with pytest.raises(RecipeError, match=r"engine.pipeline_schedule applies to pipeline parallelism"):
        _recipe(pipeline_schedule="gpipe")
    assert _recipe(pipeline_parallel=2, pipeline_schedule="interleaved-1f1b").engine.stages_per_rank == 2


def test_model_and_schedule_checks_say_what_to_change():
    from transformers import LlamaConfig

    from accord.engine.pipeline.stages import check_pipeline

    config = LlamaConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4)
    assert check_pipeline(_recipe(pipeline_parallel=2).engine, config, 4) == []
    [line] = check_pipeline(_recipe(pipeline_parallel=3, processes=3).engine, config, 4)
    assert line.startswith("engine.pipeline_parallel=3: the model's 4 decoder layers do not split evenly into 3 stages")
    assert "use engine.pipeline_parallel=2 or 4" in line
    [line] = check_pipeline(
        _recipe(pipeline_parallel=2).engine, LlamaConfig(num_hidden_layers=4, tie_word_embeddings=True)
    )
    assert "tie_word_embeddings" in line and "not supported yet" in line
    [line] = check_pipeline(_recipe(pipeline_parallel=2).engine, SimpleNamespace(num_hidden_layers=4))
    assert "has no pipeline plan" in line
    [line] = check_pipeline(_recipe(pipeline_parallel=2).engine, config, 1)
    assert "the 1f1b schedule needs at least 2 micro-batches per step" in line
    assert check_pipeline(_recipe(pipeline_parallel=2, pipeline_schedule="gpipe").engine, config, 1) == []
    [line] = check_pipeline(_recipe(pipeline_parallel=2, pipeline_schedule="zbv", processes=4).engine, config, 2, 2)
    assert "pipeline_schedule=zbv over 2 pipelines (data parallelism) is not supported yet" in line
    assert check_pipeline(_recipe(pipeline_parallel=2, pipeline_schedule="zbv").engine, config, 2, 1) == []


def test_the_preflight_reads_the_recipes_model_config_for_the_split():
    from accord.launch.preflight import check_pipeline_parallel

    [line] = check_pipeline_parallel(_recipe(pipeline_parallel=3, processes=3), 4)
    assert line.startswith("engine.pipeline_parallel=3: the model's 4 decoder layers do not split evenly into 3 stages")
    assert check_pipeline_parallel(_recipe(pipeline_parallel=2), 4) == []


def test_stages_keep_the_whole_models_names_and_owners():
    from accord.engine.pipeline.schedule import rank_stages, theoretical_bubble
    from accord.engine.pipeline.stages import keep_stages, owner_stage

    names = set(_tiny_llama().state_dict())
    kept = []
    for stage in range(2):
        model = _tiny_llama()
        keep_stages(model, [stage], 2)
        kept.append(set(model.state_dict()))
        assert all(owner_stage(n, LAYERS, 2) == stage for n in kept[-1])
    assert kept[0] | kept[1] == names and not kept[0] & kept[1]
    assert "model.embed_tokens.weight" in kept[0] and {"lm_head.weight", "model.norm.weight"} <= kept[1]
    assert rank_stages("interleaved-1f1b", 1, 2, 2) == [1, 3] and rank_stages("zbv", 0, 2, 2) == [0, 3]
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)


def test_plan_gives_each_pipeline_rank_its_stages_state_and_micro_batches_in_flight():
    from accord.planner.estimate import plan, recommend

    whole = {r.strategy: r for r in plan(_recipe(), 2)[0]}["ddp"]
    rows, world = plan(_recipe(pipeline_parallel=2), 2)
    assert [r.strategy for r in rows] == ["ddp:0", "ddp:1"] and world == 2
    assert sum(r.params for r in rows) == pytest.approx(whole.params)  # each parameter on one rank
    assert all(r.params < whole.params for r in rows)
    # 1f1b: rank 0 keeps 2 micro-batches in flight, rank 1 one (plus the whole logits of each).
    assert rows[0].grad_accum == 4 and rows[0].activations > 0 and rows[1].activations > 0
    sharded = plan(_recipe(pipeline_parallel=2, strategy="fsdp", processes=4), 4)[0]
    assert [r.strategy for r in sharded] == ["fsdp:0", "fsdp:1"]
    assert sharded[0].params < rows[0].params  # each stage sharded over the 2 pipelines
    assert recommend(rows, _recipe(pipeline_parallel=2), 2, 1.0, "GPU").startswith("pipeline rank ")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_stage_modules_in_a_chain_give_the_models_logits(packed):
    from accord.engine.pipeline.stages import StageModule, stage_layers
    from accord.tasks.causal import block_causal_mask, packed_position_ids

    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 12))
    if packed:  # two documents in the first row, as accord packs them
        inputs = {
            "attention_mask": block_causal_mask([[5, 7], [12]], 12, float_mask=False),
            "position_ids": packed_position_ids([[5, 7], [12]], 12),
        }
    else:
        inputs = {"attention_mask": torch.tensor([[1] * 12, [1] * 9 + [0] * 3])}
    expected = model(input_ids=ids, **inputs).logits
    split = stage_layers(LAYERS, 4)
    # The stage modules read the layers by index: a ModuleDict as after keep_stages.
    model.model.layers = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(model.model.layers)})
    stages = [StageModule(model, split[s], s == 0, s == 3, torch.float32) for s in range(4)]
    out = ids
    for stage in stages:
        out = stage(out, **inputs)
    real = (inputs["attention_mask"].reshape(2, -1)[:, :12] != 0) if not packed else torch.ones(2, 12, dtype=bool)
    assert (out - expected)[real].abs().max().item() < 1e-5


def test_the_schedule_with_accords_loss_gives_the_gradient_of_one_backward_over_the_global_batch():
    """Two stages on one process (interleaved 1F1B, 4 micro-batches): the gradient equals a
    plain backward of the summed token loss over the whole batch divided by its targets, so
    the schedule's own per-micro-batch scaling is off."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from accord.engine.pipeline.stages import StageModule, keep_stages, stage_layers
    from accord.run.pipeline_step import causal_loss_sum

    store_group = not dist.is_initialized()
    if store_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reference, model = _tiny_llama(), _tiny_llama()
        ids = torch.randint(0, 64, (8, 10))
        labels = ids.clone()
        labels[:, :3] = -100
        targets = int((labels[:, 1:] != -100).sum())
        (causal_loss_sum(reference(input_ids=ids).logits, labels) / targets).backward()
        keep_stages(model, [0, 1], 2)
        split = stage_layers(LAYERS, 2)
        stages = [
            PipelineStage(StageModule(model, split[s], s == 0, s == 1, torch.float32), s, 2, torch.device("cpu"))
            for s in range(2)
        ]
        schedule = ScheduleInterleaved1F1B(
            stages, n_microbatches=4, loss_fn=lambda o, t: causal_loss_sum(o, t) / targets, scale_grads=False
        )
        losses: list[torch.Tensor] = []
        schedule.step(ids, target=labels, losses=losses, return_outputs=False)
        grads = dict(model.named_parameters())
        worst = max((grads[n].grad - p.grad).abs().max().item() for n, p in reference.named_parameters())
        assert worst < 1e-6, worst
    finally:
        if store_group:
            dist.destroy_process_group()


# ---------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory) -> SimpleNamespace:
    """One pp=2 run on 2 processes (checkpoint at step 5) and the same recipe on 1 process."""
    root = tmp_path_factory.mktemp("pipeline")
    recipe = write_recipe(root / "pp.yaml", _raw())
    one, pp2 = root / "one", root / "pp2"
    assert_ok(run_accord("train", recipe, "engine.processes=1", f"output.dir={one}"))
    proc = run_accord("train", recipe, "engine.pipeline_parallel=2", "checkpoint.every_steps=5", f"output.dir={pp2}")
    assert_ok(proc)
    return SimpleNamespace(recipe=recipe, one=one, pp2=pp2, proc=proc)


@pytest.mark.distributed
def test_pp2_on_2_processes_ends_with_the_one_process_parameters_and_losses(pp_runs):
    assert "1 data-parallel group of 2 processes (pipeline parallel) × 8 sequences × 4" in pp_runs.proc.stderr
    assert max_param_diff(final_params(pp_runs.one), final_params(pp_runs.pp2)) <= TOLERANCE
    one, pp2 = step_losses(pp_runs.one), step_losses(pp_runs.pp2)
    assert one.keys() == pp2.keys() and all(abs(one[s] - pp2[s]) <= TOLERANCE for s in one)
    # Each rank wrote its stage's part of the checkpoint, keyed by the whole model's names.
    parts = sorted(p.name for p in (pp_runs.pp2 / "checkpoints" / "step-000005" / "state").glob("*.distcp"))
    assert parts == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.distributed
def test_pp2_final_folder_is_a_plain_transformers_model_with_the_trained_logits(pp_runs):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    for out in (pp_runs.one, pp_runs.pp2):
        model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
        assert model.config.num_hidden_layers == LAYERS
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    assert (logits[0] - logits[1]).abs().max().item() <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_checkpoint_resumes_on_one_process_and_continues_the_same_updates(pp_runs, tmp_path):
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(pp_runs.pp2 / "checkpoints", out / "checkpoints")
    resumed = out / "checkpoints" / "step-000005"
    proc = run_accord("train", pp_runs.recipe, "engine.processes=1", f"resume={resumed}", f"output.dir={out}")
    assert_ok(proc)
    assert max_param_diff(final_params(pp_runs.one), final_params(out)) <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["engine.pipeline_schedule=gpipe"],
        ["engine.pipeline_schedule=interleaved-1f1b"],
        ["engine.pipeline_schedule=zero-bubble"],
        ["engine.pipeline_schedule=zbv"],
        ["engine.strategy=fsdp", "engine.processes=4"],
        ["engine.strategy=ddp", "engine.processes=4"],
    ],
    ids=["gpipe", "interleaved-1f1b", "zero-bubble", "zbv", "fsdp-x-pp2-on-4", "ddp-x-pp2-on-4"],
)
def test_every_schedule_and_data_parallel_layout_matches_one_process(pp_runs, tmp_path, layout):
    out = tmp_path / "pp"
    assert_ok(run_accord("train", pp_runs.recipe, "engine.pipeline_parallel=2", *layout, f"output.dir={out}"))
    assert max_param_diff(final_params(pp_runs.one), final_params(out)) <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.slow
def test_pretraining_on_packed_text_under_pp2_matches_one_process(tmp_path):
    raw = recipe_for("pretrain", tmp_path / "data")
    raw["model"]["config"]["num_hidden_layers"] = LAYERS
    recipe = write_recipe(tmp_path / "pretrain.yaml", raw)
    one, pp2 = tmp_path / "one", tmp_path / "pp2"
    assert_ok(run_accord("train", recipe, "engine.processes=1", f"output.dir={one}"))
    assert_ok(run_accord("train", recipe, "engine.pipeline_parallel=2", f"output.dir={pp2}"))
    assert max_param_diff(final_params(one), final_params(pp2)) <= TOLERANCE
    one_losses, pp2_losses = step_losses(one), step_losses(pp2)
    assert all(abs(one_losses[s] - pp2_losses[s]) <= TOLERANCE for s in one_losses)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", [["engine.processes=2"], ["engine.strategy=fsdp", "engine.processes=4"]])
def test_bf16_stages_send_and_receive_in_the_dtype_they_compute(pp_runs, tmp_path, layout):
    """bf16 under ddp keeps an fp32 residual stream between stages, under fsdp over 2 pipelines
    FSDP2 computes in bf16: the receive buffers (and the gradients sent back) match either way."""
    out = tmp_path / "bf16"
    args = ["engine.pipeline_parallel=2", "engine.precision=bf16", "train.max_steps=4", *layout]
    assert_ok(run_accord("train", pp_runs.recipe, *args, f"output.dir={out}"))
    fp32, bf16 = step_losses(pp_runs.one), step_losses(out)
    assert all(abs(fp32[s] - bf16[s]) < 1e-2 for s in bf16), (fp32, bf16)
