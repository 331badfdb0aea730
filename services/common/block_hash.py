"""The ONE definition of the chained prefix-cache block hash (engine and router must agree).

A block's hash covers its parent's hash, its token ids and its extra keys, so equal hashes mean
equal prefixes. The encoding is canonical and machine independent:

    SHA-256( b"kvmesh-block-v1\\0"
             || parent digest (32 bytes)
             || uint32 LE token count || token ids as uint32 LE
             || uint32 LE byte length || extra keys as canonical JSON )

canonical JSON = a list, sorted keys, separators "," and ":", ASCII only; no extra keys = b"[]".
root_hash(seed) = SHA-256(b"kvmesh-root-v1\\0" || JSON of the seed); it is block 0's parent.
The cache salt is an extra key of block 0 only ({"cache_salt": salt}); the chain carries it into
every later block. A LoRA adapter's name is one too ({"lora_name": name}, after the salt), so two
adapters (or an adapter and the base model) never share a block. Only FULL blocks are hashed.
"""
from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache

BlockHash = bytes  # a 32-byte SHA-256 digest

HASH_VERSION = b"kvmesh-block-v1\x00"
_ROOT_VERSION = b"kvmesh-root-v1\x00"
_DIGEST_SIZE = 32
_U32 = struct.Struct("<I")
_EMPTY_EXTRA = b"[]"

# NOTE: array('I') is 4 bytes on every platform CPython supports today; fall back to 'L' where it
# is not, and byteswap on big-endian hosts so the digest never depends on the machine.
_TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"
assert array(_TOKEN_TYPECODE).itemsize == 4, "no 4-byte unsigned array type on this platform"
_BIG_ENDIAN = sys.byteorder == "big"


def _canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


@lru_cache(maxsize=64)
def root_hash(seed: str | int = "kvmesh") -> BlockHash:
    """The parent digest of block 0. Different seeds give disjoint hash chains."""
    if isinstance(seed, bool) or not isinstance(seed, (str, int)):
        raise TypeError(f"hash seed must be a str or an int, got {type(seed).__name__}")
    # NOTE: JSON keeps "42" and 42 apart.
    return hashlib.sha256(_ROOT_VERSION + _canonical_json(seed)).digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        arr = array(_TOKEN_TYPECODE, token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must satisfy 0 <= id < 2**32: {exc}") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """SHA-256 of (parent, token ids, extra keys) in the canonical encoding above."""
    if len(parent) != _DIGEST_SIZE:
        raise ValueError(f"parent hash must be {_DIGEST_SIZE} bytes, got {len(parent)}")
    extra = _canonical_json(list(extra_keys)) if extra_keys else _EMPTY_EXTRA
    h = hashlib.sha256(HASH_VERSION)
    h.update(parent)
    h.update(_U32.pack(len(token_ids)))
    h.update(_token_bytes(token_ids))
    h.update(_U32.pack(len(extra)))
    h.update(extra)
    return h.digest()


def block0_extra_keys(cache_salt: str | None, lora_name: str | None) -> tuple:
    """Block 0's extra keys: the cache salt, then the LoRA adapter's name (each when set)."""
    keys = () if cache_salt is None else ({"cache_salt": cache_salt},)
    # NOTE: the name, as vLLM's prefix cache keys an adapter: a router computes it from the
    # request's `model` alone. Reusing a name for other weights must reset the prefix cache.
    return keys if lora_name is None else (*keys, {"lora_name": lora_name})


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, *, seed: str | int = "kvmesh",
                       cache_salt: str | None = None, start: int = 0,
                       parent: BlockHash | None = None,
                       lora_name: str | None = None) -> list[BlockHash]:
    """Chained hashes of every FULL block of `token_ids`.

    `start` is a token offset (a multiple of block_size) where hashing begins; when it is > 0,
    `parent` must be the hash of the block just before it. The cache salt and the LoRA adapter's
    name only enter block 0.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start % block_size:
        raise ValueError(f"start ({start}) must be a multiple of block_size ({block_size})")
    if start > 0 and parent is None:
        raise ValueError("parent is required when start > 0 (the hash of the block before start)")
    if parent is None:
        parent = root_hash(seed)
    hashes: list[BlockHash] = []
    end = len(token_ids) - len(token_ids) % block_size
    for pos in range(start, end, block_size):
        extra = block0_extra_keys(cache_salt, lora_name) if pos == 0 else ()
        parent = hash_block(parent, token_ids[pos:pos + block_size], extra)
        hashes.append(parent)
    return hashes


def extend_block_hashes(existing: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        seed: str | int = "kvmesh",
                        cache_salt: str | None = None,
                        lora_name: str | None = None) -> list[BlockHash]:
    """Append (in place) the hashes of blocks that became full since `existing` was computed.

    Returns the newly appended hashes. O(1) when no block became full (the decode fast path).
    """
    start = len(existing) * block_size
    if start + block_size > len(token_ids):
        return []
    new = hash_prompt_blocks(token_ids, block_size, seed=seed, cache_salt=cache_salt,
                             start=start, parent=existing[-1] if existing else None,
                             lora_name=lora_name)
    existing.extend(new)
    return new


def hash_hex(h: BlockHash) -> str:
    """Lower-case hex of a digest (the form used in KV events and the Redis index)."""
    return h.hex()


class BlockHasher:
    """Keeps a request's `block_hashes` equal to the chained hashes of its full blocks.

    The scheduler owns one and hands it to every request it admits (vLLM's `request.block_hashes`
    filled by one hasher): the request calls it once for its prompt and again after every
    appended token, so the hashes grow with the tokens and every reader (the prefix cache, the
    cross-pod KV store) only reads them. O(1) per call unless a block just became full."""

    __slots__ = ("block_size", "seed")

    def __init__(self, block_size: int, seed: str | int = "kvmesh") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        root_hash(seed)                      # NOTE: a bad seed fails here, not mid-step
        self.block_size = block_size
        self.seed = seed

    def __call__(self, request) -> None:
        """request: anything with block_hashes, all_token_ids, cache_salt and lora_name
        (engine.Request)."""
        hashes = request.block_hashes
        if (len(hashes) + 1) * self.block_size <= len(request.all_token_ids):
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, self.seed,
                                request.cache_salt, request.lora_name)
