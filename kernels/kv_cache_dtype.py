"""The KV cache's element type (`--kv-cache-dtype`, vLLM's flag): the model's dtype ("auto") or
8-bit floats, half of bf16's bytes a token (twice the tokens in the same memory, half the bytes
a decode's attention reads).

fp8 / fp8_e4m3 is `torch.float8_e4m3fn` (3 mantissa bits, finite to +-448), fp8_e5m2 is
`torch.float8_e5m2` (2 mantissa bits, to +-57344). K/V are stored with a scale of 1.0 (vLLM's
default without calibrated scales): each value rounded to the nearest code, values past the
largest finite code saturated to it, never to inf / NaN. Readers widen a code exactly (every
fp8 value is a float32, and a bfloat16); attention sums in float32 as with any other cache.

This module is the one place a name becomes a dtype and a value becomes a code in torch; the
kernels read and write the same codes (kernels/csrc/attention.cpp and elementwise.cpp, the
reference's upcast, the Triton kernels' bit operations in kernels/fp8_codes.py).
"""
from __future__ import annotations

import torch

from kvmesh.common.config import KV_CACHE_DTYPES

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_BY_NAME = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}
# backends whose attention reads fp8 codes: all of them (C++, the torch reference, the Triton
# kernels through kernels/fp8_codes.py)
FP8_BACKENDS = ("cpu", "reference", "triton")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, attention_backend: str) -> torch.dtype:
    """The cache's torch dtype for `--kv-cache-dtype name` with a model computing in
    `model_dtype` on `attention_backend` (resolved: cpu, reference or triton)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "auto":
        return model_dtype
    if attention_backend not in FP8_BACKENDS:
        raise ValueError(f"--kv-cache-dtype {name} runs on the {' and '.join(FP8_BACKENDS)} attention "
                         f"backends; the {attention_backend} kernels read K/V in the model's dtype "
                         "(use --kv-cache-dtype auto)")
    if model_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"--kv-cache-dtype {name} needs a float32, bfloat16 or float16 model, got {model_dtype}")
    return _FP8_BY_NAME[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_cache_codes(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype; for fp8, nearest-even codes, saturated at the largest finite one
    (torch's float32 -> fp8 conversion, applied to x clamped so that no device's conversion can
    give inf or NaN for a finite value)."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    top = torch.finfo(cache_dtype).max
    return x.float().clamp(-top, top).to(cache_dtype)
