"""Decoder self-attention over the paged KV cache, shared by every family.

    x -> q,k,v proj (one fused matmul) -> [per-head q/k norm] -> RoPE -> write_kv_cache
      -> paged_attention (window, soft-cap) -> o_proj

What differs between families is data (`AttentionSpec`) plus two switches: a per-head q/k norm
module (Qwen3: RMSNorm, Gemma 3: GemmaRMSNorm) and a fused `qkv_proj` checkpoint layout (Phi-3).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from kvmesh.engine.layers.linear import fused_weights, linear
from kvmesh.kernels.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # ([num_blocks, block_size, num_kv_heads, head_dim]) x 2


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What one layer's attention computes, beyond its weights."""

    num_heads: int              # query heads
    num_kv_heads: int           # KV heads (GQA when fewer)
    head_dim: int               # may differ from hidden / heads (Qwen3, Gemma)
    scale: float                # softmax scale: head_dim ** -0.5, Gemma: query_pre_attn_scalar ** -0.5
    sliding_window: int = 0     # attend to the last W positions (the current one included); 0 = all
    softcap: float = 0.0        # Gemma 2: score = cap * tanh(score / cap) before the softmax; 0 = off
    rope: str = "global"        # which of the model's cos/sin tables (Gemma 3 sliding layers: "local")


class Attention(nn.Module):
    # NOTE: tensor parallelism (kvmesh.engine.parallel) sets the rank's group: this layer holds
    # some heads, and its o_proj output is a partial sum over the ranks.
    tp_group = None
    # NOTE: --enable-lora gives each layer its sites (kvmesh.engine.lora.targets); they add the
    # step's adapter terms to the q/k/v and o projections and do nothing in a base-only step.
    lora_qkv = None
    lora_o = None
    # NOTE: a checkpoint's calibrated KV-cache scales, set with an 8-bit cache only
    # (kvmesh.engine.quantization.kv_scales): the cache holds k / k_scale and v / v_scale
    k_scale = 1.0
    v_scale = 1.0

    def __init__(self, hidden: int, spec: AttentionSpec, ops: ModuleType, *, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: Callable[[int], nn.Module] | None = None,
                 fused_qkv: bool = False):
        super().__init__()
        self.spec = spec
        self.ops = ops
        self.fused_qkv = fused_qkv
        nq, nkv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        if fused_qkv:
            # NOTE: Phi-3 stores q, k, v as one [nq + 2 * nkv, hidden] tensor, in that order.
            self.qkv_proj = nn.Linear(hidden, nq + 2 * nkv, bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(hidden, nq, bias=qkv_bias)
            self.k_proj = nn.Linear(hidden, nkv, bias=qkv_bias)
            self.v_proj = nn.Linear(hidden, nkv, bias=qkv_bias)
        self.o_proj = nn.Linear(nq, hidden, bias=o_bias)
        if qk_norm is not None:
            # NOTE: one weight of head_dim shared by every head (HF's q_norm / k_norm).
            self.q_norm = qk_norm(spec.head_dim)
            self.k_norm = qk_norm(spec.head_dim)
        self.has_qk_norm = qk_norm is not None
        self._qkv = None   # (weight, bias, data pointers): q/k/v fused into one matmul

    def _project(self, x: torch.Tensor) -> torch.Tensor:     # [T, nq + 2 * nkv]
        if self.fused_qkv:
            out = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        else:
            w, b = fused_weights(self, (self.q_proj, self.k_proj, self.v_proj), "_qkv")
            if w is None:
                out = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            else:
                out = linear(x, w, b)
        if self.lora_qkv is not None:
            self.lora_qkv.add(x, out)
        return out

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        s = self.spec
        t = x.shape[0]
        nq, nkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv = self._project(x)
        q = qkv[:, :nq].view(t, s.num_heads, s.head_dim)
        k = qkv[:, nq:nq + nkv].view(t, s.num_kv_heads, s.head_dim)
        v = qkv[:, nq + nkv:].view(t, s.num_kv_heads, s.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin_cache)
        k_cache, v_cache = kv_cache
        if self.k_scale != 1.0:
            k = k / self.k_scale
        if self.v_scale != 1.0:
            v = v / self.v_scale
        self.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        # NOTE: the layer's window travels in the metadata; with_window memoises one view per
        # window on the step's metadata, so every layer of a window shares one object (and the
        # reference backend's per-metadata plan). Scaled codes: q . k is k_scale times q . code,
        # and the softmax's weights sum to 1, so the output is v_scale times theirs.
        o = self.ops.paged_attention(q, k_cache, v_cache, meta.with_window(s.sliding_window),
                                     s.scale * self.k_scale, s.softcap)  # [T, heads, d]
        if self.v_scale != 1.0:
            o = o * self.v_scale
        o = o.reshape(t, nq)
        out = linear(o, self.o_proj.weight, self.o_proj.bias)
        if self.lora_o is not None:
            self.lora_o.add(o, out)
        return out if self.tp_group is None else self.tp_group.all_reduce(out)
