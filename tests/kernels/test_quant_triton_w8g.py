"""The 8-bit group GEMM on the GPU (kernels/quant/triton_w8g.py: GGUF's other block formats as
one code a byte with a scale and zero per 16 / 32 elements) in the interpreter, against
kernels/reference.py; on a GPU where TRITON_INTERPRET=0 (test_quant_triton_gemm.py's `on_device`).

The bound is the kernels' own rounding, as there: the reference is the float64 product of
exactly the operands the kernel multiplies (the weight rounded to x's dtype), so what remains is
float32 accumulation and the output's one rounding.
"""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import reference  # noqa: E402
from kvmesh.kernels.quant import triton_w8g  # noqa: E402
from tests.kernels.test_quant_triton_gemm import DTYPES, U32, assert_within, on_device  # noqa: E402

CASES = {  # name: (M, N, K, group_size, bias)
    "1row-g16": (1, 40, 96, 16, False),
    "5rows-g32-bias": (5, 72, 160, 32, True),
    "16rows-g16-bias": (16, 24, 208, 16, True),
    "70rows-g32": (70, 33, 256, 32, False),
}
ROUTES = ("gemv", "kernel", "dequant", "auto")


def _weight(n, k, group_size, scale_dtype, zero_dtype, g):
    qweight = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group_size, generator=g) * 0.02 - 0.01).to(scale_dtype)    # signed (Q6_K)
    if zero_dtype == torch.uint8:
        zeros = torch.randint(0, 256, (n, k // group_size), dtype=torch.uint8, generator=g)
    else:
        zeros = torch.rand(n, k // group_size, generator=g) * 300 - 20
    return qweight, scales, zeros


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_dtype, zero_dtype", [(torch.float16, torch.uint8), (torch.float32, torch.float32)],
                         ids=["fp16-u8", "fp32-fp32"])
def test_w8g_matches_the_dequantized_matmul_to_float32_rounding(kx, case, dtype, route, scale_dtype, zero_dtype):
    m, n, k, group_size, use_bias = CASES[case]
    g = torch.Generator().manual_seed(len(case) + k)
    x = torch.randn(m, k + 8, generator=g).to(dtype)[:, 3:k + 3]       # a strided view
    qweight, scales, zeros = _weight(n, k, group_size, scale_dtype, zero_dtype, g)
    bias = torch.randn(n, generator=g).to(dtype) if use_bias else None
    if route == "gemv" and m > 16:
        with pytest.raises(ValueError, match=f"the gemv route takes at most 16 rows, got {m}"):
            on_device(triton_w8g.w8g_gemm, x, qweight, scales, zeros, group_size, bias, route=route)
        return
    with kx.poisoned():
        got = on_device(triton_w8g.w8g_gemm, x, qweight, scales, zeros, group_size, bias, route=route)
    assert got.dtype == dtype and got.shape == (m, n)
    want = reference.w8g_gemm(x, qweight, scales, zeros, group_size, bias)
    w = reference.dequantize_w8g(qweight, scales, zeros, group_size).to(dtype).double()
    mag = x.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    assert_within(got, want, (k + 2) * U32 * mag)


def test_each_column_takes_its_own_groups_scale_and_zero():
    """One row, group 16: column c has code c, group j scale 2^j and zero j; the identity rows of
    x pick out single weights."""
    k = 64
    qweight = torch.arange(k, dtype=torch.uint8)[None, :]
    scales = (2.0 ** torch.arange(k // 16)).to(torch.float16)[None, :]
    zeros = torch.arange(k // 16, dtype=torch.uint8)[None, :]
    x = torch.eye(k, dtype=torch.float32)
    want = [(c - c // 16) * 2.0 ** (c // 16) for c in range(k)]
    for route in ("kernel", "dequant"):
        assert on_device(triton_w8g.w8g_gemm, x, qweight, scales, zeros, 16, route=route)[:, 0].tolist() == want
    for c in (0, 17, 63):
        got = on_device(triton_w8g.w8g_gemm, x[c:c + 1], qweight, scales, zeros, 16, route="gemv")
        assert got.item() == want[c]


def test_empty_batches_return_empty_results():
    qweight, scales, zeros = torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2, dtype=torch.float16), \
        torch.zeros(8, 2, dtype=torch.uint8)
    for route in ROUTES:
        got = on_device(triton_w8g.w8g_gemm, torch.zeros(0, 64), qweight, scales, zeros, 32, route=route)
        assert got.shape == (0, 8)


BAD = [
    (dict(group_size=64), "group_size must be 16 or 32 and divide K = 64, got 64"),
    (dict(group_size=16, scales=torch.ones(8, 2, dtype=torch.float16)), r"scales must be \[8, 4\], got \[8, 2\]"),
    (dict(scales=torch.ones(8, 2, dtype=torch.bfloat16)), "scales must be float16 or float32, got bfloat16"),
    (dict(zeros=torch.zeros(8, 2, dtype=torch.int32)), "zeros must be uint8 or float32, got int32"),
    (dict(qweight=torch.zeros(8, 64, dtype=torch.int8)), "qweight must be uint8, got int8"),
    (dict(x=torch.zeros(2, 32)), r"x has K = 32 columns but qweight \[8, 64\] holds K = 64"),
    (dict(route="fast"), "route must be one of auto, gemv, kernel, dequant, got 'fast'"),
]


@pytest.mark.parametrize("over, message", BAD, ids=[m[:24] for _, m in BAD])
def test_w8g_refuses_bad_input(over, message):
    args = dict(x=torch.zeros(2, 64), qweight=torch.zeros(8, 64, dtype=torch.uint8),
                scales=torch.ones(8, 2, dtype=torch.float16), zeros=torch.zeros(8, 2, dtype=torch.uint8),
                group_size=32, route="auto")
    args.update(over)
    route = args.pop("route")
    with pytest.raises(ValueError, match=message):
        triton_w8g.w8g_gemm(*args.values(), route=route)
