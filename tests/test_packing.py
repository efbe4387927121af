"""Packing: whole examples into max_length rows, with attention kept inside each example."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accord.data.order import GlobalOrder
from accord.data.packing import Rows, best_fit_decreasing
from accord.models.build import build_byte_tokenizer
from accord.recipe.schema import validate_recipe
from accord.tasks import task_config
from accord.tasks.sft import SFTTask
from conftest import TINY_RECIPE


def test_best_fit_decreasing_places_every_example_once_within_capacity():
    lengths = np.random.default_rng(0).integers(1, 65, size=500)
    rows = best_fit_decreasing(lengths, 64)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(500))
    assert all(lengths[row].sum() <= 64 for row in rows)
    assert lengths.sum() / (64 * len(rows)) > 0.9  # best fit leaves little room unused (0.945 here)
    assert rows == best_fit_decreasing(lengths, 64)  # deterministic


def test_rows_sum_targets_and_lengths_of_their_members():
    rows = Rows.build(np.array([10, 20, 30, 5]), np.array([3, 4, 5, 1]), capacity=40)
    for members, targets, length in zip(rows.members, rows.targets, rows.lengths):
        assert targets == sum([3, 4, 5, 1][i] for i in members)
        assert length == sum([10, 20, 30, 5][i] for i in members)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_per_document_loss_equals_unpacked(attn):
    """The loss of each document inside a packed row equals its loss computed alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_byte_tokenizer()
    task = SFTTask(tokenizer, task_config(validate_recipe(TINY_RECIPE)))
    rows = [
        {"prompt": "12+345=", "completion": "357"},
        {"prompt": "7+8=", "completion": "15"},
        {"prompt": "99+1=", "completion": "100"},
    ]
    examples = [
        {"input_ids": ids, "labels": labels}
        for ids, labels in (task._encode_pair(task._tokens(r["prompt"]), task._tokens(r["completion"])) for r in rows)
    ]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).eval()
    task.configure_model(model)

    task.packing = True
    packed = task.loss(model, task.collate([examples]))
    task.packing = False
    alone = [task.loss(model, task.collate([[e]])) for e in examples]
    assert packed.num_targets == sum(a.num_targets for a in alone)
    expected = sum(a.loss_sum for a in alone)
    assert abs(packed.loss_sum.item() - expected.item()) <= 1e-5
    # Per document: the packed row's token losses, split at the document boundaries.
    task.packing = True
    batch = task.collate([examples])
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    token_losses = torch.nn.functional.cross_entropy(
        logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100, reduction="none"
    )
    start = 0
    for e, a in zip(examples, alone):
        end = start + len(e["input_ids"])
        assert abs(token_losses[start : end - 1].sum().item() - a.loss_sum.item()) <= 1e-5
        start = end


def test_length_grouped_order_is_global_seeded_and_groups_lengths():
    lengths = np.random.default_rng(1).integers(1, 200, size=1000)
    a = GlobalOrder(1000, 10, seed=3, group_lengths=lengths)
    b = GlobalOrder(1000, 10, seed=3, group_lengths=lengths)
    assert all(np.array_equal(a.batch(s), b.batch(s)) for s in range(100))
    epoch = np.concatenate([a.batch(s) for s in range(100)])
    assert sorted(epoch.tolist()) == list(range(1000))
    spread = np.mean([np.ptp(lengths[a.batch(s)]) for s in range(100)])
    plain = GlobalOrder(1000, 10, seed=3)
    assert spread < 0.3 * np.mean([np.ptp(lengths[plain.batch(s)]) for s in range(100)])


def test_rows_written_window_by_window_and_mapped_are_the_rows_built_in_memory(tmp_path):
    from accord.data.packing import PACK_WINDOW, write_rows

    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 300, 2 * PACK_WINDOW + 123)
    train = {"length": lengths, "num_targets": rng.integers(0, 10, len(lengths))}
    write_rows(train, 512, tmp_path / "rows")
    mapped, built = Rows.load(tmp_path / "rows"), Rows.build(train["length"], train["num_targets"], 512)
    assert isinstance(mapped.targets, np.memmap) and len(mapped) == len(built)
    assert list(mapped.members) == list(built.members)
    assert mapped.targets.tolist() == built.targets.tolist() and mapped.lengths.tolist() == built.lengths.tolist()


def test_flattened_rows_attended_per_document_give_the_block_mask_loss_and_gradients():
    """On the CPU a packed micro-batch is one unpadded sequence attended document by document
    (accord.models.documents): the same loss and gradients as the padded rows under the
    block-diagonal mask, and generation (no documents' lengths) is plain SDPA's."""
    import copy

    from accord.models.build import build_model

    tokenizer = build_byte_tokenizer()
    recipe = validate_recipe(TINY_RECIPE | {"engine": {"device": "cpu"}})
    task = SFTTask(tokenizer, task_config(recipe))
    rng = np.random.default_rng(3)

    def example(n: int) -> dict:
        ids = rng.integers(3, 200, n).tolist()
        return {"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]}

    rows = [[example(5), example(9), example(3)], [example(14)], [example(4), example(6)]]
    padded_model = build_model(recipe.model, tokenizer, recipe.seed)  # the tests' 2-layer Llama, sdpa
    flat_model = copy.deepcopy(padded_model)
    task.configure_model(flat_model)
    assert task.flatten and task.packing
    flat_batch = task.collate(rows)
    assert flat_batch["input_ids"].shape == (1, sum(len(e["input_ids"]) for row in rows for e in row))
    flat = task.loss(flat_model, flat_batch)
    task.flatten = False
    padded = task.loss(padded_model, task.collate(rows))
    assert flat.num_targets == padded.num_targets
    torch.testing.assert_close(flat.loss_sum, padded.loss_sum, rtol=1e-6, atol=1e-5)
    flat.loss_sum.backward()
    padded.loss_sum.backward()
    for (name, a), b in zip(flat_model.named_parameters(), padded_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    prompts = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    generated = [
        m.generate(prompts, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        for m in (flat_model, padded_model)
    ]
    assert torch.equal(*generated)


def test_rows_stay_padded_under_a_mask_where_attention_per_document_does_not_apply():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    tokenizer = build_byte_tokenizer()
    small = {"vocab_size": 300, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    small |= {"num_attention_heads": 2, "num_key_value_heads": 2}
    cases = [
        (
            TINY_RECIPE | {"engine": {"device": "cpu"}},
            LlamaForCausalLM(LlamaConfig(**small, attn_implementation="eager")),
        ),
        (TINY_RECIPE | {"engine": {"device": "cpu"}}, MistralForCausalLM(MistralConfig(**small, sliding_window=8))),
    ]
    for recipe, model in cases:
        task = SFTTask(tokenizer, task_config(validate_recipe(recipe)))
        task.configure_model(model)
        assert not task.flatten
        assert "attention_mask" in task.collate([[{"input_ids": [1, 2], "labels": [-100, 2]}]])
