"""Echo with logprobs, max_tokens 0, prompt_logprobs, logit_bias and /v1/embeddings on the
shared real server (the official openai client and raw HTTP over a real socket), checked
against transformers where values matter."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from .conftest import API_KEY

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is Paris, and the capital of Italy is"
ATOL = 1e-4      # float32 vs transformers: see tests/engine/test_prompt_logprobs.py


@pytest.fixture(scope="module")
def prompt_ids(server) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": PROMPT})
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def hf_lp(hf_smollm, prompt_ids) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_smollm(input_ids=torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_with_logprobs_and_max_tokens_0_returns_the_prompts_logprobs(client, prompt_ids,
                                                                          hf_lp):
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2,
                                  max_tokens=0)
    (choice,) = r.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for j in range(1, len(prompt_ids)):
        assert abs(lp.token_logprobs[j] - float(hf_lp[j - 1, prompt_ids[j]])) < ATOL
        best = hf_lp[j - 1].topk(2).values.tolist()
        top = sorted(lp.top_logprobs[j].values(), reverse=True)
        assert len(lp.top_logprobs[j]) in (2, 3)               # the top 2 and the prompt token
        assert all(abs(a - b) < ATOL for a, b in zip(top, best))


def test_echo_with_logprobs_then_generated_tokens(client, prompt_ids):
    r = client.completions.create(model=MODEL, prompt=prompt_ids, echo=True, logprobs=1,
                                  max_tokens=3, temperature=0)
    (choice,) = r.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3 and r.usage.completion_tokens == 3
    assert choice.text == PROMPT + "".join(lp.tokens[len(prompt_ids):])
    assert lp.token_logprobs[0] is None and None not in lp.token_logprobs[1:]
    assert lp.text_offset[len(prompt_ids)] == len(PROMPT)


def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(client, prompt_ids):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=0,
                                            max_tokens=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == PROMPT
    first = chunks[0].choices[0].logprobs
    assert len(first.tokens) == len(prompt_ids) and first.token_logprobs[0] is None
    assert chunks[-1].choices[0].finish_reason == "length"


def test_vllm_prompt_logprobs_on_completions_and_chat(server, prompt_ids, hf_lp):
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) and plp[0] is None
    for j in range(1, len(prompt_ids)):
        own = plp[j][str(prompt_ids[j])]
        assert abs(own["logprob"] - float(hf_lp[j - 1, prompt_ids[j]])) < ATOL
        assert own["decoded_token"] and own["rank"] >= 1
        assert any(v["rank"] == 1 for v in plp[j].values())
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                         "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    chat_plp = r.json()["choices"][0]["prompt_logprobs"]
    assert chat_plp[0] is None
    assert len(chat_plp) == r.json()["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat_plp[1:])        # k = 0: the prompt token only


def test_logit_bias_forces_and_forbids_tokens_on_both_endpoints(client, server):
    forced = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3,
        temperature=1.0, seed=3, logit_bias={"12345": 100})
    r = httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": [12345] * 3})
    assert forced.choices[0].message.content == r.json()["prompt"]
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    (first,) = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                          json={"prompt": greedy.choices[0].text,
                                "add_special_tokens": False}).json()["tokens"]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != greedy.choices[0].text


@pytest.fixture(scope="module")
def hf_last_hidden(hf_smollm):
    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            h = hf_smollm.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].float()
        return torch.nn.functional.normalize(h, dim=-1)
    return run


def test_embeddings_with_the_openai_client_equal_transformers(client, server, hf_last_hidden):
    texts = ["The quick brown fox", "jumps over the lazy dog", "x"]
    r = client.embeddings.create(model=MODEL, input=texts)      # the client asks for base64
    assert [d.index for d in r.data] == [0, 1, 2]
    ids = [httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": t}).json()["tokens"]
           for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, tok in zip(r.data, ids):
        got = torch.tensor(d.embedding)
        assert got.shape == (576,)
        assert torch.allclose(got, hf_last_hidden(tok), atol=1e-5, rtol=0)
    # token ids and a list of token-id lists, as floats, give the same vectors
    raw = httpx.post(f"{server.url}/v1/embeddings", headers=AUTH, timeout=60,
                     json={"input": ids, "encoding_format": "float"}).json()
    assert [len(d["embedding"]) for d in raw["data"]] == [576, 576, 576]
    for d, ref in zip(raw["data"], r.data):
        assert np.allclose(d["embedding"], ref.embedding, atol=1e-6)
    one = httpx.post(f"{server.url}/v1/embeddings", headers=AUTH, timeout=60,
                     json={"input": ids[2], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, r.data[2].embedding, atol=1e-6)
    assert one["usage"] == {"prompt_tokens": len(ids[2]), "total_tokens": len(ids[2])}


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "input must not be empty"),
    ({"input": ["a", ""]}, "input must not contain empty strings"),
    ({"input": "a", "dimensions": 64}, "dimensions 64 is not supported"),
    ({"input": [1, 99999999]}, "outside the vocabulary"),
    ({"input": "word " * 2100}, "maximum context length is 2048 tokens"),
    ({"input": ["a"] * 129}, "at most 128 inputs"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "\x1d"}, "has no tokens"),
])
def test_bad_embeddings_requests_are_400_and_leak_no_blocks(server, body, message):
    r = httpx.post(f"{server.url}/v1/embeddings", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_embeddings_leave_the_kv_cache_empty(client, server):
    client.embeddings.create(model=MODEL, input=["a b c d e f g"] * 3, encoding_format="float")
    metrics = httpx.get(f"{server.url}/metrics").text
    usage = [ln for ln in metrics.splitlines() if ln.startswith("vllm:kv_cache_usage_perc")]
    assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0.0


def test_openapi_documents_embeddings(server):
    doc = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    op = doc["paths"]["/v1/embeddings"]["post"]
    assert set(op["responses"]) == {"200", "400", "401", "404", "429", "503"}
    props = doc["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert props["dimensions"]["anyOf"][0]["maximum"] == 576
    assert props["encoding_format"]["enum"] == ["float", "base64"]


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.BadRequestError, match="logit_bias token ids must be in"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"49152": 1})
