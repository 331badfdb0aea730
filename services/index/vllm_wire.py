"""vLLM's KV-event wire format: kvmesh's events <-> the msgpack payloads vLLM engines publish.

One ZMQ message is three frames:

    topic (utf-8) | sequence number (8 bytes, big-endian, from 0) | payload (msgpack)

payload = KVEventBatch, a msgpack ARRAY  [ts, events, data_parallel_rank]
event   = a msgpack MAP tagged by its class name, fields in declaration order:
    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil,
     "token_ids": [...], "block_size": n, "lora_id": nil, "medium": "GPU",
     "lora_name": nil, ...optional fields only when set (extra_keys, group_idx, ...)}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", ...}
    {"type": "AllBlocksCleared"}

Block hashes are unsigned 64-bit integers by default (the low 8 bytes of the engine's digest,
read big-endian), or the digest's bytes; consumers must accept both. Fields with a default are
left out while they hold it; fields without one (parent_block_hash, lora_id, medium, lora_name)
are always written, nil included. Older vLLM releases wrote the events as arrays
[tag, field, ...]; `decode_batch` reads both forms.

A replay request (to the ROUTER socket) is one 8-byte big-endian start sequence number; the
answer is every buffered message with seq >= start as (b"", topic, seq, payload), then the end
marker (b"", b"", -1 as 8 signed bytes, b"").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUMS = {"gpu": "GPU", "cpu": "CPU"}          # kvmesh tier -> vLLM medium


class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def wire_hash(h: bytes) -> int:
    """A kvmesh digest as vLLM's default external block hash: the low 64 bits, big-endian."""
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF


def _to_wire(event: KVCacheEvent) -> _Stored | _Removed | _Cleared:
    if isinstance(event, BlockStored):
        return _Stored([wire_hash(h) for h in event.block_hashes],
                       None if event.parent_block_hash is None
                       else wire_hash(event.parent_block_hash),
                       list(event.token_ids), event.block_size, event.lora_id,
                       MEDIUMS.get(event.medium, event.medium.upper()), event.lora_name,
                       group_idx=0)
    if isinstance(event, BlockRemoved):
        return _Removed([wire_hash(h) for h in event.block_hashes],
                        MEDIUMS.get(event.medium, event.medium.upper()), group_idx=0)
    if isinstance(event, AllBlocksCleared):
        return _Cleared()
    raise TypeError(f"unknown KV event {type(event).__name__}")


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of one batch of kvmesh events, as a vLLM engine would publish it."""
    return _ENCODER.encode(_Batch(ts, [_to_wire(e) for e in events], data_parallel_rank))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(frame: bytes) -> int:
    """A sequence-number frame; ValueError unless it is 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


# ---- decoding (the router's subscribers) ------------------------------------------------------
ExternalHash = int | bytes


@dataclass(frozen=True, slots=True)
class WireStored:
    """A BlockStored as published: engine hashes (int or bytes) and the blocks' tokens."""
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    medium: str                 # lower-case tier: gpu / cpu / storage
    lora: bool                  # a LoRA adapter's blocks (lora_id or lora_name set)
    extra_keys: list | None     # per-block extra keys (adapter, multimodal ids, salt), as sent
    lora_name: str | None = None  # the adapter's served name (vLLM 0.32 sends it beside lora_id)


@dataclass(frozen=True, slots=True)
class WireRemoved:
    block_hashes: list[ExternalHash]
    medium: str


@dataclass(frozen=True, slots=True)
class WireCleared:
    pass


WireEvent = WireStored | WireRemoved | WireCleared

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


class WireFormatError(ValueError):
    """A payload that is not a vLLM KV-event batch."""


def _hashes(value: Any) -> list[ExternalHash]:
    if not isinstance(value, list) or not all(isinstance(h, (int, bytes)) for h in value):
        raise WireFormatError(f"block_hashes must be a list of ints or bytes, got {value!r:.80}")
    return value


def _fields(raw: Any, names: tuple[str, ...]) -> tuple[str, dict]:
    if isinstance(raw, dict):
        return str(raw.get("type")), raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:]))
    raise WireFormatError(f"an event must be a tagged map or array, got {type(raw).__name__}")


def _event(raw: Any) -> WireEvent:
    kind = raw.get("type") if isinstance(raw, dict) else (raw[0] if isinstance(raw, list) and raw
                                                            else None)
    if kind == "BlockStored":
        _, f = _fields(raw, _STORED_FIELDS)
        tokens, size = f.get("token_ids"), f.get("block_size")
        if (not isinstance(tokens, list) or not isinstance(size, int) or size <= 0
                or not all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens)):
            raise WireFormatError("BlockStored needs token_ids (a list of token ids) and a "
                                  "positive block_size")
        parent = f.get("parent_block_hash")
        if parent is not None and not isinstance(parent, (int, bytes)):
            raise WireFormatError(f"parent_block_hash must be an int, bytes or nil: {parent!r:.80}")
        return WireStored(_hashes(f.get("block_hashes")), parent, tokens, size,
                          str(f.get("medium") or "GPU").lower(),
                          f.get("lora_id") is not None or f.get("lora_name") is not None,
                          f.get("extra_keys"),
                          f["lora_name"] if isinstance(f.get("lora_name"), str) else None)
    if kind == "BlockRemoved":
        _, f = _fields(raw, _REMOVED_FIELDS)
        return WireRemoved(_hashes(f.get("block_hashes")), str(f.get("medium") or "GPU").lower())
    if kind == "AllBlocksCleared":
        return WireCleared()
    raise WireFormatError(f"unknown KV event type {kind!r}")


def decode_batch(payload: bytes) -> tuple[float, list[WireEvent]]:
    """(ts, events) of one payload; WireFormatError if it is not a KVEventBatch."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise WireFormatError(f"payload is not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireFormatError("a KVEventBatch is an array [ts, events, data_parallel_rank]")
    ts = raw[0] if isinstance(raw[0], (int, float)) else 0.0
    return float(ts), [_event(e) for e in raw[1]]
