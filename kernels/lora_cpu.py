"""LoRA's shrink + expand of one site as one C++ call (CPU, float32 / bfloat16): `kernels/csrc/lora.cpp`.

    out[rows[i]] += (x[rows[i]] @ A[slot(i)]^T) @ Bt[slot(i)]     x [T, K], A [L, RT, K], Bt [L, RT, N]

The same contract as `lora_ops.sgmv_add` (the torch path, kept as the fallback), with B stored
transposed (`Bt`, the site's CPU layout: its expand reads rows of Bt along the output columns) and
the segments as two int64 tensors. `part_cols` [P + 1] bounds the output columns of each part of
a fused site; part p uses ranks p*R .. (p+1)*R only (B is zero elsewhere), which the kernel skips,
and of those only the first `slot_ranks[slot]` (the slot's adapter rank; 0: the adapter does not
touch the site, its tokens are skipped).

    if lora_cpu.applies(x, a, bt, out):
        lora_cpu.sgmv_add(x, a, bt, out, rows, seg_starts, seg_slots, part_cols, slot_ranks)

NOTE: the torch path costs ~100-150 us of op dispatch per site on the built-in model (gathers,
two bmm, a scatter), against ~10-60 us of arithmetic: one call with no temporaries removes it.
"""
from __future__ import annotations

import torch

from kvmesh.kernels.cpu_kernels import load

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MAX_RANK_ROWS = 256    # parts x --max-lora-rank: the kernel's per-token stack buffer


def available(dtype: torch.dtype, rank_rows: int) -> bool:
    """Whether the kernel is built here and takes stacked slots of this dtype and `rank_rows`
    (parts x R) on CPU: a site decides once, when it is made."""
    return dtype in KERNEL_DTYPES and 0 < rank_rows <= MAX_RANK_ROWS and load() is not None


def rows_apply(x: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether one call's activations suit the kernel (a site's per-call check: cheap)."""
    return (x.dtype == out.dtype == dtype and x.dim() == 2 and out.dim() == 2
            and x.stride(1) == 1 and out.stride(1) == 1 and x.device.type == "cpu")


def applies(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the C++ kernel takes these tensors (else run `lora_ops.sgmv_add`)."""
    return (a.device.type == "cpu" and bt.dtype == a.dtype and a.is_contiguous()
            and bt.is_contiguous() and a.dim() == 3 and available(a.dtype, a.shape[1])
            and rows_apply(x, out, a.dtype))


def sgmv_add(x: torch.Tensor,            # [T, K]
             a: torch.Tensor,            # [L, RT, K] stacked slot weights
             bt: torch.Tensor,           # [L, RT, N] stacked slot weights, transposed (scale folded in)
             out: torch.Tensor,          # [T, N] the projection's output, added to in place
             rows: torch.Tensor,         # [n] int64 batch rows, grouped by slot
             seg_starts: torch.Tensor,   # [S + 1] int64 segment bounds in `rows`
             seg_slots: torch.Tensor,    # [S] int64 slot of each segment
             part_cols: torch.Tensor,    # [P + 1] int64 output column bounds of the parts, 0 .. N
             slot_ranks: torch.Tensor,   # [L] int64 each slot's adapter rank here, 0 .. RT / P
             ) -> None:
    load().lora_sgmv_add(x, a, bt, out, rows, seg_starts, seg_slots, part_cols, slot_ranks)
