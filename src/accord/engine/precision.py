"""Mixed precision: autocast dtype and the fp16 gradient scaler."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "no":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def build_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
