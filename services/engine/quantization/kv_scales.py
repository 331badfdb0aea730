"""A checkpoint's calibrated KV-cache scales: compressed-tensors' `kv_cache_scheme` (8-bit floats,
one static scale per tensor), stored as `<layer>.self_attn.k_scale` and `.v_scale`, as vLLM
reads them.

With an 8-bit cache (`--kv-cache-dtype fp8` / `fp8_e5m2`) a layer stores k / k_scale and
v / v_scale as codes, so K/V far past the codes' range (448 for e4m3) keep their precision
instead of saturating. Reading them back needs no kernel of its own: q . k = k_scale * (q . k /
k_scale) is the softmax scale times k_scale, and the softmax's weights sum to 1, so sum p v =
v_scale * sum p (v / v_scale) is the output times v_scale (`Attention.forward`). With the
model's dtype in the cache (`auto`) the scales are not used, as in vLLM.

    is_kv_scale(name)                   a checkpoint tensor name that is one of them
    record(model, name, tensor, src)    the loader: the scale kept on its attention layer
    apply(model, cache_dtype) -> int    the engine, once the cache's dtype is known: the layers
                                        that store scaled codes (0: none)
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from kvmesh.kernels.kv_cache_dtype import is_fp8

log = logging.getLogger("kvmesh.engine.kv_scales")

LEAVES = ("k_scale", "v_scale")
_KEPT = "checkpoint_"            # the attribute a recorded scale waits in: checkpoint_k_scale


def is_kv_scale(name: str) -> bool:
    return name.rpartition(".")[2] in LEAVES


def record(model: nn.Module, name: str, tensor: torch.Tensor, source: object) -> None:
    """Keep `<attention module>.k_scale` / `.v_scale` on that module; ValueError for a scale that
    is not one positive finite number, or that names no attention layer."""
    from kvmesh.engine.layers.attention import Attention  # noqa: PLC0415
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    if not isinstance(module, Attention):
        raise ValueError(f"KV-cache scale {name} in {source} names no attention layer of the model")
    if tensor.numel() != 1:
        raise ValueError(f"KV-cache scale {name} in {source} must be one number (a per-tensor scale), "
                         f"got shape {tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"KV-cache scale {name} in {source} must be positive and finite, got {value}")
    setattr(module, _KEPT + leaf, value)


def apply(model: nn.Module, cache_dtype: torch.dtype) -> int:
    """Give each attention layer its checkpoint's scales when the cache holds 8-bit codes; the
    number of layers that got them. ValueError when the checkpoint scales some layers only."""
    from kvmesh.engine.layers.attention import Attention  # noqa: PLC0415
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    found = [[hasattr(m, _KEPT + leaf) for leaf in LEAVES] for m in layers]
    if not any(any(f) for f in found):
        return 0
    if not all(all(f) for f in found):
        have = sum(all(f) for f in found)
        raise ValueError(f"the checkpoint has k_scale and v_scale for {have} of its {len(layers)} "
                         "attention layers: each layer needs both")
    if not is_fp8(cache_dtype):
        log.info("the checkpoint's KV-cache scales are not used: the cache holds %s (use "
                 "--kv-cache-dtype fp8 for 8-bit codes scaled by them)", cache_dtype)
        for m in layers:
            m.k_scale = m.v_scale = 1.0
        return 0
    for m in layers:
        m.k_scale = getattr(m, _KEPT + "k_scale")
        m.v_scale = getattr(m, _KEPT + "v_scale")
    return len(layers)
