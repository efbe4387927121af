"""task: kto — against TRL's KTOTrainer on the same tokens, the KL estimate over the whole
global batch, and the same updates on any layout."""

from __future__ import annotations

import pytest
import torch

from conftest import recipe_for

# (prompt, completion, desirable): both classes, completions of different lengths.
ROWS = [
    ("2+2=", "4", True),
    ("what is red? ", "a colour", True),
    ("hi", " there, friend", False),
    ("3+4=", "9 or so", False),
    ("name a pet: ", "a cat", True),
    ("1+1=", "11", False),
]


def _tiny_lm(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY_RECIPE

    settings = {k: v for k, v in TINY_RECIPE["model"]["config"].items() if k != "architecture"}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**settings, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))


def _recipe(folder, **kto) -> dict:
    recipe = recipe_for("dpo", folder, kto=kto) | {"task": "kto"}
    recipe["data"]["max_length"] = 64  # these rows fit whole
    return recipe


def _task(tmp_path, **kto):
    from accord.models.build import build_byte_tokenizer
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    tokenizer = build_byte_tokenizer()
    return build_task(task_config(validate_recipe(_recipe(tmp_path, **kto))), tokenizer), tokenizer


def _trl_trainer(model, tokenizer, rows, tmp_path, **args):
    """TRL's KTOTrainer on the text rows (it tokenizes them itself), its reference a copy of the
    starting weights, one batch of every row: its KL rows rotate the completions within it."""
    import copy

    import datasets
    from trl import KTOConfig, KTOTrainer

    settings = {
        "max_length": 64,
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,  # else its prepared reference runs under bf16 autocast on a CPU that has bf16
        "per_device_train_batch_size": len(rows),
        "train_sampling_strategy": "sequential",
        "gradient_checkpointing": False,
    } | args
    data = datasets.Dataset.from_list(rows)
    config = KTOConfig(output_dir=str(tmp_path / "trl"), **settings)
    reference = copy.deepcopy(model)
    return KTOTrainer(model=model, ref_model=reference, args=config, processing_class=tokenizer, train_dataset=data)


def _moved(model, batch) -> None:
    """The policy a few steps towards the batch's completions: away from its reference (at the
    reference every log-ratio is 0), and trained on the mismatched pairs, with a KL estimate above 0."""
    from accord.tasks.base import sequence_logprobs

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        (-sequence_logprobs(model(**inputs).logits, batch["labels"]).mean()).backward()
        optimizer.step()
        optimizer.zero_grad()


def _compare_with_trl(tmp_path, rows, accord_rows, **kto):
    task, tokenizer = _task(tmp_path, **kto)
    train, _ = task.fit(_dataset(accord_rows), None)
    encoded = task.encode_batch(train.to_dict())
    examples = [{name: column[i] for name, column in encoded.items()} for i in range(len(train))]
    model = _tiny_lm(tokenizer)
    task.configure_model(model)  # its reference: a copy of the starting weights, as TRL's
    trainer = _trl_trainer(model, tokenizer, rows, tmp_path, **kto)
    theirs = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    assert [e["desirable"] for e in examples] == [t["label"] for t in theirs]
    for ours, t in zip(examples, theirs):
        assert ours["prompt_ids"] + ours["completion_ids"] == t["prompt_ids"] + t["completion_ids"]
    rows_ = [[e] for e in examples]
    mismatched = task.statistics_batch(rows_, rows_[-1:] + rows_[:-1])
    _moved(model, mismatched if "labels" in mismatched else task.collate(rows_))  # after both copied their reference
    trl_loss = trainer.compute_loss(model, trainer.data_collator(theirs))
    (trl_grad,) = torch.autograd.grad(trl_loss, model.model.embed_tokens.weight)

    task.reference.policy = model  # what setup() takes from the engine
    task.use_statistics(task.statistics_sums(model, mismatched))
    out = task.loss(model, task.collate(rows_))
    ours = out.loss_sum / out.num_targets
    (our_grad,) = torch.autograd.grad(ours, model.model.embed_tokens.weight)
    assert trl_loss.item() > 0.05
    torch.testing.assert_close(ours, trl_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(our_grad, trl_grad, rtol=1e-5, atol=1e-7)
    logged = {name: float(value) / len(examples) for name, value in out.metrics.items()}
    trl_logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert logged[name] == pytest.approx(trl_logged[name], rel=1e-5, abs=1e-6), name
    return logged


def _dataset(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_step_loss_gradient_and_metrics_equal_trl_kto_trainer_on_the_same_batch(loss_type, tmp_path):
    """KTOTrainer tokenizes the rows to the same ids; its compute_loss over one batch (the KL
    estimate from the completions rotated within it) equals accord's loss when that batch is
    the global batch, with the same gradient and the metrics TRL logs."""
    pytest.importorskip("trl")
    rows = [{"prompt": p, "completion": c, "label": d} for p, c, d in ROWS]
    logged = _compare_with_trl(
        tmp_path, rows, rows, loss_type=loss_type, beta=0.5, desirable_weight=1.0, undesirable_weight=1.5
    )
    assert (logged["kl"] > 0) == (loss_type == "kto")


def test_preference_pairs_are_unpaired_as_trl_unpairs_them(tmp_path):
    pytest.importorskip("trl")
    pairs = [{"prompt": p, "chosen": c, "rejected": c[::-1] + " no"} for p, c, _ in ROWS[:4]]
    _compare_with_trl(tmp_path, pairs, pairs, beta=0.2)


def test_a_row_whose_label_is_not_a_boolean_is_named(tmp_path):
    from accord.data.rows import DataError

    task, _ = _task(tmp_path)
    rows = [
        {"prompt": "a", "completion": "b", "label": v, "__source": "rows.jsonl", "__row": i}
        for i, v in enumerate(["yes", "no"])
    ]
    with pytest.raises(DataError, match=r"rows.jsonl: row 0: kto label 'yes' is not a boolean"):
        task.fit(_dataset(rows), None)
    with pytest.raises(DataError, match=r"missing field 'label'.*fields: \{label: <column>\}"):
        task.fit(_dataset([{"prompt": "a", "completion": "b"}]), None)


def test_unbalanced_classes_get_trl_s_weight_advice(tmp_path):
    task, _ = _task(tmp_path)
    task.fit(_dataset([{"prompt": "a", "completion": "b", "label": i < 3} for i in range(12)]), None)
    (line,) = [line for line in task.describe() if "kto" in line]
    assert "3 desirable and 9 undesirable" in line and "kto.desirable_weight in [3.00, 3.99]" in line


def test_a_global_batch_of_one_row_is_refused_with_kl(tmp_path):
    from accord.recipe.schema import RecipeError, validate_recipe

    recipe = _recipe(tmp_path) | {"batch": {"global_batch_size": 1}}
    with pytest.raises(RecipeError, match="global_batch_size=1: its KL estimate"):
        validate_recipe(recipe)
    validate_recipe(recipe | {"kto": {"loss_type": "apo_zero_unpaired"}})


# ---------------------------------------------------------------- real runs


def _rows_file(folder, count: int):
    """Unpaired additions: a right sum is desirable, a wrong one not (about a third of them)."""
    import random

    from conftest import write_jsonl

    rng = random.Random(5)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        good = rng.random() < 0.65
        rows.append(
            {"prompt": f"{a}+{b}=", "completion": str(a + b if good else a + b + rng.randint(1, 9)), "label": good}
        )
    return write_jsonl(folder / "kto.jsonl", rows)


@pytest.fixture(scope="module")
def kto_layouts(tmp_path_factory):
    """KTO on 1 process (1 × 4 × 2) and 2 processes (2 × 2 × 2), the same recipe, with evaluation."""
    from conftest import assert_ok, run_accord, write_recipe

    root = tmp_path_factory.mktemp("kto")
    recipe = _recipe(root, beta=0.3, undesirable_weight=1.3)
    recipe["data"] |= {"train": str(_rows_file(root, 72)), "eval_fraction": 0.1, "shuffle": False}
    recipe["batch"] = {"global_batch_size": 8, "micro_batch_size": 4}
    recipe["optim"] = {"lr": 3.0e-3, "schedule": "constant", "warmup_steps": 0, "max_grad_norm": 1.0}
    recipe["train"] = {"max_steps": 4, "log_every": 1, "eval_every": 4}
    path = write_recipe(root / "kto.yaml", recipe)
    outs = {}
    for processes, micro in ((1, 4), (2, 2)):
        outs[processes] = root / f"p{processes}"
        proc = run_accord(
            "train",
            path,
            f"engine.processes={processes}",
            f"batch.micro_batch_size={micro}",
            f"output.dir={outs[processes]}",
        )
        assert_ok(proc)
    return outs


@pytest.mark.distributed
def test_kto_on_two_processes_with_accumulation_makes_the_one_process_updates(kto_layouts):
    """The KL estimate is one number per global batch and the loss is normalised over its rows:
    1 × 4 × 2 and 2 × 2 × 2 log the same losses and KL and end with the same weights."""
    from accord.observe.metrics import read_metrics
    from conftest import final_params, max_param_diff, step_losses

    one, two = (step_losses(kto_layouts[p]) for p in (1, 2))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])
    assert max_param_diff(final_params(kto_layouts[1]), final_params(kto_layouts[2])) < 1e-5
    records = {p: [r for r in read_metrics(kto_layouts[p]) if r["kind"] == "train"] for p in (1, 2)}
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        for a, b in zip(records[1], records[2]):
            assert abs(a[name] - b[name]) < 1e-5, name
    assert records[1][-1]["kl"] > 0  # the policy has moved: the estimate is not clamped to 0 any more
    evals = [r for r in read_metrics(kto_layouts[1]) if r["kind"] == "eval"]
    assert evals and "rewards/margins" in evals[-1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_kto_under_a_sharded_strategy_makes_the_ddp_updates(kto_layouts, strategy, tmp_path):
    """The statistics pass runs the sharded policy's and reference's forwards on every rank
    in step (collective under fsdp and zero3) and gives the ddp run's losses and weights."""
    from conftest import assert_ok, final_params, max_param_diff, run_accord, step_losses

    out = tmp_path / strategy
    recipe = kto_layouts[1].parent / "kto.yaml"
    args = ("engine.processes=2", "batch.micro_batch_size=2", f"engine.strategy={strategy}", f"output.dir={out}")
    assert_ok(run_accord("train", recipe, *args))
    ddp, sharded = step_losses(kto_layouts[2]), step_losses(out)
    for step in ddp:
        assert abs(ddp[step] - sharded[step]) < 1e-5, (step, ddp[step], sharded[step])
    assert max_param_diff(final_params(kto_layouts[2]), final_params(out)) < 1e-4
