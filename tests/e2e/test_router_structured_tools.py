"""Structured outputs and tool calls through the KV-aware router (issue 15): the router renders
the tools exactly as the engines do, so a repeated tool prompt is a prefix hit on the pod that
computed it, and the official client's parse / stream helpers work through the proxy."""
from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, Field

from .router_fixtures import MODEL, start_cluster

pytestmark = pytest.mark.slow


class Lookup(BaseModel):
    """Look a word up in the dictionary."""
    word: str = Field(max_length=10)


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=1, le=5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("router-tools"), 2,
                      engine_args=("--num-kv-blocks", "96", "--max-model-len", "1024",
                                   "--max-num-seqs", "8"))
    yield c
    codes = c.stop()
    assert codes == [0, 0, 0], codes


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.router.url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_a_repeated_tool_prompt_is_a_prefix_hit_on_the_pod_that_computed_it(client):
    messages = [{"role": "user", "content": "What does 'serendipity' mean?"}]
    tools = [openai.pydantic_function_tool(Lookup)]
    seen = []
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, tools=tools, tool_choice="required",
            temperature=1.0, max_tokens=40)
        completion = raw.parse()
        (call,) = completion.choices[0].message.tool_calls
        assert call.function.name == "Lookup"
        Lookup.model_validate_json(call.function.arguments)
        assert completion.choices[0].finish_reason == "tool_calls"
        seen.append((raw.headers["x-kvmesh-backend"], raw.headers["x-kvmesh-route-reason"]))
    # NOTE: the tools section is most of the prompt: a router rendering without it would hash
    # other blocks and find no prefix
    assert seen[1] == (seen[0][0], "prefix-hit"), seen


def test_parse_and_streamed_tool_calls_through_the_router(client):
    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Rate this answer as JSON."}],
        response_format=Verdict, temperature=1.0, max_tokens=30, seed=4)
    assert isinstance(parsed.choices[0].message.parsed, Verdict)
    with client.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Look up 'tea'."}],
            tools=[openai.pydantic_function_tool(Lookup)],
            tool_choice={"type": "function", "function": {"name": "Lookup"}},
            temperature=1.0, max_tokens=40, seed=6) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)
    assert final.choices[0].finish_reason == "tool_calls"


def test_embeddings_through_the_router_equal_the_engines(cluster, client):
    import httpx
    for inputs in (["The cat sat on the mat.", "A dog."], [[504, 3458, 253, 260, 1730, 30]]):
        via_router = client.embeddings.create(model=MODEL, input=inputs)
        assert [d.index for d in via_router.data] == list(range(len(inputs)))
        direct = httpx.post(f"{cluster.engines[0].url}/v1/embeddings",
                            json={"model": MODEL, "input": inputs}, timeout=120).json()
        assert via_router.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
        for got, want in zip(via_router.data, direct["data"]):
            assert len(got.embedding) == 576
            assert max(abs(a - b) for a, b in zip(got.embedding, want["embedding"])) < 1e-5
    bad = httpx.post(f"{cluster.router.url}/v1/embeddings", json={"model": MODEL, "input": []}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
