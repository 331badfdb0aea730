"""The quantized GEMMs on the GPU (kernels/quant/triton_gemm.py, triton_quant.py) in the
interpreter, against kernels/reference.py on the canonical layout: W4A16 int4 groups, W8A8 int8, FP8 e4m3.

Where TRITON_INTERPRET=0 and CUDA is present the kernels run on the GPU: each test makes its
operands on the CPU (seeded generators), `on_device` moves them there and the result back.

Bounds are the kernels' own rounding, not a tolerance: the reference is the float64 product of
exactly the operands the kernel multiplies, so what remains is float32 accumulation
((K + 2) * 2^-24 * |x|.|W|^T) and the output's one rounding to x's dtype; with int8 activations
the int32 accumulation is exact and only the float32 epilogue (acc -> float, * x_scale,
* w_scale, + bias: 4 roundings) remains.
"""
import os

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import reference  # noqa: E402
from kvmesh.kernels.quant import triton_gemm, triton_quant  # noqa: E402

U32 = 2.0 ** -24
UNIT = {torch.float32: U32, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}   # unit roundoff
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def on_device(fn, *args, **kwargs):
    """fn(*args, **kwargs) with every tensor argument on DEVICE; tensor results back on the CPU."""
    def move(a):
        return a.to(DEVICE) if isinstance(a, torch.Tensor) else a
    out = fn(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


def assert_within(got: torch.Tensor, want: torch.Tensor, accumulation: torch.Tensor) -> None:
    """|got - want| <= u_out |want| + (1 + u_out) * accumulation, elementwise (want float64)."""
    assert got.shape == want.shape and not torch.isnan(got).any()
    u = UNIT[got.dtype]
    err = (got.double() - want).abs()
    bound = u * want.abs() + (1 + u) * accumulation
    worst = (err - bound).max().item()
    assert worst <= 0, f"max error over the bound by {worst:.3g} (max error {err.max().item():.3g})"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def int4_weight(n, k, group_size, scale_dtype, g):
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group_size, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    zeros = torch.randint(0, 16, (n, k // group_size), dtype=torch.uint8, generator=g)
    return qweight, scales, zeros


W4_CASES = {  # name: (M, N, K, group_size, act-order perm, bias)
    "decode-1row-g32": (1, 40, 96, 32, False, False),
    "decode-5rows-g64-perm-bias": (5, 72, 192, 64, True, True),
    "decode-16rows-g128": (16, 24, 384, 128, False, False),
    "prefill-70rows-g128-perm-bias": (70, 33, 256, 128, True, True),
}


ROUTES = {"kernel": {"route": "kernel", "split_k": 1}, "kernel-split-k": {"route": "kernel", "split_k": 3},
          "dequant": {"route": "dequant"}, "gemv": {"route": "gemv"},
          # a step within one group, and a step over several groups past K's end
          "gemv-narrow": {"route": "gemv", "gemv_tiles": (16, 32, 1)},
          "gemv-wide": {"route": "gemv", "gemv_tiles": (4, 512, 2)}}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("case", sorted(W4_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_w4a16_matches_the_dequantized_matmul_to_float32_rounding(kx, case, dtype, route):
    m, n, k, group_size, use_perm, use_bias = W4_CASES[case]
    g = _gen(len(case))
    # a strided view of a wider buffer (x of a fused projection)
    x = torch.randn(m, k + 8, generator=g).to(dtype)[:, 3:k + 3]
    qweight, scales, zeros = int4_weight(n, k, group_size, dtype, g)
    perm = torch.randperm(k, generator=g) if use_perm else None
    bias = torch.randn(n, generator=g).to(dtype) if use_bias else None
    if route.startswith("gemv") and m > triton_gemm.GEMV_ROWS_LIMIT:
        with pytest.raises(ValueError, match=f"the gemv route takes at most 16 rows, got {m}"):
            on_device(triton_gemm.w4a16_gemm, x, qweight, scales, zeros, group_size, perm, bias, **ROUTES[route])
        return
    with kx.poisoned():
        got = on_device(triton_gemm.w4a16_gemm, x, qweight, scales, zeros, group_size, perm, bias, **ROUTES[route])
    assert got.dtype == dtype and got.shape == (m, n)
    want = reference.w4a16_gemm(x, qweight, scales, zeros, group_size, perm, bias)
    w = reference.dequantize_int4(qweight, scales, zeros, group_size).to(dtype).double()
    xs = x if perm is None else x[:, perm]
    mag = xs.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    assert_within(got, want, (k + 2) * U32 * mag)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("case", ["decode-1row-g32", "decode-5rows-g64-perm-bias", "prefill-70rows-g128-perm-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=["Q4_1", "Q4_K"])
def test_w4a16_with_float_zero_points_matches_the_dequantized_matmul(kx, case, dtype, route, scale_dtype):
    """Float zero points (GGUF Q4_1 / Q4_K on a GPU, kernels/quant/gguf_int4.py: -min / d with
    float16 scales, dmin m / (d sc) with float32 ones), fractional and out of 0..15, through every
    route: the GEMV's 2^23 trick must not round them."""
    m, n, k, group_size, use_perm, use_bias = W4_CASES[case]
    g = _gen(len(case) + 1)
    x = torch.randn(m, k, generator=g).to(dtype)
    qweight, scales, _ = int4_weight(n, k, group_size, scale_dtype, g)
    zeros = (torch.rand(n, k // group_size, generator=g) * 40 - 20).float()
    assert (zeros != zeros.round()).all()
    perm = torch.randperm(k, generator=g) if use_perm else None
    bias = torch.randn(n, generator=g).to(dtype) if use_bias else None
    if route.startswith("gemv") and m > triton_gemm.GEMV_ROWS_LIMIT:
        return
    with kx.poisoned():
        got = on_device(triton_gemm.w4a16_gemm, x, qweight, scales, zeros, group_size, perm, bias, **ROUTES[route])
    want = reference.w4a16_gemm(x, qweight, scales, zeros, group_size, perm, bias)
    w = reference.dequantize_int4(qweight, scales, zeros, group_size).to(dtype).double()
    xs = x if perm is None else x[:, perm]
    mag = xs.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    assert_within(got, want, (k + 2) * U32 * mag)
    # the zero points rounded to integers give another product (the test can tell them apart)
    rounded = reference.w4a16_gemm(x, qweight, scales, zeros.round().clamp(0, 15).to(torch.uint8), group_size,
                                   perm, bias)
    assert (got.double() - rounded).abs().max() > 10 * ((k + 2) * U32 * mag).max()


@pytest.mark.parametrize("route", ["gemv", "kernel", "dequant"])
def test_w4a16_layout_nibbles_zero_points_and_groups(route):
    """One hand-built row: the low nibble is the even column, a zero point shifts, each group its scale."""
    k, group_size = 64, 32
    qweight = torch.zeros(1, k // 2, dtype=torch.uint8)
    qweight[0, 0] = 0x3A               # column 0 = 10, column 1 = 3
    qweight[0, 16] = 0xF1              # column 32 = 1, column 33 = 15 (second group)
    scales = torch.tensor([[0.5, 2.0]])
    zeros = torch.tensor([[8, 1]], dtype=torch.uint8)
    x = torch.zeros(1, k)
    x[0, [0, 1, 32, 33]] = torch.tensor([1.0, 10.0, 100.0, 1000.0])
    # columns 2..31 hold q = 0: (0 - 8) * 0.5 = -4 each, x there is 0
    got = on_device(triton_gemm.w4a16_gemm, x, qweight, scales, zeros, group_size, route=route)
    want = 1.0 * (10 - 8) * 0.5 + 10.0 * (3 - 8) * 0.5 + 100.0 * (1 - 1) * 2.0 + 1000.0 * (15 - 1) * 2.0
    assert got.tolist() == [[want]]
    perm = torch.arange(k).roll(1)     # weight column k multiplies x column k - 1
    got = on_device(triton_gemm.w4a16_gemm, x, qweight, scales, zeros, group_size, perm, route=route)
    want_perm = 1.0 * (3 - 8) * 0.5 + 10.0 * (0 - 8) * 0.5 + 100.0 * (15 - 1) * 2.0 + 1000.0 * (0 - 1) * 2.0
    assert got.tolist() == [[want_perm]]


def test_split_k_splits_only_long_k_with_few_output_tiles(monkeypatch):
    """~32 K steps a split from 128 steps, when the output tiles are under two an SM."""
    monkeypatch.setitem(triton_gemm._SM_COUNT, 0, 132)         # an H100
    cuda = torch.device("cuda", 0)
    # Llama-8B's decode projections (qkv, o, gate_up, down): N / 32 tiles, K / 64 steps
    assert [triton_gemm._split_k(t, s, cuda) for t, s in [(192, 64), (128, 64), (896, 64), (128, 224)]] == [1, 1, 1, 7]
    assert triton_gemm._split_k(264, 224, cuda) == 1            # two tiles an SM: no split
    assert triton_gemm._split_k(4, 2048, cuda) == 16            # at most 16 splits
    assert triton_gemm._split_k(4, 224, torch.device("cpu")) == 1


def test_w4a16_dequantized_weight_is_the_reference_and_auto_picks_the_route_by_rows(monkeypatch):
    g = _gen(9)
    for group_size in (32, 64, 128):
        qweight, scales, zeros = int4_weight(24, 256, group_size, torch.bfloat16, g)
        got = on_device(triton_gemm.dequantize_int4, qweight, scales, zeros, group_size, torch.bfloat16)
        assert torch.equal(got, reference.dequantize_int4(qweight, scales, zeros, group_size).to(torch.bfloat16))
    qweight, scales, zeros = int4_weight(24, 128, 64, torch.bfloat16, g)
    routes = []
    monkeypatch.setattr(triton_gemm, "dequantize_int4", lambda *a: routes.append("dequant") or
                        torch.zeros(24, 128, dtype=torch.bfloat16, device=a[0].device))
    monkeypatch.setattr(triton_gemm, "_launch_gemv", lambda *a: routes.append(f"gemv {a[0].shape[0]}"))
    monkeypatch.setattr(triton_gemm, "W4A16_GEMV_MAX_ROWS", 2)
    monkeypatch.setattr(triton_gemm, "W4A16_DEQUANT_MIN_ROWS", 4)
    for m in (1, 2, 3, 4):
        on_device(triton_gemm.w4a16_gemm, torch.zeros(m, 128, dtype=torch.bfloat16), qweight, scales, zeros, 64)
    # 1-2 rows: the GEMV; 3: the fused tensor-core kernel (nothing recorded); 4: the dense GEMM
    assert routes == ["gemv 1", "gemv 2", "dequant"]
    # a limit set past the kernel's 16 rows (KVMESH_W4A16_GEMV_ROWS) is held to them
    monkeypatch.setattr(triton_gemm, "W4A16_GEMV_MAX_ROWS", 64)
    monkeypatch.setattr(triton_gemm, "W4A16_DEQUANT_MIN_ROWS", 64)
    for m in (16, 17):
        on_device(triton_gemm.w4a16_gemm, torch.zeros(m, 128, dtype=torch.bfloat16), qweight, scales, zeros, 64)
    assert routes == ["gemv 1", "gemv 2", "dequant", "gemv 16"]
    # a K long enough to split goes to the split fused kernel, even at 1 row
    monkeypatch.setattr(triton_gemm, "_split_k", lambda tiles, steps, device: 2)
    on_device(triton_gemm.w4a16_gemm, torch.zeros(1, 128, dtype=torch.bfloat16), qweight, scales, zeros, 64)
    assert routes == ["gemv 1", "gemv 2", "dequant", "gemv 16"]


def test_gemv_tiles_follow_the_h100_sweep():
    assert triton_gemm._gemv_tiles(6144) == (8, 128, 2)
    assert triton_gemm._gemv_tiles(28672) == (16, 128, 2)


def test_int8_quantization_is_the_reference_bit_for_bit():
    x = torch.randn(6, 300, generator=_gen(1)) * 3
    x[1] = 0.0                                         # scale 0, values 0
    x[2, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])  # scale 1: ties round to even
    x[2, 6:] = 0.0
    for dtype in DTYPES:
        xd = x.to(dtype)
        q, scale = on_device(triton_quant.scaled_int8_quant, xd)
        want_q, want_scale = reference.scaled_int8_quant(xd)
        assert q.dtype == torch.int8 and scale.dtype == torch.float32
        assert torch.equal(q, want_q) and torch.equal(scale, want_scale)
    assert q[2, :6].tolist() == [127, 0, 2, 2, 0, -2] and scale[1].item() == 0.0 and not q[1].any()


W8_CASES = {  # name: (M, N, K, bias, an all-zero row)
    "decode-1row-odd-k": (1, 40, 37, False, False),
    "decode-9rows-bias": (9, 33, 300, True, True),
    "prefill-70rows-two-column-tiles": (70, 130, 64, True, False),
}


@pytest.mark.parametrize("case", sorted(W8_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_is_the_exact_integer_product_to_float_rounding(kx, case, dtype):
    m, n, k, use_bias, zero_row = W8_CASES[case]
    g = _gen(len(case))
    x = (torch.randn(m, k, generator=g) * 4).to(dtype)
    if zero_row:
        x[m // 2] = 0
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    weight_scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g).to(dtype) if use_bias else None
    with kx.poisoned():
        got = on_device(triton_gemm.w8a8_gemm, x, weight, weight_scale, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    want = reference.w8a8_gemm(x, weight, weight_scale, bias)
    without_bias = want if bias is None else want - bias.double()
    mag = without_bias.abs() + (0 if bias is None else bias.double().abs())
    assert_within(got, want, 4 * U32 * (1 + 4 * U32) * mag)
    if zero_row:
        expected = torch.zeros(n) if bias is None else bias.float()
        assert torch.equal(got[m // 2].float(), expected)


def test_fp8_quantization_per_token_scales_each_row():
    x = torch.randn(5, 70, generator=_gen(6)) * torch.tensor([1.0, 100.0, 0.0, 1e-3, 7.0])[:, None]
    for dtype in DTYPES:
        xd = x.to(dtype)
        q, scale = on_device(triton_quant.scaled_fp8_quant, xd, per_token=True)
        want_q, want_scale = reference.scaled_fp8_quant(xd, per_token=True)
        assert scale.shape == (5,) and torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert scale[2].item() == 0.0 and not q[2].float().any()     # a zero row: zeros (signs kept)
        # every row's largest |x| lands on e4m3's largest value
        assert q.float().abs().amax(1).tolist() == [448.0, 448.0, 0.0, 448.0, 448.0]


def test_fp8_quantization_rounds_to_nearest_even_e4m3_like_torch():
    ties = [448.0, 447.0, 1.0625, 1.1875, 15.5, 17.0, 19.0, 2.0 ** -10, 1.5 * 2.0 ** -9,
            2.0 ** -6 - 2.0 ** -10, 0.0, -0.0, -2.0 ** -11, -1.0625, 300.0, -448.0]
    x = torch.cat([torch.tensor(ties), torch.randn(200, generator=_gen(2)) * 50]).reshape(8, 27)
    for dtype in DTYPES:
        xd = x.to(dtype)
        q, scale = on_device(triton_quant.scaled_fp8_quant, xd)
        want_q, want_scale = reference.scaled_fp8_quant(xd)
        assert q.dtype == torch.float8_e4m3fn and torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert scale.item() == 1.0    # max |x| = 448: the ties above are divided by 1
    assert q.float().flatten()[:10].tolist() == [448.0, 448.0, 1.0, 1.25, 16.0, 16.0, 20.0, 0.0, 2.0 ** -8, 2.0 ** -6]
    zero_q, zero_scale = on_device(triton_quant.scaled_fp8_quant, torch.zeros(2, 5))
    assert zero_scale.item() == 0.0 and not zero_q.view(torch.uint8).any()


# NOTE: sm_90's fp8 MMA adds an instruction's 32 products with about 13 fraction bits after
# aligning them to the largest (DeepSeek-V3's report: "around 14 bits"; on an H100 the K = 200
# case exceeded the float32 bound by 1.6e-6 to 1.5e-4 with the partial sums promoted every
# instruction); the kernel promotes each instruction's sum to float32, so each is off by at most
# 32 * 2^-13 of its products' |sum|
FP8_MMA_SUM = 32 * 2.0 ** -13

FP8_CASES = {  # name: (M, N, K, per-channel scale, bias)
    "decode-3rows-odd-k-per-tensor": (3, 40, 37, False, False),
    "prefill-70rows-per-channel-bias": (70, 33, 200, True, True),
}


@pytest.mark.parametrize("arch, activations", [(80, "tensor"), (90, "tensor"), (90, "token"), (90, "none")])
@pytest.mark.parametrize("case", sorted(FP8_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_matches_the_reference_on_both_paths(kx, arch, activations, case, dtype):
    m, n, k, per_channel, use_bias = FP8_CASES[case]
    g = _gen(len(case) + arch)
    x = torch.randn(m, k, generator=g).to(dtype)
    weight = (torch.randn(n, k, generator=g) * 30).to(torch.float8_e4m3fn)    # subnormals to 448
    weight_scale = torch.rand(n if per_channel else 1, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g).to(dtype) if use_bias else None
    with kx.poisoned():
        got = on_device(triton_gemm.fp8_gemm, x, weight, weight_scale, bias, activations=activations, arch=arch)
    assert got.dtype == dtype and got.shape == (m, n)
    acts = activations if arch >= 89 else "none"        # sm_80: weight-only whatever is asked
    want = reference.fp8_gemm(x, weight, weight_scale, bias, activations=acts)
    per_token = acts == "token"
    xa, xs = reference.scaled_fp8_quant(x, per_token=per_token) if acts != "none" else (x, torch.ones(1))
    scale = weight_scale.double() * (xs.double()[:, None] if per_token else xs.double())
    mag = (xa.double().abs() @ weight.double().abs().T) * scale + (0 if bias is None else bias.double().abs())
    # float32 accumulation over K, then up to 3 epilogue roundings; on a GPU's fp8 MMA also its
    # own accumulator's (FP8_MMA_SUM)
    hw = FP8_MMA_SUM if DEVICE == "cuda" and acts != "none" else 0.0
    assert_within(got, want, ((k + 5) * U32 + hw) * mag)


def test_the_weight_only_path_decodes_every_e4m3_value_exactly():
    """All 254 finite e4m3 codes as the weight of an identity-like product: each comes out exactly."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    weight = codes.view(torch.float8_e4m3fn).reshape(-1, 1).expand(-1, 32).contiguous()  # [254, 32]
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    got = on_device(triton_gemm.fp8_gemm, x, weight, torch.ones(1), arch=80)
    assert torch.equal(got[0], codes.view(torch.float8_e4m3fn).float())


def test_empty_batches_return_empty_results():
    x = torch.zeros(0, 64, dtype=torch.bfloat16)
    qweight, scales, zeros = int4_weight(8, 64, 32, torch.bfloat16, _gen(3))
    assert on_device(triton_gemm.w4a16_gemm, x, qweight, scales, zeros, 32).shape == (0, 8)
    assert on_device(triton_gemm.w8a8_gemm, x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)).shape == (0, 8)
    assert on_device(triton_gemm.fp8_gemm, x, torch.zeros(8, 64, dtype=torch.float8_e4m3fn), torch.ones(1)).shape == (0, 8)


def _w4_args(**over):
    qweight, scales, zeros = int4_weight(8, 128, 32, torch.float16, _gen(4))
    args = dict(x=torch.zeros(2, 128, dtype=torch.float16), qweight=qweight, scales=scales,
                zeros=zeros, group_size=32)
    args.update(over)
    return args


@pytest.mark.parametrize("over, message", [
    (dict(x=torch.zeros(2, 3, 128, dtype=torch.float16)), r"x must be 2-D \[M, K\]"),
    (dict(x=torch.zeros(2, 128, dtype=torch.int32)), "x must be float16, bfloat16 or float32"),
    (dict(x=torch.zeros(2, 96, dtype=torch.float16)), r"K = 96 columns but qweight \[8, 64\] packs K = 128"),
    (dict(qweight=torch.zeros(8, 64, dtype=torch.int8)), "qweight must be uint8, got int8"),
    (dict(group_size=48), "group_size must be a positive multiple of 32 that divides K = 128, got 48"),
    (dict(group_size=96), "group_size must be a positive multiple of 32 that divides K = 128, got 96"),
    (dict(scales=torch.ones(8, 3, dtype=torch.float16)), r"scales must be \[8, 4\], got \[8, 3\]"),
    (dict(zeros=torch.zeros(8, 4, dtype=torch.int32)), "zeros must be uint8 or float32, got int32"),
    (dict(perm=torch.arange(128, dtype=torch.int32)), "perm must be int64, got int32"),
    (dict(perm=torch.arange(64)), r"perm must be \[128\], got \[64\]"),
    (dict(bias=torch.zeros(9, dtype=torch.float16)), r"bias must be \[8\], got \[9\]"),
    (dict(qweight=torch.zeros(64, 8, dtype=torch.uint8).T), "qweight must be contiguous along its last dimension"),
    (dict(x=torch.zeros(2, 128, dtype=torch.float16, device="meta")), "must be on one device"),
    (dict(route="marlin"), "route must be one of auto, gemv, kernel, dequant, got 'marlin'"),
    (dict(route="gemv", gemv_tiles=(8, 48, 4)), r"gemv_tiles needs powers of two, BLOCK_K >= 32: got \(8, 48, 4\)"),
    (dict(route="gemv", gemv_tiles=(6, 64, 4)), r"gemv_tiles needs powers of two, BLOCK_K >= 32: got \(6, 64, 4\)"),
])
def test_w4a16_refuses_bad_input(over, message):
    with pytest.raises(ValueError, match=message):
        triton_gemm.w4a16_gemm(**_w4_args(**over))


def test_w8a8_and_fp8_refuse_bad_input():
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="weight must be int8, got float32"):
        triton_gemm.w8a8_gemm(x, torch.zeros(4, 16), torch.ones(4))
    with pytest.raises(ValueError, match=r"weight_scale must be \[4\], got \[1\]"):
        triton_gemm.w8a8_gemm(x, torch.zeros(4, 16, dtype=torch.int8), torch.ones(1))
    with pytest.raises(ValueError, match="weight_scale must be float32, got float16"):
        triton_gemm.w8a8_gemm(x, torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"x has K = 16 columns but weight \[4, 17\] has K = 17"):
        triton_gemm.w8a8_gemm(x, torch.zeros(4, 17, dtype=torch.int8), torch.ones(4))
    w8 = torch.zeros(4, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[1\] or \[4\], got float32 \[2\]"):
        triton_gemm.fp8_gemm(x, w8, torch.ones(2))
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn, got int8"):
        triton_gemm.fp8_gemm(x, torch.zeros(4, 16, dtype=torch.int8), torch.ones(1))
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32, got torch.float64"):
        triton_gemm.fp8_gemm(x.double(), w8, torch.ones(1))
    with pytest.raises(ValueError, match="activations must be one of tensor, token, none, got 'channel'"):
        triton_gemm.fp8_gemm(x, w8, torch.ones(1), activations="channel")
    with pytest.raises(ValueError, match="x must be a 2-D float16 / bfloat16 / float32 tensor"):
        triton_quant.scaled_int8_quant(torch.zeros(3))
