"""RoPE cos/sin caches, HF-exact: one [max_positions, head_dim] float32 table per RoPE setting.

A family with different RoPE per layer type (Gemma 3: a local base for sliding-window layers)
builds one table per setting; `Attention` picks its table by name (see causal_lm.py).
"""
from __future__ import annotations

import math
from typing import Any

import torch


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # NOTE: the exact expression HF uses (float32 pow), so cos/sin match it bit for bit.
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(theta: float, dim: int, s: dict) -> torch.Tensor:
    inv_freq = default_inv_freq(theta, dim)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _longrope_inv_freq(theta: float, dim: int, factors: list[float]) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def longrope_attention_factor(s: dict, max_position_embeddings: int) -> float:
    """HF's cos/sin multiplier for longrope: given, or sqrt(1 + ln(factor) / ln(original))."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def build_cos_sin_cache(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                        max_positions: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[positions, head_dim] float32: cos(pos * inv_freq) in the first half, sin in the second.

    inv_freq follows HF's formulas for rope_type default / linear / llama3 / dynamic / longrope,
    and llama.cpp's for a GGUF file's per-frequency divisors (rope_freqs).
    """
    dim, s = head_dim, scaling or {}
    rope_type = s.get("rope_type", "default")
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    mult = 1.0
    if rope_type == "default":
        freqs = pos[:, None] * default_inv_freq(theta, dim)[None, :]
    elif rope_type == "linear":
        freqs = pos[:, None] * (default_inv_freq(theta, dim) / s["factor"])[None, :]
    elif rope_type == "llama3":
        freqs = pos[:, None] * _llama3_inv_freq(theta, dim, s)[None, :]
    elif rope_type == "rope_freqs":
        # a GGUF file's per-frequency divisors (llama.cpp's rope_freqs: theta_i / factor_i)
        factors = torch.tensor(s["freq_factors"], dtype=torch.float32)
        freqs = pos[:, None] * (default_inv_freq(theta, dim) / factors)[None, :]
    elif rope_type == "dynamic":
        # NOTE: HF's dynamic NTK rescales theta for the whole sequence once it outgrows the
        # original context, which a KV cache cannot follow (old keys keep their rotation). We
        # match HF exactly inside the original context and, beyond it, rotate each position with
        # the theta HF would use for a sequence ending there; the cache covers factor x context.
        factor = float(s["factor"])
        short = pos[:, None] * default_inv_freq(theta, dim)[None, :]
        long_pos = torch.arange(max_positions, int(max_positions * factor), dtype=torch.int64)
        seq_len = (long_pos + 1).double()
        bases = theta * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
        exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv = 1.0 / (bases.float()[:, None] ** exps[None, :])
        freqs = torch.cat([short, long_pos.float()[:, None] * inv])
    elif rope_type == "longrope":
        # NOTE: HF switches every position to long_factor once a sequence outgrows the original
        # context (keys already cached keep their short-factor rotation in HF too). We choose per
        # position: short factors below original_max_position_embeddings, long ones from there
        # on, which equals HF for every sequence inside the original context.
        original = int(s["original_max_position_embeddings"])
        short = _longrope_inv_freq(theta, dim, s["short_factor"])
        long = _longrope_inv_freq(theta, dim, s["long_factor"])
        inv = torch.where((pos < original)[:, None], short[None, :], long[None, :])
        freqs = pos[:, None] * inv
        mult = longrope_attention_factor(s, max_positions)
    else:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    cache = torch.cat([freqs.cos() * mult, freqs.sin() * mult], dim=-1) if mult != 1.0 else \
        torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return cache if device is None else cache.to(device)
