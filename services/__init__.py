"""kvmesh: Kubernetes-native LLM serving.

    from kvmesh import LLM, LoRARequest, SamplingParams
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # NOTE: lazy, so `kvmesh.operator` and `kvmesh.router` import without torch.
    if name == "LLM":
        from kvmesh.engine.llm import LLM
        return LLM
    if name == "LoRARequest":
        from kvmesh.engine.lora.request import LoRARequest
        return LoRARequest
    if name == "SamplingParams":
        from kvmesh.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
