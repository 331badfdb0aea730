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

A GGUF weight served as blocks (`QuantizedWeight`) is cut the same way without dequantizing:
whole rows for column-parallel (each row is its own blocks; the padded vocabulary gets rows of
zero bytes, which every block format decodes to zeros), whole blocks of every row for
row-parallel; a column range that cuts a block is refused (`block_cut` says so before loading).
A Hugging Face quantized weight (`hf_weight`: AWQ / GPTQ int4, W8A8 int8, FP8) likewise: rows
with their scales (and zeros); for row-parallel, whole int4 groups (`hf_cut` refuses a range
that cuts one, and act-order GPTQ, whose permutation mixes K across ranks), and the int8 row
sums recomputed over the rank's columns.
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
from kvmesh.engine.layers.quantized import QuantizedEmbedding
from kvmesh.engine.parallel.group import TPGroup
from kvmesh.engine.parallel.plan import TPPlan
from kvmesh.kernels.quant import QuantizedWeight, embedding_rows
from kvmesh.kernels.quant.hf_weight import (HF_WEIGHTS, Fp8Weight, HFWeight, Int4GroupWeight, Int8ChannelWeight,
                                            Int8GroupWeight)
from kvmesh.kernels.quant.weight import FORMATS


@dataclass(frozen=True, slots=True)
class ShardRule:
    """Which part of a checkpoint tensor a rank keeps."""

    dim: int                             # 0: rows (column-parallel), 1: columns (row-parallel)
    ranges: tuple[tuple[int, int], ...]  # [start, stop) along `dim`, concatenated in order
    pad_to: int = 0                      # zero rows appended up to this many (the padded vocab)
    zero: bool = False                   # keep the shape, zero the values (row-parallel bias off rank 0)

    def take(self, source) -> torch.Tensor | QuantizedWeight:
        """The shard of `source`: a tensor, a safetensors slice (reads only those bytes), or GGUF
        blocks (whole rows or whole blocks, never dequantized)."""
        if isinstance(source, QuantizedWeight):
            return self._take_blocks(source)
        if isinstance(source, HF_WEIGHTS):
            return self._take_hf(source)
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

    def cut(self, block: int) -> tuple[int, int] | None:
        """The first column range of a row-parallel rule that does not start and end on a
        multiple of `block` (elements a block), or None: the shard keeps whole blocks."""
        if self.dim != 1:
            return None
        return next(((a, b) for a, b in self.ranges if a % block or b % block), None)

    def _take_blocks(self, w: QuantizedWeight) -> QuantizedWeight:
        name, qk, size = FORMATS[w.qtype]
        n, k = w.shape
        if self.dim == 0:
            data = self._rows(w.data)
            return QuantizedWeight(data, w.qtype, (data.shape[0], k), w.activations)
        cut = self.cut(qk)
        if cut is not None:
            raise ValueError(f"columns [{cut[0]}, {cut[1]}) of a {name} weight cut its {qk}-element blocks")
        data = torch.cat([w.data[:, a // qk * size:b // qk * size] for a, b in self.ranges if b > a], dim=1)
        return QuantizedWeight(data.contiguous(), w.qtype, (n, data.shape[1] // size * qk), w.activations)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """The rule's rows of a packed tensor, contiguous, padded with zero rows up to pad_to
        (zero bytes, codes and scales decode to zero weights in every format)."""
        out = torch.cat([t[a:b] for a, b in self.ranges if b > a])
        if self.pad_to and out.shape[0] < self.pad_to:
            out = torch.cat([out, out.new_zeros(self.pad_to - out.shape[0], *out.shape[1:])])
        return out.contiguous()

    def _take_hf(self, w: HFWeight) -> HFWeight:
        if self.dim == 0:
            rows = self._rows
            if isinstance(w, Int4GroupWeight):
                return Int4GroupWeight(rows(w.qweight), rows(w.scales), rows(w.zeros), w.group_size, w.perm)
            if isinstance(w, Int8GroupWeight):
                return Int8GroupWeight(rows(w.qweight), rows(w.scales), rows(w.zeros), w.group_size)
            if isinstance(w, Int8ChannelWeight):
                return Int8ChannelWeight(rows(w.weight), rows(w.weight_scale), rows(w.w_sum))
            per_row = w.weight_scale.numel() > 1
            return Fp8Weight(rows(w.weight), rows(w.weight_scale) if per_row else w.weight_scale, w.activations)

        def cols(t: torch.Tensor, per: int = 1) -> torch.Tensor:
            return torch.cat([t[:, a // per:b // per] for a, b in self.ranges if b > a], dim=1).contiguous()
        if isinstance(w, Int4GroupWeight):
            cut = self.cut(w.group_size)
            if w.perm is not None or cut is not None:
                raise ValueError("act-order int4 weights cannot be split along K" if w.perm is not None else
                                 f"columns [{cut[0]}, {cut[1]}) cut the int4 groups of {w.group_size}")
            return Int4GroupWeight(cols(w.qweight, 2), cols(w.scales, w.group_size), cols(w.zeros, w.group_size),
                                   w.group_size)
        if isinstance(w, Int8GroupWeight):
            cut = self.cut(w.group_size)
            if cut is not None:
                raise ValueError(f"columns [{cut[0]}, {cut[1]}) cut the int8 groups of {w.group_size}")
            return Int8GroupWeight(cols(w.qweight), cols(w.scales, w.group_size), cols(w.zeros, w.group_size),
                                   w.group_size)
        if isinstance(w, Int8ChannelWeight):
            weight = cols(w.weight)
            return Int8ChannelWeight(weight, w.weight_scale, weight.sum(1, dtype=torch.int32))
        return Fp8Weight(cols(w.weight), w.weight_scale, w.activations)


def hf_cut(rules: dict[str, ShardRule], cfg, size: int) -> str | None:
    """Why a Hugging Face quantized checkpoint (`cfg`: its HFQuantConfig) cannot be sharded as
    `rules` say, or None: only int4 groups constrain a row-parallel split."""
    if cfg.scheme != "w4a16":
        return None
    for name, rule in sorted(rules.items()):
        if rule.dim != 1 or cfg.is_ignored(name.rpartition(".")[0]):
            continue
        if cfg.desc_act:
            return (f"--tensor-parallel-size {size} splits the input columns of {name}, and act-order "
                    "GPTQ weights (desc_act) permute them across ranks")
        cut = rule.cut(cfg.group_size) if cfg.group_size else rule.ranges[0]
        if cut is not None:
            return (f"--tensor-parallel-size {size} gives each rank columns [{cut[0]}, {cut[1]}) of "
                    f"{name}, which cut its int4 groups of {cfg.group_size or 'a whole row'}")
    return None


def block_cut(rules: dict[str, ShardRule], tensors, size: int) -> str | None:
    """Why a GGUF file's blocks cannot be sharded as `rules` say, or None. `tensors`: (HF name,
    ggml type) of each tensor served as blocks (GGUFFile.block_tensors)."""
    for name, qtype in tensors:
        rule = rules.get(name)
        fmt, qk, _ = FORMATS[qtype]
        cut = rule.cut(qk) if rule is not None else None
        if cut is not None:
            return (f"--tensor-parallel-size {size} gives each rank columns [{cut[0]}, {cut[1]}) of "
                    f"{name}, which cut its {fmt} blocks of {qk}")
    return None


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


class QuantizedVocabParallelEmbedding(QuantizedEmbedding):
    """VocabParallelEmbedding over GGUF blocks: only the looked-up rows of this rank's shard are
    dequantized; a tied LM head multiplies the same bytes (CausalLM.tie_weights)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, start: int, group: TPGroup):
        super().__init__(weight, dtype)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:      # [T] -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = embedding_rows(self.weight, local.masked_fill(outside, 0))
        rows = rows if rows.dtype == self.dtype else rows.to(self.dtype)
        return self.group.all_reduce(rows.masked_fill(outside[:, None], 0.0))


def quantized_twin(module: nn.Module, weight: QuantizedWeight, dtype: torch.dtype) -> nn.Module | None:
    """The quantized replacement of a sharded module this file made, or None (not one of them)."""
    if isinstance(module, VocabParallelEmbedding):
        return QuantizedVocabParallelEmbedding(weight, dtype, module.start, module.group)
    return None


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
