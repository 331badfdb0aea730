"""A real `kvmesh serve --speculative-config` process answering the official `openai` client:
greedy text equal to the engine's without speculation, streamed in fewer chunks than tokens,
and the spec_decode counters on /metrics moved."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from openai import OpenAI
from servers import start_server

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams

F = 7
PROMPT = "w7 w7 w7 w7 w7 w7 w7 w7"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    path, _ = tiny_llama
    srv = start_server(tmp_path_factory.mktemp("spec-server"), "--model", path,
                       "--num-kv-blocks", "64", "--max-model-len", "256",
                       "--speculative-config", json.dumps(SPEC), "--log-level", "warning")
    yield srv
    srv.stop()


def test_speculating_server_answers_the_openai_client(server, tiny_llama):
    _, loaded = tiny_llama
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    body = dict(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=12,
                temperature=0, logit_bias={str(F): 100})
    done = client.completions.create(**body)
    # the same engine without speculation, in process
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=256), loaded=loaded)
    engine.add_request("x", PROMPT, SamplingParams(temperature=0.0, max_tokens=12,
                                                   logit_bias={F: 100.0}))
    expected = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                expected = out.outputs[0].text
    assert done.choices[0].text == expected
    assert done.usage.completion_tokens == 12

    chunks = [c.choices[0].text for c in client.completions.create(**body, stream=True)
              if c.choices]
    assert "".join(chunks) == expected
    assert len([c for c in chunks if c]) < 12          # several tokens per streamed delta

    text = httpx.get(f"{server.url}/metrics").text

    def value(name: str) -> float:
        m = re.search(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        assert m is not None, name
        return float(m[1])

    assert value("spec_decode_num_drafts") > 0
    assert 0 < value("spec_decode_num_accepted_tokens") <= value("spec_decode_num_draft_tokens")
