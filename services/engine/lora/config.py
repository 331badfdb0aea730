"""LoRAConfig: the engine's adapter limits (vLLM's --max-loras, --max-lora-rank, --max-cpu-loras)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    max_loras: int = 1            # distinct adapters in one step (the slots of the stacked weights)
    max_lora_rank: int = 16       # the rank every slot is sized for; a larger adapter is refused
    max_cpu_loras: int = 1        # adapters kept read in host memory (an LRU; >= max_loras)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras "
                             f"({self.max_loras}): every adapter of a step is read in memory")
