"""Backend choice: Triton kernels on CUDA, the torch reference elsewhere; a setting forces either."""
from __future__ import annotations

from typing import Literal

import torch

Backend = Literal["auto", "triton", "reference"]


def resolve_backend(requested: str, device: torch.device) -> str:
    if requested not in ("auto", "triton", "reference"):
        raise ValueError(f"attention backend must be auto, triton or reference, got {requested!r}")
    if requested == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "reference"
    return requested


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_ops(backend: str):
    """Module exposing write_kv_cache, paged_attention, rms_norm, rotary_embedding."""
    if backend == "triton":
        from kvmesh.kernels import triton_ops
        return triton_ops
    from kvmesh.kernels import reference
    return reference
