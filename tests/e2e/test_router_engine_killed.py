"""An engine SIGKILLed under load behind the router (issue 31): no client gets a 502 and no request
runs twice.

Real processes: redis-server, two `kvmesh serve` engines, one `kvmesh router`. Clients keep
sending non-streaming completions through the router (official `openai` client) while one engine
is killed with requests running on it. Those requests, and the ones the router then writes on its
kept-alive connections to the dead process, break after they were sent; the router finds the
dead engine's address refusing connections and sends each of them once to the survivor. The
survivor's own count of finished requests equals the answers the clients got from it: nothing ran
there twice.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import openai
import pytest
from waiting import wait_until

from .router_fixtures import MODEL, metric_sum, scrape, start_cluster

pytestmark = pytest.mark.slow

ENGINE_ARGS = ("--num-kv-blocks", "96", "--max-model-len", "512", "--max-num-seqs", "8")
CLIENTS = 6
MAX_TOKENS = 24          # long enough that requests are still running when the kill lands
AFTER_KILL = 3           # requests each client sends after the kill


@dataclass
class Answer:
    client: int
    status: int | None = None
    backend: str | None = None
    tokens: int | None = None
    error: str | None = None
    sent_at: float = 0.0


def _send(client: openai.OpenAI, i: int, n: int) -> Answer:
    a = Answer(i, sent_at=time.monotonic())
    try:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"Client {i}, request {n}: tell me about the sea.",
            max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        a.status, a.backend = raw.status_code, raw.headers.get("x-kvmesh-backend")
        a.tokens = raw.parse().usage.completion_tokens
    except openai.APIStatusError as e:
        a.status, a.error = e.status_code, e.message
    except openai.APIError as e:          # a transport error the client itself saw
        a.error = f"{type(e).__name__}: {e}"
    return a


def _successes(url: str) -> float:
    return metric_sum(scrape(url), "kvmesh:request_success_total")


def test_an_engine_killed_under_load_loses_no_request_and_runs_none_twice(tmp_path):
    cluster = start_cluster(tmp_path, 2, engine_args=ENGINE_ARGS)
    victim, survivor = cluster.engines
    answers: list[Answer] = []
    killed = threading.Event()
    try:
        before = _successes(survivor.url)

        def client_loop(i: int) -> None:
            client = openai.OpenAI(base_url=f"{cluster.router.url}/v1", api_key="none",
                                   max_retries=0, timeout=120)
            n = after = 0
            while after < AFTER_KILL:
                after += killed.is_set()
                answers.append(_send(client, i, n))
                n += 1

        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True)
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        assert wait_until(lambda: metric_sum(scrape(victim.url),
                                             "kvmesh:num_requests_running") >= 2,
                          timeout=120, interval=0.05), "no request ran on the victim"
        victim.kill()
        killed_at = time.monotonic()
        killed.set()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a client hung"

        bad = [a for a in answers if a.status != 200 or a.error or a.tokens != MAX_TOKENS]
        assert bad == [], bad
        assert all(a.backend == survivor.url for a in answers if a.sent_at > killed_at)
        # the path under test ran: requests the victim held broke after they were sent
        log = cluster.router.log(tail=100_000)
        assert "refuses connections): re-sending it to another backend" in log, log
        # exactly once: the survivor finished one request per answer it gave
        from_survivor = sum(a.backend == survivor.url for a in answers)
        assert wait_until(lambda: _successes(survivor.url) - before == from_survivor,
                          timeout=10, interval=0.1), (_successes(survivor.url) - before,
                                                      from_survivor)
    finally:
        codes = cluster.stop()
    assert codes[0] == 0 and codes[2] == 0, codes     # router and survivor exit cleanly
