"""Gated MLP: down(act(gate(x)) * up(x)), with SiLU (Llama family) or tanh-GELU (Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.layers.linear import fused_weights, linear
from kvmesh.kernels.cpu_ops import silu_and_mul

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _activation(name: str):
    if name == "silu":
        return F.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")


class GatedMLP(nn.Module):
    """HF names: gate_proj / up_proj / down_proj, or (fused_gate_up, Phi-3) gate_up_proj / down_proj."""

    tp_group = None     # tensor parallelism: down_proj's output is a partial sum over the ranks
    lora_gate_up = None  # --enable-lora: the LoRA sites of gate/up and down (lora/targets.py)
    lora_down = None

    def __init__(self, hidden: int, intermediate: int, act: str, *, bias: bool = False,
                 fused_gate_up: bool = False):
        super().__init__()
        self.act = _activation(act)
        self.fused_gate_up = fused_gate_up
        if fused_gate_up:
            # NOTE: Phi-3 stores gate and up as one [2 * intermediate, hidden] tensor, gate first.
            self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
            self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self._gate_up = None   # (weight, bias, data pointers): gate/up fused into one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up:
            w, b = self.gate_up_proj.weight, self.gate_up_proj.bias
        else:
            w, b = fused_weights(self, (self.gate_proj, self.up_proj), "_gate_up")
            if w is None:
                return self._reduce(self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))
        gate_up = linear(x, w, b)                                    # [T, 2i]
        if self.lora_gate_up is not None:
            self.lora_gate_up.add(x, gate_up)
        if self.act is F.silu:
            hidden = silu_and_mul(gate_up)                           # one pass on CPU
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.act(gate) * up
        out = linear(hidden, self.down_proj.weight, self.down_proj.bias)
        if self.lora_down is not None:
            self.lora_down.add(hidden, out)
        return self._reduce(out)

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.tp_group is None else self.tp_group.all_reduce(out)
