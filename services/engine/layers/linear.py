"""The layers' one entry to a projection: `linear` (dense or GGUF-quantized weight) and the fusing
of separate HF projections (q/k/v, gate/up) into one matmul, keeping HF parameter names."""
from __future__ import annotations

import torch
from torch import nn

from kvmesh.engine.layers.hf_quantized import HFQuantizedLinear
from kvmesh.engine.layers.quantized import QuantizedLinear
from kvmesh.kernels import linear as dense
from kvmesh.kernels.quant import QuantizedWeight, concat, quant_linear
from kvmesh.kernels.quant import hf_weight
from kvmesh.kernels.quant.hf_ops import hf_linear


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ b): the quantized GEMM for GGUF blocks or a Hugging Face quantized
    checkpoint's weight, `kvmesh.kernels.linear` otherwise."""
    if isinstance(weight, QuantizedWeight):
        return quant_linear(x, weight, bias)
    if isinstance(weight, hf_weight.HF_WEIGHTS):
        return hf_linear(x, weight, bias)
    return dense.linear(x, weight, bias)


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
    cached = module.__dict__.get(attr)
    if cached is not None and cached[2] == _data_ptrs(linears):
        # NOTE: the path of every forward (twice per layer): a tensor's data pointer per
        # projection, read from the modules' parameter / buffer dicts without nn.Module's
        # __getattr__, and nothing built
        return cached[0], cached[1]
    if any(isinstance(lin, QuantizedLinear) for lin in linears):
        return _fused_quantized(module, linears, attr)
    if any(isinstance(lin, HFQuantizedLinear) for lin in linears):
        return _fused_hf(module, linears, attr)
    ws = [lin.weight for lin in linears]
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


def _data_ptrs(linears: tuple[nn.Module, ...]) -> tuple[int, ...]:
    """Where each projection's weight lies now: the dense parameter, or the quantized bytes
    (GGUF blocks and int4 groups: the `qweight` buffer; int8 / fp8: `weight_q`)."""
    ptrs = []
    for lin in linears:
        t = lin._parameters.get("weight")
        if t is None:
            buffers = lin._buffers
            t = buffers["qweight"] if "qweight" in buffers else buffers["weight_q"]
        ptrs.append(t.data_ptr())
    return tuple(ptrs)


def _fused_quantized(module: nn.Module, linears: tuple[nn.Module, ...],
                     attr: str) -> tuple[QuantizedWeight | None, torch.Tensor | None]:
    """fused_weights for GGUF blocks: the rows of every projection in one buffer, each module's
    bytes rebound to its slice (one copy in memory). (None, None) when they cannot share one GEMM:
    a dense one among them, or different formats (a Q4_K_M file keeps attn_v in Q6_K)."""
    if not all(isinstance(lin, QuantizedLinear) for lin in linears):
        return None, None
    weight = concat([lin.weight for lin in linears])
    if weight is None:
        return None, None
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias.detach() if lin.bias is not None
                          else weight.data.new_zeros(lin.out_features, dtype=torch.float32)
                          for lin in linears])
    lo = 0
    for lin in linears:
        hi = lo + lin.out_features
        lin.qweight = weight.data[lo:hi]
        if lin.bias is not None:
            lin.bias = nn.Parameter(bias[lo:hi], requires_grad=False)
        lo = hi
    setattr(module, attr, (weight, bias, tuple(lin.qweight.data_ptr() for lin in linears)))
    return weight, bias


def _fused_hf(module: nn.Module, linears: tuple[nn.Module, ...],
              attr: str) -> tuple[hf_weight.HFWeight | None, torch.Tensor | None]:
    """fused_weights for Hugging Face quantized weights: every projection's codes, scales and
    zeros concatenated along N, each module rebound to its rows (one copy in memory). (None,
    None) when they cannot share one GEMM: a float one among them, or `hf_weight.concat` says
    no (GPTQ act-order permutations that differ between q, k and v; per-tensor fp8 scales)."""
    if not all(isinstance(lin, HFQuantizedLinear) for lin in linears):
        return None, None
    weights = [lin.weight for lin in linears]
    ptrs = tuple(_first_ptr(w) for w in weights)
    cached = getattr(module, attr, None)
    if cached is not None and cached[2] == ptrs:
        return cached[0], cached[1]
    fused = hf_weight.concat(weights)
    if fused is None:
        return None, None
    bias = None
    ref = next((lin.bias for lin in linears if lin.bias is not None), None)
    if ref is not None:
        bias = torch.cat([lin.bias.detach() if lin.bias is not None
                          else ref.new_zeros(lin.out_features) for lin in linears])
    lo = 0
    for lin in linears:
        hi = lo + lin.out_features
        lin.set_weight(hf_weight.rows(fused, lo, hi))
        if lin.bias is not None:
            lin.bias = nn.Parameter(bias[lo:hi], requires_grad=False)
        lo = hi
    setattr(module, attr, (fused, bias, tuple(_first_ptr(lin.weight) for lin in linears)))
    return fused, bias


def _first_ptr(w: hf_weight.HFWeight) -> int:
    return (w.qweight if isinstance(w, (hf_weight.Int4GroupWeight, hf_weight.Int8GroupWeight))
            else w.weight).data_ptr()
