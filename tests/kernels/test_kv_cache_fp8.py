"""8-bit float KV caches (--kv-cache-dtype fp8 / fp8_e5m2): the codes written (nearest, saturated,
padding slots skipped), every finite code widened exactly by the C++ kernel, and the kernel's
attention over 8-bit caches against the torch reference reading the same codes."""
from __future__ import annotations

import pytest
import torch
from fp8_cases import every_code_case, fp8_batch, hard_values

from kvmesh.kernels import cpu_ops, reference
from kvmesh.kernels.cpu_kernels import load
from kvmesh.kernels.kv_cache_dtype import to_cache_codes

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture(scope="module")
def ext():
    mod = load()
    assert mod is not None, "the C++ CPU kernels must build on the test machine (g++ is required)"
    return mod


@pytest.mark.parametrize("cache_dtype, top", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)], ids=str)
def test_codes_saturate_and_round_to_nearest(cache_dtype, top):
    x = torch.tensor([1e9, -1e9, top * 1.5, 1.0, -0.0, 1e-12, 3.3])
    got = to_cache_codes(x, cache_dtype).float()
    assert got[:3].tolist() == [top, -top, top]
    assert got[3] == 1.0 and got[4] == 0.0 and got[5] == 0.0
    assert not torch.isnan(got).any() and not torch.isinf(got).any()
    # nearest: no other code is closer to 3.3
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    finite = codes[torch.isfinite(codes)]
    assert (finite - 3.3).abs().min() == (got[6] - 3.3).abs()


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ops", ["reference", "cpu"])
def test_the_write_stores_codes_and_skips_padding(ext, cache_dtype, dtype, ops):
    k_cache = torch.zeros(4, 4, 2, 8, dtype=cache_dtype)
    v_cache = torch.zeros(4, 4, 2, 8, dtype=cache_dtype)
    key = (torch.randn(3, 2, 8) * 100).to(dtype)
    value = (torch.randn(3, 2, 8) * 1000).to(dtype)
    slots = torch.tensor([5, -1, 14])
    mod = cpu_ops if ops == "cpu" else reference
    mod.write_kv_cache(key, value, k_cache, v_cache, slots)
    kf, vf = k_cache.view(16, 2, 8), v_cache.view(16, 2, 8)
    assert torch.equal(kf[5].view(torch.uint8), to_cache_codes(key[0], cache_dtype).view(torch.uint8))
    assert torch.equal(vf[14].view(torch.uint8), to_cache_codes(value[2], cache_dtype).view(torch.uint8))
    untouched = [i for i in range(16) if i not in (5, 14)]
    assert not kf[untouched].view(torch.uint8).any() and not vf[untouched].view(torch.uint8).any()


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cpp_write_gives_torchs_codes_bit_for_bit(ext, cache_dtype, dtype):
    """The C++ encoder against torch's conversion of the clamped value: every code's value, the
    midpoints between neighbouring codes (ties go to even), values just either side of them,
    subnormals, the saturation range, zeros and infinities, and random values of every scale."""
    x = hard_values(cache_dtype).to(dtype)
    n = -(-x.numel() // 64) * 64
    rows = torch.cat([x, torch.zeros(n - x.numel(), dtype=dtype)]).view(-1, 1, 64)
    k_cache = torch.zeros(rows.shape[0], 1, 1, 64, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    ext.write_kv_cache(rows, rows, k_cache, v_cache, torch.arange(rows.shape[0]))
    want = to_cache_codes(rows, cache_dtype).view(torch.uint8).view(-1)
    got = k_cache.view(torch.uint8).view(-1)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(rows.view(-1)[i]), int(got[i]), int(want[i])) for i in bad[:5]]
    assert torch.equal(v_cache.view(torch.uint8).view(-1), want)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_every_finite_code_is_widened_exactly(ext, cache_dtype):
    """One key per sequence: the softmax weight is exactly 1, so the output is the value row the
    kernel widened. Every finite code of the format appears once in some value row."""
    k_cache, v_cache, meta = every_code_case(cache_dtype)
    query = torch.randn(k_cache.shape[0], 1, k_cache.shape[3])
    assert cpu_ops.kernel_applies(query, k_cache, v_cache)
    got = cpu_ops.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert torch.equal(got.view(-1), v_cache.float().view(-1))


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block, dim, heads, kv_heads", [
    (16, 64, 9, 3),       # the built-in model's shape
    (1, 128, 8, 1),       # one token a block, GQA 8
    (32, 80, 4, 4),       # a 64-wide pass and a tail, no GQA
    (8, 12, 4, 2),        # head_dim not a multiple of the vector width: the portable loops
])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (21, 0.0), (0, 5.0)])
def test_attention_over_codes_matches_the_reference(ext, cache_dtype, dtype, block, dim, heads, kv_heads,
                                                    window, softcap):
    # decodes of uneven contexts beside a whole prompt and a chunk after a cached prefix
    query, k, v, meta = fp8_batch([1, 37, 1, 5], [70, 37, 3, 100], cache_dtype, dtype, heads=heads,
                                  kv_heads=kv_heads, dim=dim, block=block, seed=block + dim)
    meta = meta.with_window(window)
    assert cpu_ops.kernel_applies(query, k, v)
    got = cpu_ops.paged_attention(query, k, v, meta, dim ** -0.5, softcap)
    want = reference.paged_attention(query, k, v, meta, dim ** -0.5, softcap)
    assert got.dtype == dtype
    # the same widened values both sides: float32 within a few ulp of values up to ~12 (the
    # scale of 3); bf16 within its rounding
    atol, rtol = (1e-5, 2e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_a_mixed_cache_pair_is_refused(ext):
    query, k, v, meta = fp8_batch([1], [5], torch.float8_e4m3fn, heads=2, kv_heads=1, dim=16, block=4)
    v = v.view(torch.float8_e5m2)
    assert not cpu_ops.kernel_applies(query, k, v)
    rows = cpu_ops.attention_rows(meta.query_lens_cpu, meta.seq_lens_cpu)
    with pytest.raises(RuntimeError, match="both in the query's dtype or both float8"):
        ext.paged_attention_rows(query, k, v, meta.block_tables, rows, torch.empty_like(query),
                                 0.25, 0, 0.0)
