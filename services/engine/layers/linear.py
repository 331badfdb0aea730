"""Fusing separate HF projections (q/k/v, gate/up) into one matmul, keeping HF parameter names."""
from __future__ import annotations

import torch
from torch import nn


def fused_weights(module: nn.Module, linears: tuple[nn.Linear, ...],
                  attr: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weight, bias) of `linears` concatenated along the output dim, built once and kept in sync.

    NOTE: the first call concatenates the weights into one buffer and rebinds each Linear's
    weight (and bias) to a view of it, so there is one copy in memory and the HF parameter
    names, shapes and values of `state_dict()` are unchanged (the values are views sharing one
    storage: clone them before saving with safetensors). In-place writes (`load_state_dict`,
    `p.copy_`) land in the fused buffer; a parameter replaced by a new tensor (`assign`,
    `.to(dtype)`) is noticed by its data pointer and the buffer is rebuilt. Meta weights are
    not fused (returns None, None).
    """
    ws = [lin.weight for lin in linears]
    cached = getattr(module, attr, None)
    if cached is not None:
        weight, bias, ptrs = cached
        if ptrs == tuple(w.data_ptr() for w in ws):
            return weight, bias
    if any(w.is_meta for w in ws):
        return None, None
    has_bias = [lin.bias is not None for lin in linears]
    # NOTE: a normal tensor even when first called under inference_mode, so later in-place
    # updates outside inference mode (load_state_dict) stay legal.
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([w.detach() for w in ws], dim=0)
        bias = None
        if any(has_bias):
            bias = torch.cat([lin.bias.detach() if lin.bias is not None
                              else weight.new_zeros(lin.out_features) for lin in linears])
        lo = 0
        for lin in linears:
            hi = lo + lin.out_features
            lin.weight = nn.Parameter(weight[lo:hi], requires_grad=lin.weight.requires_grad)
            if lin.bias is not None:
                lin.bias = nn.Parameter(bias[lo:hi], requires_grad=lin.bias.requires_grad)
            lo = hi
    setattr(module, attr, (weight, bias, tuple(lin.weight.data_ptr() for lin in linears)))
    return weight, bias
