"""/metrics values after real requests, aborted requests, POST /reset_prefix_cache and /tokenize
template errors, against the e2e suite's shared server (counters are compared as deltas)."""
from __future__ import annotations

import re
import time
import uuid
from types import SimpleNamespace

import httpx
import jinja2
import pytest
from starlette.testclient import TestClient

from kvmesh.api.app import ServerState, create_app

from .conftest import API_KEY

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds")
COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
            "generation_tokens_total")
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z0-9_:]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def scrape(server) -> dict[tuple[str, str], float]:
    """(name, labels) -> value for every kvmesh:/vllm: sample; every one carries model_name."""
    out = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or not m["name"].startswith(("kvmesh:", "vllm:")):
            continue
        labels = m["labels"]
        assert f'model_name="{MODEL}"' in labels, line
        rest = ",".join(p for p in labels.split(",") if not p.startswith("model_name="))
        out[(m["name"], rest)] = float(m["value"])
    return out


def delta(before: dict, after: dict, name: str, labels: str = "") -> float:
    """after - before. A metric name with no sample at all is a KeyError (a misspelt name must
    not pass); a label value not seen yet counts 0 (labelled samples appear on first use)."""
    if not any(n == name for n, _ in after):
        raise KeyError(name)
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def complete(server, prompt: str, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": prompt, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def unique_prompt() -> str:
    # NOTE: a fresh first block: nothing earlier in the session can hit in the prefix cache.
    return f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 6


def test_metrics_count_finished_requests_tokens_and_prefix_hits(server):
    prompt = unique_prompt()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    before = scrape(server)
    first = complete(server, prompt, max_tokens=4, ignore_eos=True)
    second = complete(server, prompt, max_tokens=6, ignore_eos=True)
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"messages": chat, "max_tokens": 24, "temperature": 0})
    third = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    after = scrape(server)

    usages = (first, second, third)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == (first["prompt_tokens"] - 1) // 16 * 16
    generated = 4 + 6 + third["completion_tokens"]
    for prefix in ("kvmesh", "vllm"):
        assert delta(before, after, f"{prefix}:time_to_first_token_seconds_count") == 3
        assert delta(before, after, f"{prefix}:e2e_request_latency_seconds_count") == 3
        assert delta(before, after, f"{prefix}:request_queue_time_seconds_count") == 3
        # one gap between consecutive tokens: a request of k tokens has k - 1
        assert delta(before, after, f"{prefix}:inter_token_latency_seconds_count") == generated - 3
        assert delta(before, after, f"{prefix}:prompt_tokens_total") == sum(
            u["prompt_tokens"] for u in usages)
        assert delta(before, after, f"{prefix}:generation_tokens_total") == generated
        assert delta(before, after, f"{prefix}:prefix_cache_queries_total") == sum(
            u["prompt_tokens"] for u in usages)
        assert delta(before, after, f"{prefix}:prefix_cache_hits_total") == sum(
            u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert delta(before, after, f"{prefix}:request_success_total",
                     'finished_reason="length"') == 2
        assert delta(before, after, f"{prefix}:request_success_total",
                     'finished_reason="stop"') == 1
        for name in HISTOGRAMS:
            assert delta(before, after, f"{prefix}:{name}_bucket", 'le="+Inf"') == \
                delta(before, after, f"{prefix}:{name}_count")


def test_client_disconnect_counts_as_an_abort(server):
    before = scrape(server)
    body = {"prompt": unique_prompt(), "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=body,
                      timeout=120) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")         # one token out, then hang up
    after = before
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:                   # aborts are applied between steps
        after = scrape(server)
        if delta(before, after, "vllm:request_success_total", 'finished_reason="abort"'):
            break
        time.sleep(0.05)
    for prefix in ("kvmesh", "vllm"):
        assert delta(before, after, f"{prefix}:request_success_total",
                     'finished_reason="abort"') == 1
        assert delta(before, after, f"{prefix}:e2e_request_latency_seconds_count") == 0
        assert delta(before, after, f"{prefix}:request_success_total",
                     'finished_reason="length"') == 0


def test_a_non_streaming_client_leaving_is_an_abort_not_a_traceback(server):
    before = scrape(server)
    body = {"prompt": unique_prompt(), "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body, timeout=1.0)
    after = before
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:                   # the handler polls for the disconnect
        after = scrape(server)
        if delta(before, after, "vllm:request_success_total", 'finished_reason="abort"'):
            break
        time.sleep(0.05)
    assert delta(before, after, "vllm:request_success_total", 'finished_reason="abort"') == 1
    _wait_idle(server)                                   # its KV blocks are back
    log = server.log()
    assert "Exception in ASGI application" not in log and "Traceback" not in log


def _wait_idle(server) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = scrape(server)
        if m[("kvmesh:num_requests_running", "")] == 0 and m[("kvmesh:kv_cache_usage_perc", "")] == 0:
            return
        time.sleep(0.05)
    pytest.fail("the server did not go idle")


def test_reset_prefix_cache_drops_cached_prompt_blocks(server):
    prompt = unique_prompt()
    complete(server, prompt, max_tokens=2)
    cached = complete(server, prompt, max_tokens=2)["prompt_tokens_details"]["cached_tokens"]
    assert cached == (complete(server, prompt, max_tokens=2)["prompt_tokens"] - 1) // 16 * 16 > 0
    _wait_idle(server)
    r = httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert complete(server, prompt, max_tokens=2)["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(server, prompt, max_tokens=2)["prompt_tokens_details"]["cached_tokens"] == cached


def test_reset_prefix_cache_needs_the_api_key(server):
    r = httpx.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ---- /tokenize chat-template errors (in-process app, a tokenizer whose template raises) -------
def _app_with(tokenizer) -> TestClient:
    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer), is_running=True)
    state = ServerState(engine=engine, model_name=MODEL, max_model_len=2048, ready=True)
    return TestClient(create_app(state))


@pytest.mark.parametrize("error", [
    jinja2.exceptions.TemplateError("Conversation roles must alternate user/assistant"),
    ValueError("this model's tokenizer has no chat template"),
])
def test_tokenize_turns_chat_template_errors_into_400s(error):
    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            raise error

    r = _app_with(Tok()).post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": f"cannot apply the chat template: {error}",
                                  "type": "invalid_request_error", "param": "messages",
                                  "code": None}}


# ---- with --redis-url the reset reaches the router's prefix index at once ----------------------
def _index_dump(redis_url: str) -> dict[str, set[bytes]]:
    import asyncio

    import redis.asyncio as aioredis

    from kvmesh.index.lookup import PrefixIndex

    async def go():
        client = aioredis.from_url(redis_url, decode_responses=True)
        try:
            return await PrefixIndex(client).dump(MODEL)
        finally:
            await client.aclose()
    return asyncio.run(go())


def _wait_until(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_reset_prefix_cache_publishes_all_cleared_to_the_index(tmp_path):
    from processes import RedisServer
    from servers import start_server

    redis_server = RedisServer()
    redis_server.start()
    srv = start_server(tmp_path, "--num-kv-blocks", "64", "--max-model-len", "512",
                       "--redis-url", redis_server.url, "--pod-id", "reset-pod")
    try:
        complete(srv, unique_prompt(), max_tokens=2)
        assert _wait_until(lambda: len(_index_dump(redis_server.url).get("reset-pod", ())) >= 4)
        r = httpx.post(f"{srv.url}/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        # NOTE: no request follows: only the reset itself can have published the clearing
        assert _wait_until(lambda: not _index_dump(redis_server.url).get("reset-pod")), \
            _index_dump(redis_server.url)
    finally:
        assert srv.stop() == 0
        redis_server.stop()
