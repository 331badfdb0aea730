"""Reading GGUF blocks' fields with torch, for the GPU conversions (gguf_int4.py, gguf_int8.py):
the bit helpers both use, and the one rule that turns a scale and an offset into a zero point.
The C++ kernels' reading of the same layouts is csrc/blocks.h."""
from __future__ import annotations

import torch


def fp16_at(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 held at byte `at` of every block [..., bytes]: [...]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., m] as 2m codes in ggml's order: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def bit_fields(packed: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """[..., count, bytes]: field j (`width` bits at bit j * width) of every byte of `packed` [..., bytes]."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(-2) >> shifts.view(count, 1)) & ((1 << width) - 1)


def k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of each Q4_K / Q5_K super-block from its 12 bytes:
    bytes 0-3 hold scales 0-3 (low 6 bits) and 4-7 hold mins 0-3; bytes 8-11 hold the low 4 bits
    of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top bits of
    bytes 0-3 (scales) and 4-7 (mins)."""
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    m = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return sc, m


def offset_zero_points(codes: torch.Tensor, scales: torch.Tensor,
                       offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, float32 zeros) of groups w = scale * q + offset: codes [..., groups, size],
    scales and offsets [..., groups].

    NOTE: w = (q - zero) * scale with zero = -offset / scale; a group with scale 0 is its offset
    everywhere: code 1 times scale offset, zero 0 (exact)."""
    flat = scales == 0
    codes = torch.where(flat[..., None], torch.ones_like(codes), codes)
    safe = torch.where(flat, torch.ones_like(scales), scales).float()
    zeros = torch.where(flat, torch.zeros_like(safe), -offsets.float() / safe)
    return codes, torch.where(flat, offsets.to(scales.dtype), scales), zeros
