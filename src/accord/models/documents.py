"""Attention document by document for packed rows on the CPU.

A packed micro-batch padded to B rows of L tokens and a B×L×L block-diagonal mask costs the
padding's compute in every layer and the whole row's attention (the CPU's SDPA kernels compute
every block of an explicit mask). Flattened instead (accord.tasks.causal), the micro-batch is
one sequence of only its documents' tokens, and attention runs over each document alone:
causal SDPA per document, on the very tokens the block-diagonal mask would let it see. The
linear layers then compute no padding at all, and attention costs Σ n² over the documents.

The model's attention implementation is swapped for one that does this when the forward pass
carries `accord_documents` (the documents' lengths, in order) and otherwise is plain SDPA
(generation, or any forward without it, builds its masks as before). Only for models whose
every layer is plain causal attention through transformers' attention interface: a sliding
window, or attention that is not dispatched, keeps the mask.
"""

from __future__ import annotations

from typing import Any

import torch

from accord.compat.transformers import attn_implementation, set_attn_implementation, text_config

NAME = "accord_documents_sdpa"
KWARG = "accord_documents"


def _attention(module, query, key, value, attention_mask, *args, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    lengths = kwargs.pop(KWARG, None)
    if lengths is None or query.shape[0] != 1:
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    # q, k, v: 1 × heads × tokens × head size; each document sees its own earlier tokens only
    # (no mask given: SDPA's causal form), as the block-diagonal mask would allow.
    outputs, start = [], 0
    for n in lengths.tolist():
        end = start + n
        out, _ = sdpa(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None, **kwargs)
        outputs.append(out)
        start = end
    return torch.cat(outputs, dim=1), None


def _plain_causal(model: torch.nn.Module) -> bool:
    config = text_config(model.config)
    if getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return False
    return bool(getattr(model, "_supports_attention_backend", False))


def install_document_attention(model: torch.nn.Module) -> bool:
    """Swap `model`'s SDPA attention for the document-by-document one; False where it keeps its own."""
    if attn_implementation(model.config) != "sdpa" or not _plain_causal(model):
        return False
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    set_attn_implementation(model.config, NAME)
    text = text_config(model.config)
    if text is not model.config:
        set_attn_implementation(text, NAME)
    return True


def flat_inputs(doc_lengths: list[int]) -> dict[str, Any]:
    """What a flattened micro-batch passes the model besides its tokens: the documents' lengths,
    and an empty 4D placeholder mask, which transformers hands through unbuilt (the attention
    above ignores it) instead of building a tokens × tokens mask from the restarting positions;
    any other attention given it fails loudly (it broadcasts with nothing)."""
    return {
        KWARG: torch.tensor(doc_lengths, dtype=torch.long),
        "attention_mask": torch.ones((1, 1, 0, 0), dtype=torch.bool),
    }
