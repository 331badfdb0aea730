"""Where this router just sent each prefix, remembered for a few seconds."""
from __future__ import annotations

from collections import OrderedDict


class RecentRoutes:
    """Block hashes this router routed to each pod in the last `ttl_s` seconds.

    NOTE: the Redis index learns a prefix only once its first request has been prefilled and
    published; until then a tenant's next requests would look cold and scatter over the pods.
    Remembering where the router just sent each block bridges that gap; the router consults it
    only for blocks the index does not know yet. One pod per hash (the latest).
    """

    def __init__(self, ttl_s: float = 10.0, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[str, float]] = OrderedDict()  # hash -> (pod, expiry)

    def record(self, pod_id: str, hashes: list[bytes], now: float) -> None:
        expiry = now + self.ttl_s
        entries = self._entries
        for h in hashes:
            entries[h] = (pod_id, expiry)
            entries.move_to_end(h)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def hits(self, hashes: list[bytes], now: float) -> dict[str, int]:
        """{pod: consecutive blocks from block 0 recently routed to it} (at most one pod)."""
        pod, count = None, 0
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None or entry[1] < now or (pod is not None and entry[0] != pod):
                break
            pod = entry[0]
            count += 1
        return {pod: count} if pod is not None else {}


def merge_hits(index_hits: dict[str, int], recent_hits: dict[str, int]) -> dict[str, int]:
    """Prefix hits per pod: the index's, plus the router's memory where it knows more blocks
    than any pod the index reports (it only bridges the gap until the index learns a prefix)."""
    known = max(index_hits.values(), default=0)
    merged = dict(index_hits)
    for pod, n in recent_hits.items():
        if n > known:
            merged[pod] = n
    return merged
