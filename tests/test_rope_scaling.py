"""model.rope_scaling reaches the model's rotary embeddings through transformers' own
rope_parameters, for a model built from a config and for a model folder."""

from __future__ import annotations

import pytest
import torch

from accord.errors import UserInputError
from accord.models.build import build_byte_tokenizer, build_model
from accord.recipe.schema import ModelConfig
from conftest import TINY_RECIPE

LLAMA = TINY_RECIPE["model"]["config"]  # max_position_embeddings 64


def _rotary(scaling: dict | None, **source):
    cfg = ModelConfig(**(source or {"config": LLAMA}), tokenizer="byte", rope_scaling=scaling)
    model = build_model(cfg, build_byte_tokenizer(), seed=0)
    return model.config, model.model.rotary_emb


def test_linear_scaling_divides_every_frequency_by_the_factor():
    _, plain = _rotary(None)
    config, scaled = _rotary({"rope_type": "linear", "factor": 4.0})
    assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 4.0
    torch.testing.assert_close(scaled.inv_freq, plain.inv_freq / 4.0)


def test_yarn_reaches_factor_times_the_trained_context():
    config, rotary = _rotary({"rope_type": "yarn", "factor": 4.0})
    assert config.rope_parameters["original_max_position_embeddings"] == 64
    assert config.max_position_embeddings == 256
    assert rotary.rope_type == "yarn" and rotary.attention_scaling > 1.0  # YaRN's attention temperature


def test_dynamic_scaling_keeps_the_trained_length_as_its_threshold():
    config, rotary = _rotary({"rope_type": "dynamic", "factor": 2.0})
    assert rotary.rope_type == "dynamic" and config.max_position_embeddings == 64


def test_a_model_folder_is_scaled_and_saves_the_scaling(tmp_path):
    model = build_model(ModelConfig(config=LLAMA, tokenizer="byte"), build_byte_tokenizer(), seed=0)
    model.save_pretrained(tmp_path / "model")
    config, rotary = _rotary({"rope_type": "linear", "factor": 2.0}, path=str(tmp_path / "model"))
    assert rotary.rope_type == "linear"
    from transformers import AutoConfig

    config.save_pretrained(tmp_path / "final")
    assert AutoConfig.from_pretrained(tmp_path / "final").rope_parameters["factor"] == 2.0


def test_a_model_without_rope_is_refused_in_one_line():
    bert = {
        "architecture": "bert",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    with pytest.raises(
        UserInputError,
        match=r"^model.rope_scaling: a bert model has no rotary position embeddings \(RoPE\) "
        r".*; drop model.rope_scaling$",
    ):
        build_model(
            ModelConfig(config=bert, tokenizer="byte", rope_scaling={"rope_type": "linear", "factor": 2.0}),
            build_byte_tokenizer(),
            0,
            meta=True,
        )
