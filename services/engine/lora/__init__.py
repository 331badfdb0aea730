"""Multi-LoRA serving: many PEFT adapters on one base model, mixed in one batch.

    request.py   LoRARequest (which adapter a request runs with)
    config.py    LoRAConfig (--max-loras, --max-lora-rank, --max-cpu-loras)
    targets.py   the base model's adaptable projections (sites), HF module names -> site parts
    adapter.py   reading and validating a PEFT adapter against those sites
    slots.py     one site's stacked slot weights and its add-on to the projection's output
    mapping.py   one step's tokens grouped by slot (segments), shared by every site
    manager.py   host LRU of read adapters, device slots, the step's mapping
"""
from kvmesh.engine.lora.config import LoRAConfig
from kvmesh.engine.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
