"""Builders shared by the kernel tests: random paged caches, poisoned allocations, tolerances."""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvmesh.kernels.metadata import AttentionMetadata

TOLERANCES = {  # (atol, rtol) per dtype
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not torch.isnan(actual).any(), "kernel left unwritten (NaN-poisoned) elements"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@contextlib.contextmanager
def poisoned_allocations():
    """Inside: torch.empty / empty_like return NaN-filled float tensors.

    Catches kernels that leave parts of their outputs (or scratch buffers) unwritten.
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


@dataclass
class PagedCase:
    query: torch.Tensor      # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor    # NaN in every slot outside a sequence's context
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def clean_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference gathers padding slots and multiplies them by 0, so it needs no NaN."""
        return self.k_cache.nan_to_num(0.0), self.v_cache.nan_to_num(0.0)


def make_paged_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    strided_query: bool = False,
) -> PagedCase:
    """Random out-of-order block tables (some with spare blocks), block 0 never used.

    With strided_query the query is a view into a wider fused-QKV-like buffer.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    spare = [rng.randint(0, 1) for _ in seq_lens]
    num_blocks = 1 + sum(need) + sum(spare) + 3
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)
    tables = []
    for n, extra in zip(need, spare):
        tables.append([pool.pop() for _ in range(n + extra)])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for s_len, table in zip(seq_lens, tables):
        for pos in range(s_len):
            b, o = table[pos // block_size], pos % block_size
            k_cache[b, o] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[b, o] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    num_tokens = sum(query_lens)
    if strided_query:
        fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
        query = fused.to(dtype)[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        assert not query.is_contiguous()
    else:
        query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return PagedCase(query, k_cache, v_cache, meta, head_dim ** -0.5)


@pytest.fixture
def kx():
    """The helpers above (test modules cannot import conftest under --import-mode=importlib)."""
    return SimpleNamespace(assert_close=assert_close, poisoned=poisoned_allocations,
                           make_paged_case=make_paged_case, tolerances=TOLERANCES)
