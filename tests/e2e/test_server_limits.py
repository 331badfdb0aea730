"""Bounded input against a real `kvmesh serve`: every limit is a flag, and a request over one is
answered 400 (413 for the body) with an OpenAI error body naming the parameter."""
from __future__ import annotations

import httpx
import pytest

from .conftest import start_server

BODY_LIMIT = 3 * 1024 * 1024
BIG = "The quick brown fox jumps over the lazy dog. " * 45000     # 2,025,000 characters


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("limits"), "--num-kv-blocks", "256",
                       "--max-model-len", "2048", "--max-request-body-bytes", str(BODY_LIMIT),
                       "--max-prompts-per-request", "3", "--max-n", "4", "--max-stop-strings", "2",
                       "--max-stop-string-length", "8", "--max-stop-token-ids", "3",
                       "--max-logprobs", "5", "--max-tokens", "12")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _error(param, message, code=None):
    return {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": code}}


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, param, message", [
    (CMPL, {"prompt": ["a", "b", "c", "d"]}, "prompt",
     "at most 3 prompts are allowed in one request, got 4"),
    (CMPL, {"prompt": "a", "n": 5}, "n", "n must be <= 4, got 5"),
    (CHAT, {"messages": HI, "n": 5}, "n", "n must be <= 4, got 5"),
    (CMPL, {"prompt": "a", "stop": ["x", "y", "z"]}, "stop",
     "at most 2 stop strings are allowed, got 3"),
    (CHAT, {"messages": HI, "stop": "123456789"}, "stop",
     "a stop string may be at most 8 characters long, got 9"),
    (CMPL, {"prompt": "a", "stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids",
     "at most 3 stop_token_ids are allowed, got 4"),
    (CMPL, {"prompt": "a", "stop_token_ids": [1, 10**6]}, "stop_token_ids",
     "stop_token_ids must be in the vocabulary [0, 49152), got 1000000"),
    (CMPL, {"prompt": "a", "logprobs": 6}, "logprobs", "logprobs must be <= 5, got 6"),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 6}, "top_logprobs",
     "top_logprobs must be <= 5, got 6"),
    (CMPL, {"prompt": "a", "max_tokens": 13}, "max_tokens", "max_tokens must be <= 12, got 13"),
    (CHAT, {"messages": HI, "max_tokens": 13}, "max_tokens", "max_tokens must be <= 12, got 13"),
    (CHAT, {"messages": HI, "max_completion_tokens": 13}, "max_completion_tokens",
     "max_completion_tokens must be <= 12, got 13"),
    (CMPL, {"prompt": list(range(1, 2049))}, "prompt",
     "This model's maximum context length is 2048 tokens. However, your prompt has 2048 tokens; "
     "at least one token must be left for the completion. Please reduce the length of the prompt."),
])
def test_a_request_over_a_limit_is_a_400_naming_the_parameter(limited, path, body, param, message):
    r = httpx.post(limited.url + path, json={"max_tokens": 4, **body}, timeout=60)
    code = "context_length_exceeded" if "context length" in message else None
    assert (r.status_code, r.json()) == (400, _error(param, message, code))


def test_requests_at_the_limits_are_served(limited):
    r = httpx.post(limited.url + CMPL, timeout=120, json={
        "prompt": ["a", "b", "c"], "n": 4, "stop": ["12345678", "x"], "stop_token_ids": [1, 2, 3],
        "logprobs": 5, "max_tokens": 12, "temperature": 1.0, "seed": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 12


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": HI}), (CMPL, {"prompt": "Hi"})])
def test_a_request_without_max_tokens_gets_the_deployment_cap(limited, path, body):
    r = httpx.post(limited.url + path, timeout=120,
                   json={**body, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (
        12, "length")


TOO_LARGE = _error(None, f"The request body is larger than this server's limit of {BODY_LIMIT} "
                   "bytes (kvmesh serve --max-request-body-bytes).", "request_too_large")


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(limited):
    body = b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'       # valid JSON, one byte per char
    r = httpx.post(limited.url + CMPL, content=body, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()) == (413, TOO_LARGE)

    def chunked():                       # no Content-Length: counted as it arrives
        for i in range(0, len(body), 64 * 1024):
            yield body[i:i + 64 * 1024]
    r = httpx.post(limited.url + CMPL, content=chunked(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()) == (413, TOO_LARGE)
    # a body just under the limit is read and parsed (and its prompt is too long)
    r = httpx.post(limited.url + CMPL, json={"prompt": BIG, "max_tokens": 4}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(limited.url + "/health", timeout=10).status_code == 200


def test_the_limits_come_from_flags_and_the_config_file(tmp_path):
    from kvmesh.api.server import limits_from_args, parse_args
    from kvmesh.engine.limits import RequestLimits
    assert limits_from_args(parse_args([])) == RequestLimits()
    config = tmp_path / "serve.json"
    config.write_text('{"max-n": 4, "max_pending_outputs": 8, "max-tokens": 100}')
    args = parse_args(["--config", str(config), "--max-tokens", "50"])
    assert limits_from_args(args) == RequestLimits(max_n=4, max_pending_outputs=8, max_tokens=50)


def test_a_limit_out_of_range_stops_kvmesh_serve_with_exit_2(capsys):
    from kvmesh.api.server import main
    assert main(["--max-stop-token-ids", "0"]) == 2
    assert capsys.readouterr().err == (
        "kvmesh serve: error: --max-stop-token-ids must be an integer >= 1, got 0\n")
