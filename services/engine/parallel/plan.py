"""How a model splits over N ranks: validated once, at load, against the model's sizes.

    query heads        N | heads                 rank r: heads [r*h/N, (r+1)*h/N)
    KV heads           N | kv, or kv | N          rank r: kv/N heads, or 1 head (r // (N/kv)) replicated
    MLP width          N | intermediate          (and each MoE expert's width)
    vocabulary         padded up to a multiple of N; rank r: rows [r*Vp/N, (r+1)*Vp/N)

Query head q attends with KV head q // (h/kv); the slices above keep every rank's query heads
on the KV heads that rank holds, so attention needs no communication.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvmesh.engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class TPPlan:
    """One rank's share of a model (sizes are the full model's unless named local)."""

    rank: int
    size: int
    num_heads: int            # query heads of the model
    num_kv_heads: int         # KV heads of the model
    head_dim: int
    vocab_size: int
    intermediate_size: int    # dense MLP width
    moe_intermediate_size: int | None   # one expert's width (None: no MoE)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        """KV heads held by each rank: kv / N, or 1 when KV heads are replicated (kv < N)."""
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head of this rank's slice."""
        if self.num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        return self.rank // (self.size // self.num_kv_heads)

    @property
    def local_vocab(self) -> int:
        """Rows of this rank's embedding / lm_head shard (the vocabulary padded to N | Vp)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab


def validate_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming the sizes that do not split over `size` ranks (nothing if size is 1)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    problems = _problems(config, size)
    if problems:
        valid = [n for n in range(2, 17) if not _problems(config, n)]
        hint = (f"sizes that fit this model: {', '.join(map(str, valid))}" if valid
                else "this model cannot be split; use --tensor-parallel-size 1")
        raise ValueError(f"--tensor-parallel-size {size} does not fit {config.architecture}: "
                         + "; ".join(problems) + f" ({hint})")


def _problems(config: ModelConfig, size: int) -> list[str]:
    if size == 1:
        return []
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    out = []
    if heads % size:
        out.append(f"the number of query heads ({heads}) is not divisible by {size}")
    if kv >= size and kv % size:
        out.append(f"the number of KV heads ({kv}) is not divisible by {size}")
    if kv < size and size % kv:
        out.append(f"{size} is not a multiple of the number of KV heads ({kv}), so the KV heads "
                   "cannot be replicated evenly")
    if config.intermediate_size % size:
        out.append(f"the MLP intermediate size ({config.intermediate_size}) is not divisible by {size}")
    moe = config.moe
    if moe is not None and moe.num_experts and moe.intermediate_size % size:
        out.append(f"the MoE expert intermediate size ({moe.intermediate_size}) is not divisible by {size}")
    return out


def make_plan(config: ModelConfig, rank: int, size: int) -> TPPlan:
    validate_tensor_parallel(config, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} out of range for {size} ranks")
    moe = config.moe.intermediate_size if config.moe is not None else None
    return TPPlan(rank, size, config.num_attention_heads, config.num_key_value_heads,
                  config.head_dim, config.vocab_size, config.intermediate_size, moe)


def local_config(config: ModelConfig, plan: TPPlan) -> ModelConfig:
    """The config a rank builds its model from: its heads and MLP widths (hidden size and vocab
    stay the model's; the embedding and lm_head are replaced by vocab-parallel shards)."""
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // plan.size)
    return dataclasses.replace(config, num_attention_heads=plan.local_heads,
                               num_key_value_heads=plan.local_kv_heads,
                               intermediate_size=config.intermediate_size // plan.size, moe=moe)
