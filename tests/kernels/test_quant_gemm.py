"""The quantized GEMM (kernels/quant) against the float32 matmul of the same dequantized weights.

Float activations: equal to the float64 product of the gguf package's dequantized weights within
float32 summation error (K ulps of |x| @ |W|^T). Int8 activations: equal, within the same
rounding, to the product with the int8-rounded activations x_hat (computed here by the kernels'
rule: per 32-block scale max|x| / 127, round half to even), hence within the exact int8 rounding
error |x - x_hat| @ |W|^T of the float result.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize, quantize

from kvmesh.kernels.quant import (QuantizedWeight, concat, dequantize, embedding_rows,
                                  kernels_available, quant_linear)
from kvmesh.kernels import cpu_kernels
from kvmesh.kernels.quant import build
from kvmesh.kernels.quant.ops import int8_isa
from kvmesh.kernels.quant.weight import FP16_SCALES

pytestmark = pytest.mark.skipif(not kernels_available(),
                                reason=f"quantized kernels unavailable: {build.unavailable_reason()}")

FORMATS = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL,
           T.IQ4_XS]
RANDOM_BLOCKS = tuple(T(t) for t in FP16_SCALES)        # the formats gguf has no quantizer for
K_FORMATS = tuple(t for t in RANDOM_BLOCKS if GGML_QUANT_SIZES[t][0] == 256)
U = 2.0 ** -24    # float32 unit roundoff


def random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row_bytes] blocks: gguf's own quantizer where it has one, else random bytes with small
    positive fp16 scales (gguf has no K-quant or IQ4 quantizer; every bit pattern is a valid block)."""
    if qtype not in RANDOM_BLOCKS:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    qk, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // qk, size), dtype=np.uint8)
    at, width = FP16_SCALES[qtype]
    scales = np.float16(rng.uniform(1e-3, 1e-2, (n, k // qk, width // 2))).view(np.uint8)
    raw[..., at:at + width] = scales.reshape(n, k // qk, width)
    return raw.reshape(n, -1)


def _weight(qtype: T, n: int, k: int, seed: int = 0, activations: str = "int8"):
    raw = random_blocks(qtype, n, k, np.random.default_rng(seed))
    ref = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    return QuantizedWeight(torch.from_numpy(raw.copy()), int(qtype), (n, k), activations), ref


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: per 32-block d = max|x| / 127, q = round_half_even(x / d)."""
    b = x.view(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return (torch.round(b * inv) * d).view_as(x)


SHAPES = [(1, 7, 256), (5, 33, 512), (6, 64, 768), (13, 1, 256)]   # (M, N, K): odd M and N


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_equals_gguf(qtype):
    w, ref = _weight(qtype, 9, 512)
    # NOTE: to one rounding: a * q + c may be one fused multiply-add where gguf rounds twice
    torch.testing.assert_close(dequantize(w), ref, rtol=2 * U, atol=0)
    ids = torch.tensor([[8, 0], [3, 3]])
    torch.testing.assert_close(embedding_rows(w, ids), ref[ids], rtol=2 * U, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_float_activations_equal_the_dequantized_matmul(qtype, shape):
    m, n, k = shape
    w, ref = _weight(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    y = quant_linear(x, w, activations="float")
    exact = x.double() @ ref.double().T
    bound = (k + 2) * U * (x.abs().double() @ ref.abs().double().T)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= bound).all()
    dense = x @ ref.T   # and so within float32 rounding of the dense float32 matmul
    assert ((y - dense).abs().double() <= 2 * bound).all()


def _assert_int8_bounds(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor) -> None:
    k = x.shape[1]
    y = y.double()
    x_hat = int8_rounded(x)
    rounding = (k + 4) * U * (x_hat.abs().double() @ ref.abs().double().T)
    assert ((y - x_hat.double() @ ref.double().T).abs() <= rounding).all()
    int8_error = (x - x_hat).abs().double() @ ref.abs().double().T
    exact = x.double() @ ref.double().T
    assert ((y - exact).abs() <= int8_error + rounding).all()
    assert (int8_error > 0).any()       # the bound is not vacuous: x was really rounded


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_int8_activations_within_the_int8_rounding_error(qtype, shape):
    m, n, k = shape
    w, ref = _weight(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    _assert_int8_bounds(quant_linear(x, w, activations="int8"), x, ref)


# (M, N, K) for the one-scale-per-32 formats: K / 32 = 1 (no whole group of 8 blocks), 9 (a group
# and one block left over), 23 (two groups and 7 left); M = 16 and 11: four 4-row tiles, and two
# tiles with 3 rows left.
GROUP_SHAPES = [(2, 3, 32), (16, 5, 288), (11, 9, 736)]


@pytest.mark.parametrize("shape", GROUP_SHAPES, ids=str)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_int8_groups_of_eight_blocks_and_the_blocks_left_over(qtype, shape):
    m, n, k = shape
    w, ref = _weight(qtype, n, k, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    _assert_int8_bounds(quant_linear(x, w, activations="int8"), x, ref)
    # the row results do not depend on which rows share a call (the 4-row tiles, the leftovers)
    one = torch.cat([quant_linear(x[i:i + 1], w, activations="int8") for i in range(m)])
    torch.testing.assert_close(quant_linear(x, w, activations="int8"), one, rtol=0, atol=0)


def test_the_avx2_build_of_the_per_row_paths():
    """The per-row kernels an AVX2-only CPU runs (the same sources built with -mno-avx512f):
    maddubs + madd for the int8 dot product; every format, both activations, leftover blocks."""
    missing = cpu_kernels.missing_flags("avx2")
    if missing:
        pytest.skip(f"the avx2 path needs CPU flags {', '.join(missing)}, which this CPU lacks")
    ext = build.load("avx2")
    assert ext is not None, build.unavailable_reason("avx2")
    assert ext.int8_isa() == "avx2"
    for qtype in FORMATS:
        k = 768 if qtype in K_FORMATS else 288
        w, ref = _weight(qtype, 7, k, seed=4)
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(6))
        _assert_int8_bounds(ext.quant_gemm(x, w.data, w.qtype, k, True), x, ref)
        y = ext.quant_gemm(x, w.data, w.qtype, k, False).double()
        exact = x.double() @ ref.double().T
        bound = (k + 2) * U * (x.abs().double() @ ref.abs().double().T)
        assert ((y - exact).abs() <= bound).all(), qtype.name


def test_bias_leading_dims_and_zero_rows():
    w, ref = _weight(T.Q4_1, 10, 256)
    bias = torch.randn(10)
    x = torch.randn(2, 3, 256)
    y = quant_linear(x, w, bias, activations="float")
    assert y.shape == (2, 3, 10)
    torch.testing.assert_close(y, x @ ref.T + bias, rtol=1e-5, atol=1e-4)
    assert quant_linear(torch.zeros(0, 256), w).shape == (0, 10)
    # a 2-D call returns [M, N] as it is; other dtypes come back in theirs, from the float32 result
    y2 = quant_linear(x[0], w, bias, activations="float")
    assert y2.shape == (3, 10) and torch.equal(y2, y[0])
    y16 = quant_linear(x.half(), w, activations="float")
    assert y16.dtype == torch.float16 and y16.shape == (2, 3, 10)
    torch.testing.assert_close(y16.float(), quant_linear(x.half().float(), w, activations="float"),
                               rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="activations must be one of"):
        quant_linear(x, w, activations="fp8")


def test_concat_stacks_rows_and_refuses_mixed_formats():
    a, ra = _weight(T.Q4_K, 4, 256, seed=1)
    b, rb = _weight(T.Q4_K, 3, 256, seed=2)
    both = concat([a, b])
    assert both.shape == (7, 256)
    torch.testing.assert_close(dequantize(both), torch.cat([ra, rb]), rtol=2 * U, atol=0)
    c, _ = _weight(T.Q6_K, 3, 256, seed=3)
    assert concat([a, c]) is None


def test_weight_validates_its_bytes():
    with pytest.raises(ValueError, match="unsupported GGUF quantization type IQ2_XS"):
        QuantizedWeight(torch.zeros(1, 74, dtype=torch.uint8), int(T.IQ2_XS), (1, 256))
    with pytest.raises(ValueError, match="K=100 is not a multiple of the block size 32"):
        QuantizedWeight(torch.zeros(1, 18, dtype=torch.uint8), int(T.Q4_0), (1, 100))
    with pytest.raises(ValueError, match=r"needs uint8 bytes of shape \(2, 36\)"):
        QuantizedWeight(torch.zeros(2, 18, dtype=torch.uint8), int(T.Q4_0), (2, 64))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


def test_int8_path_is_the_best_this_cpu_has():
    """The int8 dot product is chosen at compile time (-march=native); the path built here must
    be the best the CPU offers. The other paths are tested on the machines that have them."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags (not Linux x86): cannot tell which path to expect")
    if {"avx512_vnni", "avx512vl", "avx2"} <= flags:
        want = "avx512vnni"
    elif {"avx_vnni", "avx2"} <= flags:
        want = "avxvnni"
    elif "avx2" in flags:
        want = "avx2"
    else:
        want = "scalar"
    print(f"int8 dot product on this CPU: {int8_isa()}")
    assert int8_isa() == want
