"""8-bit float KV caches on the Triton kernels (interpreter): the cache write gives torch's codes
bit for bit, every finite code is widened exactly by the decode and the unified kernels, their
attention over codes matches the torch reference reading the same codes, the flash route reads
the codes widened, and caches that are neither the query's dtype nor codes are refused."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from fp8_cases import every_code_case, fp8_batch, hard_values  # noqa: E402

from kvmesh.kernels import flash_prefill, reference, triton_ops  # noqa: E402
from kvmesh.kernels.cache_ops import write_kv_cache  # noqa: E402
from kvmesh.kernels.fp8_codes import cache_bytes, kv_code, kv_read  # noqa: E402
from kvmesh.kernels.kv_cache_dtype import to_cache_codes  # noqa: E402
from kvmesh.kernels.paged_attention import paged_decode_attention  # noqa: E402
from kvmesh.kernels.prefill_attention import unified_attention  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors on the Triton kernels need TRITON_INTERPRET=1")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                            reason="needs a CUDA GPU and TRITON_INTERPRET=0 (the compiled kernels)")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def test_codes_and_byte_views():
    assert [kv_code(d) for d in (torch.bfloat16, torch.float32, *FP8)] == [0, 0, 1, 2]
    c = torch.zeros(2, 3, dtype=torch.float8_e5m2)
    assert cache_bytes(c).dtype == torch.uint8 and cache_bytes(c).data_ptr() == c.data_ptr()
    f = torch.zeros(2, 3)
    assert cache_bytes(f) is f


def test_readers_get_fp8_from_sm89_compiled_and_bytes_otherwise(monkeypatch):
    e4, e5, f = (torch.zeros(2, 3, dtype=d) for d in (*FP8, torch.bfloat16))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for arch, codes in ((80, (1, 2)), (86, (1, 2)), (89, (3, 4)), (90, (3, 4))):
        got = [kv_read(c, arch) for c in (e4, e5)]
        assert [code for _, code in got] == list(codes)
        assert [t.dtype for t, _ in got] == ([torch.uint8] * 2 if codes == (1, 2) else list(FP8))
        assert all(t.data_ptr() == c.data_ptr() for (t, _), c in zip(got, (e4, e5)))
        t, code = kv_read(f, arch)
        assert t is f and code == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")      # the interpreter: always the bit operations
    assert [kv_read(c, 90)[1] for c in (e4, e5)] == [1, 2]


@interpreted
@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_write_gives_torchs_codes_bit_for_bit(cache_dtype, dtype):
    x = hard_values(cache_dtype, 4000).to(dtype)
    heads, dim = 8, 64
    per_token = heads * dim
    n = -(-x.numel() // per_token) * per_token
    rows = torch.cat([x, torch.zeros(n - x.numel(), dtype=dtype)]).view(-1, heads, dim)
    tokens = rows.shape[0]
    k_cache = torch.zeros(tokens + 2, 1, heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(tokens) + 2                      # slots 0 and 1 stay untouched
    write_kv_cache(rows, -rows, k_cache, v_cache, slots)
    want = to_cache_codes(rows, cache_dtype).view(torch.uint8).reshape(-1)
    got = k_cache[2:].view(torch.uint8).reshape(-1)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(rows.reshape(-1)[i]), int(got[i]), int(want[i])) for i in bad[:5]]
    assert torch.equal(v_cache[2:].view(torch.uint8).reshape(-1),
                       to_cache_codes(-rows, cache_dtype).view(torch.uint8).reshape(-1))
    assert not k_cache[:2].view(torch.uint8).any() and not v_cache[:2].view(torch.uint8).any()


@interpreted
def test_the_write_skips_padding_slots():
    k_cache = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, 2, 16) * 50, torch.randn(3, 2, 16) * 500
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([5, -1, 14]))
    kf, vf = k_cache.view(16, 2, 16).view(torch.uint8), v_cache.view(16, 2, 16).view(torch.uint8)
    assert torch.equal(kf[5], to_cache_codes(key[0], torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(vf[14], to_cache_codes(value[2], torch.float8_e4m3fn).view(torch.uint8))
    assert not kf[[i for i in range(16) if i not in (5, 14)]].any()


@interpreted
@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", ["decode", "unified"])
def test_every_finite_code_is_widened_exactly(cache_dtype, dtype, kernel):
    """One key per sequence: the softmax weight is exactly 1, so the output is the value row the
    kernel widened. Every finite code appears once in some value row (all are exact in bf16)."""
    k_cache, v_cache, meta = every_code_case(cache_dtype)
    query = torch.randn(k_cache.shape[0], 1, k_cache.shape[3]).to(dtype)
    if kernel == "decode":
        got = paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 1, 0.125)
    else:
        got = unified_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                meta.block_tables, 0.125)
    assert got.dtype == dtype
    assert torch.equal(got.float().view(-1), v_cache.float().view(-1))


@interpreted
@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lens", [([1, 1, 1], [70, 3, 100]), ([1, 37, 1, 5], [70, 37, 3, 100])],
                         ids=["decode", "mixed"])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (21, 0.0), (0, 5.0)])
def test_attention_over_codes_matches_the_reference(cache_dtype, dtype, lens, window, softcap):
    """Decodes of uneven contexts (the split-K kernel) and a batch with a whole prompt and a chunk
    after a cached prefix (the unified kernel), GQA 2, through the backend's entry point."""
    query, k, v, meta = fp8_batch(*lens, cache_dtype, dtype, heads=4, kv_heads=2, dim=32, block=16,
                                  seed=len(lens[0]))
    meta = meta.with_window(window)
    got = triton_ops.paged_attention(query, k, v, meta, 32 ** -0.5, softcap)
    want = reference.paged_attention(query, k, v, meta, 32 ** -0.5, softcap)
    assert got.dtype == dtype
    # the same widened values both sides; outputs up to ~12 (the scale of 3): float32 within a
    # few ulp, 16-bit within the rounding of their own outputs
    atol, rtol = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (7e-2, 1e-2),
                  torch.float16: (1e-2, 2e-3)}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@interpreted
def test_split_decode_over_codes_matches_one_split():
    """Flash-decoding's partials and merge over an 8-bit cache: 4 splits equal 1 split."""
    query, k, v, meta = fp8_batch([1, 1], [300, 170], torch.float8_e4m3fn, torch.float32, heads=4,
                                  kv_heads=1, dim=32, block=16, seed=9)
    args = (query, k, v, meta.block_tables, meta.seq_lens, 300, 32 ** -0.5)
    one = paged_decode_attention(*args, num_splits=1)
    four = paged_decode_attention(*args, num_splits=4, min_split_tokens=16, block_n=16)
    torch.testing.assert_close(four, one, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(one, reference.paged_attention(query, k, v, meta, 32 ** -0.5),
                               atol=2e-5, rtol=2e-5)


@interpreted
def test_the_flash_route_reads_the_codes_widened(monkeypatch):
    """Fresh prompts on (here math) SDPA read their K/V back from the 8-bit cache widened to the
    query's dtype; the chunk after a prefix stays on the unified kernel: both as the reference."""
    monkeypatch.setattr(triton_ops, "default_impl", lambda device: "sdpa")
    seen = []
    real = flash_prefill._flash
    monkeypatch.setattr(flash_prefill, "_flash",
                        lambda impl, q, k, v, *a: seen.append((q.dtype, k.dtype, v.dtype)) or real(impl, q, k, v, *a))
    query, k, v, meta = fp8_batch([1, 6, 3, 7], [9, 6, 10, 7], torch.float8_e4m3fn, torch.float16,
                                  heads=4, kv_heads=2, dim=16, block=4, seed=2)
    got = triton_ops.paged_attention(query, k, v, meta, 0.25)
    assert seen == [(torch.float16, torch.float16, torch.float16)]
    torch.testing.assert_close(got.float(), reference.paged_attention(query, k, v, meta, 0.25).float(),
                               atol=1e-2, rtol=2e-3)


@interpreted
def test_caches_of_another_dtype_are_refused():
    query, k, v, meta = fp8_batch([1], [5], torch.float8_e4m3fn, torch.float32, heads=2, kv_heads=1,
                                  dim=16, block=4)
    args = (meta.block_tables, meta.seq_lens, 5, 0.25)
    with pytest.raises(ValueError, match="both hold the query's dtype or both 8-bit float codes"):
        paged_decode_attention(query, k, v.view(torch.float8_e5m2), *args)
    with pytest.raises(ValueError, match="both hold the query's dtype or both 8-bit float codes"):
        paged_decode_attention(query, k.float(), v.float().half(), *args)
    with pytest.raises(ValueError, match="the caches hold the keys' dtype"):
        write_kv_cache(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), k.half(), v.half(), torch.tensor([0]))
    with pytest.raises(ValueError, match="key and value must share a float dtype"):
        write_kv_cache(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16).half(), k, v, torch.tensor([0]))


@on_gpu
@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_the_compiled_kernels_write_and_read_the_codes(cache_dtype):
    """On a GPU: the compiled write gives torch's codes bit for bit, and decode, unified and
    flash-route attention over them match the reference run on the CPU over the same codes."""
    x = hard_values(cache_dtype, 4000).to(torch.bfloat16)
    n = -(-x.numel() // 512) * 512
    rows = torch.cat([x, torch.zeros(n - x.numel(), dtype=x.dtype)]).view(-1, 8, 64).cuda()
    k_cache = torch.zeros(rows.shape[0], 1, 8, 64, dtype=cache_dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    write_kv_cache(rows, rows, k_cache, v_cache, torch.arange(rows.shape[0], device="cuda"))
    assert torch.equal(k_cache.view(torch.uint8).cpu().view(-1),
                       to_cache_codes(rows.cpu(), cache_dtype).view(torch.uint8).view(-1))
    for lens in (([1, 1, 1], [70, 3, 100]), ([1, 37, 1, 5], [70, 37, 3, 100]), ([6, 9], [6, 9])):
        query, k, v, meta = fp8_batch(*lens, cache_dtype, torch.bfloat16, heads=8, kv_heads=2, dim=128,
                                      block=16, seed=1)
        want = reference.paged_attention(query, k, v, meta, 128 ** -0.5)
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(meta, name, getattr(meta, name).cuda())
        got = triton_ops.paged_attention(query.cuda(), k.cuda(), v.cuda(), meta, 128 ** -0.5)
        torch.testing.assert_close(got.float().cpu(), want.float(), atol=7e-2, rtol=1e-2)
