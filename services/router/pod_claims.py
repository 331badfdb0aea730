"""Which backend URL each pod id's heartbeat claims, and the pod ids claimed by two of them.

A pod's Redis heartbeat and its prefix-index entries are keyed by its pod id. Two engines
publishing under one id (a copy-pasted --pod-id, two Deployments sharing names) overwrite each
other's heartbeat, so the id's URL flips between them, while the index mixes both engines' blocks
under that id: a prefix hit would send the request to whichever engine last wrote the heartbeat.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("kvmesh.router")


@dataclass(slots=True)
class _Claim:
    url: str                                                # the URL of the last heartbeat read
    seen: dict[str, float] = field(default_factory=dict)    # every URL claimed -> last seen
    duplicate_until: float = 0.0                            # monotonic: a duplicate until then


class PodClaims:
    """Tracks pod id -> URL over successive heartbeat reads.

    NOTE: one change of URL is a pod that came back at a new address (a restart) and is fine;
    a change back to a URL the id claimed within `window_s` is two engines sharing the id.
    The id stays a duplicate until `window_s` passes without a flip."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._claims: dict[str, _Claim] = {}
        self._warned: set[str] = set()

    def observe(self, pod_urls: dict[str, str], now: float) -> None:
        """One heartbeat read: {pod id: normalized URL}."""
        for pod_id, url in pod_urls.items():
            c = self._claims.get(pod_id)
            if c is None:
                self._claims[pod_id] = _Claim(url, {url: now})
                continue
            if url != c.url and now - c.seen.get(url, -self.window_s - 1) <= self.window_s:
                c.duplicate_until = now + self.window_s
                if pod_id not in self._warned:
                    self._warned.add(pod_id)
                    logger.warning(
                        "pod id %r is claimed by more than one backend (%s): prefix hits for "
                        "them are ignored and they are routed by load; give each engine its own "
                        "--pod-id", pod_id, ", ".join(sorted(c.seen.keys() | {url})))
            c.url = url
            c.seen[url] = now
            c.seen = {u: t for u, t in c.seen.items() if now - t <= self.window_s}
        for pod_id in [p for p, c in self._claims.items()
                       if p not in pod_urls and max(c.seen.values()) < now - self.window_s]:
            del self._claims[pod_id]

    def duplicates(self, now: float) -> dict[str, set[str]]:
        """{pod id: the URLs that claimed it} for every pod id claimed by two backends now."""
        return {p: set(c.seen) for p, c in self._claims.items() if c.duplicate_until > now}
