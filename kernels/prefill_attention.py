"""Triton unified varlen attention on the paged cache: prefill chunks, prefix hits and decodes.

Every sequence's new tokens sit at the end of its context (cached prefix + this step's tokens,
already written to the cache), and attention is causal over absolute positions. One kernel
serves a mixed batch: a decode is a chunk of length 1.

Tiling. A program owns one KV head and a tile of BLOCK_Q query tokens of one sequence; its
BLOCK_M = BLOCK_Q * BLOCK_G rows are (token, query head of the group) pairs, so every K/V tile
is read once for the whole GQA group and tl.dot sees >= 16 rows even for decodes. The grid's
first axis is an upper bound on the number of query tiles, num_tokens // BLOCK_Q + num_seqs,
known on the host without a device sync; sequence s owns tiles starting at
query_start_loc[s] // BLOCK_Q + s (a binary search finds it) and surplus tiles return at once.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from kvmesh.kernels.fp8_codes import kv_read
from kvmesh.kernels.kv_cache_dtype import is_fp8
from kvmesh.kernels.paged_attention import (check_attention_args, check_window_softcap, device_arch,
                                            dot_precision, load_kv_tile, online_softmax_step, tanh,
                                            upcast_operands)

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest s with query_start_loc[s] // BLOCK_Q + s <= tile (binary search)."""
    # NOTE: typed scalars, not Python ints: num_seqs == 1 is specialised to a constexpr and the
    # loop then never runs, yet the result must still be a tensor.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        go_right = first <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


# NOTE: the number of sequences and the block tables' row stride (their width) change from step
# to step: not specialised (== 1 / divisible by 16), so a step never compiles a new variant.
@triton.jit(do_not_specialize=["num_seqs", "stride_bts"])
def _unified_attention_kernel(
    q_ptr,                  # [num_tokens, num_heads, head_dim], packed by query_start_loc
    k_cache_ptr,            # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,            # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,                # [num_tokens, num_heads, head_dim]
    block_tables_ptr,       # [num_seqs, max_blocks] int32/int64
    seq_lens_ptr,           # [num_seqs] context length incl. this step's tokens
    query_start_loc_ptr,    # [num_seqs + 1] cu_seqlens of the packed queries
    num_seqs,
    qk_scale,               # softmax scale * log2(e)
    window,                 # sliding window W: a query sees the last W positions; 0 = all
    softcap_log2,           # soft-cap * log2(e) (read only when USE_SOFTCAP)
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btb,
    GROUP: tl.constexpr,        # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,   # tokens per cache block
    BLOCK_G: tl.constexpr,      # GROUP padded to a power of two
    BLOCK_Q: tl.constexpr,      # query tokens per program
    BLOCK_M: tl.constexpr,      # BLOCK_Q * BLOCK_G rows per program
    BLOCK_D: tl.constexpr,      # HEAD_DIM padded to a power of two
    BLOCK_N: tl.constexpr,      # context tokens per loop iteration
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,       # fp32 tl.dot operands (interpreter); else native 16-bit operands
    USE_SOFTCAP: tl.constexpr,  # score = cap * tanh(score / cap) (Gemma 2)
    NUM_STAGES: tl.constexpr,   # software-pipelining depth of the K/V loops
    UNMASKED_LOOP: tl.constexpr,  # run the tiles below the diagonal without masks (16-bit)
    KV_CODE: tl.constexpr,      # 0: the caches hold the query's dtype; 1 / 2: e4m3fn / e5m2 bytes;
                                # 3 / 4: converted natively (fp8_codes.kv_read)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix = seq_len - q_len              # tokens of context before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // BLOCK_G          # query index within the sequence
    g = rows % BLOCK_G
    row_mask = (q_idx < q_len) & (g < GROUP)
    token = (q_start + q_idx).to(tl.int64)
    head = kv_head * GROUP + g
    row_pos = prefix + q_idx                              # absolute position of each row
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]

    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    # the last query of this tile sees positions < kv_end; later context is never loaded
    kv_end = tl.minimum(prefix + (q_tile + 1) * BLOCK_Q, seq_len)
    # with a window W a row at position p sees p - W + 1 .. p; the tile's first query bounds the
    # context from below, so earlier positions are never loaded (win > any position when W = 0)
    win = tl.where(window > 0, window, seq_len + 1)
    kv_start = tl.maximum(prefix + q_tile * BLOCK_Q - win + 1, 0)

    # NOTE: without a window, every row of the tile sees every position up to its first row's
    # (prefix + q_tile * BLOCK_Q): the tiles wholly below it (a cached prefix, and the chunk's
    # earlier query tiles) need no mask at all; only the tiles that reach the causal diagonal do
    full_end = kv_start
    if UNMASKED_LOOP:
        first_pos = prefix + q_tile * BLOCK_Q
        full_end = tl.where(window > 0, kv_start,
                            kv_start + (first_pos + 1 - kv_start) // BLOCK_N * BLOCK_N)
        for n0 in tl.range(kv_start, full_end, BLOCK_N, num_stages=NUM_STAGES):
            _, _, k, v = load_kv_tile(table_row, stride_btb, k_base, v_base, stride_kb, stride_ks,
                                      stride_kd, stride_vb, stride_vs, stride_vd, offs_d, d_mask,
                                      n0, kv_end, q, BLOCK_N, BLOCK_SIZE, UPCAST, KV_CODE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            if USE_SOFTCAP:
                s = softcap_log2 * tanh(s / softcap_log2)
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)

    for n0 in tl.range(full_end, kv_end, BLOCK_N, num_stages=NUM_STAGES):
        pos, valid, k, v = load_kv_tile(table_row, stride_btb, k_base, v_base, stride_kb, stride_ks,
                                        stride_kd, stride_vb, stride_vs, stride_vd, offs_d, d_mask,
                                        n0, kv_end, q, BLOCK_N, BLOCK_SIZE, UPCAST, KV_CODE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if USE_SOFTCAP:
            s = softcap_log2 * tanh(s / softcap_log2)     # log2 domain: cap * tanh(x * scale / cap)
        allowed = valid[None, :] & (pos[None, :] <= row_pos[:, None]) & (pos[None, :] > row_pos[:, None] - win)
        # NOTE: a real row always sees its own position, but with a window a padding row (past
        # q_len) or a row whose window starts after this tile can be fully masked in a tile
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def default_tiles(dtype: torch.dtype, block_g: int, head_dim: int,
                  arch: int = 80, fp8_cache: bool = False) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) that compile without register spills for
    sm_<arch> (80: A100-class, also the default off CUDA; 90: H100/H200).

    NOTE: found by compiling for both targets (kernels/gpu_compile.py, docs/KERNELS.md): with
    head_dim 128, 64 x 64 tiles spill on sm_80 in 16-bit (48 B) and badly in fp32 (fp32 operands
    take twice the registers: 2.6-10 KB of stack); 64 x 32 in 16-bit and 32 x 32 with 8 warps in
    fp32 fit in registers on both. head_dim 256 (Gemma 2) needs 8 warps in 16-bit and 32 x 16
    tiles in fp32. On sm_90, 16-bit and head_dim <= 128: 128 x 64 tiles with 8 warps and 3
    pipeline stages (the fused-attention tutorial's Hopper shape) fit: ~220 registers, 96 KiB of
    its 228 KiB of shared memory; twice the rows per K/V tile halves the K/V traffic.
    An 8-bit cache's widening needs registers of its own: on sm_80 its 16-bit tiles take 8
    warps (at head_dim 128 and 4 warps: 255 registers and 8 B of stack for e5m2 codes).
    """
    wide = head_dim > 128
    if dtype == torch.float32:
        return max(32, block_g), 16 if wide else 32, 8, 2
    if arch >= 90 and not wide:
        return max(128, block_g), 64, 8, 3
    return max(64, block_g), 32, 8 if wide or fp8_cache else 4, 2


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim] (any strides)
    k_cache: torch.Tensor,          # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,          # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64
    seq_lens: torch.Tensor,         # [num_seqs] int32/int64
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32/int64
    scale: float,
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    arch: int | None = None,
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Causal varlen attention of a mixed batch over the paged cache (K/V already written).

    `block_m` is the number of (query token, head) rows per program; it must be a power of two
    >= 16 and >= the padded GQA group size; unset tiles come from `default_tiles` for `arch`
    (default: the query's device). `sliding_window`
    W > 0: each query sees the last W positions (itself included); `softcap` > 0: scores become
    cap * tanh(score / cap). The caches hold the query's dtype, or 8-bit float codes.
    """
    group, block_size = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens)
    check_window_softcap(sliding_window, softcap)
    arch = device_arch(query.device) if arch is None else arch
    dm, dn, dw, ds = default_tiles(query.dtype, triton.next_power_of_2(group), query.shape[2], arch,
                                   fp8_cache=is_fp8(k_cache.dtype))
    block_m, block_n = block_m or dm, block_n or dn
    num_warps, num_stages = num_warps or dw, num_stages or ds
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_start_loc must be int32 or int64, got {query_start_loc.dtype}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], "
                         f"got {tuple(query_start_loc.shape)}")
    if query_start_loc.device != query.device:
        raise ValueError("query_start_loc must be on the query's device")
    block_g = triton.next_power_of_2(group)
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    if block_m < block_g:
        raise ValueError(f"block_m {block_m} must be >= the padded GQA group size {block_g}")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q = block_m // block_g
    grid = (num_tokens // block_q + num_seqs, k_cache.shape[2])
    (k_read, kv_code), (v_read, _) = kv_read(k_cache, arch), kv_read(v_cache, arch)
    _unified_attention_kernel[grid](
        query, k_read, v_read, out, block_tables, seq_lens, query_start_loc,
        num_seqs, scale * _LOG2E, int(sliding_window), float(softcap or 1.0) * _LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *block_tables.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=block_g, BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype), UPCAST=upcast_operands(query),
        USE_SOFTCAP=softcap > 0, NUM_STAGES=num_stages,
        # NOTE: fp32 tiles with a second loop body spill on sm_90 (200-344 B at head_dim 128,
        # gpu_compile): fp32 (a correctness dtype on GPUs) keeps the one masked loop
        UNMASKED_LOOP=query.dtype != torch.float32, KV_CODE=kv_code,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
