"""LoRA's grouped shrink + expand over tokens grouped by adapter slot (SGMV), torch path (CPU).

A step's LoRA tokens are listed by slot: `rows` [n] holds the batch rows of every token that runs
an adapter, grouped so that segment s is rows[starts[s]:starts[s + 1]], all of slot slots[s]:

    out[rows[i]] += (x[rows[i]] @ A[slot(i)]^T) @ B[slot(i)]^T     x [T, K], A [L, R, K], B [L, N, R]

Per segment one GEMM for the shrink and one GEMM-with-accumulate for the expand (at most
--max-loras of each per call, whatever the batch size): the CPU form of punica's SGMV;
`kvmesh.kernels.lora_triton` is the same pair as Triton kernels for CUDA. With several segments
of similar length, `padded` turns the per-segment loop into two batched GEMMs (`bmm`) over the
segments padded to the longest, the step's slots' weights gathered once per call.

NOTE: the op count is what costs on a CPU (each torch call is microseconds of dispatch and, with
several threads, a parallel region): the tokens' rows are gathered once and written back once
(`index_select` / `index_copy_`, never `index_add_`, whose CPU kernel adds row by row), the expand
accumulates in the GEMM (`addmm_`), and when every segment is one run of consecutive batch rows
(one adapter for the whole batch, or sequences grouped by adapter) there is no gather at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Padded:
    """A step's segments laid out as [S, L] rows (L: the longest segment), built once per step."""
    gather: torch.Tensor          # [S * L] int64 batch rows; padding repeats a real row
    keep: torch.Tensor | None     # [n] int64 positions in S * L of the real rows (None: no padding)
    slots: torch.Tensor           # [S] int64
    length: int                   # L
    slot_range: tuple[int, int] | None = None   # the slots are lo..hi-1: A[lo:hi] is a view


def sgmv_add(x: torch.Tensor,               # [T, K]
             a: torch.Tensor,               # [L, R, K] stacked slot weights
             b: torch.Tensor,               # [L, N, R] stacked slot weights (scale folded in)
             out: torch.Tensor,             # [T, N] the projection's output, added to in place
             rows: torch.Tensor,            # [n] int64 batch rows, grouped by slot
             starts: list[int],             # [S + 1] segment bounds in `rows`
             slots: list[int],              # [S] slot of each segment
             runs: list[tuple[int, int]] | None = None,  # per segment [lo, hi) of batch rows
             padded: Padded | None = None,
             ) -> None:
    if padded is not None:
        segs, length = padded.slots.shape[0], padded.length
        xs = x.index_select(0, padded.gather).view(segs, length, -1)
        if padded.slot_range is not None:
            lo, hi = padded.slot_range
            a_s, b_s = a[lo:hi], b[lo:hi]
        else:
            # NOTE: a copy of S slots' weights per call: the manager's slots are usually the
            # consecutive 0..S-1 (every slot in use), which takes the branch above
            a_s, b_s = a.index_select(0, padded.slots), b.index_select(0, padded.slots)
        y = torch.bmm(xs, a_s.transpose(1, 2))
        delta = torch.bmm(y, b_s.transpose(1, 2)).view(segs * length, -1)
        acc = out.index_select(0, rows)
        acc += delta if padded.keep is None else delta.index_select(0, padded.keep)
        out.index_copy_(0, rows, acc)
        return
    if runs is not None:
        # every segment is x[lo:hi]: views, nothing gathered or scattered
        for (lo, hi), slot in zip(runs, slots):
            y = torch.mm(x[lo:hi], a[slot].t())
            out[lo:hi].addmm_(y, b[slot].t())
        return
    xs, acc = x.index_select(0, rows), out.index_select(0, rows)
    y = torch.empty((rows.shape[0], a.shape[1]), dtype=x.dtype, device=x.device)
    for s, slot in enumerate(slots):
        lo, hi = starts[s], starts[s + 1]
        torch.mm(xs[lo:hi], a[slot].t(), out=y[lo:hi])
        acc[lo:hi].addmm_(y[lo:hi], b[slot].t())
    out.index_copy_(0, rows, acc)
