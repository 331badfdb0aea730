"""Heavy input work runs off the event loop: while a 2 MB prompt is tokenized (seconds on a
loaded CPU), another stream's tokens keep flowing and the probes answer."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from .conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BIG = "The quick brown fox jumps over the lazy dog. " * 45000     # 2,025,000 characters
PROBE_LIMIT_S = 1.5


async def _while_big_request(url: str, path: str, body: dict):
    """A greedy stream runs alone for 8 chunks (the baseline), then the big request is sent;
    returns (baseline gaps, gaps that overlap the big request, probe latencies, its response)."""
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300) as client:
        times: list[float] = []
        baseline_done = asyncio.Event()

        async def stream() -> None:
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
                    "temperature": 0, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.monotonic())
                        if len(times) == 9:
                            baseline_done.set()

        streaming = asyncio.create_task(stream())
        await asyncio.wait_for(baseline_done.wait(), 300)
        start = time.monotonic()
        big = asyncio.create_task(client.post(path, json=body))
        probes: list[float] = []
        while not big.done():
            t = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            probes.append(time.monotonic() - t)
            await asyncio.sleep(0.1)
        end = time.monotonic()
        count = len(times)
        while len(times) == count and not streaming.done():   # the gap that spans `end`
            await asyncio.sleep(0.05)
        streaming.cancel()
        gaps = [(a, b - a) for a, b in zip(times, times[1:])]
        baseline = [g for a, g in gaps[:8]]
        during = [g for a, g in gaps if a + g >= start and a <= end]
        return baseline, during, probes, end - start, big.result()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": BIG, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}], "max_tokens": 4}),
    ("/tokenize", {"prompt": BIG}),
], ids=["completions", "chat", "tokenize"])
def test_a_2mb_prompt_does_not_stall_other_streams_or_the_probes(server, path, body):
    baseline, during, probes, took, response = asyncio.run(_while_big_request(server.url, path,
                                                                               body))
    if path == "/tokenize":
        assert response.status_code == 200 and response.json()["count"] > 400_000
    else:
        assert (response.status_code, response.json()["error"]["code"]) == (
            400, "context_length_exceeded")
    stats = f"took {took:.2f}s, baseline {baseline}, during {during}, probes {probes}"
    assert max(probes) < PROBE_LIMIT_S, stats
    assert len(probes) >= 3, stats             # the probes did overlap the tokenization
    # NOTE: the tokenizer thread shares the CPU with the engine, so tokens may come somewhat
    # slower; on the loop, the stream would stop for the whole tokenization (seconds).
    assert during and max(during) < 3 * max(baseline) + 1.0, stats
