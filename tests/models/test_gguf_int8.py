"""GGUF blocks as 8-bit groups for a GPU (kernels/quant/gguf_int8.py), each format against
gguf-py's own dequantizer: exactly for the formats without an offset, within the float32
zero point's rounding for those with one. Random bytes are valid blocks of every format (the
K and IQ4 formats have no quantizer in gguf-py), so a code, scale or zero read from the wrong
bit or place shows as a mismatch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from kvmesh.kernels.quant import QuantizedWeight
from kvmesh.kernels.quant.gguf_gpu import to_gpu_weight
from kvmesh.kernels.quant.gguf_int8 import INT8_FORMATS, to_int8_groups
from kvmesh.kernels.quant.hf_weight import Int4GroupWeight, Int8GroupWeight
from tests.kernels.test_quant_gemm import random_blocks

EXACT = {T.Q8_0, T.Q5_0, T.Q6_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS}
# (group size, scales dtype, zeros dtype) each format converts to
LAYOUT = {
    T.Q8_0: (32, torch.float16, torch.uint8), T.Q5_0: (32, torch.float16, torch.uint8),
    T.Q5_1: (32, torch.float16, torch.float32), T.Q2_K: (16, torch.float32, torch.float32),
    T.Q3_K: (16, torch.float32, torch.uint8), T.Q5_K: (32, torch.float32, torch.float32),
    T.Q6_K: (16, torch.float32, torch.uint8), T.IQ4_NL: (32, torch.float16, torch.uint8),
    T.IQ4_XS: (32, torch.float32, torch.uint8),
}


def _weight(raw: np.ndarray, qtype: T, n: int, k: int) -> tuple[QuantizedWeight, torch.Tensor]:
    want = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(n, k)).float()
    return QuantizedWeight(torch.from_numpy(raw.reshape(n, -1).copy()), int(qtype), (n, k)), want


def _within_zero_point_rounding(got: torch.Tensor, want: torch.Tensor, group: int) -> bool:
    """|got - want| within a few float32 roundings of the group's largest value: (q - zero) *
    scale against scale * q + offset, zero = -offset / scale rounded once."""
    n, k = want.shape
    big = want.view(n, k // group, group).abs().amax(-1, keepdim=True).expand(n, k // group, group)
    return bool(((got - want).abs() <= 2.0 ** -20 * big.reshape(n, k)).all())


def test_every_format_a_gpu_takes_as_8_bit_groups_is_tested():
    assert {T(t) for t in INT8_FORMATS} == set(LAYOUT)


@pytest.mark.parametrize("qtype", sorted(LAYOUT), ids=lambda t: t.name)
def test_8_bit_groups_are_the_blocks_values(qtype):
    n, k = 5, 512
    w, want = _weight(random_blocks(qtype, n, k, np.random.default_rng(int(qtype))), qtype, n, k)
    g = to_int8_groups(w)
    g.validate()
    group, scale_dtype, zero_dtype = LAYOUT[qtype]
    assert (g.group_size, g.scales.dtype, g.zeros.dtype) == (group, scale_dtype, zero_dtype)
    assert g.qweight.shape == (n, k) and g.scales.shape == (n, k // group)
    assert g.nbytes == n * k * (1 + (scale_dtype.itemsize + zero_dtype.itemsize) / group)
    got = g.dequantize()
    if qtype in EXACT:
        assert torch.equal(got, want)
    else:
        assert _within_zero_point_rounding(got, want, group)
        assert not torch.equal(got, want)     # the bound is not vacuous: the float zero points round


def _zero_scale_group(qtype: T) -> tuple[QuantizedWeight, torch.Tensor, int]:
    """Blocks whose first group has scale 0 and a non-zero offset (its values all that offset)."""
    n, k = 2, 256
    raw = random_blocks(qtype, n, k, np.random.default_rng(7))
    if qtype == T.Q5_1:
        x = np.random.default_rng(7).standard_normal((n, k)).astype(np.float32)
        x[1, :32] = 0.7                                     # a flat block: gguf stores d = 0, m = 0.7
        from gguf.quants import quantize
        raw = quantize(x, qtype)
    elif qtype == T.Q5_K:
        raw = raw.reshape(n, 1, 176)
        raw[1, 0, 4], raw[1, 0, 8] = 0, 5                   # sub-block 0: scale 0, min 5
    else:                                                   # Q2_K: scales byte 0 holds sc (low) and m (high)
        raw = raw.reshape(n, 1, 84)
        raw[1, 0, 0] = 0x50                                 # group 0: scale 0, min 5
    w, want = _weight(np.ascontiguousarray(raw).reshape(n, -1), qtype, n, k)
    return w, want, LAYOUT[qtype][0]


@pytest.mark.parametrize("qtype", [T.Q5_1, T.Q5_K, T.Q2_K], ids=lambda t: t.name)
def test_a_zero_scale_group_holds_its_offset_exactly(qtype):
    w, want, group = _zero_scale_group(qtype)
    g = to_int8_groups(w)
    got = g.dequantize()
    assert torch.equal(got[1, :group], want[1, :group]) and (want[1, :group] != 0).all()
    assert (want[1, :group] == want[1, 0]).all()
    assert (g.qweight[1, :group] == 1).all() and float(g.zeros[1, 0]) == 0.0


def test_other_formats_are_refused_by_name():
    w = QuantizedWeight(torch.zeros(1, 18, dtype=torch.uint8), int(T.Q4_0), (1, 32))
    with pytest.raises(ValueError, match=r"Q4_0 blocks cannot be 8-bit groups \(those are Q8_0 / Q5_0"):
        to_int8_groups(w)


def test_the_gpu_picks_int4_groups_for_the_q4_formats_and_8_bit_groups_for_the_rest():
    rng = np.random.default_rng(1)
    for qtype, kind in ((T.Q4_0, Int4GroupWeight), (T.Q4_K, Int4GroupWeight), (T.Q8_0, Int8GroupWeight),
                        (T.Q6_K, Int8GroupWeight)):
        w, want = _weight(random_blocks(qtype, 2, 256, rng), qtype, 2, 256)
        g = to_gpu_weight(w)
        assert type(g) is kind and torch.allclose(g.dequantize(), want, rtol=0, atol=1e-6)
