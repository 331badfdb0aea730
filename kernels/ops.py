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


def keep_triton_out(device: str, attention_backend: str) -> bool:
    """For a process's entry point (never a library call): when it will run no Triton kernel (no
    CUDA device, backend not forced to triton), make `import triton` fail in this process.
    Whether Triton was kept out.

    NOTE: Triton kernels are only imported with the triton backend (get_ops), but torch imports
    Triton whenever it is installed, from torch._dynamo, which its own meta-device ops load while
    a model is built: a CPU server would load Triton for nothing and print Triton's nanobind leak
    report (~35 lines) at every exit. A process that runs other backends' kernels too (a test
    run) must not call this."""
    import sys  # noqa: PLC0415
    if "triton" in sys.modules or attention_backend == "triton":
        return False
    if (device == "auto" and torch.cuda.is_available()) or device.startswith("cuda"):
        return False
    sys.modules["triton"] = None     # type: ignore[assignment]  # `import triton` raises ImportError
    return True


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
