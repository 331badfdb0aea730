"""The precision the engine's reductions compute in: softmax, log-softmax, attention, RoPE."""
from __future__ import annotations

import torch


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """float32 for the half types (HF's upcast), x's own dtype from float32 up: a float64 model
    keeps float64 through attention, RoPE, logits and log-probs, as transformers' does."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
