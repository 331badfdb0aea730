"""Each parameter's shard, from the shared layers; the vocab-parallel embedding and lm_head.

A rank builds its model from `plan.local_config` (its heads and MLP widths), so every family's
layers come out at their local sizes with no change to the family files. `shard_model` then
swaps in the vocab-parallel embedding / lm_head and hands the group to the layers that
communicate; `shard_rules` says, per HF parameter name, which rows or columns of the checkpoint
tensor this rank keeps (Megatron-style):

    column-parallel (rows of W):  q/k/v, Phi-3's fused qkv (each part sliced), gate/up, Phi-3's
                                  fused gate_up, every expert's gate/up, embed_tokens, lm_head
    row-parallel (columns of W):  o_proj, down_proj, every expert's down; their bias on rank 0
                                  only, so the all-reduce adds it once
    replicated:                   norms, the MoE router, everything else
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.layers.attention import Attention
from kvmesh.engine.layers.causal_lm import CausalLM
from kvmesh.engine.layers.mlp import GatedMLP
from kvmesh.engine.layers.moe import SparseMoeBlock
from kvmesh.engine.parallel.group import TPGroup
from kvmesh.engine.parallel.plan import TPPlan


@dataclass(frozen=True, slots=True)
class ShardRule:
    """Which part of a checkpoint tensor a rank keeps."""

    dim: int                             # 0: rows (column-parallel), 1: columns (row-parallel)
    ranges: tuple[tuple[int, int], ...]  # [start, stop) along `dim`, concatenated in order
    pad_to: int = 0                      # zero rows appended up to this many (the padded vocab)
    zero: bool = False                   # keep the shape, zero the values (row-parallel bias off rank 0)

    def take(self, source) -> torch.Tensor:
        """The shard of `source`: a tensor, or a safetensors slice (reads only those bytes)."""
        if self.zero:
            shape = source.shape if isinstance(source, torch.Tensor) else source.get_shape()
            return torch.zeros(shape, dtype=_dtype(source))
        parts = []
        for start, stop in self.ranges:
            if stop > start:
                parts.append(source[start:stop] if self.dim == 0 else source[:, start:stop])
        out = torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0]
        if self.pad_to and out.shape[0] < self.pad_to:
            out = torch.cat([out, out.new_zeros(self.pad_to - out.shape[0], *out.shape[1:])])
        return out


def _dtype(source) -> torch.dtype:
    if isinstance(source, torch.Tensor):
        return source.dtype
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "F64": torch.float64}[source.get_dtype()]


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding; other ids give zeros, summed over the ranks."""

    def __init__(self, num_local: int, hidden: int, start: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_local, hidden))
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:      # [T] -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(emb.masked_fill(outside[:, None], 0.0))


def shard_model(model: CausalLM, plan: TPPlan, group: TPGroup) -> None:
    """On the meta-device model built from the local config: vocab-parallel embedding and
    lm_head, and the group for the layers whose output is a partial sum."""
    hidden = model.config.hidden_size
    model.model.embed_tokens = VocabParallelEmbedding(plan.local_vocab, hidden, plan.vocab_start, group)
    model.lm_head = nn.Linear(hidden, plan.local_vocab, bias=False)
    model.tie_weights()
    model.tp_group = group
    for module in model.modules():
        if isinstance(module, (Attention, GatedMLP, SparseMoeBlock)):
            module.tp_group = group


def shard_rules(model: CausalLM, plan: TPPlan) -> dict[str, ShardRule]:
    """HF parameter name -> this rank's rule; names absent are replicated."""
    rules: dict[str, ShardRule] = {}
    rank, hd = plan.rank, plan.head_dim
    vocab = ShardRule(0, ((plan.vocab_start, min(plan.vocab_start + plan.local_vocab, plan.vocab_size)),),
                      pad_to=plan.local_vocab)
    rules["model.embed_tokens.weight"] = vocab
    rules["lm_head.weight"] = vocab
    for prefix, module in model.named_modules():
        if isinstance(module, Attention):
            nq, nkv = plan.num_heads * hd, plan.num_kv_heads * hd
            q = (rank * plan.local_heads * hd, (rank + 1) * plan.local_heads * hd)
            kv0 = plan.kv_head_start * hd
            kv = (kv0, kv0 + plan.local_kv_heads * hd)
            if module.fused_qkv:
                _column(rules, f"{prefix}.qkv_proj", (q, (nq + kv[0], nq + kv[1]),
                                                      (nq + nkv + kv[0], nq + nkv + kv[1])))
            else:
                _column(rules, f"{prefix}.q_proj", (q,))
                _column(rules, f"{prefix}.k_proj", (kv,))
                _column(rules, f"{prefix}.v_proj", (kv,))
            _row(rules, f"{prefix}.o_proj", q, rank)
        elif isinstance(module, GatedMLP):
            width = module.down_proj.in_features            # the local width
            part = (rank * width, (rank + 1) * width)
            if module.fused_gate_up:
                full = width * plan.size
                _column(rules, f"{prefix}.gate_up_proj", (part, (full + part[0], full + part[1])))
            else:
                _column(rules, f"{prefix}.gate_proj", (part,))
                _column(rules, f"{prefix}.up_proj", (part,))
            _row(rules, f"{prefix}.down_proj", part, rank)
        elif isinstance(module, SparseMoeBlock):
            for e, expert in enumerate(module.experts):
                gate, up, down = expert.names
                width = getattr(expert, down).in_features
                part = (rank * width, (rank + 1) * width)
                _column(rules, f"{prefix}.experts.{e}.{gate}", (part,))
                _column(rules, f"{prefix}.experts.{e}.{up}", (part,))
                _row(rules, f"{prefix}.experts.{e}.{down}", part, rank)
    return rules


def _column(rules: dict[str, ShardRule], linear: str, ranges: tuple[tuple[int, int], ...]) -> None:
    rules[f"{linear}.weight"] = ShardRule(0, ranges)
    rules[f"{linear}.bias"] = ShardRule(0, ranges)


def _row(rules: dict[str, ShardRule], linear: str, cols: tuple[int, int], rank: int) -> None:
    rules[f"{linear}.weight"] = ShardRule(1, (cols,))
    if rank != 0:
        rules[f"{linear}.bias"] = ShardRule(0, (), zero=True)
