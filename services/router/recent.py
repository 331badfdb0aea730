"""Where this router just sent each prefix, remembered for a few seconds."""
from __future__ import annotations

from collections import OrderedDict


class RecentRoutes:
    """Block hashes this router routed to each pod in the last `ttl_s` seconds.

    NOTE: the Redis index learns a prefix only once its first request has been prefilled and
    published; until then a tenant's next requests would look cold and scatter over the pods.
    Remembering where the router just sent each block bridges that gap. One pod per hash (the
    latest), so a prefix the load guard spilled to a second pod follows it there.
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
