"""The bytes the LoRA slots hold: allocated before the KV cache is sized, and taken out of it.

    slot_bytes(targets)   every site's A and B, all --max-loras slots at --max-lora-rank

Per site `max_loras × parts × R × (in + out)` elements of the model's dtype (slots.py): fixed from
the start, whatever adapters are loaded, like the weights. The CPU rule subtracts them from the
KV cache's share of free memory (engine.py); on a GPU they are allocated before the profiling
run, so the device's memory in use already holds them (gpu_memory.py, as vLLM counts its LoRA
slots), and the log names them.
"""
from __future__ import annotations

from kvmesh.engine.lora.targets import LoRATargets


def slot_bytes(targets: LoRATargets) -> int:
    """Bytes of every site's stacked A and B (one rank's, under tensor parallelism)."""
    return sum(t.numel() * t.element_size() for site in targets.sites for t in (site.a, site.b))
