"""bf16 prefill attention on AMX tiles (kernels/csrc/attention_amx.cpp) against a float64 model of
what it computes.

Runs of consecutive tokens of one sequence (up to 16 / G) go to the tiles; their probabilities are
rounded to bf16 before P V (as flash attention rounds them), so the model rounds P there too and
every other sum is float64. Single rows (decodes, a run's lone last token) stay on the vector path,
which keeps P in float32: the model does not round those. Either way the kernel's float32 sums and
its one final rounding leave it within two bf16 ulps of the model.

Skipped where this CPU (or Linux) gives no AMX tiles: there the native build has no AMX code.
"""
from __future__ import annotations

import pytest
import torch
from paged_batch import paged_batch

from kvmesh.kernels import cpu_kernels, cpu_ops
from kvmesh.kernels.cpu_features import cpu_flags

AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16")


@pytest.fixture(scope="module")
def ext():
    missing = [f for f in AMX_FLAGS if f not in cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: no AMX attention here")
    mod = cpu_kernels.load()
    assert mod is not None, cpu_kernels.unavailable_reason()
    assert mod.isa() == "amx"
    if mod.attention_amx_isa() != "amx_bf16":
        pytest.skip("Linux did not grant this process the AMX tile registers")
    return mod


def test_builds_without_amx_have_no_amx_attention():
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU lacks avx512_bf16")
    mod = cpu_kernels.load("avx512_bf16")
    assert mod is not None, cpu_kernels.unavailable_reason("avx512_bf16")
    assert (mod.isa(), mod.attention_amx_isa()) == ("avx512_bf16", "")


def tiled_rows(query_lens, group):
    """The packed token rows the kernel runs on tiles: runs of 16 // group of each chunk, but
    a run of one token."""
    most, rows, start = 16 // group, set(), 0
    for q in query_lens:
        for i in range(q):
            run = i // most
            if min(most, q - run * most) >= 2 and most >= 2:
                rows.add(start + i)
        start += q
    return rows


def model(query, k, v, meta, scale, window, softcap, rounded):
    """float64 attention of every row; P rounded to bf16 on the `rounded` token rows."""
    H, D = query.shape[1], query.shape[2]
    block, kvh = k.shape[1], k.shape[2]
    G = H // kvh
    kf = k.double().reshape(-1, kvh, D)
    vf = v.double().reshape(-1, kvh, D)
    out = torch.empty(query.shape, dtype=torch.float64)
    tok = 0
    for s, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        table = meta.block_tables[s].tolist()
        for i in range(q_len):
            ctx = s_len - q_len + i + 1
            lo = max(0, ctx - window) if window else 0
            slots = [table[t // block] * block + t % block for t in range(lo, ctx)]
            keys = kf[slots].repeat_interleave(G, dim=1)           # [n, H, D]: head h reads KV head h // G
            scores = torch.einsum("nhd,hd->hn", keys, query[tok].double()) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            p = torch.softmax(scores, 1)
            if tok in rounded:
                p = p.bfloat16().double()
            out[tok] = torch.einsum("hn,nhd->hd", p, vf[slots].repeat_interleave(G, dim=1))
            tok += 1
    return out


def check(query, k, v, meta, window=0, softcap=0.0):
    H, kvh, D = query.shape[1], k.shape[2], query.shape[2]
    meta = meta.with_window(window)
    got = cpu_ops.paged_attention(query, k, v, meta, D ** -0.5, softcap)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    want = model(query, k, v, meta, D ** -0.5, window, softcap, tiled_rows(meta.query_lens_cpu, H // kvh))
    # two bf16 ulps of the model's value (2^-7 relative), and its float32 sums' share near zero
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=2e-4)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 4), (9, 3), (8, 1)])   # runs of 16, 8, 5, 2
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("block", [16, 32])
def test_prefill_runs_match_the_model(ext, heads, kv_heads, dim, block):
    # decodes beside a whole prompt, a chunk after a cached prefix, a chunk that ends in a lone row
    query, k, v, meta = paged_batch([1, 37, 1, 5, 11], [70, 37, 3, 100, 300], heads=heads, kv_heads=kv_heads,
                                    dim=dim, block=block, dtype=torch.bfloat16, seed=dim + block)
    check(query, k, v, meta)


@pytest.mark.parametrize("window, softcap", [(21, 0.0), (0, 5.0), (40, 30.0)])
def test_window_and_softcap(ext, window, softcap):
    query, k, v, meta = paged_batch([1, 30, 12], [64, 30, 75], heads=6, kv_heads=2, dim=64, block=16,
                                    dtype=torch.bfloat16, seed=window)
    check(query, k, v, meta, window, softcap)


def test_cache_rows_outside_the_span_reach_no_output(ext):
    # every slot no row may see is NaN: the last blocks' unwritten rows, the spare blocks, and the
    # keys before each window (a tile starts 16-aligned, before the window's first key)
    window = 21
    query, k, v, meta = paged_batch([30, 12, 1], [30, 75, 50], heads=6, kv_heads=2, dim=64, block=16,
                                    dtype=torch.bfloat16, seed=5)
    seen = torch.zeros(k.shape[0] * 16, dtype=torch.bool)
    for s, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        table = meta.block_tables[s].tolist()
        for ctx in range(s_len - q_len + 1, s_len + 1):
            for t in range(max(0, ctx - window), ctx):
                seen[table[t // 16] * 16 + t % 16] = True
    for cache in (k, v):
        cache.view(-1, 2, 64)[~seen] = float("nan")
    check(query, k, v, meta, window)


def test_block_sizes_off_the_tile_stay_on_the_vector_path(ext):
    # block 8 cuts a 16-key tile: no AMX; the model rounds no probability
    query, k, v, meta = paged_batch([20, 1], [20, 9], heads=4, kv_heads=2, dim=64, block=8,
                                    dtype=torch.bfloat16, seed=1)
    got = cpu_ops.paged_attention(query, k, v, meta, 0.125)
    want = model(query, k, v, meta, 0.125, 0, 0.0, rounded=set())
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=2e-4)
