"""--kv-share redis through real `kvmesh serve` processes: the second server loads the first
one's prompt blocks from Redis instead of computing them, and answers the same greedy text."""
from __future__ import annotations

import httpx
import redis
from waiting import wait_until

from .router_fixtures import metric_sum, scrape, start_cluster

BLOCK = 16
TEXT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the "
        "fall of Constantinople. Its legacy includes law, language, architecture and roads. Historians "
        "often divide it into periods: the Kingdom, the Republic and the Empire. The")


def complete(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": TEXT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_second_server_loads_the_first_servers_blocks(tmp_path):
    c = start_cluster(tmp_path, 2, strategy="round-robin",
                      engine_args=("--num-kv-blocks", "64", "--max-model-len", "512",
                                   "--kv-share", "redis"))
    try:
        a, b = c.engines
        first = complete(a.url)
        n = first["usage"]["prompt_tokens"]
        full, usable = n // BLOCK, (n - 1) // BLOCK * BLOCK   # the last token is always computed
        assert full >= 3
        client = redis.Redis(port=c.redis.port)
        try:
            assert wait_until(lambda: len(client.keys("*:kv:*")) == full, timeout=10)
        finally:
            client.close()

        second = complete(b.url)
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        hits = "kvmesh:external_prefix_cache_hits_total"
        assert metric_sum(scrape(b.url), hits) == usable
        assert metric_sum(scrape(a.url), hits) == 0
        # b computed only what it could not load: its local prefix cache had nothing
        assert metric_sum(scrape(b.url), "kvmesh:prefix_cache_hits_total") == 0
    finally:
        codes = c.stop()
    assert codes == [0, 0, 0], codes
