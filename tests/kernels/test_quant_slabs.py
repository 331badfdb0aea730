"""The quantized GEMM's many-row path ("slabs", kernels/quant/ops.py): the weight dequantized a slab
of rows at a time into one reused scratch buffer (`dequantize_into`, the tiles' arithmetic) and
each slab multiplied by the dense GEMM.

float32 slabs: the float64 product of gguf's dequantized weights within float32 summation error
(K + 2 ulps of |x| @ |W|^T, as the tiles). bf16 slabs (bf16 activations on AVX512-BF16): the
float64 product of the bf16 activations and the bf16-rounded dequantized weights within that bound,
then one rounding to bf16 (2^-8 relative). Several slabs (a small SLAB_BYTES) give the columns of
one slab to the bit: the dense GEMM's sums along K do not depend on where N is cut.
"""
from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from kvmesh.kernels.quant import build, kernels_available, quant_linear
from kvmesh.kernels.quant import ops
from kvmesh.kernels.quant.ops import SLAB_MIN_ROWS, TILED_MIN_ROWS, amx_ready, gemm_path, slab_min_rows, tile_kind
from tests.kernels.test_quant_gemm import FORMATS, U, _weight

pytestmark = pytest.mark.skipif(not kernels_available(),
                                reason=f"quantized kernels unavailable: {build.unavailable_reason()}")


def _bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[1]
    return x.double() @ w.double().T, (k + 2) * U * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_into_is_the_dequantized_rows(qtype):
    w, ref = _weight(qtype, 11, 512, seed=4, activations="float")
    out = torch.empty(6, 512)
    build.load().dequantize_into(w.data, 3, out, w.qtype, 512)
    # NOTE: to one rounding, as the tiles: a * q + c is one fused multiply-add where gguf rounds twice
    torch.testing.assert_close(out, ref[3:9], rtol=2 * U, atol=0)
    if tile_kind(torch.bfloat16) == "bf16":
        out16 = torch.empty(6, 512, dtype=torch.bfloat16)
        build.load().dequantize_into(w.data, 3, out16, w.qtype, 512)
        assert torch.equal(out16, out.bfloat16())


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_slabs_equal_the_dequantized_matmul(qtype, dtype, monkeypatch):
    m, n, k = 70, 45, 512
    w, ref = _weight(qtype, n, k, seed=m, activations="float")
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    y = quant_linear(x, w, bias, path="slabs")
    assert y.shape == (m, n) and y.dtype == dtype
    bf16_slabs = dtype == torch.bfloat16 and tile_kind(dtype) == "bf16"
    exact, bound = _bound(x, ref.bfloat16() if bf16_slabs else ref)
    exact = exact + bias.double()
    err = (y.double() - exact).abs()
    if dtype == torch.float32:
        assert (err <= bound + 2 * U * exact.abs()).all()
    else:
        # the GEMM's result rounded to bf16, the bias added (another bf16 rounding where the
        # slabs are bf16; float32 slabs add it before their one rounding)
        assert (err <= bound * (1 + 2 ** -8) + 2 ** -7 * exact.abs() + 2 ** -8 * bias.abs().double()).all()
    # cut into slabs of 8 rows (6 slabs, the last of 5): the same bits
    monkeypatch.setattr(ops, "SLAB_BYTES", 8 * k * (2 if bf16_slabs else 4))
    assert torch.equal(quant_linear(x, w, bias, path="slabs"), y)


def test_the_scratch_slab_is_reused_and_never_the_matrix(monkeypatch):
    monkeypatch.setattr(ops, "_scratch", {})
    monkeypatch.setattr(ops, "SLAB_BYTES", 16 * 256 * 4)
    w, _ = _weight(T.Q4_1, 100, 256, activations="float")
    x = torch.randn(3, 256)
    quant_linear(x, w, path="slabs")
    buf = ops._scratch[torch.float32]
    assert buf.numel() == 16 * 256                  # 16 of the 100 rows at a time
    quant_linear(x, w, path="slabs")
    assert ops._scratch[torch.float32] is buf


def test_quant_linear_takes_the_slabs_from_the_threshold(monkeypatch):
    w, _ = _weight(T.Q4_1, 24, 256, activations="float")
    calls = []
    slab_gemm = ops._slab_gemm
    monkeypatch.setattr(ops, "_slab_gemm", lambda x, w: calls.append(x.shape[0]) or slab_gemm(x, w))
    for dtype in (torch.float32, torch.bfloat16):
        kind = tile_kind(dtype)
        at = slab_min_rows(dtype)
        assert at == SLAB_MIN_ROWS[kind] or (dtype == torch.bfloat16 and amx_ready())
        assert at > TILED_MIN_ROWS[kind]
        below = "amx" if dtype == torch.bfloat16 and amx_ready() else "tiled"
        assert (gemm_path(at - 1, dtype), gemm_path(at, dtype)) == (below, "slabs")
        assert gemm_path(at, dtype, activations="int8") == "slabs"
        x = torch.randn(at, 256, generator=torch.Generator().manual_seed(at)).to(dtype)
        calls.clear()
        quant_linear(x[:-1], w)
        quant_linear(x, w)
        assert calls == [at]


def test_dequantize_into_refuses_bad_output():
    w, _ = _weight(T.Q8_0, 10, 256, activations="float")
    ext = build.load()
    with pytest.raises(RuntimeError, match=r"rows \[8, 12\) out of range \[0, 10\)"):
        ext.dequantize_into(w.data, 8, torch.empty(4, 256), w.qtype, 256)
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU"):
        ext.dequantize_into(w.data, 0, torch.empty(256, 4).T, w.qtype, 256)
    with pytest.raises(RuntimeError, match="out must be float32"):
        ext.dequantize_into(w.data, 0, torch.empty(2, 256, dtype=torch.float64), w.qtype, 256)
    with pytest.raises(RuntimeError, match="bytes a row"):
        ext.dequantize_into(w.data, 0, torch.empty(2, 512), w.qtype, 512)
