"""Llama-family decoder (Llama, SmolLM2, Qwen2) over the paged KV cache.

One packed batch per forward: the new tokens of every sequence, concatenated ([T] ids and
positions), attend to their context through the per-layer paged caches described by `meta`.
Parameter names are HF's (`model.layers.N.self_attn.q_proj.weight`, ...), so an HF state dict
loads as is. Attention, RoPE and RMSNorm go through `ops` (kernels.ops.get_ops), which is the
torch reference on CPU and Triton on CUDA.

    embed -> N x [ rms_norm -> q,k,v proj -> rope -> write_kv_cache -> paged_attention -> o_proj
                   (+res) rms_norm -> down(silu(gate(x)) * up(x)) ] -> (+res) rms_norm -> lm_head
"""
from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.model_config import ModelConfig
from kvmesh.kernels.linear import linear
from kvmesh.kernels.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # ([num_blocks, block_size, num_kv_heads, head_dim]) x 2


# --------------------------------------------------------------------------------------- RoPE


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # NOTE: the exact expression HF uses (float32 pow), so cos/sin match it bit for bit.
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(theta: float, dim: int, s: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(theta, dim)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def build_cos_sin_cache(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos(pos * inv_freq) in the first half, sin in the second.

    inv_freq follows HF's formulas for rope_type default / linear / llama3 / dynamic.
    """
    dim, theta, s = config.head_dim, config.rope_theta, config.rope_scaling or {}
    rope_type = s.get("rope_type", "default")
    max_pos = config.max_position_embeddings
    pos = torch.arange(max_pos, dtype=torch.int64).float()
    if rope_type == "default":
        freqs = pos[:, None] * _default_inv_freq(theta, dim)[None, :]
    elif rope_type == "linear":
        freqs = pos[:, None] * (_default_inv_freq(theta, dim) / s["factor"])[None, :]
    elif rope_type == "llama3":
        freqs = pos[:, None] * _llama3_inv_freq(theta, dim, s)[None, :]
    elif rope_type == "dynamic":
        # NOTE: HF's dynamic NTK rescales theta for the whole sequence once it outgrows the
        # original context, which a KV cache cannot follow (old keys keep their rotation). We
        # match HF exactly inside the original context and, beyond it, rotate each position with
        # the theta HF would use for a sequence ending there; the cache covers factor x context.
        factor = float(s["factor"])
        short = pos[:, None] * _default_inv_freq(theta, dim)[None, :]
        long_pos = torch.arange(max_pos, int(max_pos * factor), dtype=torch.int64)
        seq_len = (long_pos + 1).double()
        bases = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv = 1.0 / (bases.float()[:, None] ** exps[None, :])
        freqs = torch.cat([short, long_pos.float()[:, None] * inv])
    else:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return cache if device is None else cache.to(device)


# ------------------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: ModuleType):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With one: (norm(x + residual), x + residual)."""
        out, new_residual = self.ops.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, new_residual)


def _fused(module: nn.Module, linears: tuple[nn.Linear, ...], attr: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weight, bias) of `linears` concatenated along the output dim, built once and kept in sync.

    NOTE: the first call concatenates the weights into one buffer and rebinds each Linear's
    weight (and bias) to a view of it, so there is one copy in memory and the HF parameter
    names, shapes and values of `state_dict()` are unchanged (the values are views sharing one
    storage: clone them before saving with safetensors). In-place writes (`load_state_dict`,
    `p.copy_`) land in the fused buffer; a parameter replaced by a new tensor (`assign`,
    `.to(dtype)`) is noticed by its data pointer and the buffer is rebuilt. Meta weights are
    not fused (returns None, None).
    """
    ws = [lin.weight for lin in linears]
    cached = getattr(module, attr, None)
    if cached is not None:
        weight, bias, ptrs = cached
        if ptrs == tuple(w.data_ptr() for w in ws):
            return weight, bias
    if any(w.is_meta for w in ws):
        return None, None
    has_bias = [lin.bias is not None for lin in linears]
    # NOTE: a normal tensor even when first called under inference_mode, so later in-place
    # updates outside inference mode (load_state_dict) stay legal.
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([w.detach() for w in ws], dim=0)
        bias = None
        if any(has_bias):
            bias = torch.cat([lin.bias.detach() if lin.bias is not None
                              else weight.new_zeros(lin.out_features) for lin in linears])
        lo = 0
        for lin in linears:
            hi = lo + lin.out_features
            lin.weight = nn.Parameter(weight[lo:hi], requires_grad=lin.weight.requires_grad)
            if lin.bias is not None:
                lin.bias = nn.Parameter(bias[lo:hi], requires_grad=lin.bias.requires_grad)
            lo = hi
    setattr(module, attr, (weight, bias, tuple(lin.weight.data_ptr() for lin in linears)))
    return weight, bias


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.scale = d ** -0.5
        self.ops = ops
        h, qkv_bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_proj_bias)
        self._qkv = None   # (weight, bias, data pointers): q/k/v fused into one matmul (_fused)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        w, b = _fused(self, (self.q_proj, self.k_proj, self.v_proj), "_qkv")
        if w is None:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        else:
            qkv = linear(x, w, b)                                     # [T, nq + 2 * nkv]
        q = qkv[:, :nq].view(t, self.num_heads, self.head_dim)
        k = qkv[:, nq:nq + nkv].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, nq + nkv:].view(t, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin_cache)
        k_cache, v_cache = kv_cache
        self.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, heads, d]
        return linear(o.reshape(t, nq), self.o_proj.weight, self.o_proj.bias)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self._gate_up = None   # (weight, bias, data pointers): gate/up fused into one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = _fused(self, (self.gate_proj, self.up_proj), "_gate_up")
        if w is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = linear(x, w, b).chunk(2, dim=-1)                 # [T, i] each
        return linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__()
        self.self_attn = LlamaAttention(config, ops)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_cache):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """Llama / SmolLM2 / Qwen2 (q/k/v bias) with HF parameter names."""

    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # NOTE: float32 whatever the model dtype, and not in the state dict; a model built on the
        # meta device gets a real one from `reset_rope_cache(device)`.
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(config), persistent=False)

    def tie_weights(self) -> None:
        """Share embed_tokens' weight with lm_head when the config says so (call after assigning)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_rope_cache(self, device: torch.device | str) -> None:
        self.cos_sin_cache = build_cos_sin_cache(self.config, device)

    def forward(
        self,
        input_ids: torch.Tensor,        # [T] int64, the new tokens of all sequences, packed
        positions: torch.Tensor,        # [T] int64, absolute position of each token
        kv_caches: list[KVCache],       # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:                  # [T, hidden]
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.cos_sin_cache)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, vocab] float32 (R: the rows to sample from, e.g. last token per seq)."""
        return linear(hidden, self.lm_head.weight).float()
