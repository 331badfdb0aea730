"""Prompt token ids -> the chained block hashes the router looks up, exactly as an engine computes
them (the hash function itself: kvmesh.common.block_hash, shared with the engine's block pool)."""
from __future__ import annotations

from typing import Any

from kvmesh.common.block_hash import hash_prompt_blocks


def prompt_block_hashes(token_ids: list[int] | None, block_size: int, seed: str | int,
                        cache_salt: Any = None, lora_name: str | None = None) -> list[bytes]:
    """The engine's chained hashes of the prompt's full blocks (cache salt and LoRA adapter
    included: a request to an adapter only matches that adapter's blocks)."""
    if not token_ids:
        return []
    salt = cache_salt if isinstance(cache_salt, str) and cache_salt else None
    try:
        return hash_prompt_blocks(token_ids, block_size, seed=seed, cache_salt=salt,
                                  lora_name=lora_name)
    except (ValueError, TypeError):
        return []
