"""Memory levers for long rows change where activations live, not what is computed:
offloaded activation checkpointing (engine.activation_checkpointing: offload) and the tiled
MLP (engine.tiled_mlp) give the plain model's loss and gradients; engine.context_parallel,
not a recipe key until it can be built here, is named with the reason in one line."""

from __future__ import annotations

import copy

import pytest
import torch

import accord.engine.long_rows as long_rows
from accord.engine.long_rows import apply_memory_levers, mlp_tiles
from accord.models.build import build_byte_tokenizer, build_model
from accord.recipe.engine import EngineConfig
from accord.recipe.schema import RecipeError, validate_recipe
from accord.tasks import build_task, task_config
from conftest import TINY_RECIPE

LENGTH = 40  # a row that the tiles below split unevenly (40 = 14 + 13 + 13 with 3 tiles)


def _recipe(**engine):
    raw = copy.deepcopy(TINY_RECIPE) | {"task": "pretrain"}
    raw["engine"] = raw["engine"] | engine
    raw["data"] = {"train": "unused.txt", "max_length": LENGTH}
    return validate_recipe(raw)


def _loss_and_grads(**engine):
    recipe = _recipe(**engine)
    tokenizer = build_byte_tokenizer()
    model = build_model(recipe.model, tokenizer, recipe.seed)
    apply_memory_levers(model, recipe.engine, recipe.data.max_length, torch.device("cpu"))
    task = build_task(task_config(recipe), tokenizer)
    task.configure_model(model)
    model.train()
    ids = torch.randint(3, 250, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    out = task.loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    out.loss_sum.backward()
    return model, out.loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(reference, other, what):
    (_, ref_loss, ref_grads), (_, loss, grads) = reference, other
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    worst = max(
        ((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-30)).item() for n in ref_grads
    )
    print(f"{what}: max |Δgrad| / max |grad| {worst:.2e}")
    assert worst <= 1e-6, what


def test_offloaded_checkpointing_and_tiled_mlp_give_the_plain_loss_and_gradients(monkeypatch):
    packed: list[torch.Size] = []

    class CountingHostSavedTensors(long_rows.HostSavedTensors):
        """The real hooks, counting what passes through them (on the CPU nothing moves)."""

        def __init__(self, pin_memory):
            super().__init__(pin_memory)
            pack = self.pack_hook
            self.pack_hook = lambda t: packed.append(t.shape) or pack(t)

    monkeypatch.setattr(long_rows, "HostSavedTensors", CountingHostSavedTensors)
    plain = _loss_and_grads()
    assert not packed

    offloaded = _loss_and_grads(activation_checkpointing="offload")
    _assert_same(plain, offloaded, "offload")
    # Checkpointing is on (each layer keeps only its input) and its saved tensors went through
    # the host hooks: the hidden states entering both decoder layers are among them.
    hidden = torch.Size([2, LENGTH, TINY_RECIPE["model"]["config"]["hidden_size"]])
    assert offloaded[0].model.gradient_checkpointing
    assert packed.count(hidden) >= TINY_RECIPE["model"]["config"]["num_hidden_layers"]

    calls = []
    tiled = _loss_and_grads(tiled_mlp=3)
    for layer in tiled[0].model.layers:
        layer.mlp.gate_proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[-2]))
    _assert_same(plain, tiled, "tiled_mlp=3")
    with torch.no_grad():
        tiled[0](input_ids=torch.zeros(1, LENGTH, dtype=torch.long))
    assert calls == [14, 13, 13] * 2  # three tiles per layer, each a third of the row

    _assert_same(plain, _loss_and_grads(activation_checkpointing="offload", tiled_mlp=True), "offload + tiled_mlp=true")


def test_tiled_mlp_true_takes_tiles_of_about_hidden_size_tokens_of_max_length():
    model = build_model(_recipe().model, build_byte_tokenizer(), 0)  # hidden_size 32
    assert mlp_tiles(True, 4096, model) == 128
    assert mlp_tiles(True, 40, model) == 2
    assert mlp_tiles(5, 4096, model) == 5


@pytest.mark.parametrize(
    "engine, data, expected",
    [
        ({"tiled_mlp": 0}, {}, "engine.tiled_mlp=0 must be true, false or a number of tiles of at least 1"),
        (
            {"activation_checkpointing": "host"},
            {},
            "engine.activation_checkpointing='host' must be true, false or offload",
        ),
    ],
    ids=["tiles-zero", "checkpointing-word"],
)
def test_bad_long_row_settings_are_one_line_errors(engine, data, expected):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["engine"] |= engine
    raw["data"] |= data
    with pytest.raises(RecipeError) as err:
        validate_recipe(raw)
    message = str(err.value)
    assert expected in message and "\n" not in message, message


def test_context_parallel_is_named_as_not_available_with_what_to_use_instead():
    raw = copy.deepcopy(TINY_RECIPE)
    raw["engine"] |= {"context_parallel": 2, "strategy": "fsdp"}
    with pytest.raises(RecipeError) as err:
        validate_recipe(raw)
    message = str(err.value)
    assert "engine.context_parallel is not available in accord yet" in message, message
    assert "use engine.sequence_parallel=N" in message and "\n" not in message, message
    assert "context_parallel" not in EngineConfig.model_fields


def test_plan_leaves_offloaded_layer_inputs_and_all_but_one_mlp_tile_off_the_gpu():
    from accord.planner.estimate import plan

    raw = copy.deepcopy(TINY_RECIPE)
    config = raw["model"]["config"] = raw["model"]["config"] | {"max_position_embeddings": 4096}
    raw["data"]["max_length"] = 4096
    tokens = 4096 * 8  # micro batch 8
    activations = {}
    for name, engine in {
        "checkpointing": {"activation_checkpointing": True},
        "offload": {"activation_checkpointing": "offload"},
        "offload+tiles": {"activation_checkpointing": "offload", "tiled_mlp": 4},
    }.items():
        raw["engine"] |= engine
        rows, _ = plan(validate_recipe(raw), gpus=2)
        activations[name] = rows[0].activations
    h, f, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    assert activations["checkpointing"] - activations["offload"] == layers * h * 4 * tokens  # fp32 layer inputs
    assert activations["offload"] - activations["offload+tiles"] == 4 * f * 4 * tokens * 3 / 4
    raw["engine"] |= {"tiled_mlp": False}
    cpu_rows, _ = plan(validate_recipe(raw), gpus=2, cpu=True)  # host memory is the device's on a CPU run
    raw["engine"] |= {"activation_checkpointing": True}
    assert cpu_rows[0].activations == plan(validate_recipe(raw), gpus=2, cpu=True)[0][0].activations
