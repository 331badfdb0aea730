"""The Redis key layout of the prefix index, in one place (engines write it, the router reads it).

This module is the ONLY place key names are spelled. Every key of one InferenceService lives under
one prefix, which the operator's finalizer deletes (purge.py):

    kvmesh:{namespace}/{service}:blk:{model}:{hash_hex}   SET  of "{pod_id}|{tier}"      who holds a block
    kvmesh:{namespace}/{service}:podblk:{pod_id}          SET  of "{tier}|{model}|{hash_hex}"
                                                           every entry the pod added (exact clears)
    kvmesh:{namespace}/{service}:pod:{pod_id}             HASH url, model, running, waiting,
                                                           swapped, kv_usage, seq, ts;  PEXPIRE = TTL
    kvmesh:{namespace}/{service}:pods                     ZSET pod_id -> last heartbeat (unix s)
    kvmesh:{namespace}/{service}:kv:{model}:{dtype}:{layout}:{hash_hex}
                                                           STRING one block's KV bytes (--kv-share)

A pod is live while its `pod:` key exists. Lookups ignore members whose pod is not live, so a pod
that died without cleanup stops counting when its heartbeat expires; `PURGE_DEAD_PODS` (run by the
router and by every publisher from time to time) then deletes its entries for good.

NOTE: the Lua scripts build key names from the prefix, so they assume a standalone Redis (or a
cluster where the whole prefix maps to one slot), which is what the operator deploys.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_NAMESPACE = "default"
DEFAULT_SERVICE = "kvmesh"
TIERS = ("gpu", "cpu")


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Key names of one InferenceService (`namespace`/`service`)."""
    namespace: str
    service: str

    @classmethod
    def from_env(cls, namespace: str | None = None, service: str | None = None) -> KeySpace:
        """Explicit values win; else $POD_NAMESPACE / $KVMESH_SERVICE; else default / kvmesh."""
        return cls(namespace or os.environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE,
                   service or os.environ.get("KVMESH_SERVICE") or DEFAULT_SERVICE)

    @property
    def prefix(self) -> str:
        return f"kvmesh:{self.namespace}/{self.service}:"

    @property
    def all_keys_pattern(self) -> str:
        """SCAN pattern for every key of the service (what the finalizer deletes)."""
        return glob_escape(self.prefix) + "*"

    def block(self, model: str, hash_hex: str) -> str:
        return f"{self.prefix}blk:{model}:{hash_hex}"

    def block_pattern(self, model: str) -> str:
        """SCAN pattern for every block key of `model`."""
        return glob_escape(self.prefix + f"blk:{model}:") + "*"

    def kv_bytes_prefix(self, model: str, dtype: str, layout: tuple[int, ...]) -> str:
        """Prefix of the KV-bytes keys of one model, dtype and cache layout; a key is this
        prefix + the block's hash_hex. `model` is the weights' fingerprint
        (engine/fingerprint.py), never the served name. NOTE: the layout is in the name, so engines whose caches
        differ in shape never read each other's bytes."""
        return f"{self.prefix}kv:{model}:{dtype}:{'x'.join(str(d) for d in layout)}:"

    def pod(self, pod_id: str) -> str:
        return f"{self.prefix}pod:{pod_id}"

    @property
    def pod_key_prefix(self) -> str:
        return f"{self.prefix}pod:"

    def pod_blocks(self, pod_id: str) -> str:
        return f"{self.prefix}podblk:{pod_id}"

    @property
    def pods(self) -> str:
        return f"{self.prefix}pods"


def glob_escape(text: str) -> str:
    """`text` with Redis glob characters escaped, for a literal match in a SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def block_member(pod_id: str, tier: str) -> str:
    """Member of a block SET."""
    return f"{pod_id}|{tier}"


def parse_block_member(member: str) -> tuple[str, str]:
    """ "{pod_id}|{tier}" -> (pod_id, tier); the tier never holds a '|'."""
    pod, _, tier = member.rpartition("|")
    return pod, tier


def pod_block_member(tier: str, model: str, hash_hex: str) -> str:
    """Member of a pod's podblk SET; enough to find the block key again."""
    return f"{tier}|{model}|{hash_hex}"


def parse_pod_block_member(member: str) -> tuple[str, str, str]:
    tier, _, rest = member.partition("|")
    model, _, hash_hex = rest.rpartition("|")
    return tier, model, hash_hex


# KEYS[1] = podblk:{pod}; ARGV[1] = key prefix, ARGV[2] = pod_id. Removes every block entry the
# pod added and its podblk set. Returns the number of entries removed.
CLEAR_POD = """
local members = redis.call('SMEMBERS', KEYS[1])
for _, m in ipairs(members) do
  local tier, model, h = string.match(m, '^([^|]*)|(.*)|([^|]*)$')
  if tier then
    redis.call('SREM', ARGV[1] .. 'blk:' .. model .. ':' .. h, ARGV[2] .. '|' .. tier)
  end
end
redis.call('DEL', KEYS[1])
return #members
"""

# KEYS = the block keys of a prompt, in chain order; ARGV[1] = pod key prefix ("...:pod:").
# Returns {pod_id, count, pod_id, count, ...}: for each LIVE pod, how many consecutive blocks
# from block 0 it holds (any tier). Stops reading as soon as no pod continues the chain.
LOOKUP = """
local alive = {}
local counts = {}
local any = false
for i, key in ipairs(KEYS) do
  local here = {}
  for _, m in ipairs(redis.call('SMEMBERS', key)) do
    local pod = string.match(m, '^(.*)|[^|]*$')
    if pod then here[pod] = true end
  end
  local nxt = {}
  any = false
  if i == 1 then
    for pod in pairs(here) do
      if redis.call('EXISTS', ARGV[1] .. pod) == 1 then nxt[pod] = true; any = true end
    end
  else
    for pod in pairs(alive) do
      if here[pod] then nxt[pod] = true; any = true end
    end
  end
  if not any then break end
  alive = nxt
  for pod in pairs(alive) do counts[pod] = i end
end
local out = {}
for pod, n in pairs(counts) do
  table.insert(out, pod)
  table.insert(out, n)
end
return out
"""

# KEYS[1] = pods zset; ARGV[1] = key prefix. Drops every pod whose heartbeat key expired, with all
# its block entries. Returns the purged pod ids.
PURGE_DEAD_PODS = """
local purged = {}
for _, pod in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('EXISTS', ARGV[1] .. 'pod:' .. pod) == 0 then
    local pk = ARGV[1] .. 'podblk:' .. pod
    for _, m in ipairs(redis.call('SMEMBERS', pk)) do
      local tier, model, h = string.match(m, '^([^|]*)|(.*)|([^|]*)$')
      if tier then
        redis.call('SREM', ARGV[1] .. 'blk:' .. model .. ':' .. h, pod .. '|' .. tier)
      end
    end
    redis.call('DEL', pk)
    redis.call('ZREM', KEYS[1], pod)
    table.insert(purged, pod)
  end
end
return purged
"""
