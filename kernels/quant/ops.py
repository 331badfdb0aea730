"""The quantized linear and embedding operations, on the C++ kernels (`csrc/gemm.cpp`).

    quant_linear(x, w, bias, activations)   y = x @ W^T (+ b), W a QuantizedWeight
    embedding_rows(w, ids)                  the float rows `ids` of W (a quantized embedding)
    dequantize(w)                           the whole float32 matrix (tests, comparisons only)

`activations`: "float" multiplies float32 activations by each weight row rebuilt in float32;
"int8" first quantizes the activations per row and per 32-block to int8 (scale max|x| / 127)
and uses integer dot products. A weight carries its mode (`QuantizedWeight.activations`, the
loader's choice for the model).
"""
from __future__ import annotations

import torch

from kvmesh.kernels.quant.build import load
from kvmesh.kernels.quant.weight import QuantizedWeight

ACTIVATIONS = ("float", "int8")


def kernels_available() -> bool:
    return load() is not None


def _ext():
    ext = load()
    if ext is None:
        from kvmesh.kernels.quant.build import unavailable_reason  # noqa: PLC0415
        raise RuntimeError(f"quantized GEMM kernels unavailable: {unavailable_reason()}")
    return ext


def quant_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                 activations: str | None = None) -> torch.Tensor:
    """F.linear's contract for a quantized weight: [..., K] -> [..., N], in x's dtype (computed
    from float32 activations); `activations` overrides the weight's own mode."""
    activations = activations or w.activations
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    xf = x2 if x2.dtype == torch.float32 else x2.float()
    y = _ext().quant_gemm(xf, w.data, w.qtype, w.shape[1], activations == "int8")
    if bias is not None:
        y.add_(bias)
    y = y if x.dtype == torch.float32 else y.to(x.dtype)
    return y.view(*lead, w.shape[0])


def embedding_rows(w: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """[*ids.shape, K] float32: the rows `ids`, dequantized on lookup (nothing else is)."""
    flat = ids.reshape(-1).to(torch.int64)
    return _ext().dequantize_rows(w.data, flat, w.qtype, w.shape[1]).view(*ids.shape, w.shape[1])


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """[N, K] float32, every row (for tests and the dequantized comparison; never on the hot path)."""
    return embedding_rows(w, torch.arange(w.shape[0]))


def int8_isa() -> str:
    """Which int8 dot product this machine's build uses: avx512vnni, avxvnni, avx2 or scalar."""
    return _ext().int8_isa()
