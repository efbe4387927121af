"""Texts to token ids, the way the data layer and every task tokenize them."""

from __future__ import annotations


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts, add_special_tokens=False)["input_ids"]`, faster: a fast tokenizer's
    backend encodes ids only (`encode_batch_fast` computes no offsets, about half the time
    of tokenizing), and no attention masks are built. The plain call where the backend lacks
    it or is set up differently from what that call would set (truncation, padding, special
    tokens split), or whose class encodes its own way (a model's tokenizer that overrides the
    encoding step, e.g. CodeLlama's): the same ids either way."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    as_called = (
        fast is not None and _plain_encoding(type(tokenizer)) and backend.truncation is None and backend.padding is None
    )
    if not as_called or backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [encoding.ids for encoding in fast(texts, add_special_tokens=False)]


def _plain_encoding(cls) -> bool:
    """Whether `cls(texts)` is the backend's encode_batch and nothing else (transformers 5's
    TokenizersBackend, not overridden)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers 4: the plain call
        return False
    return (
        issubclass(cls, TokenizersBackend)
        and cls._encode_plus is TokenizersBackend._encode_plus
        and cls.__call__ is PreTrainedTokenizerBase.__call__
    )
