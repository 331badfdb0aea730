"""Unified varlen attention (mixed decodes + prefill chunks with cached prefixes) vs reference."""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import reference  # noqa: E402
from kvmesh.kernels.prefill_attention import unified_attention  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 4), (8, 2), (8, 1), (6, 2)]          # MHA, GQA 4:1, MQA, GQA 3:1 (non-pow2 group)
# NOTE: (head_dim, block_size) pairs rather than their product keep the interpreter run short
# while every head_dim and every block size is still covered with every dtype and GQA ratio.
SHAPES = [(64, 8), (128, 16), (64, 32)]
SHAPE_IDS = ["d64-bs8", "d128-bs16", "d64-bs32"]


def _mixed_batch(block_size: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens): decodes at 1 / bs-1 / bs / bs+1 / long, a full prefill,
    a chunk after a cached prefix, a prefix hit ending mid-block, the tail of a chunked prefill."""
    bs = block_size
    seq_lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, bs + 3, 2 * bs + 2, bs + 1, 3 * bs + 7]
    query_lens = [1, 1, 1, 1, 1, bs + 3, 5, 2, 2 * bs]
    return query_lens, seq_lens


def _run(kx, case, **tiles):
    meta = case.meta
    k_ref, v_ref = case.clean_caches()
    expected = reference.paged_attention(case.query, k_ref, v_ref, meta, case.scale)
    with kx.poisoned():
        out = unified_attention(case.query, case.k_cache, case.v_cache, meta.query_start_loc,
                                meta.seq_lens, meta.block_tables, case.scale, **tiles)
    kx.assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS, ids=["mha", "gqa4", "mqa", "gqa3"])
@pytest.mark.parametrize("head_dim,block_size", SHAPES, ids=SHAPE_IDS)
def test_mixed_batch_matches_reference(kx, dtype, num_heads, num_kv_heads, head_dim, block_size):
    query_lens, seq_lens = _mixed_batch(block_size)
    case = kx.make_paged_case(query_lens, seq_lens, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim,
                              block_size=block_size, dtype=dtype, seed=block_size * head_dim)
    _run(kx, case, block_m=32, block_n=64)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 128)])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([37], [37]),                    # one pure prefill (num_seqs == 1 is a constexpr on GPU)
    ([20, 0, 1], [50, 9, 9]),        # a sequence with no new tokens this step
    ([3, 17, 1, 16], [3, 17, 40, 16]),
], ids=["single", "empty-seq", "prefills"])
def test_tiling_edges(kx, block_m, block_n, query_lens, seq_lens):
    # block_size 32 with block_n 16: a context tile smaller than a cache block
    case = kx.make_paged_case(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                              block_size=32, dtype=torch.float32, seed=len(seq_lens))
    _run(kx, case, block_m=block_m, block_n=block_n)


def test_strided_query_padded_head_dim(kx):
    query_lens, seq_lens = _mixed_batch(16)
    case = kx.make_paged_case(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=80,
                              block_size=16, dtype=torch.bfloat16, strided_query=True)
    _run(kx, case, block_m=32, block_n=32)


@pytest.mark.parametrize("case_name,match", [
    ("qsl_shape", "num_seqs \\+ 1"),
    ("qsl_dtype", "int32 or int64"),
    ("block_m", "power of two"),
    ("block_m_group", "GQA group"),
    ("cache", "num_blocks, block_size"),
])
def test_unified_rejects_bad_args(kx, case_name, match):
    case = kx.make_paged_case([2, 1], [3, 9], num_heads=8, num_kv_heads=1, head_dim=64,
                              block_size=8, dtype=torch.float32)
    meta = case.meta
    args = dict(query=case.query, k_cache=case.k_cache, v_cache=case.v_cache,
                query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                block_tables=meta.block_tables, scale=case.scale)
    if case_name == "qsl_shape":
        args["query_start_loc"] = meta.query_start_loc[:-1]
    elif case_name == "qsl_dtype":
        args["query_start_loc"] = meta.query_start_loc.float()
    elif case_name == "block_m":
        args["block_m"] = 48
    elif case_name == "block_m_group":
        args["block_m"] = 16
        args["query"] = torch.randn(3, 32, 64)
    elif case_name == "cache":
        args["v_cache"] = case.v_cache[:, :4]
    with pytest.raises(ValueError, match=match):
        unified_attention(**args)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16)])
def test_unmasked_tiles_below_the_diagonal(kx, block_m, block_n):
    """Chunks after cached prefixes of 15 / 16 / 17 / 31 / 32 tokens, some spanning several query
    tiles: the K/V tiles wholly below a query tile's first row run unmasked, the rest masked;
    the boundary between the two loops falls on, before and after a tile edge (fp16: fp32
    keeps one masked loop)."""
    query_lens = [3, 9, 20, 1, 12]
    seq_lens = [15 + 3, 16 + 9, 17 + 20, 31 + 1, 32 + 12]
    case = kx.make_paged_case(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32,
                              block_size=8, dtype=torch.float16, seed=block_m)
    _run(kx, case, block_m=block_m, block_n=block_n)


def test_default_tiles_per_architecture():
    from kvmesh.kernels.prefill_attention import default_tiles
    assert default_tiles(torch.bfloat16, 4, 128) == (64, 32, 4, 2)
    assert default_tiles(torch.bfloat16, 4, 128, arch=90) == (128, 64, 8, 3)
    assert default_tiles(torch.bfloat16, 4, 128, fp8_cache=True) == (64, 32, 8, 2)   # widening's registers
    assert default_tiles(torch.bfloat16, 4, 128, arch=90, fp8_cache=True) == (128, 64, 8, 3)
    assert default_tiles(torch.float16, 4, 256, arch=90) == (64, 32, 8, 2)
    assert default_tiles(torch.float32, 4, 128, arch=90) == (32, 32, 8, 2)
    assert default_tiles(torch.bfloat16, 256, 64, arch=90) == (256, 64, 8, 3)
