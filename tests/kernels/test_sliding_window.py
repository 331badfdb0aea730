"""Sliding-window and soft-capped attention: decode and unified Triton kernels vs the reference.

A window W lets the query at position p see positions p - W + 1 .. p (HF's `kv > q - W`). The
grid puts W below, at and above the block size, below and above every context, with decodes
(split and unsplit) and a mixed batch of prefills, chunks after cached prefixes and decodes.
"""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import reference, triton_ops  # noqa: E402
from kvmesh.kernels.metadata import AttentionMetadata  # noqa: E402
from kvmesh.kernels.paged_attention import paged_decode_attention  # noqa: E402
from kvmesh.kernels.prefill_attention import unified_attention  # noqa: E402

WINDOWS = [1, 5, 8, 13, 1000]          # block size 8: below, at and above it; 1000 > every context
SOFTCAPS = [0.0, 2.0]
DECODE = ([1, 1, 1, 1, 1], [1, 7, 8, 21, 45])
MIXED = ([1, 1, 12, 5, 2, 19], [3, 30, 12, 25, 9, 40])   # decodes, a prefill, chunks after a prefix


def _expected(case, window, softcap):
    k, v = case.clean_caches()
    return reference.paged_attention(case.query, k, v, case.meta.with_window(window), case.scale, softcap)


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=["nocap", "cap2"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window(kx, window, softcap, num_splits):
    case = kx.make_paged_case(*DECODE, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                              dtype=torch.float32, seed=window)
    m = case.meta
    with kx.poisoned():
        out = paged_decode_attention(case.query, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                                     m.max_seq_len, case.scale, sliding_window=window, softcap=softcap,
                                     num_splits=num_splits, block_n=16)
    kx.assert_close(out, _expected(case, window, softcap))


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=["nocap", "cap2"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_m,block_n", [(32, 16)])
def test_unified_window(kx, window, softcap, block_m, block_n):
    case = kx.make_paged_case(*MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                              dtype=torch.float32, seed=window)
    m = case.meta
    with kx.poisoned():
        out = unified_attention(case.query, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens,
                                m.block_tables, case.scale, sliding_window=window, softcap=softcap,
                                block_m=block_m, block_n=block_n)
    kx.assert_close(out, _expected(case, window, softcap))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_window_16bit_through_get_ops(kx, dtype, lens):
    """triton_ops.paged_attention reads the window from the metadata view, like the model does."""
    case = kx.make_paged_case(*lens, num_heads=6, num_kv_heads=2, head_dim=64, block_size=8,
                              dtype=dtype, seed=3)
    with kx.poisoned():
        out = triton_ops.paged_attention(case.query, case.k_cache, case.v_cache, case.meta.with_window(5),
                                         case.scale, 2.0)
    kx.assert_close(out, _expected(case, 5, 2.0))


def test_window_changes_the_result_and_reference_matches_brute_force(kx):
    """The window is not a no-op, and the reference's mask is the literal definition."""
    case = kx.make_paged_case(*MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                              dtype=torch.float32, seed=11)
    k, v = case.clean_caches()
    full = reference.paged_attention(case.query, k, v, case.meta, case.scale)
    windowed = _expected(case, 5, 0.0)
    assert not torch.allclose(full, windowed)
    m, row = case.meta, 0
    for s, (q_len, s_len) in enumerate(zip(m.query_lens_cpu, m.seq_lens_cpu)):
        table = m.block_tables[s].long()
        keys = k[table].flatten(0, 1)[:s_len].float()              # [s_len, kv_heads, d]
        vals = v[table].flatten(0, 1)[:s_len].float()
        for i in range(q_len):
            p = s_len - q_len + i
            lo = max(0, p - 5 + 1)
            for h in range(4):
                sc = keys[lo:p + 1, h // 2] @ case.query[row + i, h].float() * case.scale
                want = torch.softmax(sc, 0) @ vals[lo:p + 1, h // 2]
                torch.testing.assert_close(windowed[row + i, h], want, atol=1e-5, rtol=1e-4)
        row += q_len


def test_with_window_is_memoised_and_validated():
    meta = AttentionMetadata.build([2], [5], [[1, 2]], 4)
    assert meta.with_window(0) is meta and meta.sliding_window == 0
    w = meta.with_window(3)
    assert w is meta.with_window(3) and w.sliding_window == 3 and w.slot_mapping is meta.slot_mapping
    with pytest.raises(ValueError, match="sliding window must be >= 0"):
        meta.with_window(-1)


@pytest.mark.parametrize("kwargs,match", [
    ({"sliding_window": -1}, "sliding_window must be an int >= 0"),
    ({"softcap": -1.0}, "softcap must be >= 0"),
])
def test_kernels_reject_bad_window_or_softcap(kx, kwargs, match):
    case = kx.make_paged_case(*DECODE, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                              dtype=torch.float32)
    m = case.meta
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(case.query, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                               m.max_seq_len, case.scale, **kwargs)
    with pytest.raises(ValueError, match=match):
        unified_attention(case.query, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens,
                          m.block_tables, case.scale, **kwargs)
