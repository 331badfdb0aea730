"""LoRA's grouped shrink / expand over tokens grouped by adapter slot (SGMV), torch path.

A step's LoRA tokens are listed by slot: `rows` [n] holds the batch rows of every token that runs
an adapter, grouped so that segment s is rows[starts[s]:starts[s + 1]], all of slot slots[s].

    shrink:  y[i]        = x[rows[i]] @ A[slot(i)]^T          x [T, K], A [L, R, K] -> y [n, R] fp32
    expand:  out[rows[i]] += y[i] @ B[slot(i)]^T              y [n, R], B [L, N, R], out [T, N]

One GEMM per segment (at most --max-loras per call, whatever the batch size): the CPU form of
punica's SGMV. `kvmesh.kernels.lora_triton` is the same pair as Triton kernels for CUDA.
"""
from __future__ import annotations

import torch


def sgmv_shrink(x: torch.Tensor,            # [T, K]
                a: torch.Tensor,            # [L, R, K] stacked slot weights
                rows: torch.Tensor,         # [n] int64 batch rows, grouped by slot
                starts: list[int],          # [S + 1] segment bounds in `rows`
                slots: list[int],           # [S] slot of each segment
                ) -> torch.Tensor:          # [n, R] float32
    xs = x.index_select(0, rows)
    y = torch.empty((rows.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for s, slot in enumerate(slots):
        lo, hi = starts[s], starts[s + 1]
        y[lo:hi] = xs[lo:hi] @ a[slot].t()
    return y


def sgmv_expand(y: torch.Tensor,            # [n, R] float32 (sgmv_shrink's output)
                b: torch.Tensor,            # [L, N, R] stacked slot weights (scale folded in)
                out: torch.Tensor,          # [T, N] the projection's output, added to in place
                rows: torch.Tensor,         # [n] int64
                starts: list[int],          # [S + 1]
                slots: list[int],           # [S]
                ) -> None:
    delta = torch.empty((rows.shape[0], b.shape[1]), dtype=out.dtype, device=out.device)
    yd = y.to(b.dtype)
    for s, slot in enumerate(slots):
        lo, hi = starts[s], starts[s + 1]
        torch.matmul(yd[lo:hi], b[slot].t(), out=delta[lo:hi])
    out.index_add_(0, rows, delta)
