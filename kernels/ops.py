"""Backend choice: Triton kernels on CUDA, the C++ CPU kernels on CPU (when they build here),
the pure-torch reference otherwise; a setting forces any of them."""
from __future__ import annotations

from typing import Literal

import torch

Backend = Literal["auto", "triton", "cpu", "reference"]
BACKENDS = ("auto", "triton", "cpu", "reference")


def resolve_backend(requested: str, device: torch.device) -> str:
    if requested not in BACKENDS:
        raise ValueError(f"attention backend must be auto, triton, cpu or reference, got {requested!r}")
    if requested == "auto":
        if device.type == "cuda":
            return "triton" if _triton_available() else "reference"
        if device.type == "cpu" and _cpu_kernels_available():
            return "cpu"
        return "reference"
    if requested == "cpu" and device.type != "cpu":
        raise ValueError(f"attention backend cpu runs on the CPU, not on {device.type}")
    return requested


def _cpu_kernels_available() -> bool:
    from kvmesh.kernels.cpu_kernels import load
    return load() is not None


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
    if backend == "cpu":
        from kvmesh.kernels import cpu_ops
        return cpu_ops
    from kvmesh.kernels import reference
    return reference
