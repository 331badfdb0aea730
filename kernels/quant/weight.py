"""A weight held as GGUF blocks: the raw bytes, row by row, and what they encode.

A GGUF tensor of shape [N, K] with a block format stores each of its N rows as K / QK blocks of
`type_size` bytes (ggml's layout). `QuantizedWeight` keeps exactly those bytes as one uint8
[N, row_bytes] tensor, so whole rows can be selected, reordered (the Q/K un-permutation) and
concatenated along N (fused q/k/v, gate/up) without touching a block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# ggml type number -> (name, elements per block, bytes per block): the formats the kernels read.
FORMATS: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
}

# Where a block of the K and IQ4 formats keeps its fp16 scale d (and dmin after it): (byte offset,
# bytes). Every other byte of such a block is codes and small scales, valid in any bit pattern
# (tests and benchmarks make random blocks so).
FP16_SCALES: dict[int, tuple[int, int]] = {10: (80, 4), 11: (108, 2), 12: (0, 4), 13: (0, 4), 14: (208, 2),
                                           20: (0, 2), 23: (0, 2)}


def format_name(qtype: int) -> str:
    """The ggml name of a type number (Q4_1, IQ2_XS, ...), supported by the kernels or not."""
    if qtype in FORMATS:
        return FORMATS[qtype][0]
    try:
        from gguf.constants import GGMLQuantizationType  # noqa: PLC0415
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"ggml type {qtype}"


def is_supported(qtype: int) -> bool:
    return qtype in FORMATS


@dataclass(slots=True)
class QuantizedWeight:
    """[N, K] weights as GGUF blocks."""

    data: torch.Tensor      # uint8 [N, row_bytes], contiguous: row n is row n's blocks, as in the file
    qtype: int              # ggml type number (a key of FORMATS)
    shape: tuple[int, int]  # (N, K): the logical float matrix these bytes encode
    activations: str = "int8"   # how the GEMM takes the activations: "int8" or "float" (ops.py)

    def __post_init__(self) -> None:
        if self.qtype not in FORMATS:
            raise ValueError(f"unsupported GGUF quantization type {format_name(self.qtype)}")
        name, qk, size = FORMATS[self.qtype]
        n, k = self.shape
        if k % qk:
            raise ValueError(f"{name} weight of shape {self.shape}: K={k} is not a multiple of "
                             f"the block size {qk}")
        want = (n, k // qk * size)
        if self.activations not in ("int8", "float"):
            raise ValueError(f"activations must be 'int8' or 'float', got {self.activations!r}")
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{name} weight of shape {self.shape} needs uint8 bytes of shape "
                             f"{want}, got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def format(self) -> str:
        return FORMATS[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation or a selection), blocks untouched."""
        data = self.data.index_select(0, index).contiguous()
        return QuantizedWeight(data, self.qtype, (data.shape[0], self.shape[1]), self.activations)


def concat(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The weights stacked along N (one GEMM for q/k/v or gate/up), or None when their formats or
    K differ (a Q4_K_M file keeps attn_v in Q6_K): the caller then runs them one by one."""
    first = weights[0]
    if any(w.qtype != first.qtype or w.shape[1] != first.shape[1] for w in weights):
        return None
    data = torch.cat([w.data for w in weights])
    return QuantizedWeight(data, first.qtype, (data.shape[0], first.shape[1]), first.activations)
