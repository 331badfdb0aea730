"""A packed attention batch over a random paged cache, for the CPU kernel tests."""
from __future__ import annotations

import torch

from kvmesh.kernels.metadata import AttentionMetadata


def paged_batch(query_lens, seq_lens, *, heads: int, kv_heads: int, dim: int, block: int,
                num_blocks: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(query, k_cache, v_cache, meta): blocks shuffled (not in order); `num_blocks` None means
    just enough for `seq_lens` plus three spare."""
    g = torch.Generator().manual_seed(seed)
    if num_blocks is None:
        num_blocks = sum(-(-n // block) for n in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in seq_lens:
        need = -(-n // block)
        tables.append(perm[:need])
        perm = perm[need:]
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, block)
    query = torch.randn(sum(query_lens), heads, dim, generator=g).to(dtype)
    return query, k_cache, v_cache, meta
