"""Model FLOPs per token and the accelerator's peak rate, for MFU (model FLOPs utilisation).

FLOPs per trained token follow the usual estimate: 6·N for the matrix multiplies of
forward and backward over the N non-embedding parameters, plus 12·L·d·T for attention
scores and values over a context of T tokens (L layers, width d).
"""

from __future__ import annotations

import re

import torch
from torch import nn

# Dense bf16 tensor-core peaks (TFLOP/s) of common accelerators, matched against
# torch.cuda.get_device_name(); engine.peak_tflops overrides.
PEAK_BF16_TFLOPS = {
    r"H200": 989.0,
    r"H100.*(PCIe|PCIE)": 756.0,
    r"H100": 989.0,
    r"GH200": 989.0,
    r"B200": 2250.0,
    r"A100": 312.0,
    r"L40S": 362.0,
    r"L40\b": 181.0,
    r"A10G": 125.0,
    r"\bA10\b": 125.0,
    r"\bL4\b": 121.0,
    r"RTX 4090": 165.0,
    r"A6000": 155.0,
    r"V100": 125.0,  # fp16: no bf16 units
}


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Peak dense bf16 TFLOP/s of one device, or None when unknown (or on the CPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, value in PEAK_BF16_TFLOPS.items():
        if re.search(pattern, name):
            return value
    return None


def flops_per_token(model: nn.Module, context: float, idle_params: int = 0) -> float:
    """Training FLOPs per token (forward + backward) for a context of `context` tokens;
    `idle_params`: parameters a token does not pass through (a mixture-of-experts model's
    experts it is not routed to)."""
    config = getattr(model, "config", None)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding_params = embeddings.weight.numel() if embeddings is not None else 0
    n = sum(p.numel() for p in model.parameters()) - embedding_params - idle_params
    layers = getattr(config, "num_hidden_layers", 0) or 0
    width = getattr(config, "hidden_size", 0) or 0
    return 6.0 * n + 12.0 * layers * width * context
