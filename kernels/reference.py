"""Pure-torch reference kernels: the ground truth for the Triton kernels and the engine's CPU path.

Cache layout (one tensor per layer and per K/V): [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.kernels.kv_cache_dtype import is_fp8, to_cache_codes
from kvmesh.kernels.linear import linear
from kvmesh.kernels.metadata import AttentionMetadata
from kvmesh.kernels.precision import at_least_float32


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
    k_new, v_new = to_cache_codes(key, k_cache.dtype), to_cache_codes(value, v_cache.dtype)
    if is_fp8(k_cache.dtype):
        # NOTE: torch has no index_copy_ for float8 on CPU: the codes are copied as bytes
        k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
        k_new, v_new = k_new.view(torch.uint8), v_new.view(torch.uint8)
    k_flat.index_copy_(0, slot_mapping, k_new)
    v_flat.index_copy_(0, slot_mapping, v_new)


def _gather_context(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] for one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float) -> torch.Tensor:
    """softmax(q k^T * scale [soft-capped], masked) v over [..., heads, len, d] float32 tensors.

    k and v may have fewer heads than q (GQA: each KV head serves a group of query heads).
    """
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    # NOTE: HF Gemma 2's eager order: scale, divide by the cap, tanh, multiply, then the mask.
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _extend_one(
    q: torch.Tensor,            # [q_len, num_heads, head_dim]
    k: torch.Tensor,            # [ctx, num_kv_heads, head_dim]
    v: torch.Tensor,            # [ctx, num_kv_heads, head_dim]
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    q_len = q.shape[0]
    ctx = k.shape[0]
    # causal with the queries at the end of the context: query i sees positions <= ctx - q_len + i
    # (and, with a window W, positions > its own - W)
    rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
    cols = torch.arange(ctx, device=q.device)[None, :]
    allowed = cols <= rows                                     # [q_len, ctx]
    if window:
        allowed &= cols > rows - window
    group = q.shape[1] // k.shape[1]
    # NOTE: K/V expanded to the query heads here, as before windows existed (the prefill path's
    # proven speed on CPU), rather than SDPA's enable_gqa.
    kh = at_least_float32(k.transpose(0, 1)).repeat_interleave(group, dim=0)
    vh = at_least_float32(v.transpose(0, 1)).repeat_interleave(group, dim=0)
    out = _attend(at_least_float32(q.transpose(0, 1)), kh, vh, allowed, scale, softcap)
    return out.transpose(0, 1).to(q.dtype)


# NOTE: the engine calls paged_attention once per layer with the same `meta` (one object per
# sliding window, see AttentionMetadata.with_window); what depends only on `meta` (decode groups,
# their flattened block ids and masks, the prefill chunks) is computed for the first layer and
# reused by the others. The cache holds strong references to the metas it was built for, so an
# identity check (`is`) can never match a different, newer object. A few entries, so layers
# alternating between a full and a windowed view do not rebuild plans.
_plan_cache: list = []   # [(meta, _Cached)], most recent last
_PLAN_CACHE_SIZE = 4

# A decode group may hold at most this much padding: padded keys / real keys.
_MAX_PADDING = 1.25


@dataclass(slots=True)
class _DecodeGroup:
    tokens: torch.Tensor        # [b] int64: the query rows (packed token index) of the group
    blocks: torch.Tensor        # [b * num_blocks] int64: each sequence's first num_blocks block ids
    num_blocks: int             # blocks gathered per sequence (the longest sequence's count)
    ctx: int                    # keys per sequence after the gather (num_blocks * block_size, or
                                # the exact length for a group of one)
    mask: torch.Tensor | None   # [b, 1, 1, ctx] bool, True = attend; None when nothing is padded


@dataclass(slots=True)
class _Plan:
    groups: list[_DecodeGroup]
    prefills: list[tuple[int, int, int, int]]   # (seq, first token, last token + 1, seq_len)
    identity: bool              # one group covering every token in order: its output is the output


def _decode_groups(rows: list[int], tokens: list[int], seq_lens: list[int], tables: torch.Tensor,
                   block_size: int, device: torch.device, window: int = 0) -> list[_DecodeGroup]:
    """Split decode sequences into groups of similar length, longest first, so padding a group
    to its longest member wastes at most ~_MAX_PADDING x the real keys."""
    order = sorted(range(len(rows)), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in order:
        n = seq_lens[i]
        if cur and seq_lens[cur[0]] * (len(cur) + 1) > _MAX_PADDING * (real + n):
            groups.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += n
    if cur:
        groups.append(cur)
    out = []
    for g in groups:
        longest = seq_lens[g[0]]
        nb = (longest + block_size - 1) // block_size
        row_idx = torch.tensor([rows[i] for i in g], dtype=torch.long)
        blocks = tables.index_select(0, row_idx.to(tables.device))[:, :nb].reshape(-1).long()
        lens = [seq_lens[i] for i in g]
        ctx = longest if len(g) == 1 else nb * block_size
        # NOTE: the window only masks; the reference still gathers every block of the context.
        windowed = window > 0 and longest > window
        if all(n == ctx for n in lens) and not windowed:
            mask = None
        else:
            lens_t = torch.tensor(lens, device=device)
            cols = torch.arange(ctx, device=device)[None, :]
            m = cols < lens_t[:, None]
            if windowed:
                m &= cols >= lens_t[:, None] - window
            mask = m[:, None, None, :]
        out.append(_DecodeGroup(torch.tensor([tokens[i] for i in g], dtype=torch.long, device=device),
                                blocks, nb, ctx, mask))
    return out


def _plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
    for cached_meta, cached in _plan_cache:
        if cached_meta is meta and cached.block_size == block_size:
            return cached.plan
    if meta.is_all_decode:
        rows = list(range(meta.num_seqs))
        tokens = rows
        prefills: list[tuple[int, int, int, int]] = []
    else:
        starts = meta.query_start_loc.tolist()
        rows, tokens, prefills = [], [], []
        for s, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len == 1:
                rows.append(s)
                tokens.append(starts[s])
            elif q_len > 0:
                prefills.append((s, starts[s], starts[s] + q_len, s_len))
    lens = [meta.seq_lens_cpu[s] for s in rows]
    groups = (_decode_groups(rows, tokens, lens, meta.block_tables, block_size, device, meta.sliding_window)
              if rows else [])
    identity = (not prefills and len(groups) == 1 and len(rows) == sum(meta.query_lens_cpu)
                and groups[0].tokens.tolist() == list(range(len(rows))))
    plan = _Plan(groups, prefills, identity)
    _plan_cache.append((meta, _Cached(plan, block_size)))
    del _plan_cache[:-_PLAN_CACHE_SIZE]
    return plan


@dataclass(slots=True)
class _Cached:
    plan: _Plan
    block_size: int


def _decode_group(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  g: _DecodeGroup, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """[b, num_heads, head_dim] attention of one decode group over its gathered context."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    b = g.tokens.shape[0]
    q = at_least_float32(query.index_select(0, g.tokens)).view(b, num_heads, 1, head_dim)
    # [b, num_blocks * block_size, kv_heads, d] -> [b, kv_heads, ctx, d] (a strided view)
    k = k_cache.index_select(0, g.blocks).view(b, g.num_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache.index_select(0, g.blocks).view(b, g.num_blocks * block_size, num_kv_heads, head_dim)
    k = at_least_float32(k[:, :g.ctx].transpose(1, 2))
    v = at_least_float32(v[:, :g.ctx].transpose(1, 2))
    o = _attend(q, k, v, g.mask, scale, softcap)
    return o.view(b, num_heads, head_dim).to(query.dtype)


def paged_attention(
    query: torch.Tensor,        # [num_tokens, num_heads, head_dim], packed by meta.query_start_loc
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:              # [num_tokens, num_heads, head_dim]
    """Causal attention of a mixed batch (decodes and prefill chunks) over the paged cache.

    The new tokens' K/V must already be in the cache (write_kv_cache first). Decodes run
    batched, in groups of similar context length (little padding); prefill chunks run one
    sequence at a time. `meta.sliding_window` W > 0 limits each query to the last W positions
    (itself included); `softcap` > 0 caps scores as cap * tanh(score / cap) (Gemma 2).
    """
    if meta.num_seqs == 0:
        return torch.empty_like(query)
    plan = _plan(meta, k_cache.shape[1], query.device)
    if plan.identity:
        return _decode_group(query, k_cache, v_cache, plan.groups[0], scale, softcap)
    out = torch.empty_like(query)
    for g in plan.groups:
        out.index_copy_(0, g.tokens, _decode_group(query, k_cache, v_cache, g, scale, softcap))
    for s, lo, hi, s_len in plan.prefills:
        table = meta.block_tables[s]
        k = _gather_context(k_cache, table, s_len)
        v = _gather_context(v_cache, table, s_len)
        out[lo:hi] = _extend_one(query[lo:hi], k, v, scale, meta.sliding_window, softcap)
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
        xf = at_least_float32(x)
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(query), rot(key)


# ------------------------------------------------------------------------- mixture of experts


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, top_k] fp32 weights, [num_tokens, top_k] int64 ids)
    """Softmax over experts (float32), the top-k, and optionally their weights rescaled to sum 1.

    NOTE: HF's order exactly (Mixtral, Qwen3-MoE `norm_topk_prob`): softmax first, then top-k,
    then renormalise; the weights stay float32 until they scale the expert outputs.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,             # [num_tokens, hidden]
    w13: torch.Tensor,           # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,            # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,      # [num_tokens, top_k] int32/int64
) -> torch.Tensor:               # [num_tokens, hidden]
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's experts e = ids[t, k].

    Grouped per expert: the (token, k) pairs are sorted by expert and every expert with tokens
    runs one matmul over all of them; the results are added back with index_add_.
    """
    def expert(e: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = linear(h, w13[e]).chunk(2, dim=-1)                 # [n, inter] each
        return linear(F.silu(gate) * up, w2[e])                       # [n, hidden]
    return moe_by_expert(x, topk_weights, topk_ids, w13.shape[0], expert)


def moe_by_expert(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  num_experts: int, expert) -> torch.Tensor:
    """sum_k w_k * expert(e, x) over each token's experts e = ids[t, k], with `expert(e, rows)`
    called once per expert that has tokens, on all of them (the (token, k) pairs sorted by
    expert, stable); the results are added back with index_add_."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)                  # pair ids grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    pair_weights = topk_weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // top_k
        y = expert(e, x[tokens])
        out.index_add_(0, tokens, (y * pair_weights[pairs, None]).to(out.dtype))
    return out


# Quantized GEMMs (the ground truth of kernels/quant/triton_gemm.py). Each returns the float64
# product of exactly the operands the kernel multiplies, before the kernel's float32
# accumulation and its rounding to x's dtype, so a test can bound that rounding.

def dequantize_int4(
    qweight: torch.Tensor,      # [N, K // 2] uint8: weight k in byte k // 2, even k low nibble
    scales: torch.Tensor,       # [N, K // group_size] float
    zeros: torch.Tensor,        # [N, K // group_size] uint8 0..15, or float32 (GGUF Q4_1's -min / d)
    group_size: int,
) -> torch.Tensor:              # [N, K] float32: (q - zero) * scale
    n = qweight.shape[0]
    q = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(n, -1).float()
    group = torch.arange(q.shape[1], device=q.device) // group_size
    return (q - zeros.float()[:, group]) * scales.float()[:, group]


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, perm: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:   # [M, N] float64
    """x[:, perm] @ W^T + bias, W dequantized in float32 and rounded to x's dtype (the tl.dot operand)."""
    w = dequantize_int4(qweight, scales, zeros, group_size).to(x.dtype)
    if perm is not None:
        x = x[:, perm]
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def dequantize_w8g(
    qweight: torch.Tensor,      # [N, K] uint8 codes
    scales: torch.Tensor,       # [N, K // group_size] float
    zeros: torch.Tensor,        # [N, K // group_size] uint8, or float32
    group_size: int,
) -> torch.Tensor:              # [N, K] float32: (q - zero) * scale
    group = torch.arange(qweight.shape[1], device=qweight.device) // group_size
    return (qweight.float() - zeros.float()[:, group]) * scales.float()[:, group]


def w8g_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:   # [M, N] float64
    """x @ W^T + bias, W dequantized in float32 and rounded to x's dtype (the tl.dot operand)."""
    w = dequantize_w8g(qweight, scales, zeros, group_size).to(x.dtype)
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def scaled_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: scale = max|x| / 127 (float32), q = x / scale rounded half to even (0 for a zero row)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1) / 127
    q = torch.round(xf / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-127, 127)
    return q.to(torch.int8), scale


def w8a8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:   # [M, N] float64
    """(x_q @ w^T, exact in integers) * x_scale[m] * w_scale[n] + bias."""
    q, scale = scaled_int8_quant(x)
    # NOTE: float64 holds every such sum exactly (|sum| <= 127^2 K < 2^53), and CUDA has no int64 matmul
    acc = q.double() @ weight.double().T
    y = acc * scale.double()[:, None] * weight_scale.double()[None, :]
    return y if bias is None else y + bias.double()


def scaled_fp8_quant(x: torch.Tensor, per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor: scale = max|x| / 448 (float32, [1]); per token: one a row ([M]);
    q = x / scale cast to e4m3fn (nearest, ties even)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1) / 448 if per_token else (xf.abs().amax() / 448).reshape(1)
    div = torch.where(scale > 0, scale, 1.0)
    q = (xf / (div[:, None] if per_token else div)).clamp(-448, 448)
    return q.to(torch.float8_e4m3fn), scale


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, *, activations: str = "tensor") -> torch.Tensor:  # [M, N] float64
    """activations "tensor" / "token": (x_q @ w^T) * x_scale * w_scale + bias, x_q cast per tensor /
    per token (sm_89+); "none": (x @ w^T) * w_scale + bias (weight-only, and every fp8 GEMM on sm_80)."""
    w = weight.double()
    if activations != "none":
        q, scale = scaled_fp8_quant(x, per_token=activations == "token")
        y = (q.double() @ w.T) * (scale.double()[:, None] if activations == "token" else scale.double())
    else:
        y = x.double() @ w.T
    y = y * weight_scale.double()[None, :]
    return y if bias is None else y + bias.double()
