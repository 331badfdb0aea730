"""Split-K paged decode attention against the reference's decode path."""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import reference  # noqa: E402
from kvmesh.kernels.paged_attention import paged_decode_attention  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 4), (8, 2), (8, 1), (6, 2)]          # MHA, GQA 4:1, MQA, GQA 3:1 (non-pow2 group)
# NOTE: (head_dim, block_size) pairs rather than their product keep the interpreter run short
# while every head_dim and every block size is still covered with every dtype and GQA ratio.
SHAPES = [(64, 8), (128, 16), (64, 32)]
SHAPE_IDS = ["d64-bs8", "d128-bs16", "d64-bs32"]


def _context_lens(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 4 * block_size + 5]


def _run(kx, case, **tiles):
    meta = case.meta
    k_ref, v_ref = case.clean_caches()
    expected = reference.paged_attention(case.query, k_ref, v_ref, meta, case.scale)
    with kx.poisoned():
        out = paged_decode_attention(case.query, case.k_cache, case.v_cache, meta.block_tables,
                                     meta.seq_lens, meta.max_seq_len, case.scale, **tiles)
    kx.assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS, ids=["mha", "gqa4", "mqa", "gqa3"])
@pytest.mark.parametrize("head_dim,block_size", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(kx, dtype, num_heads, num_kv_heads, head_dim, block_size,
                                  num_splits):
    lens = _context_lens(block_size)
    case = kx.make_paged_case([1] * len(lens), lens, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim,
                              block_size=block_size, dtype=dtype, seed=block_size + head_dim)
    _run(kx, case, num_splits=num_splits, block_n=32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_decode_long_context_split_k(kx, dtype, num_splits):
    # more splits than some sequences have tiles: empty splits must merge as zero weight
    lens = [1000, 37, 3]
    case = kx.make_paged_case([1] * 3, lens, num_heads=4, num_kv_heads=2, head_dim=64,
                              block_size=16, dtype=dtype, seed=num_splits)
    _run(kx, case, num_splits=num_splits, block_n=128)


def test_decode_strided_query_padded_head_dim_int64_indices(kx):
    lens = [5, 70, 33]
    # block_size 32 with block_n 16: a context tile smaller than a cache block
    case = kx.make_paged_case([1] * 3, lens, num_heads=4, num_kv_heads=2, head_dim=80,
                              block_size=32, dtype=torch.float16, strided_query=True)
    case.meta.block_tables = case.meta.block_tables.long()
    case.meta.seq_lens = case.meta.seq_lens.long()
    _run(kx, case, num_splits=2, block_n=16)


@pytest.mark.parametrize("case_name,match", [
    ("dtype", "both hold the query.s dtype or both 8-bit float codes"),
    ("heads", "multiple of num_kv_heads"),
    ("head_dim", "head_dim"),
    ("index_dtype", "int32 or int64"),
    ("block_n", "power of two"),
    ("num_seqs", "one query per sequence"),
])
def test_decode_rejects_bad_args(kx, case_name, match):
    case = kx.make_paged_case([1, 1], [3, 9], num_heads=4, num_kv_heads=2, head_dim=64,
                              block_size=8, dtype=torch.float32)
    q, kc, vc, meta = case.query, case.k_cache, case.v_cache, case.meta
    bt, sl, tiles = meta.block_tables, meta.seq_lens, {}
    if case_name == "dtype":
        q = q.half()
    elif case_name == "heads":
        q = torch.randn(2, 3, 64)
    elif case_name == "head_dim":
        q = torch.randn(2, 4, 32)
    elif case_name == "index_dtype":
        bt = bt.float()
    elif case_name == "block_n":
        tiles = {"block_n": 24}
    elif case_name == "num_seqs":
        q = torch.randn(3, 4, 64)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(q, kc, vc, bt, sl, meta.max_seq_len, case.scale, **tiles)
