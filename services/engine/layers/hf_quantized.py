"""Projections whose weight is a Hugging Face quantized checkpoint's (AWQ, GPTQ, W8A8, FP8), or a
GGUF file's blocks converted for a GPU (int4 / int8 groups: gguf_int4.py, gguf_int8.py).

The loader swaps an `nn.Linear` for `HFQuantizedLinear` when its checkpoint tensors are quantized.
The canonical tensors (`kvmesh.kernels.quant.hf_weight`) are registered as buffers (so `.to()`,
the memory accounting and `state_dict()` see them) and `.weight` rebuilds the weight object over
them, so the layers' code stays `linear(x, proj.weight, proj.bias)`: `layers.linear.linear`
sends it to `hf_linear` (the CPU kernels, or the Triton GEMMs on CUDA).
"""
from __future__ import annotations

import torch
from torch import nn

from kvmesh.kernels.quant.hf_ops import hf_linear
from kvmesh.kernels.quant.hf_weight import Fp8Weight, HFWeight, Int4GroupWeight, Int8ChannelWeight, Int8GroupWeight

# The tensor fields of each weight kind, in constructor order (all registered as buffers).
_FIELDS: dict[type, tuple[str, ...]] = {
    Int4GroupWeight: ("qweight", "scales", "zeros"),
    Int8GroupWeight: ("qweight", "scales", "zeros"),
    Int8ChannelWeight: ("weight_q", "weight_scale", "w_sum"),
    Fp8Weight: ("weight_q", "weight_scale"),
}


class HFQuantizedLinear(nn.Module):
    """nn.Linear's interface (in_features, out_features, weight, bias, forward) over a quantized
    checkpoint's weight."""

    def __init__(self, weight: HFWeight, bias: nn.Parameter | None):
        super().__init__()
        self.kind = type(weight)
        self.out_features, self.in_features = weight.shape
        self.group_size = getattr(weight, "group_size", 0)
        self.activations = getattr(weight, "activations", None)     # fp8: how x is cast
        for field, tensor in zip(_FIELDS[self.kind], _tensors(weight)):
            self.register_buffer(field, tensor)
        self.register_buffer("perm", getattr(weight, "perm", None))
        self.bias = bias

    @property
    def weight(self) -> HFWeight:
        tensors = [getattr(self, f) for f in _FIELDS[self.kind]]
        if self.kind is Int4GroupWeight:
            return Int4GroupWeight(*tensors, self.group_size, self.perm)
        if self.kind is Int8GroupWeight:
            return Int8GroupWeight(*tensors, self.group_size)
        if self.kind is Fp8Weight:
            return Fp8Weight(*tensors, self.activations)
        return self.kind(*tensors)

    def set_weight(self, weight: HFWeight) -> None:
        """Rebind the buffers to `weight`'s tensors (views of a fused buffer)."""
        for field, tensor in zip(_FIELDS[self.kind], _tensors(weight)):
            setattr(self, field, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hf_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.weight.format}")


def _tensors(weight: HFWeight) -> list[torch.Tensor]:
    if isinstance(weight, (Int4GroupWeight, Int8GroupWeight)):
        return [weight.qweight, weight.scales, weight.zeros]
    if isinstance(weight, Int8ChannelWeight):
        return [weight.weight, weight.weight_scale, weight.w_sum]
    return [weight.weight, weight.weight_scale]


def hf_quantized_bytes(model: nn.Module) -> int:
    """Bytes of every quantized checkpoint weight in `model` (codes, scales and zeros)."""
    return sum(m.weight.nbytes for m in model.modules() if isinstance(m, HFQuantizedLinear))
