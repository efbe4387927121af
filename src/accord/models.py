"""Build or load the model and its tokenizer (no network: local folders and configs only)."""

from __future__ import annotations

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from accord.recipe import BYTE_TOKENIZER, ModelConfig

# A plain role-tagged template: every turn is <|role|>content<|eos|>, and a generation
# prompt opens the assistant's turn. Byte-level, so it renders any text.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code: ids 0-255 are the bytes, then special tokens.

    No merges, so every string (any language, any symbol) round-trips exactly and the
    vocabulary stays tiny — right for small models trained from scratch.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=BYTE_CHAT_TEMPLATE,
        padding_side="right",
    )


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    source = cfg.tokenizer or (cfg.path if cfg.path is not None else BYTE_TOKENIZER)
    if source == BYTE_TOKENIZER:
        return build_byte_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token is None:
        # Padding positions never reach the loss (labels are masked), so any id will do.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """The causal LM in fp32 on the CPU; the engine moves, wraps and casts it."""
    kwargs = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
    if cfg.path is not None:
        return AutoModelForCausalLM.from_pretrained(
            cfg.path, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code, **kwargs
        )
    settings = dict(cfg.config or {})
    architecture = settings.pop("architecture")
    settings.setdefault("vocab_size", len(tokenizer))
    settings.setdefault("pad_token_id", tokenizer.pad_token_id)
    settings.setdefault("bos_token_id", tokenizer.bos_token_id)
    settings.setdefault("eos_token_id", tokenizer.eos_token_id)
    config = AutoConfig.for_model(architecture, **settings)
    # Every rank builds the same initial weights from the seed (DDP would broadcast rank
    # 0's anyway; sharded strategies need them equal before sharding).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
