"""Projections and embeddings whose weight is held as GGUF blocks (`kvmesh.kernels.quant`).

The loader swaps a model's `nn.Linear` / `nn.Embedding` for these when it serves a GGUF tensor
quantized. Each keeps the block bytes as a buffer (`qweight`) and exposes `.weight` as a
`QuantizedWeight` view of them, so the layers' code stays `linear(x, proj.weight, proj.bias)`:
`kvmesh.engine.layers.linear.linear` sends a quantized weight to the quantized GEMM and a tensor
to the dense one. A tied LM head shares the embedding's bytes (`QuantizedLinear.tied_to`).
"""
from __future__ import annotations

import torch
from torch import nn

from kvmesh.kernels.quant import QuantizedWeight, embedding_rows, quant_linear


class QuantizedLinear(nn.Module):
    """nn.Linear's interface (in_features, out_features, weight, bias, forward) over GGUF blocks."""

    def __init__(self, weight: QuantizedWeight, bias: nn.Parameter | None):
        super().__init__()
        self.register_buffer("qweight", weight.data)
        self.qtype = weight.qtype
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.activations = weight.activations   # "int8" or "float": how the GEMM takes activations

    @classmethod
    def tied_to(cls, embedding: QuantizedEmbedding) -> QuantizedLinear:
        """An LM head over the embedding's own bytes (tie_word_embeddings): no second copy."""
        return cls(embedding.weight, None)

    @property
    def weight(self) -> QuantizedWeight:
        # NOTE: read by every forward (o_proj, down_proj): the view is built (and validated) once
        # per bytes tensor; a `qweight` rebound (fused q/k/v, a load) or a changed mode builds anew
        data = self._buffers["qweight"]
        cached = self.__dict__.get("_weight_view")
        if cached is None or cached.data is not data or cached.activations != self.activations:
            cached = QuantizedWeight(data, self.qtype, (self.out_features, self.in_features), self.activations)
            self.__dict__["_weight_view"] = cached
        return cached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.weight, self.bias, self.activations)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.weight.format}, activations={self.activations}")


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's lookup over GGUF blocks: only the looked-up rows are dequantized."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("qweight", weight.data)
        self.activations = weight.activations   # the mode a tied head over these bytes takes
        self.qtype = weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype                # the model's dtype: what the rows are returned in

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.qtype, (self.num_embeddings, self.embedding_dim),
                               self.activations)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = embedding_rows(self.weight, ids)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.weight.format}"


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of every GGUF-block weight in `model` (a tied head's shared bytes counted once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            seen[module.qweight.untyped_storage().data_ptr()] = module.qweight.untyped_storage().nbytes()
    return sum(seen.values())


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, (QuantizedLinear, QuantizedEmbedding))


__all__ = ["QuantizedEmbedding", "QuantizedLinear", "is_quantized", "quant_linear", "quantized_bytes"]
