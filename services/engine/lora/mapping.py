"""LoRAMapping: one step's LoRA tokens grouped by adapter slot, built once and read by every site.

    per sequence: slot (-1: base model) and its tokens this step
    rows   [n]      batch rows of the tokens that run an adapter, grouped by slot (stable)
    starts [S + 1]  segment s = rows[starts[s]:starts[s + 1]], all of slot slots[s]
    runs   [S]      (CPU) (lo, hi) when every segment's rows are the consecutive batch rows lo..hi-1
                    (one adapter for the batch, or sequences grouped by adapter), else None
    padded          several segments padded to the longest cost at most PAD_WASTE times the real
                    rows: the CPU path's batched form (kernels/lora_ops.Padded), else None

NOTE: every LoRA site holds the same mapping object and the runner refills it before each
forward (vLLM's punica wrapper does the same): the family files keep their signatures, and a
base-only step only clears `active`, which each site checks before doing anything.
"""
from __future__ import annotations

import numpy as np
import torch

from kvmesh.kernels.lora_ops import Padded

# padded rows / real rows up to which two bmm beat a loop of 2 x S GEMMs: measured on the
# built-in model (docs/LORA.md), a GEMM call costs tens of microseconds whatever its few rows
PAD_WASTE = 4.0


class LoRAMapping:
    __slots__ = ("active", "rows", "starts", "slots", "runs", "padded", "seg_starts", "seg_slots", "max_seg_len")

    def __init__(self) -> None:
        self.active = False                    # any adapter token in this step
        self.rows: torch.Tensor | None = None  # [n] int64 on the model's device
        self.starts: list[int] = []            # [S + 1] host segment bounds (torch path)
        self.slots: list[int] = []             # [S] host slot per segment
        self.runs: list[tuple[int, int]] | None = None  # [S] batch-row ranges, when contiguous
        self.padded: Padded | None = None      # the segments as [S, L] (CPU, several segments)
        # the segments as tensors: int32 on CUDA (Triton path), int64 on CPU (C++ kernel)
        self.seg_starts: torch.Tensor | None = None   # [S + 1]
        self.seg_slots: torch.Tensor | None = None    # [S]
        self.max_seg_len = 0

    def clear(self) -> None:
        self.active = False

    def update(self, seq_slots: list[int], query_lens: list[int], device: torch.device) -> None:
        """The step's grouping from each sequence's slot (-1: base) and its tokens."""
        token_slots = np.repeat(np.asarray(seq_slots, dtype=np.int64),
                                np.asarray(query_lens, dtype=np.int64))
        lora_rows = np.flatnonzero(token_slots >= 0)
        if lora_rows.size == 0:
            self.active = False
            return
        rows = lora_rows[np.argsort(token_slots[lora_rows], kind="stable")]
        sorted_slots = token_slots[rows]
        cuts = np.flatnonzero(np.diff(sorted_slots)) + 1
        starts = np.concatenate([[0], cuts, [rows.size]])
        self.starts = starts.tolist()
        self.slots = sorted_slots[starts[:-1]].tolist()
        self.max_seg_len = int(np.diff(starts).max())
        self.runs = self.padded = None
        if device.type == "cpu":            # the torch path's layouts (the Triton kernels take rows)
            self.runs = _runs(rows, starts)
            segs = len(self.slots)
            if segs > 1 and segs * self.max_seg_len <= PAD_WASTE * rows.size:
                self.padded = _pad(rows, starts, self.slots, self.max_seg_len)
            self.seg_starts = torch.from_numpy(starts.astype(np.int64))
            self.seg_slots = torch.from_numpy(sorted_slots[starts[:-1]].astype(np.int64))
        self.rows = torch.from_numpy(rows).to(device)
        if device.type == "cuda":
            self.seg_starts = torch.tensor(self.starts, dtype=torch.int32).to(device)
            self.seg_slots = torch.tensor(self.slots, dtype=torch.int32).to(device)
        self.active = True


def _runs(rows: np.ndarray, starts: np.ndarray) -> list[tuple[int, int]] | None:
    """Each segment's [lo, hi) of batch rows when every segment is one run of consecutive rows."""
    lo, hi = rows[starts[:-1]], rows[starts[1:] - 1] + 1
    # NOTE: rows within a segment ascend (stable sort of ascending rows), so a segment whose
    # first and last row span exactly its length is one run
    return list(zip(lo.tolist(), hi.tolist())) if bool(np.all(hi - lo == np.diff(starts))) else None


def _pad(rows: np.ndarray, starts: np.ndarray, slots: list[int], length: int) -> Padded:
    """Segment s's rows at positions s * length ...; the padding gathers rows[0] (any real row)."""
    segs = len(slots)
    gather = np.full(segs * length, rows[0], dtype=np.int64)
    seg_len = np.diff(starts)
    keep = (np.repeat(np.arange(segs) * length, seg_len)
            + np.arange(rows.size) - np.repeat(starts[:-1], seg_len))
    gather[keep] = rows
    contiguous = slots == list(range(slots[0], slots[0] + segs))
    return Padded(torch.from_numpy(gather), None if keep.size == gather.size else torch.from_numpy(keep),
                  torch.tensor(slots, dtype=torch.int64), length,
                  (slots[0], slots[0] + segs) if contiguous else None)
