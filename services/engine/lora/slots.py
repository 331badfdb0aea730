"""LoRASite: one fused projection's stacked adapter weights and its add-on to the output.

A site is one matmul of the base model (q/k/v fused, o, gate/up fused, down) made of parts, the HF
modules whose outputs it concatenates (q_proj, k_proj, v_proj; or Phi-3's one qkv_proj). Each
part gets its own rank columns, so one shrink and one expand serve every part:

    A [max_loras, parts * R, in]     part p's A in rows p*R : p*R + r
    B [max_loras, out, parts * R]    part p's scaled B in its output rows, columns p*R : p*R + r
    out += (x @ A[slot]^T) @ B[slot]^T      per token, slot from the step's LoRAMapping

NOTE: B is block-diagonal over the parts (zeros elsewhere): the torch path's expand does parts
times the work of a per-part loop, for one GEMM per segment; the C++ kernel (CPU) skips the
zeros. R is --max-lora-rank; a smaller adapter leaves its extra columns zero (the kernel reads
only the first `slot_ranks[slot]`). No adapter is ever merged into the base weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.lora.mapping import LoRAMapping
from kvmesh.kernels import lora_cpu, lora_ops


@dataclass(frozen=True, slots=True)
class SitePart:
    name: str            # the HF module name (q_proj, gate_up_proj, ...)
    out_offset: int      # first output column of this part in the fused output
    out_features: int


class LoRASite:
    __slots__ = ("prefix", "in_features", "parts", "rank", "a", "b", "bt", "part_cols", "slot_ranks",
                 "fused", "adapted", "mapping")

    def __init__(self, prefix: str, in_features: int, parts: tuple[SitePart, ...], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, mapping: LoRAMapping):
        self.prefix = prefix                   # module path of the layer (model.layers.3.self_attn)
        self.in_features = in_features
        self.parts = parts
        self.rank = max_rank
        out = sum(p.out_features for p in parts)
        self.a = torch.zeros((max_loras, len(parts) * max_rank, in_features), dtype=dtype, device=device)
        if device.type == "cpu":
            # NOTE: stored transposed, [L, parts * R, out], for the C++ kernel; `b` is the same
            # memory seen as [L, out, parts * R], which the torch fallback reads as well
            self.bt = torch.zeros((max_loras, len(parts) * max_rank, out), dtype=dtype, device=device)
            self.b = self.bt.transpose(1, 2)
        else:
            self.b = torch.zeros((max_loras, out, len(parts) * max_rank), dtype=dtype, device=device)
            self.bt = None
        # [P + 1] output columns of each part (the kernel's block-diagonal expand)
        self.part_cols = torch.tensor([0, *(p.out_offset + p.out_features for p in parts)],
                                      dtype=torch.int64)
        # [L] each slot's adapter rank at this site (0: untouched): the kernel skips the zero ranks
        self.slot_ranks = torch.zeros(max_loras, dtype=torch.int64)
        # the C++ kernel takes this site (CPU, its dtype, its rank rows): decided once
        self.fused = self.bt is not None and lora_cpu.available(dtype, len(parts) * max_rank)
        self.adapted = [False] * max_loras     # per slot: does its adapter touch this site
        self.mapping = mapping

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter into `slot`: part index -> (A [r, in], scaled B [out_part, r]);
        parts it does not adapt stay zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.adapted[slot] = bool(weights)
        self.slot_ranks[slot] = max((a.shape[0] for a, _ in weights.values()), default=0)
        for i, (a, b) in weights.items():
            part, r, lo = self.parts[i], a.shape[0], i * self.rank
            self.a[slot, lo:lo + r].copy_(a)
            self.b[slot, part.out_offset:part.out_offset + part.out_features, lo:lo + r].copy_(b)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, out] += the LoRA term of each adapter token of x [T, in] (nothing for a
        base-only step, nor when no adapter of the step touches this site)."""
        m = self.mapping
        if not m.active or not any(self.adapted[s] for s in m.slots):
            return
        if out.is_cuda:
            from kvmesh.kernels import lora_triton  # noqa: PLC0415  (Triton only where it runs)
            y = lora_triton.sgmv_shrink(x, self.a, m.rows, m.seg_starts, m.seg_slots, m.max_seg_len)
            lora_triton.sgmv_expand(y, self.b, out, m.rows, m.seg_starts, m.seg_slots, m.max_seg_len)
            return
        if self.fused and lora_cpu.rows_apply(x, out, self.a.dtype):
            lora_cpu.sgmv_add(x, self.a, self.bt, out, m.rows, m.seg_starts, m.seg_slots,
                              self.part_cols, self.slot_ranks)
            return
        lora_ops.sgmv_add(x, self.a, self.b, out, m.rows, m.starts, m.slots, m.runs, m.padded)
