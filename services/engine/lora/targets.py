"""The base model's adaptable projections: a LoRASite per fused matmul, attached to its layer.

Every family builds its decoder from the shared `Attention` and `GatedMLP` layers, so the sites
are found by walking the model: per attention layer q/k/v (or Phi-3's qkv_proj) and o_proj, per
gated MLP gate/up (or Phi-3's gate_up_proj) and down_proj. A mixture-of-experts MLP has none
(an adapter targeting its projections is refused as a module the base lacks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvmesh.engine.layers.attention import Attention
from kvmesh.engine.layers.mlp import GatedMLP
from kvmesh.engine.lora.mapping import LoRAMapping
from kvmesh.engine.lora.slots import LoRASite, SitePart


@dataclass(slots=True)
class LoRATargets:
    sites: list[LoRASite] = field(default_factory=list)
    # HF module path (model.layers.0.self_attn.q_proj) -> (its site, its part index)
    parts: dict[str, tuple[LoRASite, int]] = field(default_factory=dict)

    @property
    def module_names(self) -> set[str]:
        """The short names an adapter may target (q_proj, o_proj, ...)."""
        return {path.rsplit(".", 1)[-1] for path in self.parts}


def _parts(linears: list[tuple[str, nn.Linear]]) -> tuple[SitePart, ...]:
    out, off = [], 0
    for name, lin in linears:
        out.append(SitePart(name, off, lin.out_features))
        off += lin.out_features
    return tuple(out)


def _site_specs(module: nn.Module) -> list[tuple[str, list[tuple[str, nn.Linear]]]]:
    """(attribute on the layer, [(HF name, Linear)]) of each site of one layer."""
    if isinstance(module, Attention):
        qkv = ([("qkv_proj", module.qkv_proj)] if module.fused_qkv else
               [("q_proj", module.q_proj), ("k_proj", module.k_proj), ("v_proj", module.v_proj)])
        return [("lora_qkv", qkv), ("lora_o", [("o_proj", module.o_proj)])]
    if isinstance(module, GatedMLP):
        gate_up = ([("gate_up_proj", module.gate_up_proj)] if module.fused_gate_up else
                   [("gate_proj", module.gate_proj), ("up_proj", module.up_proj)])
        return [("lora_gate_up", gate_up), ("lora_down", [("down_proj", module.down_proj)])]
    return []


def attach_sites(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, mapping: LoRAMapping) -> LoRATargets:
    """Give every attention and gated-MLP layer of `model` its LoRA sites (all slots zero)."""
    targets = LoRATargets()
    for prefix, module in model.named_modules():
        for attr, linears in _site_specs(module):
            site = LoRASite(prefix, linears[0][1].in_features, _parts(linears), max_loras,
                            max_rank, dtype, device, mapping)
            setattr(module, attr, site)
            targets.sites.append(site)
            for i, (name, _) in enumerate(linears):
                targets.parts[f"{prefix}.{name}"] = (site, i)
    return targets
