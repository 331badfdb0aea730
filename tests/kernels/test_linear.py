"""kernels.linear: F.linear's results on the oneDNN path, and F.linear itself wherever oneDNN cannot run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import linear as lin


@pytest.mark.parametrize("m", [1, 9, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_f_linear(m, bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 96, generator=g), torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert lin.uses_onednn(x, w) == lin._ONEDNN


def test_bfloat16_matches_f_linear():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(32, 64, generator=g).bfloat16()
    y = lin.linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=5e-2)


def test_the_cpu_oneDNN_path_is_taken_on_this_torch():
    # the pinned CPU build ships oneDNN: the float32 fast path must not silently fall back
    assert torch.backends.mkldnn.is_available()
    assert lin._ONEDNN and torch.float32 in lin._ONEDNN_DTYPES
    assert lin.uses_onednn(torch.ones(2, 4), torch.ones(3, 4))


def test_a_dtype_the_probe_refused_stays_on_f_linear(monkeypatch):
    monkeypatch.setattr(lin, "_ONEDNN_DTYPES", (torch.float32,))
    x, w = torch.ones(2, 4).bfloat16(), torch.ones(3, 4).bfloat16()
    assert not lin.uses_onednn(x, w)
    torch.testing.assert_close(lin.linear(x, w), F.linear(x, w))
    assert lin.uses_onednn(torch.ones(2, 4), torch.ones(3, 4))


def test_falls_back_to_f_linear_where_onednn_cannot_run():
    w = torch.randn(8, 6)
    assert not lin.uses_onednn(torch.randn(0, 6), w)                     # no rows
    assert not lin.uses_onednn(torch.randn(2, 3, 6), w)                  # not 2-D
    assert not lin.uses_onednn(torch.randn(2, 6, dtype=torch.float64), w.double())
    assert not lin.uses_onednn(torch.randn(2, 6), torch.randn(6, 8).t())  # strided weight
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        lin.linear(torch.randn(2, 5), w)                                 # F.linear's own error
    assert lin.linear(torch.randn(0, 6), w).shape == (0, 8)
    x3 = torch.randn(2, 3, 6)
    torch.testing.assert_close(lin.linear(x3, w), F.linear(x3, w))
    wt = torch.randn(6, 8).t()
    x = torch.randn(4, 6)
    torch.testing.assert_close(lin.linear(x, wt), F.linear(x, wt))


def test_autograd_still_works_when_grad_is_wanted():
    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(3, 6)
    assert not lin.uses_onednn(x, w)
    lin.linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(8, 6))
    with torch.inference_mode():
        assert lin.uses_onednn(x, w) == lin._ONEDNN


def test_non_contiguous_input_and_mismatched_bias():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 12, generator=g)
    x = torch.randn(12, 5, generator=g).t()                              # [5, 12], strided
    b = torch.randn(32, generator=g)[::2]                                # strided bias
    torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.float32 not in lin._PACK_DTYPES, reason="oneDNN cannot reorder weights here")
def test_the_reordered_weight_is_built_once_and_follows_in_place_writes():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 96, generator=g), torch.randn(160, 96, generator=g)
    first = lin.linear(x, w)
    packed = w._kvmesh_packed[0]
    assert packed.is_mkldnn
    assert torch.equal(lin.linear(x, w), first)
    assert w._kvmesh_packed[0] is packed                          # reused, not rebuilt
    with torch.no_grad():
        w.mul_(2.0)                                               # e.g. load_state_dict's copy_
    torch.testing.assert_close(lin.linear(x, w), 2.0 * first, rtol=1e-5, atol=1e-4)
    assert w._kvmesh_packed[0] is not packed
    with torch.inference_mode():                                  # the engine's mode
        torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_reordering_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(lin, "_PACK_DTYPES", ())
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 6, generator=g), torch.randn(8, 6, generator=g)
    torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert not hasattr(w, "_kvmesh_packed")


def test_the_reordered_copies_are_counted_before_they_exist(monkeypatch):
    """What the engine sets aside from the KV cache's memory: every Linear's float32 weight once
    (a tied LM head is the embedding's tensor, counted once as the head's), nothing else."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 6), torch.nn.Linear(4, 10))
    model[2].weight = model[0].weight                                  # tied: [10, 4]
    monkeypatch.setattr(lin, "_PACK_DTYPES", (torch.float32,))
    assert lin.packed_copy_bytes(model) == (6 * 4 + 10 * 4) * 4
    monkeypatch.setattr(lin, "_PACK_DTYPES", ())
    assert lin.packed_copy_bytes(model) == 0


@pytest.mark.skipif(torch.float32 not in lin._ONEDNN_DTYPES, reason="oneDNN's float32 linear is not available here")
@pytest.mark.parametrize("pack", [True, False])
def test_bf16_without_bf16_dot_products_runs_as_float32_on_a_widened_copy(monkeypatch, pack):
    """On a CPU without AVX512-BF16 / AMX a bf16 projection is the float32 GEMM of the exactly
    widened operands, rounded to bf16 once: bit-equal to doing that by hand, the weight widened
    once and kept (2x its bf16 bytes, which the KV sizing sets aside)."""
    monkeypatch.setattr(lin, "_BF16_VIA_FLOAT32", True)
    if not pack:
        monkeypatch.setattr(lin, "_PACK_DTYPES", ())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 48, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 48, generator=g).to(torch.bfloat16)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        got = lin.linear(x, w, b)
        want = lin.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    copy = w._kvmesh_packed[0]
    assert copy.dtype == torch.float32 and copy.is_mkldnn == pack
    with torch.inference_mode():
        lin.linear(x, w)
    assert w._kvmesh_packed[0] is copy                              # widened once
    model = torch.nn.Linear(48, 40, bias=False).to(torch.bfloat16)
    assert lin.packed_copy_bytes(model) == 40 * 48 * 4


def test_bf16_with_bf16_dot_products_stays_bf16(monkeypatch):
    monkeypatch.setattr(lin, "_BF16_VIA_FLOAT32", False)
    x = torch.randn(3, 8).to(torch.bfloat16)
    w = torch.randn(5, 8).to(torch.bfloat16)
    assert not lin.bf16_via_float32(x, w)
    model = torch.nn.Linear(8, 5, bias=False).to(torch.bfloat16)
    expect = 5 * 8 * 2 if torch.bfloat16 in lin._PACK_DTYPES else 0
    assert lin.packed_copy_bytes(model) == expect
