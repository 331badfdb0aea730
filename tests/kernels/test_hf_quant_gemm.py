"""The Hugging Face quantized GEMMs (kernels/quant/csrc/hf_gemm.cpp) on every code path this CPU
can build (its native one, and the narrower avx2 / portable builds of the same sources).

int4 groups, float activations: equal to the dequantized float32 matmul to float32 rounding.
W8A8: the activation codes equal the per-row int8 rounding exactly; the product equals the int32
dot products of those codes times both scales (to float32 rounding); and it differs from the
float matmul by no more than that rounding allows: sum_k |x_k - q_k * s| |w_k| <= s / 2 * sum_k |w_k|.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.quant import hf_build
from kvmesh.kernels.quant.hf_ops import hf_linear, reference_linear
from kvmesh.kernels.quant.hf_weight import Int4GroupWeight, Int8ChannelWeight

PATHS = [None, "avx2", "portable"]


def ext_for(path):
    ext = hf_build.load(path)
    if ext is None:
        pytest.skip(f"no {path or 'native'} build here: {hf_build.unavailable_reason(path)}")
    return ext


def int4_weight(n: int, k: int, group: int, gen: torch.Generator) -> Int4GroupWeight:
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
    zeros = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    w = Int4GroupWeight(packed, scales, zeros, group)
    w.validate()
    return w


def int8_weight(n: int, k: int, gen: torch.Generator) -> Int8ChannelWeight:
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    w = Int8ChannelWeight(codes, torch.rand(n, generator=gen) * 0.01 + 1e-3, codes.sum(1, dtype=torch.int32))
    w.validate()
    return w


def test_int4_dequantize_reads_low_nibble_first():
    w = Int4GroupWeight(torch.tensor([[0x21, 0x43]], dtype=torch.uint8), torch.tensor([[0.5]]),
                        torch.tensor([[1]], dtype=torch.uint8), 4)
    assert w.dequantize().tolist() == [[0.0, 0.5, 1.0, 1.5]]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m, k, group", [(1, 256, 128), (5, 256, 64), (13, 384, 32), (20, 256, 128)])
def test_int4_gemm_equals_dequantized_matmul(path, m, k, group):
    ext = ext_for(path)
    gen = torch.Generator().manual_seed(m * k + group)
    w = int4_weight(19, k, group, gen)
    x = torch.randn(m, k, generator=gen)
    y = ext.w4a16_gemm(x, w.qweight, w.scales, w.zeros, group)
    want = x.double() @ w.dequantize().double().T
    bound = 2e-6 * (x.double().abs() @ w.dequantize().double().abs().T) + 1e-7
    assert ((y.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m, n", [(3, 8), (14, 19)])
def test_int4_gemm_with_bf16_activations(path, m, n):
    """bf16 activations: from 12 rows on, where the CPU has AVX512-BF16 (from 2 on AMX tiles), the
    product of the bf16-rounded weight and activations to float32 rounding; elsewhere the float32
    product of the bf16 activations."""
    ext = ext_for(path)
    gen = torch.Generator().manual_seed(m + n)
    w = int4_weight(n, 256, 64, gen)
    x = torch.randn(m, 256, generator=gen).bfloat16()
    y = ext.w4a16_gemm(x, w.qweight, w.scales, w.zeros, 64)
    assert y.dtype == torch.float32
    wd = w.dequantize()
    bf16_tiles = (m >= 12 and ext.w4a16_isa() == "avx512_bf16") or (m >= 2 and ext.w4a16_amx_isa() != "")
    want = x.double() @ (wd.bfloat16() if bf16_tiles else wd).double().T
    bound = 2e-6 * (x.double().abs() @ wd.double().abs().T) + 1e-7
    assert ((y.double() - want).abs() <= bound).all()


def test_act_order_permutation_is_applied_to_the_activations():
    ext_for(None)
    gen = torch.Generator().manual_seed(7)
    w = int4_weight(8, 128, 32, gen)
    w.perm = torch.randperm(128, generator=gen)
    x = torch.randn(3, 128, generator=gen)
    want = x.double() @ w.dequantize_original().double().T
    assert torch.allclose(hf_linear(x, w).double(), want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(hf_linear(x, w), reference_linear(x, w), rtol=1e-5, atol=1e-6)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.abs().amax(1) / 127
    q = torch.where(s[:, None] > 0, torch.round(x / s[:, None]), torch.zeros_like(x))
    return q.to(torch.int8), s


@pytest.mark.parametrize("path", PATHS)
def test_activation_codes_are_the_exact_per_row_rounding(path):
    ext = ext_for(path)
    x = torch.randn(6, 200, generator=torch.Generator().manual_seed(3))
    x[2] = 0.0                                          # a zero row: scale 0, codes 0
    x[4, :4] = torch.tensor([0.5, -0.5, 1.5, 2.5]) * (x[4].abs().max() / 127)   # exact halves
    q, s = ext.quantize_rows_int8(x)
    want_q, want_s = _quantize_rows(x)
    assert torch.equal(s, want_s) and torch.equal(q, want_q)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m, k", [(1, 256), (4, 200), (7, 72)])
def test_w8a8_gemm_is_the_int32_product_of_the_codes(path, m, k):
    ext = ext_for(path)
    gen = torch.Generator().manual_seed(m + k)
    w = int8_weight(21, k, gen)
    x = torch.randn(m, k, generator=gen) * 3
    y = ext.w8a8_gemm(x, w.weight, w.weight_scale, w.w_sum)
    q, s = _quantize_rows(x)
    exact = (q.double() @ w.weight.double().T) * s.double()[:, None] * w.weight_scale.double()[None]
    assert ((y.double() - exact).abs() <= 1e-6 * exact.abs() + 1e-9).all()
    # within the int8 rounding's own bound of the float product
    wf = w.dequantize().double()
    bound = (s.double()[:, None] / 2) * wf.abs().sum(1)[None] * (1 + 1e-5) + 1e-6
    assert ((y.double() - x.double() @ wf.T).abs() <= bound).all()


def test_hf_linear_keeps_the_leading_shape_dtype_and_adds_the_bias():
    ext_for(None)
    gen = torch.Generator().manual_seed(11)
    w, b = int8_weight(16, 64, gen), torch.randn(16, generator=gen)
    x = torch.randn(2, 3, 64, generator=gen)
    y = hf_linear(x.bfloat16(), w, b.bfloat16())
    assert y.shape == (2, 3, 16) and y.dtype == torch.bfloat16
    want = hf_linear(x.bfloat16().float(), w) + b.bfloat16().float()
    assert torch.allclose(y.float(), want, rtol=1e-2, atol=1e-2)


def test_isa_names_the_widest_int8_path_this_cpu_built():
    from kvmesh.kernels.cpu_features import cpu_flags
    ext = ext_for(None)
    flags = cpu_flags()
    want = "avx512vnni" if "avx512_vnni" in flags else "avxvnni" if "avx_vnni" in flags else \
        "avx2" if "avx2" in flags else "portable"
    assert ext.w8a8_isa() == want
    assert ext_for("portable").w8a8_isa() == "portable" and ext_for("avx2").w4a16_isa() == "avx2"


# ---- W8A8 on AMX int8 tiles (csrc/hf_amx.cpp): where the CPU has them, the VNNI path's bits

def _amx_ext():
    from kvmesh.kernels.quant.hf_ops import w8a8_amx_ready
    ext = ext_for(None)
    if not w8a8_amx_ready():
        pytest.skip("no AMX int8 tiles here (CPU flags, or the kernel's permission)")
    return ext


# (M, N, K): M around the 16-row activation groups (one padded, a pair, an odd third); N around
# the 32-row weight tasks (a partial tile, a partial task from the zero-padded copy); K one to
# several 64-element steps
@pytest.mark.parametrize("m, n, k", [(1, 7, 64), (2, 16, 128), (16, 33, 576), (17, 32, 192),
                                     (47, 80, 1536), (64, 96, 256)])
def test_w8a8_on_amx_tiles_gives_the_vnni_paths_bits(m, n, k):
    ext = _amx_ext()
    gen = torch.Generator().manual_seed(m * n + k)
    w = int8_weight(n, k, gen)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, :7] = 40.0                     # an outlier row: large codes, int32 sums past int16
    y = ext.w8a8_gemm_amx(x, w.weight, w.weight_scale)
    assert torch.equal(y, ext.w8a8_gemm(x, w.weight, w.weight_scale, w.w_sum))
    q, s = _quantize_rows(x)
    exact = (q.double() @ w.weight.double().T) * s.double()[:, None] * w.weight_scale.double()[None]
    assert ((y.double() - exact).abs() <= 1e-6 * exact.abs() + 1e-9).all()


def test_hf_linear_takes_the_amx_tiles_from_their_threshold(monkeypatch):
    from kvmesh.kernels.quant import hf_ops
    ext = _amx_ext()
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ext, name)
    monkeypatch.setattr(hf_ops, "_ext", Spy)
    gen = torch.Generator().manual_seed(5)
    at = hf_ops.W8A8_AMX_MIN_ROWS
    for rows, k, kernel in ((at, 128, "w8a8_gemm_amx"), (at - 1, 128, "w8a8_gemm"),
                            (at + 3, 72, "w8a8_gemm")):          # K not a multiple of 64: VNNI
        calls.clear()
        w = int8_weight(9, k, gen)
        assert hf_linear(torch.randn(rows, k, generator=gen), w).shape == (rows, 9)
        assert calls == [kernel]
    assert hf_ops.isa()["w8a8"].startswith("amx_int8+")


def test_w8a8_amx_refusals_and_where_it_is_absent():
    from kvmesh.kernels.cpu_features import cpu_flags
    from kvmesh.kernels.quant.hf_ops import w8a8_amx_ready
    ext = ext_for(None)
    w = int8_weight(8, 96, torch.Generator().manual_seed(2))
    if "amx_int8" not in cpu_flags():
        assert not w8a8_amx_ready() and ext.w8a8_amx_isa() == ""
    if not w8a8_amx_ready():
        with pytest.raises(RuntimeError, match="no AMX int8 tiles"):
            ext.w8a8_gemm_amx(torch.zeros(4, 128), int8_weight(8, 128, torch.Generator()).weight, w.weight_scale)
    with pytest.raises(RuntimeError, match="not a multiple of 64"):
        ext.w8a8_gemm_amx(torch.zeros(4, 96), w.weight, w.weight_scale)
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        ext.w8a8_gemm_amx(torch.zeros(4, 96, dtype=torch.bfloat16), w.weight, w.weight_scale)
    with pytest.raises(RuntimeError, match="w_scale must be float32"):
        ext.w8a8_gemm_amx(torch.zeros(4, 96), w.weight, w.weight_scale[:3])


# ---- the int4 GEMM on AMX bf16 tiles (hf_gemm.cpp over amx_tiles.h): the bf16 tiles' product

@pytest.mark.parametrize("m, n, k, group", [(1, 7, 128, 128), (8, 33, 256, 64), (17, 48, 512, 32),
                                            (47, 80, 1024, 128)])
def test_int4_on_amx_tiles_is_a_bf16_gemm_of_the_rounded_weights(m, n, k, group):
    ext = ext_for(None)
    if not ext.w4a16_amx_isa():
        pytest.skip("no AMX bf16 tiles here (CPU flags, or the kernel's permission)")
    gen = torch.Generator().manual_seed(m * n + k)
    w = int4_weight(n, k, group, gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    y = ext.w4a16_gemm_amx(x, w.qweight, w.scales, w.zeros, group)
    wd = w.dequantize().bfloat16().double()
    exact = x.double() @ wd.T
    assert ((y.double() - exact).abs() <= (k + 2) * 2.0 ** -24 * (x.double().abs() @ wd.abs().T)).all()
    # w4a16_gemm takes the tiles from 2 bf16 rows
    assert torch.equal(ext.w4a16_gemm(x, w.qweight, w.scales, w.zeros, group), y) == (m >= 2)


@pytest.mark.parametrize("m, n, k, group", [(1, 7, 128, 128), (2, 33, 256, 64), (17, 48, 512, 32)])
def test_int4_amx_bf16_output_is_torchs_rounding_of_the_float32_result(m, n, k, group):
    ext = ext_for(None)
    if not ext.w4a16_amx_isa():
        pytest.skip("no AMX bf16 tiles here (CPU flags, or the kernel's permission)")
    gen = torch.Generator().manual_seed(7 * m + n)
    w = int4_weight(n, k, group, gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    y32 = ext.w4a16_gemm_amx(x, w.qweight, w.scales, w.zeros, group)
    y16 = ext.w4a16_gemm_amx(x, w.qweight, w.scales, w.zeros, group, out_bf16=True)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert torch.equal(y16.view(torch.int16), y32.bfloat16().view(torch.int16))
    # w4a16_gemm: bf16 y where the tiles run (from 2 rows), float32 from the other kernels
    y = ext.w4a16_gemm(x, w.qweight, w.scales, w.zeros, group, out_bf16=True)
    assert y.dtype == (torch.bfloat16 if m >= 2 else torch.float32)
    # hf_linear: bf16 in, bf16 out either way, a bias added to the float32 result before rounding
    assert torch.equal(hf_linear(x, w), (y16 if m >= 2 else y.bfloat16()))
    bias = torch.randn(n, generator=gen)
    want = (ext.w4a16_gemm(x, w.qweight, w.scales, w.zeros, group) + bias).bfloat16()
    assert torch.equal(hf_linear(x, w, bias), want)


def test_int4_amx_refusals_and_where_it_is_absent():
    from kvmesh.kernels.cpu_features import cpu_flags
    ext = ext_for(None)
    w = int4_weight(8, 128, 64, torch.Generator().manual_seed(1))
    if "amx_bf16" not in cpu_flags():
        assert ext.w4a16_amx_isa() == ""
    with pytest.raises(RuntimeError, match="bfloat16 x and AMX bf16 tiles"):
        ext.w4a16_gemm_amx(torch.zeros(9, 128), w.qweight, w.scales, w.zeros, 64)
