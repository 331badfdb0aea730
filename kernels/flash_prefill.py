"""Prefill chunks with no cached prefix on torch's flash attention; the rest on the unified kernel.

A chunk whose context is only its own tokens (query_len == seq_len: a first chunk, no prefix
hit) is plain causal attention over the chunk, which torch's FlashAttention kernels do faster
than the Triton unified kernel (issue 30 measured 1.9-2.3x at 1x8192 .. 32x512). For a batch
that is not all-decode, `prefill_attention` sends those sequences to

  * "varlen": `torch.nn.attention.varlen.varlen_attn` over the packed chunks (one launch), or
  * "sdpa": `scaled_dot_product_attention` per sequence (flash backend on CUDA, math on CPU),

and every other sequence (a chunk after a cached prefix, a decode mixed in) as its own batch to
the Triton unified kernel, then assembles the output rows in the step's order. The chunk's K/V
are read back from the cache (one gather of its slots: `write_kv_cache` ran first, and an 8-bit
cache's codes are widened to the query's dtype) so the ops interface stays the reference's.

Flash applies to fp16/bf16, head_dim <= 256 (a multiple of 8), no soft-cap; a sliding window
only with "varlen" (its `window_size`). Anything else, and every step off CUDA (unless a test
names an impl), runs the unified kernel alone, as before.
"""
from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.kernels.metadata import AttentionMetadata

IMPLS = ("varlen", "sdpa")


@dataclass(slots=True)
class PrefillRoute:
    """Which sequences of one step go to flash and which to the unified kernel."""
    flash_seqs: list[int]               # sequences with no cached prefix (query_len == seq_len)
    flash_tokens: torch.Tensor | None   # [Tf] their token rows; None: every row of the step
    flash_cu: torch.Tensor              # [F + 1] int32 cu_seqlens of their chunks packed
    flash_max_len: int
    rest_tokens: torch.Tensor | None    # [Tr] the other rows; None when there are none
    rest_meta: AttentionMetadata | None  # the other sequences as a batch of their own


def split_sequences(query_lens: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
    """(sequences with no cached prefix, the others), each in step order."""
    fresh = [i for i, (q, s) in enumerate(zip(query_lens, seq_lens)) if q == s and q > 0]
    taken = set(fresh)
    return fresh, [i for i in range(len(query_lens)) if i not in taken]


def _rows(seqs: list[int], starts: list[int], lens: list[int]) -> list[int]:
    return [t for i in seqs for t in range(starts[i], starts[i] + lens[i])]


def build_route(meta: AttentionMetadata) -> PrefillRoute | None:
    """The route of a step (None: no sequence for flash)."""
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    fresh, rest = split_sequences(q_lens, s_lens)
    if not fresh:
        return None
    device = meta.query_start_loc.device
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    cu = [0]
    for i in fresh:
        cu.append(cu[-1] + q_lens[i])
    flash_cu = torch.tensor(cu, dtype=torch.int32, device=device)
    max_len = max(q_lens[i] for i in fresh)
    if not rest:
        return PrefillRoute(fresh, None, flash_cu, max_len, None, None)
    flash_tokens = torch.tensor(_rows(fresh, starts, q_lens), dtype=torch.int64, device=device)
    rest_tokens = torch.tensor(_rows(rest, starts, q_lens), dtype=torch.int64, device=device)
    rest_idx = torch.tensor(rest, dtype=torch.int64, device=device)
    rest_cu = [0]
    for i in rest:
        rest_cu.append(rest_cu[-1] + q_lens[i])
    rest_q, rest_s = [q_lens[i] for i in rest], [s_lens[i] for i in rest]
    rest_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping.index_select(0, rest_tokens),
        query_start_loc=torch.tensor(rest_cu, dtype=torch.int32, device=device),
        seq_lens=meta.seq_lens.index_select(0, rest_idx),
        block_tables=meta.block_tables.index_select(0, rest_idx),
        max_query_len=max(rest_q), max_seq_len=max(rest_s),
        query_lens_cpu=rest_q, seq_lens_cpu=rest_s, sliding_window=meta.sliding_window)
    return PrefillRoute(fresh, flash_tokens, flash_cu, max_len, rest_tokens, rest_meta)


# NOTE: as the reference's plan cache: built by the first layer of a step, reused by the rest
# (a window view of the step is another metadata object and gets its own).
_routes: list[tuple[AttentionMetadata, PrefillRoute | None]] = []
_ROUTES = 4


def _route(meta: AttentionMetadata) -> PrefillRoute | None:
    for m, route in _routes:
        if m is meta:
            return route
    route = build_route(meta)
    _routes.append((meta, route))
    del _routes[:-_ROUTES]
    return route


@functools.lru_cache(maxsize=8)
def default_impl(device: torch.device) -> str | None:
    """The flash implementation a CUDA device runs (None: none, everything on Triton).
    `KVMESH_FLASH_PREFILL` = varlen | sdpa | off overrides the choice (for A/B measurements)."""
    forced = os.environ.get("KVMESH_FLASH_PREFILL", "")
    if forced in ("off", "0"):
        return None
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return None
    if forced in IMPLS:
        return forced
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401, PLC0415
    except ImportError:
        return "sdpa"
    return "varlen"


@functools.lru_cache(maxsize=1)
def varlen_keywords() -> frozenset[str]:
    """The keywords this torch's `varlen_attn` takes: torch 2.11's has no `enable_gqa` (the K/V
    heads are then repeated here). Its causal mask is `window_size` (-1, 0): a torch without it
    sends nothing to "varlen"."""
    from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415
    return frozenset(inspect.signature(varlen_attn).parameters)


def eligible(query: torch.Tensor, softcap: float, window: int, impl: str | None) -> bool:
    """Whether this layer's fresh chunks can go to flash with `impl`."""
    head_dim = query.shape[2]
    return (impl in IMPLS and query.dtype in (torch.float16, torch.bfloat16) and softcap == 0
            and head_dim <= 256 and head_dim % 8 == 0
            and (impl == "sdpa" and window == 0 or impl == "varlen" and "window_size" in varlen_keywords()))


def _flash(impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
           cu_host: list[int], max_len: int, scale: float, window: int) -> torch.Tensor:
    """Causal attention of packed chunks q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
    if impl == "varlen":
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415
        # NOTE: window_size is (left, right), the causal mask with right 0; a query sees itself
        # and W - 1 positions before it (left -1: all of them)
        extra = {"window_size": (window - 1 if window else -1, 0)}
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in varlen_keywords():
                extra["enable_gqa"] = True
            else:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **extra)
    out = torch.empty_like(q)
    for lo, hi in zip(cu_host[:-1], cu_host[1:]):
        o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1)[None], k[lo:hi].transpose(0, 1)[None],
                                           v[lo:hi].transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, softcap: float, unified,
                      impl: str | None) -> torch.Tensor | None:
    """The step's attention with its fresh chunks on flash (`impl`), the rest through `unified`
    (the unified kernel's signature); None when nothing goes to flash (the caller runs the
    unified kernel on the whole step)."""
    if not eligible(query, softcap, meta.sliding_window, impl):
        return None
    route = _route(meta)
    if route is None:
        return None
    slots = meta.slot_mapping if route.flash_tokens is None else meta.slot_mapping.index_select(
        0, route.flash_tokens)
    # [Tf, KVH, D]: the chunks' own K/V (8-bit codes widened exactly to the query's dtype)
    k = k_cache.flatten(0, 1).index_select(0, slots).to(query.dtype)
    v = v_cache.flatten(0, 1).index_select(0, slots).to(query.dtype)
    q = query if route.flash_tokens is None else query.index_select(0, route.flash_tokens)
    cu_host = [0]
    for i in route.flash_seqs:
        cu_host.append(cu_host[-1] + meta.query_lens_cpu[i])
    flash_out = _flash(impl, q, k, v, route.flash_cu, cu_host, route.flash_max_len, scale,
                       meta.sliding_window)
    if route.rest_meta is None:
        return flash_out
    rm = route.rest_meta
    rest_out = unified(query.index_select(0, route.rest_tokens), k_cache, v_cache,
                       rm.query_start_loc, rm.seq_lens, rm.block_tables, scale,
                       sliding_window=rm.sliding_window, softcap=softcap)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    out.index_copy_(0, route.flash_tokens, flash_out)
    out.index_copy_(0, route.rest_tokens, rest_out)
    return out
