"""`kvmesh serve --async-scheduling`: a real server answers the official openai client with the
synchronous engine's tokens, streamed and not; a combination it cannot run is a CLI message."""
from __future__ import annotations

import subprocess
import sys

import openai
from servers import start_server
from tiny_models import save_tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams

PROMPT = "w5 w17 w33 w9 w41 w70"


def test_async_scheduling_with_speculative_decoding_is_a_cli_error():
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--async-scheduling",
                        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                        "--allocator", "none", "--log-level", "warning"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().endswith(
        "--async-scheduling does not support --speculative-config yet; drop one of them")
    assert "Traceback" not in r.stderr


def test_a_server_with_async_scheduling_answers_the_openai_client(tmp_path):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = str(save_tiny_model(LlamaForCausalLM(cfg), tmp_path / "tiny", seed=3))
    sync = LLMEngine(EngineConfig(model=path, dtype="float32", num_kv_blocks=64, max_model_len=256))
    sync.add_request("ref", PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while sync.has_unfinished_requests():
        for out in sync.step():
            expected = out.outputs[0].text
    server = start_server(tmp_path, "--model", path, "--num-kv-blocks", "64", "--max-model-len",
                          "256", "--async-scheduling")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw)
        assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 12
        chunks = list(client.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert "async scheduling: on" in server.log()
    finally:
        assert server.stop() == 0
