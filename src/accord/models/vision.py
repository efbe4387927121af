"""Vision-language models (transformers' AutoModelForImageTextToText families): telling one
from a text-only model, their processors (the model folder's, or for a LLaVA built from a
config one made in code from accord's byte tokenizer), and the parts `model.freeze` names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from accord.errors import UserInputError
from accord.recipe.hub import local_path
from accord.recipe.schema import BYTE_TOKENIZER, ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IMAGE_TOKEN = "<image>"  # the byte processor's image placeholder (LLaVA's own spelling)
# The byte processor's chat template: content given as a string or as parts; an image part is
# one IMAGE_TOKEN, which the processor expands to the image's tokens. The generation markers
# let transformers' return_assistant_tokens_mask (TRL's assistant_only_loss) find the answers.
BYTE_VISION_CHAT_TEMPLATE = (
    "{% macro body(content) %}{% if content is string %}{{ content }}{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' %}" + IMAGE_TOKEN + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ body(message['content']) }}<|eos|>{% endgeneration %}"
    "{% else %}{{ body(message['content']) }}<|eos|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# model.freeze's names for the parts of a vision-language model -> the attribute names the
# transformers families give them (LLaVA, Qwen2-VL, Idefics3 / SmolVLM, Gemma 3, ...).
PARTS = {
    "vision_tower": ("vision_tower", "visual", "vision_model"),
    "projector": ("multi_modal_projector", "connector", "merger"),
    "language_model": ("language_model",),
}


def model_type(cfg: ModelConfig) -> str | None:
    """The transformers model type a recipe's model has (its config.json's, or model.config's
    architecture), without importing any model code; None where it cannot be read yet."""
    if cfg.config is not None:
        return str(cfg.config.get("architecture"))
    try:
        folder = local_path(cfg.path, cfg.revision, where="model.path")
    except UserInputError:
        return None
    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def is_vision_language(cfg: ModelConfig) -> bool:
    """Whether transformers loads the model with AutoModelForImageTextToText."""
    kind = model_type(cfg)
    if kind is None:
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def add_image_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The byte tokenizer with the image placeholder as one special token, and the chat
    template that renders image parts."""
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.image_token = IMAGE_TOKEN
    tokenizer.chat_template = BYTE_VISION_CHAT_TEMPLATE
    return tokenizer


def vision_config(settings: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """model.config of a LLaVA with the byte tokenizer's vocabulary and special ids filled in
    where the recipe leaves them out (the text model's, and the image token's)."""
    text = dict(settings.get("text_config") or {})
    text.setdefault("model_type", "llama")
    text.setdefault("vocab_size", len(tokenizer))
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        text.setdefault(name, getattr(tokenizer, name))
    out = dict(settings) | {"text_config": text}
    out.setdefault("image_token_index", tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    out.setdefault("vision_feature_select_strategy", "default")
    return out


def build_processor(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, model_config=None):
    """The model's processor: model.processor's folder, else the model folder's (AutoProcessor);
    for a LLaVA built from model.config with the byte tokenizer, one made in code (transformers'
    LlavaProcessor over a CLIP image processor sized to the vision tower). The returned
    processor's tokenizer is `tokenizer`, so the text encodes as the rest of the run encodes it."""
    source = cfg.processor or (cfg.path if cfg.config is None else None)
    if source is not None:
        from transformers import AutoProcessor

        folder = local_path(source, cfg.revision if source == cfg.path else None, where="model.processor")
        try:
            processor = AutoProcessor.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
        except Exception as e:  # transformers raises many kinds; all mean the same to the user
            reason = " ".join(str(e).split())[:300]
            raise UserInputError(
                f"model.processor: no image processor can be loaded from {folder} ({type(e).__name__}: {reason}); "
                "point model.processor at a folder with the model's preprocessor_config.json"
            ) from None
        if not hasattr(processor, "image_processor"):
            raise UserInputError(
                f"model.processor: {folder} holds a tokenizer but no image processor (preprocessor_config.json); "
                "point model.processor at the vision-language model's processor folder"
            )
        processor.tokenizer = tokenizer
        return processor
    architecture = model_type(cfg)
    if architecture != "llava" or (cfg.tokenizer not in (None, BYTE_TOKENIZER)):
        raise UserInputError(
            f"model.config: a {architecture} model built from a config needs its processor: set model.processor to a "
            "folder holding one (accord makes one in code only for llava with the byte tokenizer)"
        )
    return byte_llava_processor(tokenizer, model_config)


def byte_llava_processor(tokenizer: PreTrainedTokenizerBase, config):
    """transformers' LlavaProcessor for a LLaVA config: square crops of the vision tower's
    image size, CLIP's normalisation, the PIL image processor (no torchvision needed)."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vision = config.vision_config
    size = vision.image_size
    images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=vision.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops again
        chat_template=BYTE_VISION_CHAT_TEMPLATE,
    )


def part_modules(model: nn.Module) -> dict[str, list[tuple[str, nn.Module]]]:
    """model.freeze's part names -> the (qualified name, module) pairs they name on `model`."""
    found: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        for part, attributes in PARTS.items():
            covered = any(name.startswith(f"{other}.") for other, _ in found.get(part, []))
            if last in attributes and not covered:
                found.setdefault(part, []).append((name, module))
    return found


def freeze(model: nn.Module, names: list[str]) -> list[str]:
    """Turn off the gradients of the parts `names` (model.freeze); returns the modules frozen.
    A name is a part (vision_tower, projector, language_model) or any module's qualified name;
    one that names nothing is one line listing the valid ones."""
    parts = part_modules(model)
    modules = dict(model.named_modules())
    frozen = []
    for name in names:
        targets = parts.get(name) or ([(name, modules[name])] if name and name in modules else [])
        if not targets:
            top = [n for n, _ in model.named_children()]
            raise UserInputError(
                f"model.freeze: {type(model).__name__} has no part {name!r} (parts: {', '.join(parts) or 'none'}; "
                f"or a module name such as {', '.join(top)})"
            )
        for qualified, module in targets:
            for parameter in module.parameters():
                parameter.requires_grad_(False)
            frozen.append(qualified)
    return frozen


def leaves_parameters_unused(model: nn.Module) -> bool:
    """Whether some trained parameters may get no gradient in a step: the vision tower and
    projector are unused by a micro-batch without images, and some towers have layers no
    caption reaches (CLIP's post-layernorm feeds only its pooled output). DDP must then look
    for them."""
    parts = part_modules(model)
    image_side = [module for part in ("vision_tower", "projector") for _, module in parts.get(part, [])]
    return any(p.requires_grad for module in image_side for p in module.parameters())


def language_model_linears(model: nn.Module) -> list[str]:
    """The qualified names of the language model's linear layers (LoRA's `all-linear` on a
    vision-language model: the vision tower and projector keep their weights)."""
    roots = [name for name, _ in part_modules(model).get("language_model", [])]
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(name.startswith(f"{root}.") for root in roots)
    ]
