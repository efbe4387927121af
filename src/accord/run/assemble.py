"""Put a run together, in one direction: tokenizer -> task -> prepared data -> rows and
global order -> model (task hook, adapters) -> engine -> task setup. The result is a
RunSetup (accord.run.setup) that the Trainer only reads; nothing is set on the Trainer afterwards."""

from __future__ import annotations

import math

import numpy as np
import torch

from accord.data.order import GlobalOrder
from accord.data.split import held_out_warning
from accord.distributed import group as dist
from accord.distributed.batch_plan import BatchPlan
from accord.engine import build_engine
from accord.engine.spec import EngineSpec
from accord.models.build import apply_lora, build_model
from accord.models.moe import idle_expert_parameters
from accord.models.vision import freeze
from accord.observe.throughput import flops_per_token, peak_tflops
from accord.recipe.schema import Recipe, TrainConfig
from accord.run.inputs import build_inputs
from accord.run.setup import ModelFacts, RunSetup
from accord.tasks import groups_by_length, task_config
from accord.tasks.router_balance import balance_router
from accord.tasks.sequence_shards import SequenceShards


def build_run(recipe: Recipe, plan: BatchPlan, info: dist.DistInfo, device: torch.device) -> RunSetup:
    """The run of `recipe` on this rank; `plan` is the batch plan the process derived at its start."""
    # Under accord's own launcher the data is already prepared (a cache hit); under an
    # outer launcher each node's first process prepares it and the others wait. Where this
    # process ran the checks, they built these already.
    inputs = build_inputs(task_config(recipe), preparer=info.leads_node)
    tokenizer, task, data, rows = inputs.tokenizer, inputs.task, inputs.data, inputs.rows
    grouped = rows.lengths if groups_by_length(recipe.data, type(task)) else None
    order = GlobalOrder(len(rows), plan.global_batch_size, recipe.seed, recipe.data.shuffle, group_lengths=grouped)
    total_steps = _total_steps(recipe.train, order, task.steps_per_batch)

    # On the meta device: the engine gives it storage and values, each rank only its shards
    # under fsdp; the facts below come from the shapes alone.
    model = build_model(recipe.model, tokenizer, recipe.seed, task.model_kind, task.model_kwargs(), meta=True)
    task.configure_model(model)
    freeze(model, recipe.model.freeze)
    num_params = sum(p.numel() for p in model.parameters())
    if recipe.lora is not None:
        model = apply_lora(model, recipe.lora, task.model_kind, recipe.seed)
    # A mixture-of-experts model's router hooks go on before the engine wraps it.
    task = balance_router(task, model, recipe.moe, plan)
    facts = ModelFacts(
        name=type(model).__name__,
        num_params=num_params,
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        # Counted before the engine shards the parameters (zero3 leaves local stubs).
        flops_per_token=flops_per_token(model, float(rows.lengths.mean()), idle_expert_parameters(model)),
        peak_tflops=peak_tflops(device, recipe.engine.peak_tflops),
    )
    engine = build_engine(EngineSpec.of(recipe), model, info, device, plan, total_steps)
    eval_data = data.eval
    if eval_data is not None and recipe.train.eval_limit is not None and len(eval_data) > recipe.train.eval_limit:
        eval_data = eval_data.select(range(recipe.train.eval_limit))
    train_data, eval_data = task.setup(engine, data.train, eval_data)
    report = data.report | {"eval_tokens": eval_tokens(data.eval)}  # the full held-out split, before eval_limit
    n = recipe.engine.sequence_parallel
    sequence = SequenceShards(n, info.rank % n, getattr(task, "attn_implementation", "sdpa"))
    return RunSetup(
        recipe=recipe,
        info=info,
        tokenizer=tokenizer,
        task=task,
        train_data=train_data,
        eval_data=eval_data,
        data_report=report,
        rows=rows,
        order=order,
        plan=plan,
        total_steps=total_steps,
        engine=engine,
        model=facts,
        sequence=sequence,
    )


def describe(run: RunSetup) -> list[str]:
    """What the run is about to do, for its first lines of output."""
    recipe, report, facts = run.recipe, run.data_report, run.model
    params = f"{_count(facts.num_params)} parameters" + (
        f", {_count(facts.trainable)} trained" if facts.trainable != facts.num_params else ""
    )
    layout = "packed rows" if run.task.packing else "rows"
    used = len(run.eval_data) if run.eval_data is not None else 0
    lines = [
        f"{run.task.name} on {facts.name} ({params}), {recipe.engine.strategy} on {run.engine.device.type}, "
        f"precision {recipe.engine.precision}"
        + (
            f", each MoE layer's experts split over groups of {recipe.engine.expert_parallel} ranks (expert parallel)"
            if recipe.engine.expert_parallel > 1
            else ""
        ),
        f"batch {run.plan.describe()}",
        f"{report['train_examples']} training examples in {len(run.rows)} {layout} "
        f"({run.order.steps_per_epoch} steps per epoch), "
        f"{report['eval_examples']} held out"
        + (f" ({used} used)" if run.eval_data is not None and used < report["eval_examples"] else "")
        + f"; {run.total_steps} steps",
    ]
    if run.task.packing:
        fill = run.rows.lengths.sum() / (len(run.rows) * recipe.data.max_length)
        lines.append(f"packing fills {100 * fill:.1f}% of each {recipe.data.max_length}-token row")
    if report.get("train_over_length"):
        policy = recipe.data.truncation
        lines.append(
            f"{report['train_over_length']} training examples were longer than "
            f"data.max_length={recipe.data.max_length} ({'dropped' if policy == 'drop' else 'truncated'}; "
            f"{report['train_dropped']} left out in all)"
        )
    warning = held_out_warning(recipe.data.eval_fraction, int(run.rows.lengths.sum()), report.get("eval_tokens", 0))
    return [f"accord: {line}" for line in lines + ([warning] if warning else []) + run.task.describe()]


def eval_tokens(eval_ds) -> int:
    """Tokens in an encoded held-out split (0 without one)."""
    if eval_ds is None or "length" not in eval_ds.column_names:
        return 0
    return int(np.asarray(eval_ds["length"]).sum())


def _total_steps(train: TrainConfig, order: GlobalOrder, steps_per_batch: int) -> int:
    """train.max_steps, or the steps that train.epochs passes over the rows take."""
    if train.max_steps is not None:
        return train.max_steps
    assert train.epochs is not None
    return max(1, math.ceil(train.epochs * order.steps_per_epoch * steps_per_batch))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"
