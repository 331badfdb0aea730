"""model_fingerprint: a short, stable name for the weights an engine loaded (not its served name).

Cross-pod KV bytes (--kv-share) are keyed by it, so two pods serving different weights under one
--served-model-name never load each other's blocks, and the same weights served under different
names do share them.

NOTE: cheap, not a full weight hash: every tensor's name, shape and dtype plus a strided sample
of 64 of its values. Any fine-tune or different checkpoint changes the samples; hashing all
weights would cost seconds at start for nothing more.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

_SAMPLES = 64


def model_fingerprint(model: nn.Module, config_repr: str = "") -> str:
    """16 hex digits naming these weights (and this model config)."""
    h = hashlib.sha256(config_repr.encode())
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES)
            sample = flat[::step][:_SAMPLES].to("cpu", copy=True)
            h.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return h.hexdigest()[:16]
