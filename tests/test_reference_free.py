"""task: orpo and task: cpo — reference-free preference optimisation, against TRL's
experimental ORPOTrainer and CPOTrainer on the same tokens, and invariant to the layout."""

from __future__ import annotations

import pytest
import torch

from conftest import recipe_for

# TRL's task names and the accord recipe sections that configure each variant.
VARIANTS = {
    "orpo": ("orpo", {"orpo": {"beta": 0.5}}),
    "cpo-sigmoid": ("cpo", {"cpo": {"loss_type": "sigmoid", "beta": 0.5, "label_smoothing": 0.1}}),
    "cpo-hinge": ("cpo", {"cpo": {"loss_type": "hinge", "beta": 0.5}}),
    "cpo-ipo": ("cpo", {"cpo": {"loss_type": "ipo", "beta": 0.5}}),
    "cpo-simpo": ("cpo", {"cpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.3, "cpo_alpha": 0.5}}),
}
ROWS = [("2+2=", "4", "5"), ("what is red? ", "a colour", "a small dog that sat"), ("hi", " there, friend", "!")]


def _tiny_lm(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY_RECIPE

    settings = {k: v for k, v in TINY_RECIPE["model"]["config"].items() if k != "architecture"}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**settings, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))


def _task(variant: str, tmp_path):
    from accord.models.build import build_byte_tokenizer
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    tokenizer = build_byte_tokenizer()
    return build_task(task_config(validate_recipe(_recipe(variant, tmp_path))), tokenizer), tokenizer


def _recipe(variant: str, folder, **sections) -> dict:
    """The tiny recipe on conftest's addition pairs, as task `variant`."""
    task, settings = VARIANTS[variant]
    recipe = recipe_for("dpo", folder, **settings, **sections) | {"task": task}
    recipe["data"]["max_length"] = 64  # TRL truncates otherwise: these rows fit whole
    return recipe


def _trl_trainer(variant: str, model, tokenizer, rows, tmp_path, **args):
    """TRL's own trainer for `variant`, on the text rows (it tokenizes them itself)."""
    import datasets

    task, sections = VARIANTS[variant]
    settings = dict(sections[task]) | {"max_length": 64, "report_to": "none", "use_cpu": True} | args
    if task == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
    data = datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows])
    config = Config(output_dir=str(tmp_path / "trl"), **settings)
    return Trainer(model=model, args=config, processing_class=tokenizer, train_dataset=data)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_step_loss_and_gradient_equal_trl_trainers_on_the_same_batch(variant, tmp_path):
    """TRL's trainer tokenizes the rows to the same ids, and its compute_loss over the batch
    (NLL per chosen token + the preference term per pair) equals the step loss accord's task
    gives when the batch is the whole global batch; the gradients too."""
    pytest.importorskip("trl")
    task, tokenizer = _task(variant, tmp_path)
    encoded = task.encode_batch({k: [r[i] for r in ROWS] for i, k in enumerate(("prompt", "chosen", "rejected"))})
    examples = [{name: column[i] for name, column in encoded.items()} for i in range(len(ROWS))]
    model = _tiny_lm(tokenizer)
    trainer = _trl_trainer(variant, model, tokenizer, ROWS, tmp_path)
    tokenized = [trainer.train_dataset[i] for i in range(len(ROWS))]
    for ours, theirs in zip(examples, tokenized):
        assert ours["chosen_input_ids"] == theirs["chosen_input_ids"]
        assert ours["rejected_input_ids"] == theirs["rejected_input_ids"]
        assert ours["chosen_labels"] == theirs["chosen_labels"]
    trl_batch = trainer.data_collator(tokenized)
    trl_loss = trainer.compute_loss(model, trl_batch)
    (trl_grad,) = torch.autograd.grad(trl_loss, model.model.embed_tokens.weight)

    task.configure_model(model)
    out = task.loss(model, task.collate([[e] for e in examples]))
    targets = sum(e["num_targets"] for e in examples)
    assert out.num_targets.item() == targets
    loss_sum, metrics = out.over_targets(targets, len(ROWS))
    ours = loss_sum / targets
    (our_grad,) = torch.autograd.grad(ours, model.model.embed_tokens.weight)
    assert trl_loss.item() > 0.05
    torch.testing.assert_close(ours, trl_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(our_grad, trl_grad, rtol=1e-5, atol=1e-7)
    logged = {name: float(value) / targets for name, value in metrics.items()}
    trl_logged = {name: sum(values) / len(values) for name, values in trainer._stored_metrics["train"].items()}
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "nll_loss"):
        assert logged[name] == pytest.approx(trl_logged[name], rel=1e-5, abs=1e-6), name
    if variant == "orpo":
        for name in ("log_odds_ratio", "log_odds_chosen"):
            assert logged[name] == pytest.approx(trl_logged[name], rel=1e-5, abs=1e-6), name


# ---------------------------------------------------------------- real runs


def _pairs_file(folder, count: int):
    import random

    from conftest import write_jsonl

    rng = random.Random(3)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b + rng.randint(1, 9)} ok"})
    return write_jsonl(folder / "pairs.jsonl", rows), rows


def _run_recipe(variant: str, folder, steps: int, **sections) -> dict:
    """`variant` on generated pairs in file order (no held-out split), fp32, a constant lr."""
    path, _ = _pairs_file(folder, 64)
    recipe = _recipe(variant, folder, **sections)
    recipe["data"] |= {"train": str(path), "eval_fraction": 0.0, "shuffle": False}
    recipe["optim"] = {"lr": 3.0e-3, "schedule": "constant", "warmup_steps": 0, "max_grad_norm": 1.0}
    recipe["train"] = {"max_steps": steps, "log_every": 1}
    return recipe


@pytest.fixture(scope="module")
def orpo_layouts(tmp_path_factory):
    """ORPO on 1 process (1 × 4 × 2) and 2 processes (2 × 2 × 2), the same recipe, with a
    checkpoint at step 2 (the slow tier resumes from it)."""
    from conftest import assert_ok, run_accord, write_recipe

    root = tmp_path_factory.mktemp("orpo")
    batch = {"global_batch_size": 8, "micro_batch_size": 4}
    recipe = write_recipe(root / "orpo.yaml", _run_recipe("orpo", root, 4, batch=batch, checkpoint={"every_steps": 2}))
    outs = {}
    for processes, micro in ((1, 4), (2, 2)):
        outs[processes] = root / f"p{processes}"
        proc = run_accord(
            "train",
            recipe,
            f"engine.processes={processes}",
            f"batch.micro_batch_size={micro}",
            f"output.dir={outs[processes]}",
        )
        assert_ok(proc)
    return outs


@pytest.mark.distributed
def test_orpo_on_two_processes_with_accumulation_makes_the_one_process_updates(orpo_layouts):
    """The NLL per chosen token and the odds-ratio term per pair are both normalised over the
    whole global batch: 1 × 4 × 2 and 2 × 2 × 2 log the same losses and end with the same weights."""
    first = _same_updates(orpo_layouts, ("nll_loss", "log_odds_ratio", "rewards/accuracies", "rewards/margins"))
    assert 0.0 <= first["rewards/accuracies"] <= 1.0


def _same_updates(layouts: dict, metrics: tuple[str, ...]) -> dict:
    """The 1- and 2-process runs log the same losses and `metrics` at steps 1-4 and end with
    the same weights; the 1-process run's first train record."""
    from conftest import final_params, max_param_diff, records, step_losses

    one, two = (step_losses(layouts[p]) for p in (1, 2))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])
    assert max_param_diff(final_params(layouts[1]), final_params(layouts[2])) < 1e-5
    logged = {p: records(layouts[p], "train") for p in (1, 2)}
    for name in metrics:
        for a, b in zip(logged[1], logged[2]):
            assert abs(a[name] - b[name]) < 1e-5, name
    return logged[1][0]


@pytest.fixture(scope="module")
def cpo_layouts(tmp_path_factory):
    """CPO (simpo loss with the chosen NLL) on 1 process (1 × 4 × 2) and 2 processes (2 × 2 × 2) under ddp."""
    from conftest import assert_ok, run_accord, write_recipe

    root = tmp_path_factory.mktemp("cpo")
    batch = {"global_batch_size": 8, "micro_batch_size": 4}
    recipe = write_recipe(root / "cpo.yaml", _run_recipe("cpo-simpo", root, 4, batch=batch))
    outs = {}
    for processes, micro in ((1, 4), (2, 2)):
        outs[processes] = root / f"p{processes}"
        args = (f"engine.processes={processes}", f"batch.micro_batch_size={micro}", f"output.dir={outs[processes]}")
        assert_ok(run_accord("train", recipe, *args))
    return outs


@pytest.mark.slow
@pytest.mark.distributed
def test_cpo_on_two_processes_with_accumulation_makes_the_one_process_updates(cpo_layouts):
    """SimPO's length-normalised margin per pair and the NLL per chosen token are normalised over
    the global batch: 1 × 4 × 2 and 2 × 2 × 2 log the same losses and end with the same weights."""
    _same_updates(cpo_layouts, ("nll_loss", "rewards/accuracies", "rewards/margins"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
@pytest.mark.parametrize("task", ["orpo", "cpo"])
def test_reference_free_under_a_sharded_strategy_makes_the_ddp_updates(task, strategy, request, tmp_path):
    """The chosen and rejected forwards run on every rank in step under the sharded strategies
    (their all-gathers are collective) and give the ddp run's losses and weights."""
    from conftest import assert_ok, final_params, max_param_diff, run_accord, step_losses

    if strategy == "zero3":
        pytest.importorskip("deepspeed")
    ddp = request.getfixturevalue(f"{task}_layouts")[2]
    out = tmp_path / strategy
    args = ("engine.processes=2", "batch.micro_batch_size=2", f"engine.strategy={strategy}", f"output.dir={out}")
    assert_ok(run_accord("train", ddp.parent / f"{task}.yaml", *args))
    ours, theirs = step_losses(ddp), step_losses(out)
    assert sorted(ours) == sorted(theirs) == [1, 2, 3, 4]
    for step in ours:
        assert abs(ours[step] - theirs[step]) < 1e-5, (step, ours[step], theirs[step])
    assert max_param_diff(final_params(ddp), final_params(out)) < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
def test_orpo_resumed_on_one_process_ends_as_the_uninterrupted_two_process_run(orpo_layouts, tmp_path):
    from conftest import assert_ok, final_params, max_param_diff, run_accord, step_losses

    out = tmp_path / "resumed"
    checkpoint = orpo_layouts[2] / "checkpoints" / "step-000002"
    args = ("engine.processes=1", "batch.micro_batch_size=4", f"resume={checkpoint}", f"output.dir={out}")
    assert_ok(run_accord("train", orpo_layouts[2].parent / "orpo.yaml", *args))
    whole, resumed = step_losses(orpo_layouts[2]), step_losses(out)
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert abs(whole[step] - resumed[step]) < 1e-5, (step, whole[step], resumed[step])
    assert max_param_diff(final_params(orpo_layouts[2]), final_params(out)) < 1e-5
