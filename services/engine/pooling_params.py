"""Per-request pooling settings: an embeddings request is a prefill whose hidden states are
pooled into one vector instead of sampled (vLLM's PoolingParams). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean")


@dataclass(slots=True, frozen=True)
class PoolingParams:
    pooling: str = "last"      # "last": the last prompt token's hidden state; "mean": all of them
    normalize: bool = True     # L2-normalise the pooled vector (what embedding clients expect)

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling!r}")
