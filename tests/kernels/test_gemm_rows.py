"""kernels.gemm_rows: the row floor of oneDNN's GEMM (1- and 2-row products padded to 4 rows)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import gemm_rows
from kvmesh.kernels import linear as lin


def test_the_default_floor_is_where_it_was_measured():
    wide = frozenset({"avx2", "fma", "avx512f"})
    assert gemm_rows.default_min_rows("AuthenticAMD", wide) == 4
    assert gemm_rows.default_min_rows("AuthenticAMD", frozenset({"avx2", "fma"})) == 1
    assert gemm_rows.default_min_rows("GenuineIntel", wide) == 1
    assert gemm_rows.default_min_rows("", frozenset()) == 1


def test_the_env_sets_the_floor(monkeypatch):
    monkeypatch.setenv("KVMESH_GEMM_MIN_ROWS", "3")
    assert gemm_rows.min_rows_from_env() == 3
    monkeypatch.delenv("KVMESH_GEMM_MIN_ROWS")
    assert gemm_rows.min_rows_from_env() == gemm_rows.default_min_rows(gemm_rows.cpu_vendor(),
                                                                       gemm_rows.cpu_flags())
    monkeypatch.setenv("KVMESH_GEMM_MIN_ROWS", "0")
    with pytest.raises(ValueError, match="KVMESH_GEMM_MIN_ROWS='0'"):
        gemm_rows.min_rows_from_env()


@pytest.mark.parametrize("value", ["0", "65", "four", "", "2.5"])
def test_a_bad_env_value_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=r"KVMESH_GEMM_MIN_ROWS=.*from 1 to 64"):
        gemm_rows.parse_min_rows(value)


def test_padded_appends_zero_rows_only_below_the_floor():
    x = torch.arange(6, dtype=torch.float32).view(1, 6)
    p = gemm_rows.padded(x, 4)
    assert p.shape == (4, 6)
    assert p[0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert p[1:].count_nonzero().item() == 0
    x5 = torch.ones(5, 6)
    assert gemm_rows.padded(x5, 4) is x5
    assert gemm_rows.padded(x, 1) is x


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_the_first_m_rows_come_back(m, bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 64, generator=g), torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    y = gemm_rows.onednn_linear(x, w, b, min_rows=4)
    assert y.shape == (m, 48) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_padded_row_is_bitwise_the_same_row_in_a_larger_batch():
    # NOTE: the property speculative decoding leans on: a token's row in a 5-row verify step and
    # in a 1-row decode step give the same bits. oneDNN's 1-row path sums a K = 1536 row in
    # another order than its 2+-row path; with the floor a 1-row product runs the latter.
    g = torch.Generator().manual_seed(0)
    w = lin.packed_weight(torch.randn(576, 1536, generator=g))
    x = torch.randn(8, 1536, generator=g)
    with torch.inference_mode():
        batch = gemm_rows.onednn_linear(x, w, None, min_rows=1)
        for m in (1, 2, 3):
            rows = gemm_rows.onednn_linear(x[:m], w, None, min_rows=4)
            assert torch.equal(rows, batch[:m])


def test_linear_goes_through_the_floor(monkeypatch):
    seen: list[int] = []
    real = gemm_rows.padded

    def spy(x, min_rows):
        out = real(x, min_rows)
        seen.append(out.shape[0])
        return out
    monkeypatch.setattr(gemm_rows, "padded", spy)
    monkeypatch.setattr(gemm_rows, "MIN_ROWS", 4)
    # NOTE: the small-row C++ GEMM off: where oneDNN's rows are not padded (an Intel CPU), it takes
    # float32 rows once an earlier test has loaded the CPU kernels, and its choice is cached
    monkeypatch.setattr(lin.small_gemm, "takes", lambda rows, weight: False)
    w = torch.randn(16, 8)
    for m in (1, 2, 5):
        x = torch.randn(m, 8)
        torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # bf16 on a CPU without bf16 dot products: the float32 GEMM on the widened weight, padded too
    monkeypatch.setattr(lin, "_BF16_VIA_FLOAT32", True)
    y = lin.linear(torch.ones(1, 8).bfloat16(), w.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (1, 16)
    assert seen == [4, 4, 5, 4]
