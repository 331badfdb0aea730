"""The AMX path of the quantized GEMM (kernels/quant/csrc/amx.cpp) against exact products.

Where the CPU has AMX bf16 tiles: the float64 product of the bf16 activations and the bf16-rounded
dequantized weights (what the bf16 tiles and a bf16 model hold) within the float32 summation error,
before the output's one rounding to bf16, as the bf16 tiles' test. Shapes: M around the 16-row
activation groups (one group, two, an odd third), N around the 32-row weight tasks and their
16-row tiles, K of one tile step up to several super-blocks. Elsewhere: the path is never taken
and refuses to run.
"""
from __future__ import annotations

import numpy as np
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
    raw = build.load().quant_gemm_amx(x, w.data, w.qtype, k, False)
    assert raw.dtype == torch.float32
    assert ((raw.double() - tiles.double()).abs() <= 2 * bound).all()
    # the bf16 result is the float32 one rounded by torch, bit for bit
    rounded = build.load().quant_gemm_amx(x, w.data, w.qtype, k, True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, raw.bfloat16()) and torch.equal(y, rounded)


@needs_amx
def test_amx_bf16_output_rounds_ties_to_even_and_keeps_nan_and_inf():
    """Hand-built Q8_0 rows (scale 1: row n holds 1 and n, zeros after), so y is exact in
    float32: 1 + n * 2^-8 lies halfway between two bf16 values for odd n (ties to even) and on one
    for even n; an infinite activation gives inf, inf - inf NaN."""
    n, k = 16, 256
    row = np.zeros((k // 32, 34), dtype=np.uint8)
    row[:, :2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    rows = np.repeat(row[None], n, axis=0)
    rows[:, 0, 2] = 1                                   # weight 0 = 1
    rows[:, 0, 3] = np.arange(n, dtype=np.int8).view(np.uint8)  # weight 1 = n
    data = torch.from_numpy(rows.reshape(n, -1).copy())
    x = torch.zeros(3, k, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = 1.0, 2.0 ** -8
    x[1, 0] = float("inf")
    x[2, 0], x[2, 1] = float("inf"), float("-inf")
    ext = build.load()
    y32 = ext.quant_gemm_amx(x, data, int(T.Q8_0), k, False)
    y16 = ext.quant_gemm_amx(x, data, int(T.Q8_0), k, True)
    assert y32[0].tolist() == [1.0 + i * 2.0 ** -8 for i in range(n)]
    # ties to even: 1 + 1/256 -> 1, 1 + 3/256 -> 1 + 4/256; exact for even n
    assert y16[0].tolist() == [1.0 + 2.0 ** -8 * (i + (i % 4 == 3) - (i % 4 == 1)) for i in range(n)]
    assert torch.equal(y16[0].view(torch.int16), y32[0].bfloat16().view(torch.int16))
    assert y16[1].tolist() == [float("inf")] * n
    assert y16[2].isnan().all()


@needs_amx
def test_quant_linear_takes_amx_between_the_tiles_and_the_slabs(monkeypatch):
    w, _ = _weight(T.Q4_1, 40, 256, activations="float")
    bf16 = torch.bfloat16
    floor_f, floor_i8 = AMX_MIN_ROWS["float"], AMX_MIN_ROWS["int8"]
    assert floor_f == 1 and floor_i8 == 8
    assert slab_min_rows(bf16) == AMX_SLAB_MIN_ROWS
    # float activations: every row count up to the slabs (one kernel whatever the batch)
    assert {gemm_path(m, bf16) for m in range(1, AMX_SLAB_MIN_ROWS)} == {"amx"}
    # int8 activations: their per-row int8 kernel below 8 rows, then the tiles (taken as floats)
    assert gemm_path(floor_i8 - 1, bf16, activations="int8") == "rows"
    assert gemm_path(floor_i8, bf16, activations="int8") == "amx"
    assert gemm_path(AMX_SLAB_MIN_ROWS, bf16) == "slabs"
    assert gemm_path(64, torch.float32) == "slabs" and gemm_path(32, torch.float32) == "tiled"
    x = torch.randn(floor_i8 + 3, 256, generator=torch.Generator().manual_seed(3)).to(bf16)
    wi, _ = _weight(T.Q4_1, 40, 256, activations="int8")
    calls = []
    ext = build.load()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ext, name)
    monkeypatch.setattr(ops, "_ext", Spy)
    for rows, weight, kernel in ((1, w, "quant_gemm_amx"), (floor_i8, wi, "quant_gemm_amx"),
                                 (floor_i8 - 1, wi, "quant_gemm")):
        calls.clear()
        assert quant_linear(x[:rows], weight).shape == (rows, 40)
        assert calls == [kernel]


@needs_amx
@pytest.mark.parametrize("fmt", [T.Q4_1, T.Q8_0])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(fmt):
    # float activations take the AMX kernel at every row count: row i alone, or among 1..40 others,
    # gives the same bits
    w, _ = _weight(fmt, 70, 256, activations="float")
    x = torch.randn(41, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    full = quant_linear(x, w)
    for m in (1, 2, 7, 8, 17):
        assert torch.equal(quant_linear(x[:m], w), full[:m]), m


def test_amx_only_where_the_cpu_has_it():
    if "amx_bf16" not in cpu_flags():
        assert not amx_ready()
        assert all(gemm_path(m, torch.bfloat16) != "amx" for m in (1, 8, 64))
    assert build.load().amx_isa() in ("", "amx_bf16")
    assert all(gemm_path(m, torch.float32) != "amx" for m in (1, 8, 64, 512))


def test_amx_refusals():
    w, _ = _weight(T.Q8_0, 10, 256, activations="float")
    with pytest.raises(ValueError, match="path 'amx' takes bfloat16 activations"):
        quant_linear(torch.randn(9, 256), w, path="amx")
    ext = build.load()
    with pytest.raises(RuntimeError, match="x must be a CPU bfloat16"):
        ext.quant_gemm_amx(torch.zeros(9, 256), w.data, w.qtype, 256, False)
    with pytest.raises(RuntimeError, match="bytes a row"):
        ext.quant_gemm_amx(torch.zeros(9, 512, dtype=torch.bfloat16), w.data, w.qtype, 512, True)
    if not amx_ready():
        with pytest.raises(RuntimeError, match="no AMX bf16 tiles"):
            ext.quant_gemm_amx(torch.zeros(9, 256, dtype=torch.bfloat16), w.data, w.qtype, 256, True)
    else:
        assert ext.quant_gemm_amx(torch.zeros(0, 256, dtype=torch.bfloat16), w.data, w.qtype, 256, True).shape == (0, 10)
