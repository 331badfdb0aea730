"""GGUF Q4_0 / Q4_1 blocks as int4 groups, for the GPU's W4A16 GEMM (`triton_gemm.w4a16_gemm`).

The block kernels that serve GGUF files as they are run on CPUs (csrc/). On a GPU, the two
formats whose blocks are already an int4 code with a scale (and an offset) a 32-element group
become the `Int4GroupWeight` that AWQ and GPTQ checkpoints load as, so a GGUF file there keeps
4-bit weights instead of being dequantized at load:

  * Q4_0 block: fp16 d, 16 bytes of codes; w = d * (q - 8): scales d, zeros 8 (uint8), exact;
  * Q4_1 block: fp16 d, fp16 m, 16 bytes of codes; w = d * q + m: scales d, zeros -m / d as
    float32 (so (q - zero) * d = d * q + m to float32 rounding, ~2^-24 of |m|); a block with
    d = 0 holds m in all 32 places: codes 1, scale m, zero 0 (exact).

ggml packs a block's element j (j < 16) in the low nibble of byte j and element j + 16 in its
high nibble; the int4 layout has element k in byte k // 2, low nibble for even k: the codes are
re-packed once at load. Every other GGUF format is dequantized on a GPU (the loader).
"""
from __future__ import annotations

import torch

from kvmesh.kernels.quant.hf_weight import Int4GroupWeight
from kvmesh.kernels.quant.weight import FORMATS, QuantizedWeight

Q4_0, Q4_1 = 2, 3
GPU_FORMATS = (Q4_0, Q4_1)      # ggml types served as int4 groups on a GPU
GROUP = 32


def to_int4_groups(w: QuantizedWeight) -> Int4GroupWeight:
    """`w`'s Q4_0 / Q4_1 blocks as int4 groups of 32 (on `w`'s device; scales float16)."""
    if w.qtype not in GPU_FORMATS:
        raise ValueError(f"{w.format} blocks cannot be int4 groups (the GPU takes "
                         f"{', '.join(FORMATS[t][0] for t in GPU_FORMATS)}; the loader dequantizes the rest)")
    n, k = w.shape
    size = FORMATS[w.qtype][2]
    blocks = w.data.view(n, k // GROUP, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(n, k // GROUP)
    offset = 2 if w.qtype == Q4_0 else 4
    qs = blocks[..., offset:offset + GROUP // 2]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)                 # [n, groups, 32], element order
    if w.qtype == Q4_0:
        scales, zeros = d, torch.full_like(d, 8, dtype=torch.uint8)
    else:
        m = blocks[..., 2:4].contiguous().view(torch.float16).view(n, k // GROUP)
        flat = d == 0
        # NOTE: d = 0 leaves m alone in every place: code 1 times scale m, zero 0
        codes = torch.where(flat[..., None], torch.ones_like(codes), codes)
        scales = torch.where(flat, m, d)
        safe = torch.where(flat, torch.ones_like(d), d).float()
        zeros = torch.where(flat, torch.zeros_like(safe), -m.float() / safe)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(n, k // 2)
    return Int4GroupWeight(packed.contiguous(), scales.contiguous(), zeros.contiguous(), GROUP)
