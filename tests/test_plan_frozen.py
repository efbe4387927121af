"""`accord plan` counts a task's frozen second model: dpo's and kto's reference, grpo's and
rloo's KL anchor, distill's teacher — its weights (sharded where the strategy shards) and what
its forward holds while it runs."""

from __future__ import annotations

import pytest

from conftest import TINY_RECIPE


def _plan(recipe: dict):
    from accord.planner.estimate import plan
    from accord.recipe.schema import validate_recipe

    rows, _ = plan(validate_recipe(recipe), 2)
    return {r.strategy: r for r in rows}


def _params(hidden: int, layers: int) -> dict:
    return TINY_RECIPE["model"]["config"] | {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
    }


def _folder(root, hidden: int, layers: int):
    from transformers import LlamaConfig

    settings = {k: v for k, v in _params(hidden, layers).items() if k != "architecture"}
    LlamaConfig(**settings, vocab_size=262).save_pretrained(root / f"model-{hidden}")
    return root / f"model-{hidden}"


def _trained_fp32(recipe: dict) -> float:
    """The trained model's fp32 weights, as the plan's ddp row counts its parameters."""
    return _plan(recipe)["ddp"].params


@pytest.mark.parametrize(
    ("task", "sections", "holds"),
    [
        ("sft", {}, False),
        ("dpo", {}, True),  # a copy of the starting model
        ("dpo", {"dpo": {"reference_free": True}}, False),
        ("kto", {}, True),
        ("grpo", {"grpo": {"beta": 0.04, "max_new_tokens": 8}}, True),
        ("grpo", {"grpo": {"beta": 0.0, "max_new_tokens": 8}}, False),
        ("rloo", {"grpo": {"beta": 0.05, "max_new_tokens": 8}}, True),
        ("dpo", {"lora": {"r": 4}}, False),  # the reference is the policy with its adapters off
    ],
)
def test_a_reference_copy_adds_the_starting_models_weights_sharded_as_the_strategy_shards(task, sections, holds):
    base = TINY_RECIPE | {"model": TINY_RECIPE["model"] | {"config": _params(128, 2)}}
    plans = _plan(base | {"task": task} | sections)
    plain = _plan(base)
    for strategy, row in plans.items():
        if not holds:
            assert row.frozen == row.frozen_activations == 0
            continue
        weights = plain["ddp"].params  # fp32 parameters of the whole model
        shards = 2 if strategy in ("zero3", "fsdp") else 1
        assert row.frozen == pytest.approx(weights / shards), strategy
        assert row.frozen_activations > 0
        assert row.total == pytest.approx(
            row.params + row.grads + row.optimizer + row.master + row.activations + row.frozen + row.frozen_activations
        )
        assert row.phases["train"] - plain[strategy].phases["train"] >= row.frozen + row.frozen_activations - 1
        assert row.phases["build"] >= plain[strategy].phases["build"] + row.frozen - 1


def test_a_teacher_is_counted_at_its_own_size_with_its_kept_logits(tmp_path):
    """distill's teacher comes from its folder (here 4x the student's width): its weights, and
    its whole fp32 logits, which the loss reads beside the student's."""
    from accord.planner.estimate import GIB, format_table

    teacher = _folder(tmp_path, 256, 2)
    small = TINY_RECIPE | {"model": TINY_RECIPE["model"] | {"config": _params(64, 2)}}
    recipe = small | {"task": "distill", "distill": {"teacher": str(teacher), "lmbda": 0.0}}
    rows = _plan(recipe)
    teacher_weights = _trained_fp32(TINY_RECIPE | {"model": TINY_RECIPE["model"] | {"config": _params(256, 2)}})
    assert rows["ddp"].frozen == pytest.approx(teacher_weights) and rows["ddp"].frozen > 4 * rows["ddp"].params
    assert rows["fsdp"].frozen == pytest.approx(teacher_weights / 2)
    micro, length = 8, 32  # TINY_RECIPE's micro batch and max_length
    logits = 4 * micro * length * 262
    assert rows["ddp"].frozen_activations > logits
    table = format_table(list(rows.values()), 8)
    assert "frozen" in table.splitlines()[0]
    assert f"{(rows['ddp'].frozen + rows['ddp'].frozen_activations) / GIB:9.3f}" in table.splitlines()[2]
    assert "frozen" not in format_table(list(_plan(small).values()), 8).splitlines()[0]


def test_a_reference_folder_that_cannot_be_read_is_one_line_naming_its_key(tmp_path):
    from accord.errors import UserInputError

    recipe = TINY_RECIPE | {"task": "dpo", "dpo": {"reference": str(tmp_path / "missing")}}
    with pytest.raises(UserInputError, match=r"^dpo.reference: .*missing cannot be read as a model folder"):
        _plan(recipe)
