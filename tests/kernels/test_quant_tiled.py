"""The tiled many-row quantized GEMM (kernels/quant/csrc/tiled.cpp) against exact products.

float32 tiles: the float64 product of gguf's dequantized weights within float32 summation error
(K ulps of |x| @ |W|^T). bf16 tiles (bf16 activations on AVX512-BF16): the float64 product of the
bf16 activations and the bf16-rounded dequantized weights (what a bf16 model holds) within the
float32 summation error, before the output's own rounding to bf16. Shapes: odd M and N, M around
the tiled thresholds, K past one tile (several K slabs).
"""
from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from kvmesh.kernels import cpu_kernels
from kvmesh.kernels.quant import build, kernels_available, quant_linear
from kvmesh.kernels.quant.ops import (INT8_TILED_MIN_ROWS, SLAB_MIN_ROWS, TILED_MIN_ROWS, amx_ready, gemm_path,
                                      tile_kind, tiled_isa)
from tests.kernels.test_quant_gemm import FORMATS, U, _weight

pytestmark = pytest.mark.skipif(not kernels_available(),
                                reason=f"quantized kernels unavailable: {build.unavailable_reason()}")

# (M, N, K): M around the thresholds, odd N (tile and micro-kernel edges), K = 2048 is two K slabs
# of both tile kinds, K = 1536 two float32 slabs
SHAPES = [(7, 33, 512), (8, 16, 256), (33, 21, 1536), (9, 17, 2048)]


def _exact(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ w^T, (K + 2) U |x| @ |w|^T) in float64."""
    k = x.shape[1]
    return x.double() @ w.double().T, (k + 2) * U * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_float32_tiles_equal_the_dequantized_matmul(qtype, shape):
    m, n, k = shape
    w, ref = _weight(qtype, n, k, seed=m, activations="float")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    y = quant_linear(x, w, path="tiled")
    exact, bound = _exact(x, ref)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_bf16_activations(qtype, shape):
    m, n, k = shape
    w, ref = _weight(qtype, n, k, seed=m, activations="float")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    y = quant_linear(x, w, path="tiled")
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # bf16 tiles: a bf16 GEMM of the dequantized weights; float32 tiles: the widened activations'
    # float32 product. Either, then rounded to bf16 once (bf16 unit roundoff 2^-8).
    wt = ref.bfloat16() if tile_kind(x.dtype) == "bf16" else ref
    exact, bound = _exact(x, wt)
    err = (y.double() - exact).abs()
    assert (err <= bound * (1 + 2 ** -8) + 2 ** -8 * exact.abs()).all()


def test_bf16_tiles_where_the_cpu_has_avx512_bf16():
    want = "float32" if cpu_kernels.missing_flags("avx512_bf16") else "bf16"
    assert tile_kind(torch.bfloat16) == want
    assert tile_kind(torch.float32) == "float32"
    # (the tiles' paths: AMX is the quantized GEMM's own "amx" path, not the tiles')
    assert tiled_isa() == next(p for p in cpu_kernels.PATHS if p != "amx" and not cpu_kernels.missing_flags(p))


def test_quant_linear_switches_kernels_at_the_threshold(monkeypatch):
    import kvmesh.kernels.quant.ops as qops  # noqa: PLC0415
    w, _ = _weight(T.Q4_1, 24, 256, activations="float")
    ext, called = qops._ext(), []

    class Spy:
        def __getattr__(self, name):
            called.append(name)
            return getattr(ext, name)

    def kernel_of(x):
        called.clear()
        with monkeypatch.context() as m:
            m.setattr(qops, "_ext", Spy)
            y = quant_linear(x, w)
        return y, called[-1]
    # NOTE: on a CPU with AMX, bf16 activations take the AMX path over the bf16 tiles (test_quant_amx)
    for dtype in (torch.float32,) if amx_ready() else (torch.float32, torch.bfloat16):
        at = TILED_MIN_ROWS[tile_kind(dtype)]
        assert (gemm_path(at - 1, dtype), gemm_path(at, dtype)) == ("rows", "tiled")
        int8_at = INT8_TILED_MIN_ROWS[tile_kind(dtype)]
        if int8_at is None:
            assert gemm_path(SLAB_MIN_ROWS[tile_kind(dtype)] - 1, dtype, activations="int8") == "rows"
        else:
            assert (gemm_path(int8_at - 1, dtype, activations="int8"),
                    gemm_path(int8_at, dtype, activations="int8")) == ("rows", "tiled")
            xi = torch.randn(int8_at, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
            assert torch.equal(quant_linear(xi, w, activations="int8"), quant_linear(xi, w, path="tiled"))
            assert torch.equal(quant_linear(xi[:-1], w, activations="int8"),
                               quant_linear(xi[:-1], w, activations="int8", path="rows"))
        x = torch.randn(at, 256, generator=torch.Generator().manual_seed(at)).to(dtype)
        # the kernel each call reached (on an AVX2-only CPU the two paths can round alike, so the
        # bits alone cannot say which ran), and its result is that path's
        y, kernel = kernel_of(x)
        assert kernel == "quant_gemm_tiled" and torch.equal(y, quant_linear(x, w, path="tiled"))
        y, kernel = kernel_of(x[:-1])
        assert kernel == "quant_gemm" and torch.equal(y, quant_linear(x[:-1], w, path="rows"))


def test_bias_leading_dims_zero_rows_and_refusals():
    w, ref = _weight(T.Q8_0, 10, 256, activations="float")
    bias = torch.randn(10)
    x = torch.randn(3, 4, 256)
    y = quant_linear(x, w, bias, path="tiled")
    assert y.shape == (3, 4, 10)
    torch.testing.assert_close(y, x @ ref.T + bias, rtol=1e-5, atol=1e-4)
    assert quant_linear(torch.zeros(0, 256), w, path="tiled").shape == (0, 10)
    with pytest.raises(ValueError, match="'tiled' takes float activations"):
        quant_linear(x, w, activations="int8", path="tiled")
    with pytest.raises(ValueError, match="path must be one of"):
        quant_linear(x, w, path="dense")
    ext = build.load()
    with pytest.raises(RuntimeError, match="x must be a CPU float32 or bfloat16"):
        ext.quant_gemm_tiled(torch.zeros(2, 256, dtype=torch.float64), w.data, w.qtype, 256)
    with pytest.raises(RuntimeError, match="bytes a row"):
        ext.quant_gemm_tiled(torch.zeros(2, 512), w.data, w.qtype, 512)


def test_the_avx2_build():
    """The tile kernels an AVX2-only CPU runs (a build of the same sources with -mno-avx512f):
    float32 tiles for both activation dtypes, every format."""
    missing = cpu_kernels.missing_flags("avx2")
    if missing:
        pytest.skip(f"the avx2 path needs CPU flags {', '.join(missing)}, which this CPU lacks")
    ext = build.load("avx2")
    assert ext is not None, build.unavailable_reason("avx2")
    assert ext.tiled_isa() == "avx2"
    for qtype in FORMATS:
        w, ref = _weight(qtype, 19, 1536, seed=3, activations="float")
        x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(5))
        exact, bound = _exact(x, ref)
        y = ext.quant_gemm_tiled(x, w.data, w.qtype, 1536)
        assert ((y.double() - exact).abs() <= bound).all(), qtype.name
        xb = x.bfloat16()
        exact, bound = _exact(xb, ref)   # widened exactly: no bf16 rounding of the weights
        yb = ext.quant_gemm_tiled(xb, w.data, w.qtype, 1536)
        assert ((yb.double() - exact).abs() <= bound).all(), qtype.name
