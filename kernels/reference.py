"""Pure-torch reference kernels: the ground truth for the Triton kernels and the engine's CPU path.

Cache layout (one tensor per layer and per K/V): [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.kernels.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padding token to skip
) -> None:
    """Store each token's K/V in its slot (block_id * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] for one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def _decode_batch(
    query: torch.Tensor,        # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,     # [num_seqs]
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = (max_seq_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    # [num_seqs, ctx, num_kv_heads, head_dim]
    k = k_cache[table].flatten(1, 2)[:, :max_seq_len].float()
    v = v_cache[table].flatten(1, 2)[:, :max_seq_len].float()
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,sckd->skgc", q, k) * scale  # [num_seqs, kvh, group, ctx]
    pos = torch.arange(max_seq_len, device=query.device)
    mask = pos[None, :] >= seq_lens[:, None].long()          # [num_seqs, ctx]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgc,sckd->skgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _extend_one(
    q: torch.Tensor,            # [q_len, num_heads, head_dim]
    k: torch.Tensor,            # [ctx, num_kv_heads, head_dim]
    v: torch.Tensor,            # [ctx, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # causal with the queries at the end of the context: query i sees positions <= ctx - q_len + i
    rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
    cols = torch.arange(ctx, device=q.device)[None, :]
    allowed = cols <= rows                                     # [q_len, ctx]
    qh = q.transpose(0, 1).float()                             # [num_heads, q_len, d]
    kh = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
    vh = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


def paged_attention(
    query: torch.Tensor,        # [num_tokens, num_heads, head_dim], packed by meta.query_start_loc
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:              # [num_tokens, num_heads, head_dim]
    """Causal attention of a mixed batch (decodes and prefill chunks) over the paged cache.

    The new tokens' K/V must already be in the cache (write_kv_cache first).
    """
    if meta.num_seqs == 0:
        return torch.empty_like(query)
    if meta.is_all_decode:
        return _decode_batch(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                             meta.max_seq_len, scale)
    out = torch.empty_like(query)
    decode_rows = [s for s, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
    starts = meta.query_start_loc.tolist()
    if len(decode_rows) > 1:
        # NOTE: decodes in a mixed batch still go through the batched path; only the
        # prefill chunks pay a per-sequence loop.
        idx = torch.tensor(decode_rows, device=query.device)
        tok = torch.tensor([starts[s] for s in decode_rows], device=query.device)
        max_len = max(meta.seq_lens_cpu[s] for s in decode_rows)
        out[tok] = _decode_batch(query[tok], k_cache, v_cache, meta.block_tables[idx],
                                 meta.seq_lens[idx], max_len, scale)
        done = set(decode_rows)
    else:
        done = set()
    for s, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if s in done or q_len == 0:
            continue
        table = meta.block_tables[s]
        k = _gather_context(k_cache, table, s_len)
        v = _gather_context(v_cache, table, s_len)
        lo, hi = starts[s], starts[s] + q_len
        out[lo:hi] = _extend_one(query[lo:hi], k, v, scale)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm in float32 (as HF Llama does). With a residual: returns (norm(x + r), x + r)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype), residual


def rotary_embedding(
    positions: torch.Tensor,    # [num_tokens] int64
    query: torch.Tensor,        # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: cos in [:, :d/2], sin in [:, d/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style (rotate-half) RoPE, the layout of HF Llama / Qwen2 checkpoints."""
    half = query.shape[-1] // 2
    cs = cos_sin_cache[positions]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(query), rot(key)
