"""GGUF Q4_0 / Q4_1 / Q4_K blocks as int4 groups, for the GPU's W4A16 GEMM (`triton_gemm.w4a16_gemm`).

The block kernels that serve GGUF files as they are run on CPUs (csrc/). On a GPU, the formats
whose blocks are an int4 code with a scale (and an offset) per 32 elements become the
`Int4GroupWeight` that AWQ and GPTQ checkpoints load as, so a GGUF file there keeps 4-bit weights
instead of being dequantized at load:

  * Q4_0 block: fp16 d, 16 bytes of codes; w = d * (q - 8): scales d, zeros 8 (uint8), exact;
  * Q4_1 block: fp16 d, fp16 m, 16 bytes of codes; w = d * q + m: scales d, zeros -m / d as
    float32 (so (q - zero) * d = d * q + m to float32 rounding, ~2^-24 of |m|);
  * Q4_K super-block of 256: fp16 d and dmin, 12 bytes of 6-bit scales sc and mins m for its
    eight 32-element sub-blocks, 128 bytes of codes; w = (d * sc) * q - dmin * m: scales d * sc as
    float32 (a fp16 times a 6-bit integer: exact), zeros dmin * m / (d * sc) as float32.

A group whose scale is 0 holds its offset in all 32 places: codes 1, scale the offset, zero 0
(exact). ggml packs a Q4_0 / Q4_1 block's element j (j < 16) in the low nibble of byte j and
element j + 16 in its high nibble; a Q4_K super-block's 64-element chunk c keeps sub-block 2c in
the low nibbles of its 32 bytes and sub-block 2c + 1 in the high ones. The int4 layout has element
k in byte k // 2, low nibble for even k: the codes are re-packed once at load. Every other GGUF
format becomes 8-bit groups (gguf_int8.py; gguf_gpu.py picks).
"""
from __future__ import annotations

import torch

from kvmesh.kernels.quant.gguf_layout import bit_fields, fp16_at, k4_scales, nibbles, offset_zero_points
from kvmesh.kernels.quant.hf_weight import Int4GroupWeight
from kvmesh.kernels.quant.weight import FORMATS, QuantizedWeight

Q4_0, Q4_1, Q4_K = 2, 3, 12
INT4_FORMATS = (Q4_0, Q4_1, Q4_K)   # ggml types served as int4 groups on a GPU
GROUP = 32


def to_int4_groups(w: QuantizedWeight) -> Int4GroupWeight:
    """`w`'s Q4_0 / Q4_1 / Q4_K blocks as int4 groups of 32, on `w`'s device (scales float16 for
    Q4_0 / Q4_1, float32 for Q4_K)."""
    if w.qtype not in INT4_FORMATS:
        raise ValueError(f"{w.format} blocks cannot be int4 groups (those are "
                         f"{' / '.join(FORMATS[t][0] for t in INT4_FORMATS)}: gguf_gpu.to_gpu_weight)")
    n, k = w.shape
    if w.qtype == Q4_K:
        codes, scales, offsets = _q4_k(w.data.view(n, k // 256, 144))
    else:
        blocks = w.data.view(n, k // GROUP, FORMATS[w.qtype][2])
        scales = fp16_at(blocks, 0)
        start = 2 if w.qtype == Q4_0 else 4
        codes = nibbles(blocks[..., start:start + GROUP // 2])       # [n, groups, 32], element order
        offsets = None if w.qtype == Q4_0 else fp16_at(blocks, 2)
    if offsets is None:
        zeros = torch.full_like(scales, 8, dtype=torch.uint8)
    else:
        codes, scales, zeros = offset_zero_points(codes, scales, offsets)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(n, k // 2)
    return Int4GroupWeight(packed.contiguous(), scales.contiguous(), zeros.contiguous(), GROUP)


def _q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [n, groups, 32] in element order, scales d * sc and offsets -dmin * m, float32
    [n, groups]) of Q4_K super-blocks [n, supers, 144]."""
    n, supers, _ = blocks.shape
    d, dmin = fp16_at(blocks, 0).float(), fp16_at(blocks, 2).float()
    sc, m = k4_scales(blocks[..., 4:16])
    # chunk c of 32 bytes: low nibbles, then high
    codes = bit_fields(blocks[..., 16:144].reshape(n, supers, 4, 32), 2, 4).reshape(n, supers * 8, 32)
    scales = (d[..., None] * sc.float()).reshape(n, supers * 8)
    offsets = -(dmin[..., None] * m.float()).reshape(n, supers * 8)
    return codes, scales, offsets
