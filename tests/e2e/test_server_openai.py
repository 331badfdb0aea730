"""The official openai client against a real `kvmesh serve` process over a real socket."""
from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams

from .conftest import API_KEY, metric

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def offline_greedy(smollm, prompt, max_tokens):
    engine = LLMEngine(EngineConfig(num_kv_blocks=128, max_model_len=2048), loaded=smollm)
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0]


def test_models_lists_the_served_model(client, smollm):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["dtype"] == "float32"       # the suite's servers ask for it
    assert models.data[0].model_extra["quantization"] is None     # the built-in GGUF, dequantized
    assert models.data[0].model_extra["weight_bytes"] == smollm.weight_bytes == 538_060_032


def test_greedy_completion_is_identical_to_the_offline_llm(client, smollm):
    prompt = "The three primary colours are"
    expected = offline_greedy(smollm, prompt, 24)
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert res.choices[0].text == expected.text
    assert res.usage.completion_tokens == len(expected.token_ids)
    assert res.usage.prompt_tokens == len(smollm.tokenizer.encode(prompt))
    assert res.choices[0].finish_reason == expected.finish_reason


def test_chat_completion_uses_the_chat_template(client, smollm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    res = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    ids = smollm.tokenizer.apply_chat_template(messages)
    expected = offline_greedy(smollm, ids, 24)
    assert res.choices[0].message.content == expected.text == "The capital of France is Paris."
    assert res.choices[0].finish_reason == "stop"
    assert res.usage.prompt_tokens == len(ids)
    assert res.usage.total_tokens == len(ids) + len(expected.token_ids)


def test_streaming_chat_with_usage_equals_the_full_response(client):
    messages = [{"role": "user", "content": "Name three fruits."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3   # real streaming


def test_n_2_returns_two_choices(client):
    res = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=8, n=2,
                                    temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in res.choices) == [0, 1]
    assert res.usage.completion_tokens == 16


def test_stop_string_cuts_the_output(client):
    prompt = "Count: 1, 2, 3,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    stop = full[6:9]
    assert stop.strip(), full
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert res.choices[0].text == full[:full.index(stop)]
    assert res.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, prompt="Write a word:", max_tokens=12, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=4321, **kw).choices[0].text
    assert a == b and a != c


def test_completion_logprobs(client):
    res = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                                    logprobs=3)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == res.choices[0].text
    for chosen, tops in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(tops) <= 4
        assert chosen == pytest.approx(max(tops.values()))      # greedy picks the top token


def test_chat_logprobs(client):
    res = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)


async def _one_client(ac, i: int, rng: random.Random) -> str:
    disconnect_after = rng.randint(1, 6) if i % 3 == 0 else None
    stream = await ac.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=24,
                                         temperature=0.8, seed=i, stream=True,
                                         extra_body={"ignore_eos": True})
    received, finish = 0, None
    async for chunk in stream:
        received += 1
        finish = chunk.choices[0].finish_reason or finish
        if disconnect_after is not None and received >= disconnect_after:
            await stream.close()
            return "disconnected"
    assert finish == "length"
    return "completed"


def test_64_concurrent_streams_with_disconnects_leave_nothing_behind(server, async_client):
    rng = random.Random(0)

    async def run():
        return await asyncio.gather(*[_one_client(async_client, i, rng) for i in range(64)])

    results = asyncio.run(run())
    assert results.count("disconnected") == 22 and results.count("completed") == 42
    text = ""
    for _ in range(100):                      # aborts are applied between engine steps
        text = httpx.get(f"{server.url}/metrics").text
        if (metric(text, "kvmesh:num_requests_running") == 0
                and metric(text, "kvmesh:num_requests_waiting") == 0
                and metric(text, "kvmesh:kv_cache_usage_perc") == 0):
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:num_requests_waiting") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(text, "vllm:generation_tokens_total") >= 42 * 24
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "Invalid JSON body"),
    (b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens: Input should be a valid integer"),
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "x", "max_tokens": 1000000}', 400, "maximum context length is 2048 tokens"),
    (b'{"prompt": "x", "bogus_field": 1}', 400, "Unrecognized request argument supplied: bogus_field"),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "The model `gpt-4` does not exist."),
    (b'{"prompt": ""}', 400, "prompt must not be empty"),
    (b'{"prompt": [1, 2, 99999999]}', 400, "outside the vocabulary"),
    (b'{"prompt": "x", "logit_bias": {"a": 5}}', 400, "logit_bias keys must be token ids"),
    (b'{"prompt": "x", "logit_bias": {"99999999": 5}}', 400, "logit_bias token ids must be in"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens 0 is only allowed with echo"),
    (b'{"prompt": "x", "prompt_logprobs": 1, "stream": true}', 400,
     "prompt_logprobs is not available with stream"),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_healthy(server, body, status, message):
    r = httpx.post(f"{server.url}/v1/completions", content=body,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_over_long_prompt_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="word " * 2100, max_tokens=4)
    assert exc.value.body["code"] == "context_length_exceeded"


def test_chat_errors(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH,
                   json={"messages": [], "max_tokens": 4})
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "hi"}],
                         "tools": [{"type": "function", "function": {"nam": "f"}}]})
    assert r.status_code == 400 and "tools[0] is not a function tool" in r.json()["error"]["message"]


def test_api_key_is_enforced_except_on_health_ready_and_metrics(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{server.url}{path}").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_request_id_is_echoed_or_generated(server):
    r = httpx.get(f"{server.url}/health", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(f"{server.url}/health")
    assert len(r.headers["x-request-id"]) == 32


def test_tokenize_and_detokenize_round_trip(server, smollm):
    r = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": "Hello world"})
    assert r.json()["tokens"] == smollm.tokenizer.encode("Hello world")
    r2 = httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": r.json()["tokens"]})
    assert r2.json()["prompt"] == "Hello world"
    r3 = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                    json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r3.json()["tokens"] == smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


# ---- request-boundary range checks: a client value must never reach the engine thread --------
def _complete(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": "Hello", "max_tokens": 2, **body})


def _assert_engine_serves(server) -> None:
    r = _complete(server, {"temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value, message", [
    ("top_k", 2**63, "top_k: Input should be less than or equal to 2147483647"),
    ("top_k", 2**31, "top_k: Input should be less than or equal to 2147483647"),
    ("top_k", -2, "top_k: Input should be greater than or equal to -1"),
    ("seed", 2**64, "seed: Input should be less than or equal to 9223372036854775807"),
    ("seed", -(2**63) - 1, "seed: Input should be greater than or equal to -9223372036854775808"),
    ("priority", 10**309, "priority: Input should be less than or equal to 2147483647"),
    ("priority", -(2**31) - 1, "priority: Input should be greater than or equal to -2147483648"),
])
def test_out_of_range_values_are_400s_naming_the_field_and_the_engine_lives(
        server, field, value, message, stream):
    r = _complete(server, {field: value, "temperature": 1.0, "stream": stream})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                  "param": field, "code": None}}
    _assert_engine_serves(server)


def test_range_limits_themselves_are_served(server):
    r = _complete(server, {"top_k": 2**31 - 1, "seed": 2**63 - 1, "priority": -(2**31),
                           "temperature": 1.0, "n": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    _assert_engine_serves(server)


def test_min_tokens_above_max_tokens_is_a_400(server):
    for stream in (False, True):
        r = _complete(server, {"min_tokens": 8, "max_tokens": 4, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "min_tokens (8) must be <= max_tokens (4)",
                                     "type": "invalid_request_error", "param": "min_tokens",
                                     "code": None}


def test_streaming_request_over_the_context_is_a_400_not_a_broken_stream(server):
    r = _complete(server, {"max_tokens": 1000000, "stream": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "max_tokens"


# ---- routing errors and content types --------------------------------------------------------
def test_unknown_path_is_an_openai_404(server):
    r = httpx.post(f"{server.url}/v1/nope", headers=AUTH, json={})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "Invalid URL (POST /v1/nope)",
                                  "type": "not_found_error", "param": None, "code": "not_found"}}


def test_wrong_method_is_an_openai_405(server):
    r = httpx.get(f"{server.url}/v1/completions", headers=AUTH)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert r.json() == {"error": {"message": "Method GET is not allowed for /v1/completions",
                                  "type": "invalid_request_error", "param": None,
                                  "code": "method_not_allowed"}}


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_json_body_without_a_json_content_type_is_parsed_as_json(server, content_type):
    headers = dict(AUTH)
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = b'{"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": true}'
    r = httpx.post(f"{server.url}/v1/completions", headers=headers, content=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# ---- stream_options.continuous_usage_stats ---------------------------------------------------
def _sse_events(r: httpx.Response) -> list[dict]:
    lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    import json
    return [json.loads(x) for x in lines[:-1]]


def test_completions_continuous_usage_counts_tokens_so_far(server):
    body = {"prompt": "One two three", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        events = _sse_events(r)
    prompt = events[-1]["usage"]["prompt_tokens"]
    assert prompt == 3
    per_chunk = [e["usage"] for e in events[:-1]]
    assert [u["completion_tokens"] for u in per_chunk] == [1, 2, 3, 4, 5]
    assert all(u["prompt_tokens"] == 3 and u["total_tokens"] == 3 + u["completion_tokens"]
               for u in per_chunk)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_chat_continuous_usage_counts_tokens_so_far(server, smollm):
    messages = [{"role": "user", "content": "Say hi"}]
    prompt = len(smollm.tokenizer.apply_chat_template(messages))
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH, json=body,
                      timeout=120) as r:
        events = _sse_events(r)
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts[0] == 0                       # the role chunk
    assert counts[-1] == 4                      # the finish_reason chunk
    assert counts == sorted(counts) and set(counts) == {0, 1, 2, 3, 4}
    assert all(e["usage"]["prompt_tokens"] == prompt for e in events)
    assert events[-1]["usage"]["total_tokens"] == prompt + 4


def test_include_usage_alone_keeps_usage_null_on_content_chunks(server):
    body = {"prompt": "One two three", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=body,
                      timeout=120) as r:
        events = _sse_events(r)
    assert [e["usage"] for e in events[:-1]] == [None, None, None]
    assert events[-1]["usage"]["completion_tokens"] == 3


def test_start_up_objects_are_frozen_out_of_the_garbage_collector(server):
    """After the model load and warm-up the server freezes its heap (no full-heap GC pauses)."""
    import re

    frozen = re.search(r"\((\d+) start-up objects frozen out of the garbage collector\)",
                       server.log())
    assert frozen is not None and int(frozen.group(1)) > 10_000
