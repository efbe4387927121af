"""Mixture-of-experts models: built from a transformers MoE config, trained under every strategy,
and their router's balancing loss counted over the whole global batch (equal to transformers'
load_balancing_loss_func on the batch in one forward), or per forward as transformers.Trainer
adds it."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import (
    MOE_CONFIG,
    TINY_RECIPE,
    assert_ok,
    final_params,
    max_param_diff,
    moe_recipe,
    records,
    run_accord,
    step_losses,
    write_recipe,
)

TOLERANCE = 1e-5
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (pip install deepspeed)")


def _tiny_moe(architecture: str = "qwen3_moe", vocab: int = 40):
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {k: v for k, v in MOE_CONFIG.items() if k != "architecture"}
    if architecture != "qwen3_moe":  # Mixtral and OLMoE name their experts num_local_experts / num_experts
        settings = {k: v for k, v in settings.items() if k not in ("moe_intermediate_size", "num_experts")}
        settings["num_local_experts" if architecture == "mixtral" else "num_experts"] = 4
    torch.manual_seed(0)
    config = AutoConfig.for_model(architecture, vocab_size=vocab, pad_token_id=0, **settings)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class _Forward:
    """A task whose micro-batch loss is just the model's forward (the router terms are the test's)."""

    name, online, batch_statistics = "forward", False, False

    def collate(self, rows):
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}

    def loss(self, model, batch):
        from accord.tasks.base import LossOutput

        logits = model(**batch).logits
        return LossOutput(logits.sum() * 0, torch.tensor(1))

    def step_means(self):
        return {}


def _rows(count: int = 8) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 40, (int(n),), generator=generator).tolist() for n in torch.randint(3, 12, (count,))]


def _balanced(model, mode: str, aux: float = 1.0, z: float = 0.0, forwards: int = 4):
    from accord.models.moe import RouterCapture, moe_layout
    from accord.tasks.router_balance import RouterBalancedTask

    return RouterBalancedTask(_Forward(), RouterCapture(model, moe_layout(model)), mode, aux, z, forwards)


# ---------------------------------------------------------------- one process, no workers


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "olmoe"])
def test_moe_families_are_found_with_their_experts_and_router_layers(architecture):
    from accord.models.moe import moe_layout

    model = _tiny_moe(architecture)
    layout = moe_layout(model)
    assert (layout.num_experts, layout.top_k, layout.layers) == (4, 2, 2)


def test_a_dense_model_has_no_router_to_balance():
    from transformers import LlamaConfig, LlamaForCausalLM

    from accord.models.moe import moe_layout

    settings = {k: v for k, v in TINY_RECIPE["model"]["config"].items() if k != "architecture"}
    assert moe_layout(LlamaForCausalLM(LlamaConfig(**settings, vocab_size=40))) is None


def test_global_batch_balance_loss_equals_transformers_on_the_whole_batch_in_one_forward():
    """Micro-batches of 2 rows, each padded to its own longest: the gradient-free pass's counts and
    the micro-batches' shares add up to transformers' aux_loss (and the z-loss) of one forward over
    all 8 rows, with the same gradient; the per-forward mean of the same split does not."""
    model = _tiny_moe()
    rows = _rows()
    micro = [rows[i : i + 2] for i in range(0, len(rows), 2)]
    task = _balanced(model, "global_batch", aux=1.0, z=0.5)
    with torch.no_grad():
        totals = sum(task.statistics_sums(model, task.collate(part)) for part in micro)
    task.use_statistics(totals)
    ours = sum(task.loss(model, task.collate(part)).normalised_loss for part in micro)

    whole = _Forward().collate(rows)
    out = model(**whole, output_router_logits=True)
    mask = whole["attention_mask"].reshape(-1).bool()
    z = torch.cat([torch.logsumexp(layer[mask], dim=-1).square() for layer in out.router_logits]).mean()
    theirs = out.aux_loss + 0.5 * z
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    router = model.model.layers[0].mlp.gate.weight
    (our_grad,) = torch.autograd.grad(ours, router)
    (their_grad,) = torch.autograd.grad(theirs, router)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-8)
    assert our_grad.abs().max() > 1e-4

    per_forward = _balanced(model, "per_forward", aux=1.0, forwards=len(micro))
    mean_of_forwards = sum(per_forward.loss(model, task.collate(part)).normalised_loss for part in micro)
    assert abs(float(mean_of_forwards.detach() - out.aux_loss.detach())) > 1e-3
    means = task.step_means()
    assert means["router_balance_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-6)
    assert means["router_imbalance"] >= 1.0
    # per_forward logs what it trained (the forwards' mean) beside the whole batch's balance
    logged = per_forward.step_means()
    assert logged["router_aux_loss_per_forward"] == pytest.approx(float(mean_of_forwards.detach()), rel=1e-6)
    assert logged["router_balance_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-6)


@pytest.mark.parametrize("mode", ["global_batch", "per_forward"])
def test_balance_loss_trains_under_activation_checkpointing_as_without(mode):
    """The router hooks run inside each checkpointed layer and not in its recomputation: the
    balancing loss's gradient is the same with engine.activation_checkpointing as without."""
    rows = _rows()
    micro = [rows[i : i + 2] for i in range(0, len(rows), 2)]
    grads = []
    for checkpointing in (False, True):
        model = _tiny_moe().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        task = _balanced(model, mode, aux=1.0, z=0.5, forwards=len(micro))
        if mode == "global_batch":
            with torch.no_grad():
                task.use_statistics(sum(task.statistics_sums(model, task.collate(part)) for part in micro))
        sum(task.loss(model, task.collate(part)).normalised_loss for part in micro).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(".mlp.gate." in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_per_forward_balance_loss_equals_transformers_trainer_loss_on_the_same_batch(tmp_path):
    """moe.balance_loss=per_forward on one micro-batch: accord's sft loss and the model's own
    aux_loss × router_aux_loss_coef, as transformers.Trainer computes it with output_router_logits."""
    from transformers import Trainer, TrainingArguments

    from accord.distributed.batch_plan import BatchPlan
    from accord.models.build import build_byte_tokenizer, build_model
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config
    from accord.tasks.router_balance import balance_router

    recipe = moe_recipe(balance_loss="per_forward", aux_loss_coef=None, z_loss_coef=None)
    recipe["data"] = {**recipe["data"], "packing": False}
    recipe["batch"] = {"global_batch_size": 6, "micro_batch_size": 6}
    recipe["model"]["config"]["router_aux_loss_coef"] = 0.3  # the weight both read from the config
    recipe = validate_recipe(recipe)
    tokenizer = build_byte_tokenizer()
    task = build_task(task_config(recipe), tokenizer)
    model = build_model(recipe.model, tokenizer, recipe.seed)
    task.configure_model(model)
    balanced = balance_router(task, model, recipe.moe, BatchPlan.of(recipe.batch, recipe.engine, 1))
    pairs = [("12+7=", "19"), ("3+4=", "7"), ("100+1=", "101"), ("5+5=", "10"), ("9+9=", "18"), ("0+0=", "0")]
    encoded = task.encode_batch({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})
    rows = [[{name: column[i] for name, column in encoded.items()}] for i in range(len(pairs))]
    batch = balanced.collate(rows)
    out = balanced.loss(model, batch)
    ours = out.loss_sum / out.num_targets + out.normalised_loss

    model.config.output_router_logits = True
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True)
    trainer = Trainer(model=model, args=args)
    theirs = trainer.compute_loss(model, dict(batch))
    aux = model(**{k: v for k, v in batch.items() if k != "labels"}).aux_loss
    assert float(aux) > 1.0  # the balancing term is really in both
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_moe_refusals_are_one_line_each(tmp_path):
    """The preflight check (run before any training): moe settings on a dense model, a layout the
    router statistics are not counted right in yet, a task the global-batch pass cannot serve."""
    from accord.launch.preflight import check_moe
    from accord.recipe.schema import validate_recipe
    from conftest import recipe_for

    dense = validate_recipe(copy.deepcopy(TINY_RECIPE) | {"moe": {"aux_loss_coef": 0.1}})
    assert check_moe(dense) == [
        "moe: the model has no mixture-of-experts layers (no routed experts in its config); drop the moe section"
    ]
    assert check_moe(validate_recipe(TINY_RECIPE)) == []
    assert check_moe(validate_recipe(moe_recipe())) == []
    [line] = check_moe(validate_recipe(moe_recipe() | {"engine": TINY_RECIPE["engine"] | {"sequence_parallel": 2}}))
    assert line.startswith("engine.sequence_parallel=2 with a mixture-of-experts model is not supported yet")
    kto = recipe_for("dpo", tmp_path) | {"task": "kto", "model": {"config": dict(MOE_CONFIG), "tokenizer": "byte"}}
    [line] = check_moe(validate_recipe(kto))
    assert line.startswith("moe.balance_loss=global_batch with task kto is not supported yet")
    assert check_moe(validate_recipe(kto | {"moe": {"balance_loss": "per_forward"}})) == []


@pytest.mark.slow
@pytest.mark.subprocess
def test_moe_settings_on_a_dense_model_stop_accord_train_in_one_line(tmp_path):
    recipe = copy.deepcopy(TINY_RECIPE) | {"moe": {"aux_loss_coef": 0.1}}
    proc = run_accord("train", write_recipe(tmp_path / "dense.yaml", recipe), f"output.dir={tmp_path / 'out'}")
    assert proc.returncode == 2
    assert "moe: the model has no mixture-of-experts layers" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 1 process against 2, one run each


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, moe_reference) -> dict[str, Path]:
    """The tiny MoE with its balancing and z-loss on: 1 process × 8 × 4 (the session's
    moe_reference) and 2 processes × 4 × 4."""
    root = tmp_path_factory.mktemp("moe")
    recipe, one = moe_reference
    out = root / "2x4x4"
    overrides = ["engine.processes=2", "batch.micro_batch_size=4", "checkpoint.every_steps=2"]
    assert_ok(run_accord("train", recipe, f"output.dir={out}", *overrides))
    return {"1x8x4": one, "2x4x4": out}


@pytest.mark.distributed
def test_moe_with_balancing_loss_trains_alike_on_1_and_2_processes(moe_runs):
    one, two = moe_runs["1x8x4"], moe_runs["2x4x4"]
    assert max_param_diff(final_params(one), final_params(two)) <= TOLERANCE
    losses_one, losses_two = step_losses(one), step_losses(two)
    assert max(abs(losses_one[s] - losses_two[s]) for s in losses_one) <= TOLERANCE
    for a, b in zip(records(one, "train"), records(two, "train"), strict=True):
        for key in ("router_balance_loss", "router_z_loss", "router_imbalance"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), key


@pytest.mark.distributed
def test_moe_final_folder_is_a_plain_transformers_model_with_the_trained_logits(moe_runs):
    from transformers import AutoModelForCausalLM

    one, two = (AutoModelForCausalLM.from_pretrained(moe_runs[n] / "final") for n in ("1x8x4", "2x4x4"))
    assert type(one).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.tensor([[257, 49, 50, 43, 51, 61]])
    with torch.no_grad():
        torch.testing.assert_close(one(ids).logits, two(ids).logits, rtol=0, atol=1e-4)
    trained = final_params(moe_runs["1x8x4"])
    for name, value in one.state_dict().items():
        if name in trained:
            assert torch.equal(value, trained[name]), name


@pytest.mark.slow
@pytest.mark.distributed
def test_a_2_process_moe_checkpoint_resumes_under_fsdp_on_1_process(moe_runs, tmp_path):
    """Router statistics hold no state between steps: the 2-process run's step-2 checkpoint,
    resumed under fsdp on 1 process, ends where the uninterrupted runs ended."""
    recipe = write_recipe(tmp_path / "moe.yaml", moe_recipe())
    checkpoint = moe_runs["2x4x4"] / "checkpoints" / "step-000002"
    out = tmp_path / "resumed"
    overrides = ["engine.processes=1", "engine.strategy=fsdp", f"resume={checkpoint}", f"output.dir={out}"]
    assert_ok(run_accord("train", recipe, *overrides))
    assert max_param_diff(final_params(moe_runs["1x8x4"]), final_params(out)) <= TOLERANCE


# ---------------------------------------------------------------- every strategy (slow)

STRATEGIES = {
    "fsdp": ["engine.strategy=fsdp"],
    "zero1": ["engine.strategy=zero1", "engine.zero1_implementation=deepspeed"],
    "zero2": ["engine.strategy=zero2"],
    "zero3": ["engine.strategy=zero3"],
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[needs_deepspeed] if n.startswith("zero") else [], id=n) for n in STRATEGIES]
)
def test_moe_under_each_strategy_makes_the_ddp_updates(moe_runs, tmp_path, name):
    recipe = write_recipe(tmp_path / "moe.yaml", moe_recipe())
    out = tmp_path / name
    assert_ok(run_accord("train", recipe, f"output.dir={out}", "batch.micro_batch_size=4", *STRATEGIES[name]))
    assert max_param_diff(final_params(moe_runs["2x4x4"]), final_params(out)) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.distributed
def test_moe_lora_trains_alike_on_1_and_2_processes(tmp_path):
    recipe = write_recipe(tmp_path / "moe.yaml", moe_recipe() | {"lora": {"r": 4}})
    outs = {}
    for name, overrides in {"one": ["engine.processes=1"], "two": ["batch.micro_batch_size=4"]}.items():
        outs[name] = tmp_path / name
        assert_ok(run_accord("train", recipe, f"output.dir={outs[name]}", *overrides))
    assert max_param_diff(final_params(outs["one"]), final_params(outs["two"])) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.distributed
def test_per_forward_balance_loss_changes_with_the_split(tmp_path):
    """The model's own form is the option it is: its objective moves with micro-batch size and
    processes (the global_batch runs above agree within 1e-5)."""
    recipe = write_recipe(tmp_path / "moe.yaml", moe_recipe(balance_loss="per_forward"))
    outs = {}
    for name, overrides in {"one": ["engine.processes=1"], "two": ["batch.micro_batch_size=4"]}.items():
        outs[name] = tmp_path / name
        assert_ok(run_accord("train", recipe, f"output.dir={outs[name]}", *overrides))
    assert max_param_diff(final_params(outs["one"]), final_params(outs["two"])) > 1e-4


@pytest.mark.parametrize("architecture", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_a_moe_folder_with_experts_stored_one_by_one_loads_into_the_fused_experts(tmp_path, architecture):
    """save_pretrained (and the hub's checkpoints) store each expert's projections apart; accord
    reads them slice by slice into transformers 5's fused 3-D expert parameters, as from_pretrained does."""
    from safetensors import safe_open

    from accord.models.build import build_byte_tokenizer, build_model
    from accord.models.weights import Checkpoint
    from accord.recipe.schema import ModelConfig

    original = _tiny_moe(architecture, vocab=len(build_byte_tokenizer()))
    original.save_pretrained(tmp_path / "moe")
    with safe_open(str(tmp_path / "moe" / "model.safetensors"), framework="pt") as stored:
        assert any(".experts.3." in key for key in stored.keys())  # one by one, not fused
    loaded = build_model(ModelConfig(path=str(tmp_path / "moe")), build_byte_tokenizer(), seed=0)
    theirs = original.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    # A shard of the experts (what one FSDP rank reads): only its rows.
    meta = build_model(ModelConfig(path=str(tmp_path / "moe")), build_byte_tokenizer(), seed=0, meta=True)
    checkpoint = Checkpoint(tmp_path / "moe", meta)
    name = "model.layers.1.mlp.experts.down_proj"
    key = checkpoint.key_for(name)
    part = checkpoint.read(key, (2, 0, 0), (2, *theirs[name].shape[1:]))
    assert torch.equal(part, theirs[name][2:4])


def test_lora_on_the_experts_and_router_merges_on_export_as_peft_merges_it():
    """peft's all-linear on an MoE adapts the fused 3-D expert parameters and the router too
    (ParamWrapper): accord's streamed merge gives peft's own merge_and_unload, tensor by tensor."""
    import warnings

    from peft import LoraConfig, get_peft_model

    from accord.output.export import merged_lora

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(_tiny_moe(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.normal_()
    ours = dict(merged_lora(list(model.state_dict().items()), model))
    theirs = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(ours) == sorted(theirs)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in ours)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-6, atol=1e-6, msg=name)
    assert not torch.equal(
        ours["model.layers.0.mlp.experts.down_proj"], _tiny_moe().state_dict()["model.layers.0.mlp.experts.down_proj"]
    )


def test_flops_per_token_count_only_the_experts_a_token_is_routed_to():
    from accord.models.moe import idle_expert_parameters
    from accord.observe.throughput import flops_per_token

    model = _tiny_moe()
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert idle_expert_parameters(model) == experts // 2  # top-2 of 4
    dense = flops_per_token(model, 16.0)
    assert flops_per_token(model, 16.0, idle_expert_parameters(model)) == dense - 6.0 * experts // 2
