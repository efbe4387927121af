"""The recipe's `model` section: which model, its tokenizer, and how it is built or loaded."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from accord.recipe.section import Section

BYTE_TOKENIZER = "byte"  # model.tokenizer value for accord's built-in byte-level tokenizer


class RopeScalingConfig(Section):
    """Rotary position embeddings stretched past the length a model was trained on (passed to
    transformers as the config's rope_parameters, so final/ keeps them for inference)."""

    rope_type: Literal["linear", "dynamic", "yarn"] = Field(
        ...,
        description="linear: positions divided by factor; dynamic: NTK scaling that grows past the original length; "
        "yarn: YaRN.",
    )
    factor: float = Field(..., ge=1.0, description="How many times the original context to reach (e.g. 4.0).")
    original_max_position_embeddings: int | None = Field(
        None,
        gt=0,
        description="yarn: the context the model was trained on (default: its max_position_embeddings, which becomes "
        "factor × this).",
    )


class ModelConfig(Section):
    """Which model to train: a local Hugging Face folder, or an architecture built from a config."""

    path: str | None = Field(
        None,
        description="Local folder with a Hugging Face model (config.json + weights), or a hub name ORG/NAME read "
        "through the Hugging Face cache (a local folder of that name wins).",
    )
    revision: str | None = Field(
        None,
        description="Hub models: the branch, tag or commit of model.path (default: main). The run's recipe.yaml "
        "records the commit read, which a resume keeps.",
    )
    config: dict[str, Any] | None = Field(
        None,
        description="Build a fresh model from a config instead: `architecture` (a transformers "
        "model type such as llama) plus its config fields (hidden_size, num_hidden_layers, ...).",
    )
    tokenizer: str | None = Field(
        None,
        description="`byte` for accord's built-in byte-level tokenizer, or a local tokenizer folder. "
        "Default: the model folder's tokenizer, or `byte` for a model built from a config.",
    )
    tokenizer_revision: str | None = Field(
        None, description="A hub model.tokenizer: its branch, tag or commit (default: main); recorded like revision."
    )
    processor: str | None = Field(
        None,
        description="Vision-language models: a local folder (or hub name) with the model's processor (image "
        "processor, chat template). Default: the model folder's; a llava built from model.config gets one made "
        "in code.",
    )
    freeze: list[str] = Field(
        default_factory=list,
        description="Parts of the model left untrained: vision_tower, projector, language_model (a "
        "vision-language model's), or any module's qualified name.",
    )
    attn_implementation: str | None = Field(
        None, description="Attention kernel: sdpa, eager, flash_attention_2; default: transformers' choice."
    )
    trust_remote_code: bool = Field(False, description="Allow model code shipped inside the model folder to run.")
    # A section of the model (not of data): it changes the model's config, saved with final/.
    rope_scaling: RopeScalingConfig | None = Field(
        None, description="Extend a RoPE model's context: {rope_type: linear|dynamic|yarn, factor: 4.0}."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.config is None):
            raise ValueError(
                "give exactly one of model.path (a local folder or hub name) or model.config (an architecture to build)"
            )
        if self.config is not None and "architecture" not in self.config:
            raise ValueError("model.config needs `architecture` (a transformers model type such as llama)")
        return self
