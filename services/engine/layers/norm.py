"""RMSNorm in the two roundings HF uses.

`RMSNorm` (Llama, Qwen, Mistral, Phi-3): weight * norm(x).to(dtype), through the kernels (the
Triton path fuses the residual add). `GemmaRMSNorm` (Gemma 2 / 3): (norm(x) * (1 + weight)) in
float32, then rounded once; the weight is stored as an offset from 1 (HF's checkpoints).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: ModuleType):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With one: (norm(x + residual), x + residual)."""
        out, new_residual = self.ops.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, new_residual)


class GemmaRMSNorm(nn.Module):
    """HF Gemma2RMSNorm / Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32.

    NOTE: plain torch, not a kernel: the (1 + w) in float32 and the single final rounding differ
    from the Llama kernel's rounding in bf16/fp16, and HF-exactness matters more here than the
    fused residual add (a Triton variant is future work).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)
