"""y = x @ W^T + b for the model's projections, on the fastest GEMM the tensors' device offers.

On CPU, PyTorch's `F.linear` runs float32 through the BLAS it was built with (MKL), which on
some x86 CPUs (AMD EPYC here) takes a path that reaches half of what oneDNN does for the same
shapes (`docs/BENCHMARKS.md`, "Optimisations made": oneDNN GEMMs). oneDNN's linear primitive
takes the dense weight as it is (no repacked copy, no extra memory), so CPU float32 / bfloat16
go there; everything else (CUDA, other dtypes, a torch built without oneDNN) uses `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes for which oneDNN's linear runs here and agrees with F.linear on a probe.

    NOTE: probed per dtype: a CPU without the instructions oneDNN wants for bfloat16 may refuse
    to create the primitive, and then bfloat16 must stay on F.linear.
    """
    if not torch.backends.mkldnn.is_available():
        return ()
    ok = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.arange(8, dtype=torch.float32).view(2, 4).to(dtype)
        w = torch.ones(3, 4, dtype=dtype)
        try:
            y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
        except (AttributeError, RuntimeError):
            continue
        if torch.equal(y, F.linear(x, w)):
            ok.append(dtype)
    return tuple(ok)


_ONEDNN_DTYPES = _onednn_dtypes()
_ONEDNN = bool(_ONEDNN_DTYPES)


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs on oneDNN (CPU, float32 / bfloat16, dense, 2-D)."""
    return (_ONEDNN and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype and x.dim() == 2
            and x.shape[0] > 0 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's contract ([..., in] x [out, in] (+ [out]) -> [..., out])."""
    # NOTE: the oneDNN op has no backward; with grad enabled and a tensor that requires it,
    # F.linear keeps autograd working (the engine itself runs under inference_mode).
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [None], "")
