"""A checkpoint's calibrated KV-cache scales: compressed-tensors' `kv_cache_scheme` (8-bit floats,
one static scale per tensor), stored as `<layer>.self_attn.k_scale` and `.v_scale`, and the
other layouts vLLM reads them in (`_layout`): `<attn>.{k,v}_proj.output_scale` (the fp8 method,
older llm-compressor), `<attn>.{k,v}_proj.{k,v}_scale` (ModelOpt), `<attn>.qkv_proj.{k,v}_scale`
(fused projections), `<attn>.attn.{k,v}_scale` (vLLM's own names) and the deprecated
`<attn>.kv_scale` (one scale for both). Query and softmax scales (`q_scale`, `prob_scale`,
`q_proj.output_scale`, `prob_output_scale`) are for 8-bit attention arithmetic, which kvmesh
does not do: they are recognised and not used.

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
_UNUSED = ("q_scale", "prob_scale", "prob_output_scale")
_WRAPPERS = ("k_proj", "v_proj", "qkv_proj", "attn")    # modules a layout names the scale under
_TOLD_UNUSED: set[str] = set()                          # checkpoints whose unused scales were logged


def _layout(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(the attention module's name, the scales the tensor sets) for a KV-cache scale in any of
    the layouts above; ("", ()) for a query / softmax scale; None for any other name."""
    parts = name.split(".")
    leaf, owner = parts[-1], parts[:-1]
    if leaf in _UNUSED or (leaf == "output_scale" and owner[-1:] == ["q_proj"]):
        return "", ()
    if leaf in LEAVES:
        if owner[-1:] and owner[-1] in _WRAPPERS:
            owner = owner[:-1]
        return ".".join(owner), (leaf,)
    if leaf == "kv_scale":
        return ".".join(owner), LEAVES
    if leaf == "output_scale" and owner[-1:] and owner[-1] in ("k_proj", "v_proj"):
        return ".".join(owner[:-1]), (owner[-1][0] + "_scale",)
    return None


def is_kv_scale(name: str) -> bool:
    return _layout(name) is not None


def record(model: nn.Module, name: str, tensor: torch.Tensor, source: object) -> None:
    """Keep the scale(s) `name` sets on its attention module; ValueError for a scale that is not
    one positive finite number, or that names no attention layer."""
    from kvmesh.engine.layers.attention import Attention  # noqa: PLC0415
    module_name, leaves = _layout(name) or ("", ())
    if not leaves:
        if str(source) not in _TOLD_UNUSED:
            _TOLD_UNUSED.add(str(source))
            log.info("%s has query / softmax scales (%s, ...) for 8-bit attention arithmetic: not "
                     "used", source, name)
        return
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
    for leaf in leaves:
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
