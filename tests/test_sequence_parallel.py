"""engine.sequence_parallel (Ulysses): each row's tokens split over a group of ranks; the
updates stay those of one process (contract 2), resume crosses degrees (contract 3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from accord.distributed.batch_plan import BatchPlan, BatchPlanError
from accord.engine.sequence_parallel.ulysses import check_sequence_parallel
from accord.recipe.schema import validate_recipe
from accord.tasks.base import IGNORE
from accord.tasks.causal import block_causal_mask, packed_position_ids
from accord.tasks.chunked_loss import shifted_targets
from accord.tasks.sequence_shards import SequenceShards
from conftest import (
    TINY_RECIPE,
    assert_ok,
    final_params,
    max_param_diff,
    recipe_for,
    run_accord,
    step_losses,
    write_recipe,
)

TOLERANCE = 1e-5


# ---------------------------------------------------------------- pure: the plan and the slices


def test_the_plan_counts_data_parallel_groups_and_gives_a_group_the_same_rows():
    plan = BatchPlan.derive(32, 4, 4, sequence_parallel=2)
    assert (plan.world_size, plan.grad_accum, plan.sequence_parallel) == (2, 4, 2)
    assert [plan.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert plan.micro_slice(plan.data_rank(1), 0) == plan.micro_slice(plan.data_rank(0), 0) == slice(0, 4)
    assert plan.micro_slice(plan.data_rank(2), 3) == slice(28, 32)
    assert "2 data-parallel groups of 2 processes (sequence parallel)" in plan.describe()
    with pytest.raises(
        BatchPlanError, match=r"engine.sequence_parallel=3 does not divide the 4 processes; use one of 1, 2, 4"
    ):
        BatchPlan.derive(32, 4, 4, sequence_parallel=3)


def _packed_batch(doc_lengths: list[list[int]], width: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (len(doc_lengths), width), generator=gen)
    labels = ids.clone()
    labels[:, 0] = IGNORE
    for i, lengths in enumerate(doc_lengths):
        labels[i, sum(lengths) :] = IGNORE  # padding
    positions = packed_position_ids(doc_lengths, width)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "attention_mask": block_causal_mask(doc_lengths, width, False),
    }


def test_slices_rejoin_into_the_row_with_targets_shifted_over_the_whole_row():
    docs = [[4, 5], [3, 3, 1]]  # 9 and 7 tokens of an 9-wide row: padded to 12 for 4 slices
    batch = _packed_batch(docs, 9)
    parts = [SequenceShards(4, k).shard(batch) for k in range(4)]
    joined = {key: torch.cat([p[key] for p in parts], dim=1) for key in ("input_ids", "position_ids", "shift_labels")}
    assert joined["input_ids"].shape == (2, 12)
    assert torch.equal(joined["input_ids"][:, :9], batch["input_ids"])
    assert torch.equal(joined["shift_labels"][:, :9], shifted_targets(batch["labels"]))
    assert (joined["shift_labels"][:, 9:] == IGNORE).all()  # padding has no targets
    assert torch.equal(joined["position_ids"][:, :9], batch["position_ids"])
    # A slice's last token predicts the first token of the next slice.
    assert parts[0]["shift_labels"][0, -1] == batch["labels"][0, 3]
    # Every slice carries the whole row's mask: documents stay apart across slice boundaries.
    mask = parts[1]["attention_mask"]
    assert mask.shape == (2, 1, 12, 12) and all(torch.equal(p["attention_mask"], mask) for p in parts)
    assert torch.equal(mask[:, :, :9, :9][0], batch["attention_mask"][0])  # row 0 has no padding
    assert not mask[0, 0, 4, 3] and mask[0, 0, 5, 4] and not mask[1, 0, 6, 5]  # no attention across documents
    assert SequenceShards().shard(batch) is batch  # one slice: untouched


def test_rows_of_one_document_take_sdpa_causal_attention_without_the_whole_row_mask():
    # The mask would be rows × L × L (and a float copy inside CPU sdpa); eager needs it.
    ids = torch.arange(10).expand(2, 10)
    batch = {"input_ids": ids, "labels": ids.clone()}
    assert "attention_mask" not in SequenceShards(2, 1, "sdpa").shard(batch)
    assert SequenceShards(2, 1, "eager").shard(batch)["attention_mask"].shape == (2, 1, 10, 10)
    packed = _packed_batch([[4, 5], [9]], 9)
    assert SequenceShards(2, 1, "sdpa").shard(packed)["attention_mask"].shape == (2, 1, 10, 10)


def test_heads_task_and_attention_are_checked_with_one_line_each():
    def recipe(**engine):
        data = {**TINY_RECIPE, "engine": {**TINY_RECIPE["engine"], **engine}}
        return validate_recipe(data)

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)  # what the check reads of a model's config
    assert check_sequence_parallel(recipe(sequence_parallel=1), config) == []
    assert check_sequence_parallel(recipe(sequence_parallel=4), config) == []  # kv heads replicated
    [line] = check_sequence_parallel(recipe(sequence_parallel=8), config)
    assert (
        line.startswith("engine.sequence_parallel=8 must divide the model's 4 attention heads")
        and "use 2, 4 or 1" in line
    )
    # Before any worker starts, from the recipe's model config (no weights).
    from accord.launch.preflight import check_sequence_parallel as preflight_check

    [line] = preflight_check(recipe(sequence_parallel=8))
    assert line.startswith("engine.sequence_parallel=8 must divide the model's 4 attention heads")
    dpo = validate_recipe({**TINY_RECIPE, "task": "dpo", "engine": {**TINY_RECIPE["engine"], "sequence_parallel": 2}})
    assert check_sequence_parallel(dpo, config) == [
        "engine.sequence_parallel=2 supports task sft and pretrain, not dpo; set engine.sequence_parallel=1"
    ]


# ---------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def sp2(tmp_path_factory):
    """TINY_RECIPE (packed sft) with sequence_parallel 2 on 2 processes: 1 data-parallel group
    × 8 × 4, the layout of the session's 1-process reference, with its checkpoint at step 6."""
    root = tmp_path_factory.mktemp("sp2")
    recipe = write_recipe(root / "tiny.yaml", TINY_RECIPE)
    out = root / "sp2"
    proc = run_accord("train", recipe, "engine.sequence_parallel=2", "checkpoint.every_steps=6", f"output.dir={out}")
    assert_ok(proc)
    assert (
        "1 data-parallel group of 2 processes (sequence parallel) × 8 sequences × 4 accumulation steps" in proc.stderr
    )
    return recipe, out


@pytest.mark.distributed
def test_sequence_parallel_2_trains_packed_sft_as_one_process(sp2, one_process_reference):
    _, out = sp2
    reference = one_process_reference[1]
    assert max_param_diff(final_params(reference), final_params(out)) <= TOLERANCE
    losses, expected = step_losses(out), step_losses(reference)
    assert losses.keys() == expected.keys() and max(abs(losses[s] - expected[s]) for s in expected) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_from_sequence_parallel_2_on_one_process(sp2, one_process_reference, tmp_path):
    recipe, out = sp2
    resumed = tmp_path / "resumed"
    proc = run_accord(
        "train", recipe, "engine.processes=1", f"resume={out / 'checkpoints' / 'step-000006'}", f"output.dir={resumed}"
    )
    assert_ok(proc)
    assert "at step 6 " in proc.stderr
    assert max_param_diff(final_params(one_process_reference[1]), final_params(resumed)) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_data_parallel_2_by_sequence_parallel_2_on_4_processes_equals_one_process(
    one_process_reference, tmp_path, strategy
):
    recipe, reference = one_process_reference
    out = tmp_path / strategy
    proc = run_accord(
        "train",
        recipe,
        "engine.processes=4",
        "engine.sequence_parallel=2",
        f"engine.strategy={strategy}",
        "batch.micro_batch_size=4",
        f"output.dir={out}",
        timeout=600,
    )
    assert_ok(proc)
    assert (
        "2 data-parallel groups of 2 processes (sequence parallel) × 4 sequences × 4 accumulation steps" in proc.stderr
    )
    assert max_param_diff(final_params(reference), final_params(out)) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "packing", ["true", "false"], ids=["packed", "one-document-a-row"]
)  # false: sdpa without a mask
def test_sequence_parallel_2_pretrains_as_one_process(tmp_path, packing):
    recipe = write_recipe(tmp_path / "pretrain.yaml", recipe_for("pretrain", tmp_path / "data"))
    outs = {}
    for name, args in {"one": ["engine.processes=1"], "sp2": ["engine.sequence_parallel=2"]}.items():
        outs[name] = tmp_path / name
        batch = [] if packing == "true" else ["batch.global_batch_size=8"]  # 24 documents
        assert_ok(run_accord("train", recipe, *args, f"data.packing={packing}", *batch, f"output.dir={outs[name]}"))
    assert max_param_diff(final_params(outs["one"]), final_params(outs["sp2"])) <= TOLERANCE
    losses = step_losses(outs["one"])
    assert losses[max(losses)] < losses[1] - 0.1  # it trained


def test_plan_divides_activations_by_the_group_and_recommends_the_smallest_that_fits():
    import copy

    from accord.planner.estimate import GIB, plan, recommend

    raw = copy.deepcopy(TINY_RECIPE)
    raw["model"]["config"] |= {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "max_position_embeddings": 8192,
    }
    raw["data"]["max_length"] = 8192
    raw["batch"] = {"global_batch_size": 8, "micro_batch_size": 1}
    raw["engine"] |= {"processes": 4}
    recipe = validate_recipe(raw)
    rows, world = plan(recipe, gpus=4)
    per_degree = rows[0].sequence_parallel
    assert sorted(per_degree) == [1, 2, 4] and rows[0].activations == per_degree[1]
    # Per rank: 1/N of the row's tokens (4 layers × (8h + 4f) fp32 values each, and their
    # whole fp32 logits and log-softmax: a byte vocabulary's stay under the chunking budget),
    # plus the row's L × L mask.
    from accord.planner.estimate import meta_model

    kept_per_token = 4 * (8 * 256 + 4 * 1024) * 4 + 2 * 4 * meta_model(recipe).config.vocab_size
    assert per_degree[1] - per_degree[2] == kept_per_token * 4096 - 8192**2
    assert per_degree[1] > per_degree[2] > per_degree[4]
    base = min(r.total - r.activations for r in rows)
    between = (base + (per_degree[2] + per_degree[1]) / 2) / GIB  # sp 2 fits, sp 1 does not
    assert recommend(rows, recipe, world, between).startswith(
        "recommended: engine.sequence_parallel=2 with engine.strategy="
    )
    too_small = (base + per_degree[4] / 2) / GIB
    assert "engine.sequence_parallel" in recommend(rows, recipe, world, too_small).split("use more")[1]
    # Under sequence_parallel 2 the plan's micro-batch arithmetic counts data-parallel groups.
    rows2, _ = plan(validate_recipe(raw | {"engine": raw["engine"] | {"sequence_parallel": 2}}), gpus=4)
    assert rows2[0].activations == per_degree[2] and (rows2[0].micro_batch_size, rows2[0].grad_accum) == (1, 4)


PACKED_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from accord.distributed.group import DistInfo
from accord.engine.sequence_parallel.ulysses import install_ulysses
from accord.tasks.base import IGNORE, causal_token_loss
from accord.tasks.causal import CausalLMTask, packed_position_ids, block_causal_mask
from accord.tasks.sequence_shards import SequenceShards

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, attn_implementation="sdpa")
torch.manual_seed(0)
alone = LlamaForCausalLM(config)  # plain transformers, one document at a time
packed = LlamaForCausalLM(config)
packed.load_state_dict(alone.state_dict())
# 20 tokens: 3 documents
docs = [torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 6)]
loss_alone = sum(causal_token_loss(alone(input_ids=d[None]).logits, d[None])[0] for d in docs)
loss_alone.backward()

info = DistInfo(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
install_ulysses(world, packed, info, micro_batch_size=1)
ids = torch.cat(docs)[None]
labels = torch.cat([torch.cat([torch.tensor([IGNORE]), d[1:]]) for d in docs])[None]  # no target across documents
lengths = [[len(d) for d in docs]]
batch = {
    "input_ids": ids,
    "labels": labels,
    "position_ids": packed_position_ids(lengths, 20),
    "attention_mask": block_causal_mask(lengths, 20, False),
}
task = CausalLMTask.__new__(CausalLMTask)
task.logprobs = None
out = task.loss(packed, SequenceShards(world, rank, "sdpa").shard(batch))
out.loss_sum.backward()
loss = out.loss_sum.detach().clone()
dist.all_reduce(loss)
grads = {n: p.grad.clone() for n, p in packed.named_parameters()}
for g in grads.values():
    dist.all_reduce(g)
if rank == 0:
    reference = dict(alone.named_parameters())
    grad = max((grads[n] - reference[n].grad).abs().max().item() for n in grads)
    print(json.dumps({"loss": abs(loss.item() - loss_alone.item()), "grad": grad}))
# As accord's workers leave (accord.distributed.group.shutdown, exit_after_shutdown):
# no static-destructor abort at exit.
from accord.distributed.group import exit_after_shutdown, shutdown
shutdown()
exit_after_shutdown(0)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_a_packed_rows_loss_and_gradient_under_sequence_parallel_equal_its_documents_alone(tmp_path):
    """Three documents packed in one 20-token row, cut over 2 ranks (a document crosses the
    cut): the summed loss and the gradient (summed over the group) equal those of each
    document run alone through a plain transformers model."""
    import json
    import sys

    from conftest import accord_env, run_process

    script = tmp_path / "packed.py"
    script.write_text(PACKED_SCRIPT)
    proc = run_process(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        timeout=300,
        env=accord_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["loss"] <= 1e-5 and result["grad"] <= 1e-5
