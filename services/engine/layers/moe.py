"""The sparse mixture-of-experts block shared by the MoE families (Mixtral, Qwen3-MoE).

    x [T, H] ─▶ gate (router) ─▶ softmax ─▶ top-k (─▶ renormalise) ─▶ ops.fused_moe(x, w13, w2, ...)

Parameters keep HF's checkpoint names, which differ per family only in the expert's three
projections (Mixtral: `experts.N.w1 / w3 / w2`; Qwen3-MoE: `experts.N.gate_proj / up_proj /
down_proj`), so a checkpoint loads as is. The experts' weights are stacked once into
`w13 [E, 2I, H]` (gate rows, then up rows) and `w2 [E, H, I]`, the layout of the grouped
kernels; each expert's parameters are then views of the stacked buffers (one copy in memory).
Experts held quantized (a quantized checkpoint served as such: their projections are
HFQuantizedLinear / QuantizedLinear) are not stacked: each expert with tokens runs its own three
quantized GEMMs over them (`per_expert_moe`, the grouping of the reference fused_moe).
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.kernels.reference import moe_by_expert, select_experts


class _Expert(nn.Module):
    """One SiLU-gated expert; its three Linear layers carry the family's HF names."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names   # (gate, up, down)
        setattr(self, names[0], nn.Linear(hidden, inter, bias=False))
        setattr(self, names[1], nn.Linear(hidden, inter, bias=False))
        setattr(self, names[2], nn.Linear(inter, hidden, bias=False))

    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self, n) for n in self.names)


class SparseMoeBlock(nn.Module):
    """Router + experts: each token goes through its top-k experts, outputs weighted and summed."""

    # NOTE: tensor parallelism shards every expert (gate/up rows, down columns) and replicates
    # the router, so the output is a partial sum over the ranks: one all-reduce per block.
    tp_group = None

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool,
                 ops: ModuleType, expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 *, round_weights: bool = False):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and num_experts ({num_experts})")
        self.top_k = top_k
        self.renormalize = renormalize
        # NOTE: HF Qwen3-MoE rounds the routing weights to the model dtype before scaling the expert
        # outputs; Mixtral keeps them float32. A no-op in float32.
        self.round_weights = round_weights
        self.ops = ops
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(_Expert(hidden, inter, expert_names) for _ in range(num_experts))
        self._stacked = None   # (w13, w2, data pointers of every expert weight): see stacked_weights

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]), built once and kept in sync with the expert parameters.

        NOTE: as `layers.linear.fused_weights` does for q/k/v: the first call copies the experts into two
        buffers and rebinds each expert's weights to views of them; a parameter replaced later
        (assign, `.to(dtype)`) changes its data pointer and the buffers are rebuilt.
        """
        linears = [lin for expert in self.experts for lin in expert.linears()]
        ptrs = tuple(lin.weight.data_ptr() for lin in linears)
        if self._stacked is not None and self._stacked[2] == ptrs:
            return self._stacked[0], self._stacked[1]
        with torch.inference_mode(False), torch.no_grad():
            w13 = torch.stack([torch.cat([gate.weight, up.weight]) for gate, up, _ in
                               (e.linears() for e in self.experts)])
            w2 = torch.stack([e.linears()[2].weight.detach() for e in self.experts])
            inter = w2.shape[2]
            for i, expert in enumerate(self.experts):
                gate, up, down = expert.linears()
                gate.weight = nn.Parameter(w13[i, :inter], requires_grad=False)
                up.weight = nn.Parameter(w13[i, inter:], requires_grad=False)
                down.weight = nn.Parameter(w2[i], requires_grad=False)
        ptrs = tuple(lin.weight.data_ptr() for lin in linears)
        self._stacked = (w13, w2, ptrs)
        return w13, w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [T, H] -> [T, H]
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        if isinstance(self.experts[0].linears()[0], nn.Linear):
            w13, w2 = self.stacked_weights()
            out = self.ops.fused_moe(x, w13, w2, weights, ids)
        else:
            out = per_expert_moe(x, self.experts, weights, ids)
        return out if self.tp_group is None else self.tp_group.all_reduce(out)


def per_expert_moe(x: torch.Tensor, experts: nn.ModuleList, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)), each expert's projections called as modules
    (quantized ones included) on the tokens routed to it, in one GEMM per projection."""
    def expert(e: int, h: torch.Tensor) -> torch.Tensor:
        gate, up, down = experts[e].linears()
        return down(F.silu(gate(h)) * up(h))
    return moe_by_expert(x, topk_weights, topk_ids, len(experts), expert)
