"""The chunked loss (train.loss_chunk_size) gives the plain loss's values and gradients while
the full-vocabulary logits are never materialised, for sft, pretrain and dpo, in one process
and in a 2-process run."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from accord.models.build import build_byte_tokenizer, build_model
from accord.recipe.schema import validate_recipe
from accord.tasks import build_task, task_config
from accord.tasks.chunked_loss import AUTO_CHUNK_TOKENS, AUTO_WHOLE_LOGITS_BYTES, chunk_tokens, shifted_targets
from conftest import TINY_RECIPE, assert_ok, final_params, max_param_diff, run_accord, step_losses

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
CHUNK = 5  # tokens: every batch below spans several chunks and a partial last one


def _recipe(task: str, chunk: int, **sections) -> object:
    raw = copy.deepcopy(TINY_RECIPE) | {"task": task}
    raw["train"] = raw["train"] | {"loss_chunk_size": chunk}
    for key, value in sections.items():
        raw[key] = raw.get(key, {}) | value
    return validate_recipe(raw)


def _tasks_and_models(task: str, **sections):
    """(plain task, plain model), (chunked task, chunked model): the same starting weights."""
    tokenizer = build_byte_tokenizer()
    out = []
    for chunk in (0, CHUNK):
        recipe = _recipe(task, chunk, **sections)
        model = build_model(recipe.model, tokenizer, recipe.seed)
        t = build_task(task_config(recipe), tokenizer)
        t.configure_model(model)
        out.append((t, model))
    return out


def _batch(task, columns: dict[str, list]) -> dict[str, torch.Tensor]:
    encoded = task.encode_batch(columns)
    if "num_targets" not in encoded:  # pretraining cuts blocks after encoding
        from accord.tasks.pretrain import _rows

        encoded = _rows(encoded["input_ids"], over=None)
    rows = [[{k: v[i] for k, v in encoded.items()}] for i in range(len(encoded["num_targets"]))]
    return task.collate(rows)


def _loss_and_grads(task, model, batch):
    model.zero_grad()
    out = task.loss(model, batch)
    out.loss_sum.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(plain, chunked):
    (plain_out, plain_grads), (chunked_out, chunked_grads) = plain, chunked
    torch.testing.assert_close(chunked_out.loss_sum, plain_out.loss_sum, rtol=1e-6, atol=1e-6)
    assert int(chunked_out.num_targets) == int(plain_out.num_targets)
    assert plain_grads.keys() == chunked_grads.keys() and "lm_head.weight" in plain_grads
    # Relative to each gradient's largest entry: the losses are sums (not means) over targets.
    worst = max(
        ((chunked_grads[n] - plain_grads[n]).abs().max() / plain_grads[n].abs().max().clamp(min=1e-30)).item()
        for n in plain_grads
    )
    print(f"max |Δgrad| / max |grad| {worst:.2e}")
    assert worst <= 1e-6


PROMPTS = ["12+345=", "7+8=", "100+200=", "0+0="]
COMPLETIONS = ["357", "15", "300", "0"]


@pytest.mark.parametrize("packing", [False, True], ids=["one-per-row", "packed"])
def test_chunked_sft_loss_and_gradients_equal_the_plain_ones_on_completion_tokens(packing):
    (plain, plain_model), (chunked, chunked_model) = _tasks_and_models("sft", data={"packing": packing})
    assert plain.config.data.completion_only_loss and chunked.logprobs is not None and plain.logprobs is None
    columns = {"prompt": PROMPTS, "completion": COMPLETIONS}
    if packing:
        encoded = plain.encode_batch(columns)
        examples = [{k: v[i] for k, v in encoded.items()} for i in range(len(PROMPTS))]
        batch = plain.collate([examples[:3], examples[3:]])  # two rows, three documents in the first
    else:
        batch = _batch(plain, columns)
    _assert_same(_loss_and_grads(plain, plain_model, batch), _loss_and_grads(chunked, chunked_model, batch))


def test_chunked_pretrain_loss_and_gradients_equal_the_plain_ones():
    (plain, plain_model), (chunked, chunked_model) = _tasks_and_models("pretrain", data={"packing": False})
    batch = _batch(plain, {"text": ["the cat sat on the mat", "a dog ran under the big red sun today"]})
    _assert_same(_loss_and_grads(plain, plain_model, batch), _loss_and_grads(chunked, chunked_model, batch))


def _moved_from_the_reference(*models) -> None:
    """The same seeded step away from the starting weights for each policy: at the reference
    every margin is 0 up to rounding, and the accuracy metric would count the rounding."""
    generator = torch.Generator().manual_seed(0)
    noise = {n: 0.05 * torch.randn(p.shape, generator=generator) for n, p in models[0].named_parameters()}
    with torch.no_grad():
        for model in models:
            for name, param in model.named_parameters():
                param.add_(noise[name])


def test_chunked_dpo_loss_gradients_and_rewards_equal_the_plain_ones():
    (plain, plain_model), (chunked, chunked_model) = _tasks_and_models("dpo")
    _moved_from_the_reference(plain_model, chunked_model)
    assert chunked.reference.reference_logprobs is not None  # the frozen reference is chunked too
    batch = _batch(plain, {"prompt": PROMPTS, "chosen": COMPLETIONS, "rejected": ["358", "16", "301", "1"]})
    plain_result, chunked_result = (
        _loss_and_grads(plain, plain_model, batch),
        _loss_and_grads(chunked, chunked_model, batch),
    )
    _assert_same(plain_result, chunked_result)
    for name, value in plain_result[0].metrics.items():
        torch.testing.assert_close(chunked_result[0].metrics[name], value, rtol=1e-6, atol=1e-6)


def test_generation_and_whole_logits_are_untouched_by_the_chunked_head():
    """Outside a loss request the output layer is the plain one: generate and eval see logits."""
    (_, plain_model), (_, chunked_model) = _tasks_and_models("sft")
    ids = torch.tensor([[1, 40, 41, 42]])
    torch.testing.assert_close(chunked_model(input_ids=ids).logits, plain_model(input_ids=ids).logits, rtol=0, atol=0)


def test_a_row_without_targets_still_reaches_the_output_layer():
    """Every strategy's gradient hooks expect the output layer in each backward, as with the plain loss."""
    (plain, plain_model), (chunked, chunked_model) = _tasks_and_models("sft")
    batch = _batch(plain, {"prompt": PROMPTS[:2], "completion": COMPLETIONS[:2]})
    batch["labels"][:] = -100
    _, grads = _loss_and_grads(chunked, chunked_model, batch)
    assert "lm_head.weight" in grads and grads["lm_head.weight"].abs().max() == 0


def test_a_model_that_rescales_its_logits_keeps_the_plain_loss():
    recipe = _recipe("sft", CHUNK)
    recipe.model.config = {
        "architecture": "granite",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "logits_scaling": 2.0,
    }
    tokenizer = build_byte_tokenizer()
    task = build_task(task_config(recipe), tokenizer)
    task.configure_model(build_model(recipe.model, tokenizer, recipe.seed, meta=True))
    assert task.logprobs is None
    assert task.describe() == [
        "loss: over whole logits "
        "(not chunked: the model rescales its logits after the output layer (logits_scaling=2.0))"
    ]


class _Doubled(torch.nn.Module):
    """A model that scales what its output layer returned before handing it back as logits."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, **inputs):
        out = self.inner(**inputs)
        out.logits = out.logits * 2
        return out


def test_a_model_that_changes_what_its_output_layer_returns_is_refused_naming_the_chunked_computation():
    """One check for every user of the output layer's second mode (the chunked loss, distill's
    divergence): its text names the one that asked."""
    from accord.errors import UserInputError
    from accord.tasks.chunked_loss import HeadCall, row_target_logprobs

    recipe, tokenizer = _recipe("sft", CHUNK), build_byte_tokenizer()
    model, task = build_model(recipe.model, tokenizer, recipe.seed), build_task(task_config(recipe), tokenizer)
    task.configure_model(model)
    batch = _batch(task, {"prompt": PROMPTS[:2], "completion": COMPLETIONS[:2]})
    inputs = {k: v for k, v in batch.items() if k != "labels"}  # as the task's loss passes them
    targets = shifted_targets(batch["labels"])
    with pytest.raises(UserInputError, match="so the chunked loss cannot be used with it; set train.loss_chunk_size=0"):
        task.logprobs.row_logprobs(_Doubled(model), inputs, targets)

    def project(hidden, weight, bias):
        return row_target_logprobs(hidden, targets, weight, bias, CHUNK)

    call = HeadCall.install(model)
    assert call is task.logprobs.call  # one mode per output layer, whoever installs it
    with pytest.raises(UserInputError, match="so the chunked divergence cannot be used with it"):
        call.run(_Doubled(model), inputs, project, what="divergence")
    # The model itself hands back what its layer computed; after a refusal nothing is left pending.
    hidden = model.model(**inputs).last_hidden_state
    served = call.run(model, inputs, project, what="loss")
    torch.testing.assert_close(served, project(hidden, model.lm_head.weight, model.lm_head.bias), rtol=0, atol=0)
    assert call.checked and call.pending is None and model(**inputs).logits.shape[-1] == model.lm_head.out_features


@pytest.mark.distributed
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["train.loss_chunk_size=7"], id="ddp-chunk7"),
        pytest.param(["engine.strategy=fsdp", "train.loss_chunk_size=7"], marks=pytest.mark.slow, id="fsdp-chunk7"),
        pytest.param(
            ["engine.strategy=zero3", "train.loss_chunk_size=7"],
            marks=[pytest.mark.slow, needs_deepspeed],
            id="zero3-chunk7",
        ),
    ],
)
def test_two_process_chunked_run_equals_the_plain_run(tmp_path, tiny_reference, overrides):
    """The session's reference run (2-process DDP, train.loss_chunk_size auto) takes the plain
    loss: its byte-level vocabulary's logits are far below the auto budget."""
    recipe, reference = tiny_reference
    assert validate_recipe(TINY_RECIPE).train.loss_chunk_size == "auto"
    assert chunk_tokens("auto", 8 * TINY_RECIPE["data"]["max_length"], 262) == 0
    out = tmp_path / "run"
    assert_ok(run_accord("train", recipe, *overrides, f"output.dir={out}"))
    diff = max_param_diff(final_params(reference), final_params(out))
    expected, losses = step_losses(reference), step_losses(out)
    loss_diff = max(abs(expected[s] - losses[s]) for s in expected)
    print(f"{overrides}: max |Δparam| {diff:.2e}, max |Δloss| {loss_diff:.2e}")
    assert sorted(expected) == sorted(losses) == list(range(1, TINY_RECIPE["train"]["max_steps"] + 1))
    assert diff <= 1e-5 and loss_diff <= 1e-5


def test_auto_chunk_size_chunks_only_micro_batches_whose_logits_pass_the_budget():
    """auto: a byte-level vocabulary keeps the plain loss (same sums, same trajectory as
    before the chunked loss existed); a 32k vocabulary chunks from about one chunk's worth."""
    assert AUTO_CHUNK_TOKENS == 1024 and AUTO_WHOLE_LOGITS_BYTES == 128 * 2**20
    assert chunk_tokens("auto", 8 * 256, 262) == 0  # the quickstart's micro batch
    assert chunk_tokens("auto", 100_000, 262) == 0
    assert chunk_tokens("auto", 1024, 32000) == 0 and chunk_tokens("auto", 1100, 32000) == 1024
    assert chunk_tokens("auto", 2048, 151936) == 1024
    assert chunk_tokens(0, 10**6, 32000) == 0 and chunk_tokens(7, 8, 262) == 7  # a number is always obeyed
    # In a task: the tiny byte-vocabulary model under auto computes exactly the plain loss.
    tokenizer = build_byte_tokenizer()
    losses = []
    for setting in ("auto", 0):
        recipe = _recipe("pretrain", setting)
        model = build_model(recipe.model, tokenizer, recipe.seed)
        task = build_task(task_config(recipe), tokenizer)
        task.configure_model(model)
        ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        assert (task.logprobs is not None) == (setting == "auto") and (setting == 0 or not task.logprobs.serves(ids))
        losses.append(task.loss(model, batch).loss_sum)
    assert torch.equal(losses[0], losses[1])


def test_plan_counts_one_chunk_of_logits_instead_of_whole_ones(tmp_path):
    from accord.planner.estimate import plan

    raw = copy.deepcopy(TINY_RECIPE)
    raw["model"]["config"] = raw["model"]["config"] | {"vocab_size": 32000, "max_position_embeddings": 8192}
    raw["data"]["max_length"] = 8192
    tokens = 8192 * 4  # micro batch 4 on 2 processes (global 32 → 2 × 4 × 4)
    raw["batch"]["micro_batch_size"] = 4
    activations = {}
    for chunk in (0, 1024):
        raw["train"]["loss_chunk_size"] = chunk
        rows, _ = plan(validate_recipe(raw), gpus=2)
        activations[chunk] = rows[0].activations
    assert activations[0] - activations[1024] == 2 * 4 * tokens * 32000 - 4 * 4 * 1024 * 32000
    raw["task"] = "classify"  # not a chunked task: the estimate keeps whole logits
    rows, _ = plan(validate_recipe(raw), gpus=2)
    assert rows[0].activations == activations[0]


def test_chunked_pretrain_loss_equals_transformers_own_loss():
    """Against code accord did not write: the model's own `labels=` loss (transformers' shift and
    mean over targets) on the same batch, from a model accord never touched."""
    (plain, plain_model), (chunked, chunked_model) = _tasks_and_models("pretrain", data={"packing": False})
    batch = _batch(plain, {"text": ["the cat sat on the mat", "a dog ran under the big red sun today"]})
    out = chunked.loss(chunked_model, batch)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    theirs = plain_model(**inputs, labels=batch["labels"]).loss
    torch.testing.assert_close(out.loss_sum / out.num_targets, theirs, rtol=1e-6, atol=1e-6)
