"""Triton fused RMSNorm (+ residual add): one program per row, the whole row in registers.

On a GPU this saves the separate add kernel and a round trip of the hidden state through HBM;
rounding follows the reference (HF Llama): the residual sum is rounded to the input dtype, the
normalised value is rounded to the input dtype before the weight multiply.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,              # [num_rows, hidden]
    residual_ptr,       # [num_rows, hidden] (unused unless HAS_RESIDUAL)
    weight_ptr,         # [hidden]
    out_ptr,            # [num_rows, hidden]
    residual_out_ptr,   # [num_rows, hidden] x + residual (unused unless HAS_RESIDUAL)
    stride_x, stride_r, stride_o, stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,        # hidden padded to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x_sum = (x + r).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x_sum, mask=mask)
        x = x_sum.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(dtype), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, hidden] view with unit column stride (copies only if it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(
    x: torch.Tensor,            # [..., hidden]
    weight: torch.Tensor,       # [hidden], same dtype as x
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden] like x
    *,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm; with a residual returns (norm(x + residual), x + residual).

    The inputs are not modified (the reference's contract); outputs are new tensors.
    """
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x dtype must be fp16, bf16 or fp32, got {x.dtype}")
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [hidden={hidden}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x: {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}")
    if weight.device != x.device or (residual is not None and residual.device != x.device):
        raise ValueError("x, weight and residual must be on one device")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty_like(out)
        ro2 = res_out.view(-1, hidden)
    else:
        r2, res_out, ro2 = x2, None, out2
    if x2.shape[0] == 0:
        return out, res_out
    block = triton.next_power_of_2(hidden)
    if num_warps is None:
        num_warps = min(16, max(1, block // 256))
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight.contiguous(), out2, ro2,
        x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
    )
    return out, res_out
