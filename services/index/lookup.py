"""PrefixIndex: the router's read side of the Redis prefix index (layout: common/redis_keys.py).

`lookup` answers "how many consecutive blocks from block 0 does each live pod hold" for all of a
prompt's block hashes in ONE round trip (a Lua script that stops at the first block no pod
continues). Works with a `redis.asyncio.Redis` client created with decode_responses=True.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.block_hash import hash_hex
from kvmesh.index.layout import (LOOKUP, PURGE_DEAD_PODS, KeySpace, parse_block_member)


@dataclass(frozen=True, slots=True)
class PodLoad:
    """One pod's last heartbeat."""
    pod_id: str
    url: str            # where the pod serves (matched against the router's backends)
    model: str          # served model name
    running: int        # requests in the running batch
    waiting: int        # requests queued
    swapped: int        # requests swapped out to CPU
    kv_usage: float     # fraction of GPU KV blocks in use
    ts: float           # unix time of the heartbeat


def _int(v, default: int = 0) -> int:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return default


def _float(v, default: float = 0.0) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


class PrefixIndex:
    def __init__(self, redis_client, namespace: str | None = None,
                 service: str | None = None) -> None:
        self.redis = redis_client
        self.keys = KeySpace.from_env(namespace, service)
        self._lookup = redis_client.register_script(LOOKUP)
        self._purge = redis_client.register_script(PURGE_DEAD_PODS)

    async def lookup(self, model: str, hashes: list[bytes]) -> dict[str, int]:
        """{pod_id: consecutive blocks held from block 0} for live pods holding block 0."""
        if not hashes:
            return {}
        keys = [self.keys.block(model, hash_hex(h)) for h in hashes]
        flat = await self._lookup(keys=keys, args=[self.keys.pod_key_prefix])
        return {str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def live_pods(self) -> dict[str, PodLoad]:
        """Every pod whose heartbeat has not expired, with its load."""
        pods = await self.redis.zrange(self.keys.pods, 0, -1)
        if not pods:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for pod in pods:
            pipe.hgetall(self.keys.pod(pod))
        rows = await pipe.execute()
        out: dict[str, PodLoad] = {}
        for pod, row in zip(pods, rows):
            if not row:
                continue   # heartbeat expired: the janitor will purge it
            out[pod] = PodLoad(pod, row.get("url", ""), row.get("model", ""),
                               _int(row.get("running")), _int(row.get("waiting")),
                               _int(row.get("swapped")), _float(row.get("kv_usage")),
                               _float(row.get("ts")))
        return out

    async def purge_dead_pods(self) -> list[str]:
        """Delete the entries of pods whose heartbeat expired; returns their ids."""
        return [str(p) for p in await self._purge(keys=[self.keys.pods],
                                                  args=[self.keys.prefix])]

    async def dump(self, model: str) -> dict[str, set[bytes]]:
        """{pod_id: block hashes it holds} over the whole index of `model`, dead pods included
        (for tests and debugging: it SCANs)."""
        out: dict[str, set[bytes]] = {}
        cut = len(self.keys.block(model, ""))
        async for key in self.redis.scan_iter(match=self.keys.block_pattern(model), count=1000):
            h = bytes.fromhex(key[cut:])
            for member in await self.redis.smembers(key):
                pod, _tier = parse_block_member(member)
                out.setdefault(pod, set()).add(h)
        return out
