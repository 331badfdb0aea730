"""One vLLM engine's cached blocks as its KV events describe them, keyed by kvmesh's own hash.

Pure state, no I/O (the subscriber, vllm_subscriber.py, does the sockets and Redis). A
BlockStored carries its blocks' token ids and its parent's ENGINE hash; the chain keeps
engine hash -> kvmesh hash for every block the engine holds, so it can extend kvmesh's chained
hash (kvmesh.common.block_hash) from the parent. A LoRA adapter's chain gets the adapter's name
in block 0, as kvmesh's engines hash it (vLLM puts the name first in every block's extra keys),
so the router's lookup for that adapter matches it. What kvmesh's hash cannot express (an
adapter known by its id alone, multimodal extra keys, another block size, a parent it never
saw) is left out and counted: a missing index entry costs a prefix hit, a wrong one would
misroute.
"""
from __future__ import annotations

from kvmesh.common.block_hash import BlockHash, block0_extra_keys, hash_block
from kvmesh.index.vllm_wire import ExternalHash, WireRemoved, WireStored

Entry = tuple[BlockHash, str]      # (kvmesh hash, tier)


class EngineBlockChain:
    def __init__(self, root: BlockHash, block_size: int) -> None:
        self.root = root                    # root_hash(seed): block 0's parent
        self.block_size = block_size        # the router's --block-size
        self._hash: dict[ExternalHash, BlockHash] = {}     # engine hash -> kvmesh hash
        self._tiers: dict[ExternalHash, set[str]] = {}     # engine hash -> tiers holding it
        self.skipped_blocks = 0             # blocks left out (see the module doc)

    def stored(self, e: WireStored) -> list[Entry]:
        """Apply a BlockStored; returns the entries that became present."""
        n = len(e.block_hashes)
        parent = self.root if e.parent_block_hash is None else self._hash.get(e.parent_block_hash)
        lora = e.lora_name if e.lora else None
        keys = _without_lora(e.extra_keys, lora)
        salt = False if keys is False else _salt(keys, e.parent_block_hash is None)
        if (parent is None or (e.lora and lora is None) or e.block_size != self.block_size
                or len(e.token_ids) != n * e.block_size or salt is False):
            self.skipped_blocks += n
            return []
        added = []
        for i, engine_hash in enumerate(e.block_hashes):
            # NOTE: below a chain's block 0 the adapter and salt ride in the parent's hash
            first = i == 0 and e.parent_block_hash is None
            extra = block0_extra_keys(salt or None, lora) if first else ()
            parent = hash_block(parent, e.token_ids[i * e.block_size:(i + 1) * e.block_size],
                                extra)
            known = self._hash.get(engine_hash)
            if known is not None and known != parent:
                self.skipped_blocks += 1          # an engine hash collision: keep the first
                continue
            self._hash[engine_hash] = parent
            tiers = self._tiers.setdefault(engine_hash, set())
            if e.medium not in tiers:
                tiers.add(e.medium)
                added.append((parent, e.medium))
        return added

    def removed(self, e: WireRemoved) -> list[Entry]:
        """Apply a BlockRemoved; returns the entries that became absent (unknown ones: none)."""
        gone = []
        for engine_hash in e.block_hashes:
            tiers = self._tiers.get(engine_hash)
            if not tiers or e.medium not in tiers:
                continue
            tiers.discard(e.medium)
            gone.append((self._hash[engine_hash], e.medium))
            if not tiers:
                del self._tiers[engine_hash]
                del self._hash[engine_hash]
        return gone

    def clear(self) -> None:
        self._hash.clear()
        self._tiers.clear()

    def entries(self) -> set[Entry]:
        """Every (kvmesh hash, tier) the engine holds, as far as the events said."""
        return {(self._hash[h], t) for h, tiers in self._tiers.items() for t in tiers}


def _without_lora(extra_keys: list | None, lora_name: str | None) -> list | None | bool:
    """Each block's extra keys without the adapter's name vLLM puts first in them; False when
    a block's keys do not start with it."""
    if not extra_keys or lora_name is None:
        return extra_keys
    out = []
    for keys in extra_keys:
        if not isinstance(keys, (list, tuple)) or not keys or keys[0] != lora_name:
            return False
        out.append(list(keys[1:]) or None)
    return out


def _salt(extra_keys: list | None, first_block: bool) -> str | None | bool:
    """The cache salt of a chain's block 0 from its extra keys: None (no extra keys), the salt
    string, or False when the keys hold anything kvmesh's hash cannot express."""
    if not extra_keys:
        return None
    if any(k for k in extra_keys[1:]):
        return False
    first = extra_keys[0]
    if not first:
        return None
    if first_block and isinstance(first, (list, tuple)) and len(first) == 1 \
            and isinstance(first[0], str):
        return first[0]
    return False
