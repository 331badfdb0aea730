"""GGUF blocks other than Q4_0 / Q4_1 / Q4_K as 8-bit groups, for the GPU's 8-bit group GEMM
(`triton_w8g.w8g_gemm`; `hf_weight.Int8GroupWeight`: w = (q - zero) * scale per group).

Every format the CPU kernels read is a small integer code times a scale, plus an offset, per 16
or 32 elements (csrc/blocks.h). Here each code takes a byte and each group a scale and a zero
point (gguf-py's `dequantize_blocks` is the reference the tests hold these to):

  format   group  code (0..255)              scale            zero                       exact
  Q8_0     32     int8 q + 128               d (fp16)         128                        yes
  IQ4_NL   32     grid[idx] + 128            d (fp16)         128                        yes
  IQ4_XS   32     grid[idx] + 128            d * (ls - 32)    128                        yes
  Q5_0     32     5-bit q                    d (fp16)         16                         yes
  Q5_1     32     5-bit q                    d (fp16)         -m / d (float32)           rounding
  Q5_K     32     5-bit q                    d * sc           dmin * m / (d * sc)        rounding
  Q6_K     16     6-bit q                    d * sc (signed)  32                         yes
  Q3_K     16     low 2 bits + 4 * hmask bit d * (sc - 32)    4                          yes
  Q2_K     16     2-bit q                    d * sc           dmin * m / (d * sc)        rounding

Scales other than a bare fp16 d are float32, where a fp16 times a small integer is exact; the
offset formats' zero points are float32 (one rounding of -offset / scale), and a group whose
scale is 0 becomes codes 1 times its offset (gguf_layout.offset_zero_points). Element order is
ggml's: the codes are laid out once at load in the weight's own column order.
"""
from __future__ import annotations

import torch

from kvmesh.kernels.quant.gguf_layout import bit_fields, fp16_at, k4_scales, nibbles, offset_zero_points
from kvmesh.kernels.quant.hf_weight import Int8GroupWeight
from kvmesh.kernels.quant.weight import FORMATS, QuantizedWeight

Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 6, 7, 8, 10, 11, 13, 14, 20, 23
INT8_FORMATS = (Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)   # served as 8-bit groups on a GPU
# IQ4's 16 grid values (as csrc/blocks.h's kIQ4Values)
IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def to_int8_groups(w: QuantizedWeight) -> Int8GroupWeight:
    """`w`'s blocks as 8-bit groups (on `w`'s device)."""
    if w.qtype not in INT8_FORMATS:
        raise ValueError(f"{w.format} blocks cannot be 8-bit groups (those are "
                         f"{' / '.join(FORMATS[t][0] for t in INT8_FORMATS)}: gguf_gpu.to_gpu_weight)")
    n, k = w.shape
    _, qk, size = FORMATS[w.qtype]
    blocks = w.data.view(n, k // qk, size)
    codes, scales, zeros, group = _CONVERT[w.qtype](blocks)
    return Int8GroupWeight(codes.reshape(n, k).contiguous(), scales.reshape(n, k // group).contiguous(),
                           zeros.reshape(n, k // group).contiguous(), group)


def _u8(scales: torch.Tensor, value: int) -> torch.Tensor:
    return torch.full(scales.shape, value, dtype=torch.uint8, device=scales.device)


def _grid(idx: torch.Tensor) -> torch.Tensor:
    """IQ4 indices as the stored code grid[idx] + 128."""
    table = torch.tensor([v + 128 for v in IQ4_GRID], dtype=torch.uint8, device=idx.device)
    return table[idx.long()]


def _q8_0(b):
    d = fp16_at(b, 0)
    return b[..., 2:34] ^ 0x80, d, _u8(d, 128), 32     # int8 q + 128: the sign bit flipped


def _q5_high_bits(b, at):
    """The fifth bit of each of a Q5_0 / Q5_1 block's 32 codes (qh: a little-endian uint32)."""
    return bit_fields(b[..., at:at + 4], 8).transpose(-1, -2).reshape(*b.shape[:-1], 32)


def _q5_0(b):
    d = fp16_at(b, 0)
    return nibbles(b[..., 6:22]) | (_q5_high_bits(b, 2) << 4), d, _u8(d, 16), 32


def _q5_1(b):
    codes = nibbles(b[..., 8:24]) | (_q5_high_bits(b, 4) << 4)
    return (*offset_zero_points(codes, fp16_at(b, 0), fp16_at(b, 2)), 32)


def _q5_k(b):
    n, supers, _ = b.shape
    d, dmin = fp16_at(b, 0).float(), fp16_at(b, 2).float()
    sc, m = k4_scales(b[..., 4:16])
    low = bit_fields(b[..., 48:176].reshape(n, supers, 4, 32), 2, 4).reshape(n, supers, 8, 32)
    high = bit_fields(b[..., 16:48], 8)                                      # [n, supers, 8, 32]
    scales = d[..., None] * sc.float()
    return (*offset_zero_points(low | (high << 4), scales, -(dmin[..., None] * m.float())), 32)


def _q6_k(b):
    n, supers, _ = b.shape
    low = bit_fields(b[..., 0:128].reshape(n, supers, 2, 64), 2, 4).reshape(n, supers, 8, 32)
    high = bit_fields(b[..., 128:192].reshape(n, supers, 2, 32), 4, 2).reshape(n, supers, 8, 32)
    codes = (low | (high << 4)).reshape(n, supers, 16, 16)
    scales = fp16_at(b, 208).float()[..., None] * b[..., 192:208].view(torch.int8).float()
    return codes, scales, _u8(scales, 32), 16


def _k_2bit_codes(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K's 64 code bytes as 256 2-bit codes: each 128 elements a 32-byte run, four
    shifts of it in turn; [n, supers, 16, 16]."""
    n, supers, _ = qs.shape
    return bit_fields(qs.reshape(n, supers, 2, 32), 4, 2).reshape(n, supers, 16, 16)


def _q2_k(b):
    d, dmin = fp16_at(b, 80).float(), fp16_at(b, 82).float()
    packed = b[..., 0:16]
    scales = d[..., None] * (packed & 0x0F).float()
    return (*offset_zero_points(_k_2bit_codes(b[..., 16:80]), scales, -(dmin[..., None] * (packed >> 4).float())),
            16)


def _q3_k(b):
    n, supers, _ = b.shape
    hbit = bit_fields(b[..., 0:32], 8).reshape(n, supers, 16, 16)            # bit j of hmask byte i: element 32 j + i
    packed = b[..., 96:108]
    low = bit_fields(packed[..., 0:8], 2, 4).reshape(n, supers, 16)          # scale k < 8: low nibble of byte k, ...
    high = bit_fields(packed[..., 8:12], 4, 2).reshape(n, supers, 16)        # ... its top two bits at 2 (k // 4) of byte 8 + k % 4
    sc = (low | (high << 4)).float() - 32
    scales = fp16_at(b, 108).float()[..., None] * sc
    # NOTE: value = d * sc * (low 2 bits - 4 * (1 - hbit)): code low + 4 hbit, zero 4
    return _k_2bit_codes(b[..., 32:96]) | (hbit << 2), scales, _u8(scales, 4), 16


def _iq4_nl(b):
    d = fp16_at(b, 0)
    return _grid(nibbles(b[..., 2:18])), d, _u8(d, 128), 32


def _iq4_xs(b):
    n, supers, _ = b.shape
    d = fp16_at(b, 0).float()
    high = bit_fields(b[..., 2:4], 4, 2).transpose(-1, -2).reshape(n, supers, 8)   # sub-block j: bits 2 j of a LE uint16
    low = bit_fields(b[..., 4:8], 2, 4).transpose(-1, -2).reshape(n, supers, 8)
    scales = d[..., None] * ((low | (high << 4)).float() - 32)
    codes = _grid(nibbles(b[..., 8:136].reshape(n, supers, 8, 16)))
    return codes, scales, _u8(scales, 128), 32


_CONVERT = {Q8_0: _q8_0, Q5_0: _q5_0, Q5_1: _q5_1, Q2_K: _q2_k, Q3_K: _q3_k, Q5_K: _q5_k, Q6_K: _q6_k,
            IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs}
