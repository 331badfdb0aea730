"""The AMX path of the quantized GEMM (kernels/quant/csrc/amx.cpp) against exact products.

Where the CPU has AMX bf16 tiles: the float64 product of the bf16 activations and the bf16-rounded
dequantized weights (what the bf16 tiles and a bf16 model hold) within the float32 summation error,
before the output's one rounding to bf16, as the bf16 tiles' test. Shapes: M around the 16-row
activation groups (one group, two, an odd third), N around the 32-row weight tasks and their
16-row tiles, K of one tile step up to several super-blocks. Elsewhere: the path is never taken
and refuses to run.
"""
from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from kvmesh.kernels.cpu_features import cpu_flags
from kvmesh.kernels.quant import build, kernels_available, ops, quant_linear
from kvmesh.kernels.quant.ops import AMX_MIN_ROWS, AMX_SLAB_MIN_ROWS, amx_ready, gemm_path, slab_min_rows
from tests.kernels.test_quant_gemm import FORMATS, _weight
from tests.kernels.test_quant_tiled import _exact

pytestmark = pytest.mark.skipif(not kernels_available(),
                                reason=f"quantized kernels unavailable: {build.unavailable_reason()}")
needs_amx = pytest.mark.skipif(not kernels_available() or not amx_ready(),
                               reason="no AMX bf16 tiles here (CPU flags, or the kernel's permission)")

# (M, N, K): M 1 (one padded group), 16, 17 and 47 (a pair of groups and an odd third); N 7 (a
# partial tile), 16, 33 (a task and a partial one), 80; K 256 (one super-block), 768, 2048
SHAPES = [(1, 7, 256), (16, 33, 768), (17, 16, 256), (47, 80, 2048), (8, 48, 512)]


@needs_amx
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_amx_is_a_bf16_gemm_of_the_dequantized_weights(qtype, shape):
    m, n, k = shape
    w, ref = _weight(qtype, n, k, seed=m + n, activations="float")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)).bfloat16()
    y = quant_linear(x, w, path="amx")
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    exact, bound = _exact(x, ref.bfloat16())
    err = (y.double() - exact).abs()
    assert (err <= bound * (1 + 2 ** -8) + 2 ** -8 * exact.abs()).all()
    # the bf16 tiles hold the same weights: the two differ only in summation order
    tiles = build.load().quant_gemm_tiled(x, w.data, w.qtype, k)
    raw = build.load().quant_gemm_amx(x, w.data, w.qtype, k)
    assert ((raw.double() - tiles.double()).abs() <= 2 * bound).all()


@needs_amx
def test_quant_linear_takes_amx_between_the_tiles_and_the_slabs(monkeypatch):
    w, _ = _weight(T.Q4_1, 40, 256, activations="float")
    bf16 = torch.bfloat16
    assert gemm_path(AMX_MIN_ROWS - 1, bf16) == "rows"
    assert slab_min_rows(bf16) == AMX_SLAB_MIN_ROWS
    assert gemm_path(AMX_MIN_ROWS, bf16) == gemm_path(AMX_SLAB_MIN_ROWS - 1, bf16) == "amx"
    assert gemm_path(AMX_MIN_ROWS, bf16, activations="int8") == "amx"     # taken as floats, as the tiles
    assert gemm_path(AMX_SLAB_MIN_ROWS, bf16) == "slabs"
    assert gemm_path(64, torch.float32) == "slabs" and gemm_path(32, torch.float32) == "tiled"
    x = torch.randn(AMX_MIN_ROWS + 3, 256, generator=torch.Generator().manual_seed(3)).to(bf16)
    wi, _ = _weight(T.Q4_1, 40, 256, activations="int8")
    calls = []
    ext = build.load()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ext, name)
    monkeypatch.setattr(ops, "_ext", Spy)
    for rows, weight, kernel in ((AMX_MIN_ROWS, w, "quant_gemm_amx"), (AMX_MIN_ROWS, wi, "quant_gemm_amx"),
                                 (AMX_MIN_ROWS - 1, w, "quant_gemm")):
        calls.clear()
        assert quant_linear(x[:rows], weight).shape == (rows, 40)
        assert calls == [kernel]


def test_amx_only_where_the_cpu_has_it():
    if "amx_bf16" not in cpu_flags():
        assert not amx_ready()
        assert gemm_path(AMX_MIN_ROWS, torch.bfloat16) != "amx"
    assert build.load().amx_isa() in ("", "amx_bf16")
    assert all(gemm_path(m, torch.float32) != "amx" for m in (1, 8, 64, 512))


def test_amx_refusals():
    w, _ = _weight(T.Q8_0, 10, 256, activations="float")
    with pytest.raises(ValueError, match="path 'amx' takes bfloat16 activations"):
        quant_linear(torch.randn(9, 256), w, path="amx")
    ext = build.load()
    with pytest.raises(RuntimeError, match="x must be a CPU bfloat16"):
        ext.quant_gemm_amx(torch.zeros(9, 256), w.data, w.qtype, 256)
    with pytest.raises(RuntimeError, match="bytes a row"):
        ext.quant_gemm_amx(torch.zeros(9, 512, dtype=torch.bfloat16), w.data, w.qtype, 512)
    if not amx_ready():
        with pytest.raises(RuntimeError, match="no AMX bf16 tiles"):
            ext.quant_gemm_amx(torch.zeros(9, 256, dtype=torch.bfloat16), w.data, w.qtype, 256)
    else:
        assert ext.quant_gemm_amx(torch.zeros(0, 256, dtype=torch.bfloat16), w.data, w.qtype, 256).shape == (0, 10)
