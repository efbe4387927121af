"""peft internals accord uses: how a LoRA adapter on a parameter (peft's ParamWrapper, which
`target_parameters`, and `all-linear` on a mixture-of-experts model, put on the fused 3-D expert
weights and the router) folds into that parameter, for the merged export (output.export) that
streams the tensors one by one and so cannot call the layer's own `get_delta_weight`. The
layer's `parameter_name` and `num_experts` are public attributes; the orientation of the
experts' weights (`_did_swap_in_out_features`) is not.
"""

from __future__ import annotations

from typing import Any

from accord.compat import incompatible, installed_version

WRITTEN_FOR = "0.21"


def is_parameter_adapter(layer: Any) -> bool:
    """Whether a LoRA layer adapts a parameter (a ParamWrapper) rather than a module's weight."""
    return type(layer).__name__ == "ParamWrapper"


def parameter_name(layer: Any) -> str:
    return layer.parameter_name


def parameter_delta(layer: Any, lora_a: Any, lora_b: Any, scaling: float) -> Any:
    """What the adapter adds to its parameter, as ParamWrapper.get_delta_weight computes it from
    the adapter's A and B: per expert B_e·A_e, laid out as the parameter is."""
    import torch

    experts = getattr(layer, "num_experts", None)
    if experts is None:
        raise _missing("ParamWrapper.num_experts")
    if experts == 1:
        return (lora_b @ lora_a) * scaling
    swapped = getattr(layer, "_did_swap_in_out_features", None)
    if swapped is None:
        raise _missing("ParamWrapper._did_swap_in_out_features")
    a = lora_a.reshape(experts, -1, lora_a.shape[-1])  # experts × rank × in
    b = lora_b.reshape(lora_b.shape[0], -1, experts)  # out × rank × experts
    return torch.einsum("o r e, e r i -> e o i" if swapped else "o r e, e r i -> e i o", b, a) * scaling


def _missing(what: str) -> Exception:
    return incompatible("peft", installed_version("peft"), f"no {what}", "the merged LoRA export", WRITTEN_FOR)
