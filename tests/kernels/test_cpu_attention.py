"""The C++ CPU kernels against the torch reference: paged attention (decodes in place, mixed
batches, GQA, sliding windows, soft-capping), RMSNorm with the residual add, RoPE; and their
argument checks."""
from __future__ import annotations

import pytest
import torch
from paged_batch import paged_batch

from kvmesh.kernels import cpu_ops, reference
from kvmesh.kernels.cpu_kernels import load
from kvmesh.kernels.ops import get_ops, resolve_backend

BLOCK = 4


@pytest.fixture(scope="module")
def ext():
    mod = load()
    assert mod is not None, "the C++ CPU kernels must build on the test machine (g++ is required)"
    return mod


def _batch(query_lens, seq_lens, heads=6, kv_heads=2, dim=16, num_blocks=64, seed=0, block=BLOCK):
    return paged_batch(query_lens, seq_lens, heads=heads, kv_heads=kv_heads, dim=dim, block=block,
                       num_blocks=num_blocks, seed=seed)


@pytest.mark.parametrize("query_lens, seq_lens", [
    ([1, 1, 1], [5, 17, 1]),                  # all decode, uneven contexts
    ([1, 7, 1, 3], [9, 7, 30, 11]),           # decodes mixed with a prompt and a chunk
    ([4], [13]),                              # a prefill chunk after a cached prefix
    ([9], [9]),                               # a whole prompt
])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (6, 0.0), (0, 5.0)])
def test_matches_the_reference(ext, query_lens, seq_lens, window, softcap):
    query, k, v, meta = _batch(query_lens, seq_lens)
    meta = meta.with_window(window)
    want = reference.paged_attention(query, k, v, meta, 0.25, softcap)
    got = cpu_ops.paged_attention(query, k, v, meta, 0.25, softcap)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("block, dim, heads, kv_heads", [
    (16, 64, 9, 3),       # the built-in model's shape: full 8-key tiles, one 64-wide value pass
    (16, 80, 4, 4),       # a 64-wide pass plus an 8-wide tail, no GQA
    (8, 12, 4, 1),        # head_dim not a multiple of 8: the portable loops
    (32, 128, 8, 2),      # two 64-wide passes, keys in tiles of 8 plus a partial tile
])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (21, 0.0), (0, 5.0)])
def test_matches_the_reference_at_model_shapes(ext, block, dim, heads, kv_heads, window, softcap):
    query, k, v, meta = _batch([1, 37, 1, 5], [70, 37, 3, 100], heads=heads, kv_heads=kv_heads, dim=dim,
                               num_blocks=256 // block + 8, block=block, seed=block + dim)
    meta = meta.with_window(window)
    want = reference.paged_attention(query, k, v, meta, dim ** -0.5, softcap)
    got = cpu_ops.paged_attention(query, k, v, meta, dim ** -0.5, softcap)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_rows_are_every_token_with_its_causal_context_in_a_balanced_order():
    rows = cpu_ops.attention_rows([1, 4, 1], [7, 13, 3])
    # tokens 1..4 are the last 4 of a 13-token context: they see 10, 11, 12, 13 keys
    assert sorted(map(tuple, rows.tolist())) == [(0, 0, 7), (1, 1, 10), (2, 1, 11), (3, 1, 12),
                                                 (4, 1, 13), (5, 2, 3)]
    assert rows[:, 2].tolist() == [13, 3, 12, 7, 11, 10]      # longest, shortest, 2nd longest, ...
    half = rows.shape[0] // 2
    assert abs(int(rows[:half, 2].sum()) - int(rows[half:, 2].sum())) <= 13


def test_reads_a_strided_query_view(ext):
    query, k, v, meta = _batch([1, 1], [6, 11])
    wide = torch.randn(2, query.shape[1] * query.shape[2] + 8)
    view = wide[:, : query.shape[1] * query.shape[2]].view(2, query.shape[1], query.shape[2])
    assert not view.is_contiguous()
    torch.testing.assert_close(cpu_ops.paged_attention(view, k, v, meta, 0.5),
                               reference.paged_attention(view.contiguous(), k, v, meta, 0.5),
                               rtol=2e-5, atol=2e-6)


def test_bfloat16_runs_the_kernel_and_float16_the_reference(ext):
    query, k, v, meta = _batch([1, 1], [6, 11])
    q16, k16, v16 = query.bfloat16(), k.bfloat16(), v.bfloat16()
    assert cpu_ops.kernel_applies(q16, k16, v16)
    torch.testing.assert_close(cpu_ops.paged_attention(q16, k16, v16, meta, 0.5).float(),
                               reference.paged_attention(q16, k16, v16, meta, 0.5).float(), atol=1e-2, rtol=1e-2)
    h, kh, vh = query.half(), k.half(), v.half()
    assert not cpu_ops.kernel_applies(h, kh, vh)
    assert not cpu_ops.kernel_applies(q16, k, v)          # the cache in another dtype than the query
    assert torch.equal(cpu_ops.paged_attention(h, kh, vh, meta, 0.5),
                       reference.paged_attention(h, kh, vh, meta, 0.5))


@pytest.mark.parametrize("rows, message", [
    ([[2, 0, 5]], "row token index out of range"),
    ([[0, 3, 5]], "row sequence index out of range"),
    ([[0, 0, 0]], "row context length exceeds its block table"),
    ([[0, 0, 4 * BLOCK + 1]], "row context length exceeds its block table"),
])
def test_bad_rows_are_refused_before_any_read(ext, rows, message):
    query, k, v, meta = _batch([1, 1], [6, 11])
    out = torch.zeros_like(query)
    with pytest.raises(RuntimeError, match=message):
        ext.paged_attention_rows(query, k, v, meta.block_tables, torch.tensor(rows), out, 1.0, 0, 0.0)
    assert not out.any()


def test_a_block_id_outside_the_cache_is_refused(ext):
    query, k, v, meta = _batch([1], [6])
    tables = meta.block_tables.clone()
    tables[0, 1] = k.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        ext.paged_attention_rows(query, k, v, tables, torch.tensor([[0, 0, 6]]), torch.zeros_like(query),
                                 1.0, 0, 0.0)


def test_wrong_dtypes_and_shapes_are_refused(ext):
    query, k, v, meta = _batch([1], [6])
    rows = torch.tensor([[0, 0, 6]])
    with pytest.raises(RuntimeError, match="query must be float32"):
        ext.paged_attention_rows(query.double(), k, v, meta.block_tables, rows, torch.zeros_like(query), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="block_tables must be contiguous int32"):
        ext.paged_attention_rows(query, k, v, meta.block_tables.long(), rows, torch.zeros_like(query), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="rows must be contiguous int64"):
        ext.paged_attention_rows(query, k, v, meta.block_tables, rows.int(), torch.zeros_like(query), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="heads / head_dim do not match"):
        ext.paged_attention_rows(query[:, :5], k, v, meta.block_tables, rows, torch.zeros_like(query[:, :5]),
                                 1.0, 0, 0.0)


def test_auto_picks_the_cpu_backend_here(ext):
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert get_ops("cpu") is cpu_ops
    with pytest.raises(ValueError, match="backend cpu runs on the CPU, not on cuda"):
        resolve_backend("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="auto, triton, cpu or reference"):
        resolve_backend("fast", torch.device("cpu"))


@pytest.mark.parametrize("tokens", [3, 200])       # inline (a decode step) and split across threads
def test_rms_norm_matches_the_reference(ext, tokens):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 96, generator=g)
    r = torch.randn(tokens, 96, generator=g)
    w = torch.randn(96, generator=g)
    out, none = cpu_ops.rms_norm(x, w, 1e-5)
    want, _ = reference.rms_norm(x, w, 1e-5)
    assert none is None
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    out, summed = cpu_ops.rms_norm(x, w, 1e-5, r)
    want, want_sum = reference.rms_norm(x, w, 1e-5, r)
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [2, 300])
def test_rope_is_bit_exact_with_the_reference_on_strided_views(ext, tokens):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (6 + 2 + 2) * 16, generator=g)
    q = qkv[:, :96].view(tokens, 6, 16)                       # views of a fused projection
    k = qkv[:, 96:128].view(tokens, 2, 16)
    table = torch.randn(512, 16, generator=g)
    pos = torch.randint(0, 512, (tokens,), generator=g)
    got_q, got_k = cpu_ops.rotary_embedding(pos, q, k, table)
    want_q, want_k = reference.rotary_embedding(pos, q, k, table)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_norm_and_rope_refuse_bad_arguments(ext):
    with pytest.raises(RuntimeError, match="weight must be contiguous \\[H\\] in x's dtype"):
        ext.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5, None)
    with pytest.raises(RuntimeError, match="weight must be contiguous \\[H\\] in x's dtype"):
        ext.rms_norm(torch.ones(2, 8), torch.ones(8).bfloat16(), 1e-5, None)
    with pytest.raises(RuntimeError, match="residual must be contiguous, shaped like x, in its dtype"):
        ext.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5, torch.ones(3, 8))
    q, k = torch.ones(2, 3, 8), torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="position out of the table's range"):
        ext.rotary_embedding(torch.tensor([0, 16]), q, k, torch.ones(16, 8))
    with pytest.raises(RuntimeError, match="head_dim does not match the table"):
        ext.rotary_embedding(torch.tensor([0, 1]), q, k, torch.ones(16, 6))
    with pytest.raises(RuntimeError, match="q and k must share a dtype"):
        ext.rotary_embedding(torch.tensor([0, 1]), q, k.bfloat16(), torch.ones(16, 8))
    # other dtypes run the reference
    q64, k64 = q.double(), k.double()
    got = cpu_ops.rotary_embedding(torch.tensor([0, 1]), q64, k64, torch.ones(16, 8))
    assert got[0].dtype == torch.float64


@pytest.mark.parametrize("vocab", [1, 7, 8, 49152, 49157])
def test_argmax_is_torchs_first_maximum(ext, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = 0.0                                        # all tied: the first index
    x[2, :] = float("-inf")                           # all masked: 0, as torch
    if vocab > 3:
        x[3, vocab // 2] = x[3, vocab - 1] = 50.0     # a tie for the max: the earlier one
        x[4, vocab - 2] = float("nan")                # torch counts NaN as the maximum
        x[4, vocab - 1] = float("nan")
    assert cpu_ops.argmax(x).tolist() == x.argmax(dim=-1).tolist()
    view = torch.randn(12, vocab, generator=g)[::3]   # rows strided, columns dense
    assert cpu_ops.argmax(view).tolist() == view.argmax(dim=-1).tolist()


def test_argmax_falls_back_off_the_kernel(ext):
    x = torch.randn(4, 33, dtype=torch.float64)
    assert cpu_ops.argmax(x).tolist() == x.argmax(dim=-1).tolist()
    cols = torch.randn(33, 4).t()                     # columns strided: torch's own
    assert cpu_ops.argmax(cols).tolist() == cols.argmax(dim=-1).tolist()


@pytest.mark.parametrize("tokens, inter", [(1, 5), (3, 64), (70, 1536)])
def test_silu_and_mul_matches_torch(ext, tokens, inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(tokens, 2 * inter, generator=g) * 6.0       # both signs, past |x| = 10
    x[0, 0], x[-1, inter - 1] = -100.0, 100.0                    # saturated sigmoid both ways
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up,
                               rtol=1e-6, atol=1e-6)
    view = x[:, : 2 * inter - 2]                                 # rows strided: still one pass
    gate, up = view.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(view), torch.nn.functional.silu(gate) * up,
                               rtol=1e-6, atol=1e-6)
