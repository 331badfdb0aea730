"""Triton paged decode attention: one query token per sequence, split-K (flash-decoding) + reduce.

Grid of the main kernel: (num_seqs, num_kv_heads, num_splits). A program owns every query head
of one KV-head group (so each K/V tile is loaded once for the whole group) and one contiguous
slice of its sequence's context. With num_splits > 1 each program writes a
partial (its own softmax-normalised output and its log-sum-exp) and a second kernel merges the
splits, weighting each by exp(lse - max lse). A sequence uses only as many splits as its context
fills at `min_split_tokens` each; one that uses one writes its output directly and the merge
skips it (so a CUDA graph's fixed split count costs little at short context). How many splits,
and the preallocated partials: `decode_plan.py`.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kvmesh.kernels.decode_plan import DEFAULT_MIN_SPLIT_TOKENS, DecodeWorkspace, decode_splits
from kvmesh.kernels.fp8_codes import kv_read, widen_codes
from kvmesh.kernels.kv_cache_dtype import is_fp8

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(table_row, stride_btb, k_base, v_base, stride_kb, stride_ks, stride_kd,
                 stride_vb, stride_vs, stride_vd, offs_d, d_mask, n0, end, q,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr,
                 KV_CODE: tl.constexpr):
    """Positions n0 .. n0+BLOCK_N of one sequence's K and V, read through its block table.

    Returns (pos [BLOCK_N], valid [BLOCK_N], k [BLOCK_N, D], v [BLOCK_N, D]); invalid rows are 0.
    An 8-bit cache (KV_CODE 1 / 2 read as bytes, 3 / 4 as fp8, fp8_codes.kv_read) is widened to
    the dtype of `q`, the program's query tile, which the tiles meet in tl.dot. Shared by the
    decode and the unified kernels.
    """
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_btb, mask=valid, other=0)
    block = block.to(tl.int64)
    offset = pos % BLOCK_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_base + block[:, None] * stride_kb + offset[:, None] * stride_ks
                + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_base + block[:, None] * stride_vb + offset[:, None] * stride_vs
                + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if KV_CODE >= 3:               # fp8 tiles: the GPU's conversion, exact into bf16 / fp16 / fp32
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    elif KV_CODE != 0:
        k = widen_codes(k, KV_CODE).to(q.dtype)
        v = widen_codes(v, KV_CODE).to(q.dtype)
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return pos, valid, k, v


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION: tl.constexpr):
    """Fold one K/V tile into flash attention's running state (log2 domain): s [M, N] are the
    tile's scaled scores, -inf where a row may not look; v [N, D]. Returns (m_i, l_i, acc).
    Shared by the decode and the unified kernels.

    NOTE: a row can be fully masked in a tile (with a sliding window, or a padding row): a
    finite stand-in for its -inf max keeps alpha and p at 0 instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def tanh(x):
    """tanh from exp2 (no libdevice call, so it runs in the interpreter and on any GPU)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))    # exp(-2|x|), in (0, 1]: no overflow
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _split_range(seq_len, window, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 MIN_CHUNK: tl.constexpr):
    """(start, end, active) of one split of a decode query's context: positions start .. end - 1
    of the `active` splits this sequence uses (the rest are empty). Shared by both kernels."""
    # NOTE: the query (position seq_len - 1) sees positions lo .. seq_len - 1: all of them, or
    # with a window W the last W. Only that span is split and loaded, so a windowed decode reads
    # W tokens whatever the context length.
    lo = tl.maximum(seq_len - tl.where(window > 0, window, seq_len), 0)
    # NOTE: each sequence is cut into equal slices of *its own* span (rounded to BLOCK_N, so
    # splits of short and long sequences in one batch carry balanced work), none shorter than
    # MIN_CHUNK: a short context uses fewer splits than NUM_SPLITS (a CUDA graph fixes
    # NUM_SPLITS at the longest context) and with one it skips the partials and the merge.
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    active = tl.maximum(tl.cdiv(seq_len - lo, chunk), 1)
    start = lo + split * chunk
    return start, tl.minimum(start + chunk, seq_len), active


# NOTE: the block tables' row stride is their width, which changes from step to step in eager
# mode: not specialised (== 1 / divisible by 16), so a step never compiles a new variant.
@triton.jit(do_not_specialize=["stride_bts"])
def _decode_split_kernel(
    q_ptr,              # [num_seqs, num_heads, head_dim]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,   # [num_seqs, max_blocks] int32/int64
    seq_lens_ptr,       # [num_seqs] int32/int64
    out_ptr,            # [num_seqs, num_heads, head_dim] (query dtype): a one-split sequence's output
    part_ptr,           # [num_seqs, num_heads, NUM_SPLITS, head_dim] fp32 partials (NUM_SPLITS > 1)
    lse_ptr,            # [num_seqs, num_heads, NUM_SPLITS] fp32 (log2 domain); unused if 1 split
    qk_scale,           # softmax scale * log2(e)
    window,             # sliding window W: attend to the last W positions; 0 = the whole context
    softcap_log2,       # soft-cap * log2(e) (read only when USE_SOFTCAP)
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pp, stride_pd,
    stride_ls, stride_lh,
    GROUP: tl.constexpr,        # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,   # tokens per cache block
    BLOCK_G: tl.constexpr,      # GROUP padded to a power of two >= 16 (tl.dot rows)
    BLOCK_D: tl.constexpr,      # HEAD_DIM padded to a power of two
    BLOCK_N: tl.constexpr,      # context tokens per loop iteration
    NUM_SPLITS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,    # fewest tokens of a split (a multiple of BLOCK_N)
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,       # fp32 tl.dot operands (interpreter); else native 16-bit operands
    USE_SOFTCAP: tl.constexpr,  # score = cap * tanh(score / cap) (Gemma 2)
    KV_CODE: tl.constexpr,      # 0: the caches hold the query's dtype; 1 / 2: e4m3fn / e5m2 bytes;
                                # 3 / 4: e4m3fn / e5m2 caches converted natively (fp8_codes.kv_read)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start, end, active = _split_range(seq_len, window, split, NUM_SPLITS, BLOCK_N, MIN_CHUNK)
    if split >= active:
        return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh

    for n0 in range(start, end, BLOCK_N):
        pos, valid, k, v = load_kv_tile(table_row, stride_btb, k_base, v_base, stride_kb, stride_ks,
                                        stride_kd, stride_vb, stride_vs, stride_vd, offs_d, d_mask,
                                        n0, end, q, BLOCK_N, BLOCK_SIZE, UPCAST, KV_CODE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        if USE_SOFTCAP:
            s = softcap_log2 * tanh(s / softcap_log2)     # log2 domain: cap * tanh(x * scale / cap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    if NUM_SPLITS == 1:       # compiled without the partials' path
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    elif active == 1:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        p_ptrs = (part_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_pp
                  + offs_d[None, :] * stride_pd)
        tl.store(p_ptrs, out, mask=o_mask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_ptr,           # [num_seqs, num_heads, NUM_SPLITS, head_dim] fp32
    lse_ptr,            # [num_seqs, num_heads, NUM_SPLITS] fp32 (log2 domain, -inf = empty split)
    out_ptr,            # [num_seqs, num_heads, head_dim]
    seq_lens_ptr,       # [num_seqs] int32/int64: which splits each sequence used
    window,             # as the split kernel's
    stride_ps, stride_ph, stride_pp, stride_pd,
    stride_ls, stride_lh,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,      # NUM_SPLITS padded to a power of two
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,      # the split kernel's, to find each sequence's active splits
    MIN_CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    _, _, active = _split_range(seq_len, window, 0, NUM_SPLITS, BLOCK_N, MIN_CHUNK)
    if active == 1:           # the split kernel wrote this sequence's output itself
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # NOTE: only the active splits wrote partials: the workspace is reused, never cleared, so
    # the rest hold another step's values and are not read
    s_mask = offs_s < active
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)      # an empty sequence merges to zeros, not NaN
    w = tl.exp2(lse - m)                          # [BLOCK_S]; 0 for empty splits
    part = tl.load(part_ptr + seq * stride_ps + head * stride_ph + offs_s[:, None] * stride_pp
                   + offs_d[None, :] * stride_pd, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    # NOTE: empty splits hold 0 (never NaN) and weigh 0, so no masking of part is needed here.
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def check_attention_args(query, k_cache, v_cache, block_tables, seq_lens) -> tuple[int, int]:
    """Validate what every attention launcher shares; return (group, block_size)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], "
                         f"got {tuple(query.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query dtype must be fp16, bf16 or fp32, got {query.dtype}")
    if k_cache.dtype != v_cache.dtype or not (k_cache.dtype == query.dtype or is_fp8(k_cache.dtype)):
        raise ValueError(f"the caches must both hold the query's dtype or both 8-bit float codes, "
                         f"got {query.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if block_tables.dim() != 2 or seq_lens.dim() != 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks] and seq_lens [num_seqs], "
                         f"got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    devices = {t.device for t in (query, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return num_heads // num_kv_heads, k_cache.shape[1]


def check_window_softcap(sliding_window: int, softcap: float) -> None:
    if not isinstance(sliding_window, int) or sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 0 (0 = full attention), got {sliding_window!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap!r}")


def dot_precision(dtype: torch.dtype) -> str:
    # NOTE: only fp32 operands read this; an fp32 cache asks for full ieee products, not tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_operands(query: torch.Tensor) -> bool:
    """Whether tl.dot gets fp32 operands instead of the native fp16/bf16 tiles.

    NOTE: on a GPU the 16-bit tiles go straight to the tensor cores (fp32 accumulate), which
    halves the registers a K/V tile takes. The interpreter stores bf16 as 16-bit integers and
    cannot do arithmetic on them, so there every tile is upcast right after loading; the two
    paths differ only in the operand dtype of the two tl.dot calls.
    """
    return query.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                       *, min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS) -> int:
    """`decode_plan.decode_splits` for this device; 1 off CUDA (the interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 1
    return decode_splits(max(1, num_seqs), num_kv_heads, max(1, max_seq_len),
                         num_sms(device.index or 0), min_split_tokens=min_split_tokens)


def device_arch(device: torch.device) -> int:
    """sm_<major><minor> of a CUDA device as an int (90 for 9.0); 80 off CUDA."""
    return _cuda_arch(device.index or 0) if device.type == "cuda" else 80


@functools.lru_cache(maxsize=8)
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim] (any strides)
    k_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,      # [num_seqs] int32/int64, each >= 1
    max_seq_len: int,
    scale: float,
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
    num_splits: int | None = None,
    min_split_tokens: int | None = None,
    workspace: DecodeWorkspace | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    arch: int | None = None,
) -> torch.Tensor:               # [num_seqs, num_heads, head_dim]
    """One query token per sequence against its paged context (flash-decoding when split).
    The caches hold the query's dtype, or 8-bit float codes (`--kv-cache-dtype fp8`).

    `sliding_window` W > 0: the query sees the last W positions (itself included); `softcap`
    > 0: scores become cap * tanh(score / cap) before the softmax. `num_splits` (default: the
    rule of `decode_plan.decode_splits`) is the most splits a sequence uses; each split is at
    least `min_split_tokens` long (default: `block_n`, i.e. every sequence uses all
    `num_splits`), so a sequence shorter than that takes one split and is written directly.
    `workspace`: preallocated partials (else allocated per call when split). `arch`: the
    sm_<arch> an 8-bit cache is read for (default: the query's device; fp8_codes.kv_read).
    """
    group, block_size = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens)
    check_window_softcap(sliding_window, softcap)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"decode needs one query per sequence: {num_seqs} queries, "
                         f"{seq_lens.shape[0]} sequences")
    # NOTE: fp32 K/V tiles take twice the registers: 64 tokens x head_dim 128 with 4 warps spill
    # (152-680 B of stack on sm_80 / sm_90, kernels/gpu_compile.py); 32 tokens with 8 warps do not.
    fp32 = query.dtype == torch.float32
    # NOTE: so do 8-bit K/V tiles at head_dim 256 (their widening's temporaries: 16-56 B of
    # stack on sm_80 / sm_90 at 64 tokens and 4 warps, 8 B at 32)
    wide_codes = is_fp8(k_cache.dtype) and head_dim > 128
    arch = device_arch(query.device) if arch is None else arch
    (k_read, kv_code), (v_read, _) = kv_read(k_cache, arch), kv_read(v_cache, arch)
    # NOTE: fp8 tiles converted natively take 128 tokens: a 64-token tile is half the bytes in
    # flight of a bf16 one, and read at ~1.5 TB/s on an H100 against bf16's ~3 (0.88-0.98x its
    # time at batch 64); 128 tokens and 4 warps: 0.65-0.75x (8 warps 0.71-0.83x, 256 tokens
    # slower than bf16; docs/BENCHMARKS.md, "The 8-bit KV cache on an H100")
    native_fp8 = kv_code >= 3
    block_n = block_n or (32 if fp32 or wide_codes else 128 if native_fp8 else 64)
    num_warps = num_warps or (8 if fp32 or wide_codes else 4)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if min_split_tokens is not None and min_split_tokens < 1:
        raise ValueError(f"min_split_tokens must be >= 1, got {min_split_tokens}")
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device,
                                        min_split_tokens=min_split_tokens or DEFAULT_MIN_SPLIT_TOKENS)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    min_chunk = triton.cdiv(min_split_tokens or block_n, block_n) * block_n
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out

    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))   # tl.dot needs K >= 16
    if num_splits == 1:
        part, lse = out, out          # neither is touched with one split
        part_strides = (0, 0, 0, 0)
        lse_strides = (0, 0)
    else:
        if workspace is not None:
            part, lse = workspace.views(num_seqs, num_heads, num_splits, head_dim)
        else:
            part = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=query.device)
            lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                              device=query.device)
        part_strides = part.stride()
        lse_strides = lse.stride()[:2]
    window = int(sliding_window)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_read, v_read, block_tables, seq_lens, out, part, lse,
        scale * _LOG2E, window, float(softcap or 1.0) * _LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *out.stride(), *part_strides, *lse_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=block_g, BLOCK_D=block_d,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, MIN_CHUNK=min_chunk,
        DOT_PRECISION=dot_precision(query.dtype), UPCAST=upcast_operands(query),
        USE_SOFTCAP=softcap > 0, KV_CODE=kv_code,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part, lse, out, seq_lens, window, *part_strides, *lse_strides, *out.stride(),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            BLOCK_N=block_n, MIN_CHUNK=min_chunk,
            num_warps=min(num_warps, 4),
        )
    return out


__all__ = ["paged_decode_attention", "check_attention_args", "check_window_softcap", "default_num_splits",
           "device_arch", "dot_precision", "num_sms", "upcast_operands"]
