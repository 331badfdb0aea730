"""LoRARequest: which adapter a request runs with (vLLM's `LoRARequest` fields)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter as a request names it. Requests for the base model carry None."""

    lora_name: str                     # the adapter's `model` name in the API
    lora_int_id: int                   # unique id >= 1 while loaded (slots, KV events)
    lora_path: str                     # PEFT directory: adapter_config.json + adapter_model.safetensors
    base_model_name: str | None = None  # the model it was trained on (`parent` in /v1/models)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")
