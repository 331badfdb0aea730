"""Prefill/decode disaggregation through real `kvmesh serve` processes on loopback, Mooncake's TCP
transport between them, the official `openai` client: a prefill engine (kv_producer) computes a
prompt and keeps its blocks; a decode engine (kv_consumer) reads them and decodes. Its greedy
answer is token for token the one colocated engine's (float32, tiny random Llama).
"""
from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from servers import start_server
from waiting import wait_until

pytest.importorskip("mooncake.engine", reason="needs the pd extra (mooncake-transfer-engine-non-cuda)")

BLOCK = 16
VOCAB = 128
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+\-infa]+)$', re.M)


def words(seed: int, n: int) -> str:
    """A prompt of `n` tokens of the tiny word-level tokenizer (no BOS is added)."""
    return " ".join(f"w{3 + (seed * 31 + i * 7) % (VOCAB - 3)}" for i in range(n))


def metric(url: str, name: str) -> float:
    total = 0.0
    for m_name, _, value in _SAMPLE.findall(httpx.get(f"{url}/metrics", timeout=5).text):
        if m_name == name:
            total += float(value)
    return total


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import save_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = save_tiny_model(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("m") / "tiny", seed=3)
    tc = path / "tokenizer_config.json"      # a chat template, for the chat endpoint
    conf = json.loads(tc.read_text())
    conf["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tc.write_text(json.dumps(conf))
    return path


def _kt(role: str, engine_id: str, **extra) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "engine_id": engine_id, "kv_port": 0, "kv_connector_extra_config": extra})


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    """prefill (kv_producer), decode (kv_consumer), and a second producer whose pins time out
    after 1 s: "colocated", as requests without kv_transfer_params run there as on any engine
    (the reference answers), and the timeout and killed-producer tests' prefill engine.

    NOTE: three processes, not four: on a loaded 2-core machine each start costs most of this
    file's time."""
    tmp = tmp_path_factory.mktemp("pd")
    common = ("--model", str(tiny_model), "--num-kv-blocks", "96", "--max-model-len", "1024",
              "--cpu-threads", "1", "--swap-space", "0", "--allocator", "none")
    flags = {"prefill": ("--kv-transfer-config", _kt("kv_producer", "prefill-0")),
             "decode": ("--kv-transfer-config", _kt("kv_consumer", "decode-0")),
             "colocated": ("--kv-transfer-config", _kt("kv_producer", "prefill-1",
                                                       pinned_timeout_s=1))}
    # NOTE: the engine's speed is not under test: the torch kernels spare a C++ build
    env = {"OMP_NUM_THREADS": "1", "KVMESH_CPU_KERNELS": "0"}
    with ThreadPoolExecutor(len(flags)) as pool:
        futures = {k: pool.submit(start_server, tmp, *common, *f, env=env) for k, f in flags.items()}
        servers = {k: f.result() for k, f in futures.items()}
    yield servers
    for s in servers.values():
        s.stop()


def prefill(server, prompt: str, transfer_id: str) -> dict:
    """The prefill leg as a router sends it: max_tokens 1 and do_remote_decode."""
    r = client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}})
    return r.model_extra["kv_transfer_params"]


def decode(server, prompt: str, params: dict | None, max_tokens: int = 12) -> str:
    """The decode leg, streamed (as a router streams it to the client)."""
    extra = {"kv_transfer_params": params} if params is not None else {}
    stream = client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={**extra, "ignore_eos": True})
    return "".join(c.choices[0].text for c in stream if c.choices)


def colocated(server, prompt: str, max_tokens: int = 12) -> str:
    return decode(server, prompt, None, max_tokens)


def test_a_long_prompt_through_the_pair_is_the_colocated_answer(cluster):
    col, pre, dec = cluster["colocated"], cluster["prefill"], cluster["decode"]
    prompt = words(1, 300)
    params = prefill(pre, prompt, "xfer-long")
    full = 300 // BLOCK
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-0"
    assert params["transfer_id"] == "xfer-long"
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", params["remote_bootstrap_addr"])
    assert len(params["remote_block_ids"]) == full
    assert metric(pre.url, "kvmesh:kv_transfer_pinned_blocks") == full

    computed0 = metric(dec.url, "kvmesh:prompt_tokens_computed_total")
    assert decode(dec, prompt, params) == colocated(col, prompt)
    # the decode engine ran only the prompt's tail: the blocks before it were read
    loaded = (300 - 1) // BLOCK * BLOCK
    assert metric(dec.url, "kvmesh:prompt_tokens_computed_total") - computed0 == 300 - loaded
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4         # layers x K,V x tokens x kv heads x dim x f32
    assert metric(dec.url, "kvmesh:kv_transfer_bytes_total") == loaded // BLOCK * block_bytes
    assert metric(dec.url, "kvmesh:kv_transfer_seconds_count") == 1
    # Mooncake's read alone: a part of the load, whose side-channel round trips come on top
    assert 0 < metric(dec.url, "kvmesh:kv_transfer_read_seconds_total") < metric(
        dec.url, "kvmesh:kv_transfer_seconds_sum")
    assert metric(dec.url, "kvmesh:kv_transfer_failures_total") == 0
    assert metric(dec.url, "kvmesh:kv_transfer_timeouts_total") == 0
    # the producer's blocks are released once read: its pool is back where it started
    assert wait_until(lambda: metric(pre.url, "kvmesh:kv_transfer_pinned_blocks") == 0, 5)
    assert wait_until(lambda: metric(pre.url, "kvmesh:kv_cache_usage_perc") == 0, 5)
    assert metric(pre.url, "kvmesh:kv_transfer_pins_released_total") == 1
    assert metric(pre.url, "kvmesh:kv_transfer_pin_timeouts_total") == 0


def test_concurrent_requests_through_the_pair(cluster):
    col, pre, dec = cluster["colocated"], cluster["prefill"], cluster["decode"]
    prompts = [words(10 + i, 40 + 37 * i) for i in range(4)]

    def pd(i: int) -> str:
        return decode(dec, prompts[i], prefill(pre, prompts[i], f"xfer-conc-{i}"))

    failures0 = metric(dec.url, "kvmesh:kv_transfer_failures_total")
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(pd, range(4)))
    assert got == [colocated(col, p) for p in prompts]
    assert metric(dec.url, "kvmesh:kv_transfer_failures_total") == failures0
    assert wait_until(lambda: metric(pre.url, "kvmesh:kv_transfer_pinned_blocks") == 0, 5)


def test_a_prefix_hit_on_the_decode_side_reads_fewer_blocks(cluster):
    col, pre, dec = cluster["colocated"], cluster["prefill"], cluster["decode"]
    head = words(50, 128)                            # 8 full blocks both prompts share
    first, second = head + " " + words(51, 60), head + " " + words(52, 70)
    assert decode(dec, first, prefill(pre, first, "xfer-prefix-1")) == colocated(col, first)
    bytes0 = metric(dec.url, "kvmesh:kv_transfer_bytes_total")
    hits0 = metric(dec.url, "kvmesh:prefix_cache_hits_total")
    assert decode(dec, second, prefill(pre, second, "xfer-prefix-2")) == colocated(col, second)
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4
    # 198 tokens: blocks 0-7 are the decode engine's own prefix hits, 8-11 are read
    assert metric(dec.url, "kvmesh:prefix_cache_hits_total") - hits0 == 128
    assert metric(dec.url, "kvmesh:kv_transfer_bytes_total") - bytes0 == 4 * block_bytes


def test_pinned_blocks_are_freed_after_the_timeout_when_nobody_reads_them(cluster):
    pre2 = cluster["colocated"]
    params = prefill(pre2, words(60, 100), "xfer-unread")
    assert len(params["remote_block_ids"]) == 6
    # never read: the pin expires after pinned_timeout_s (1 s) and the pool is whole again
    assert wait_until(lambda: metric(pre2.url, "kvmesh:kv_transfer_pin_timeouts_total") == 1, 10)
    assert metric(pre2.url, "kvmesh:kv_transfer_pinned_blocks") == 0
    assert metric(pre2.url, "kvmesh:kv_cache_usage_perc") == 0
    r = httpx.get(params["remote_bootstrap_addr"] + "/query",
                  params={"transfer_id": "xfer-unread"}, timeout=5)
    assert r.status_code == 404


def test_chat_carries_the_params_on_the_final_streamed_chunk(cluster):
    col, pre, dec = cluster["colocated"], cluster["prefill"], cluster["decode"]
    messages = [{"role": "user", "content": words(80, 90)}]
    chunks = list(client(pre).chat.completions.create(
        model="tiny", messages=messages, max_tokens=1, temperature=0, stream=True,
        extra_body={"kv_transfer_params": {"do_remote_decode": True, "transfer_id": "xfer-chat"}}))
    with_params = [c.model_extra.get("kv_transfer_params") for c in chunks]
    params = with_params[-1]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert params["transfer_id"] == "xfer-chat" and all(p is None for p in with_params[:-1])

    def chat(server, extra: dict) -> str:
        r = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                   temperature=0, extra_body=extra)
        assert r.model_extra.get("kv_transfer_params") is None
        return r.choices[0].message.content

    assert chat(dec, {"kv_transfer_params": params, "ignore_eos": True}) == \
        chat(col, {"ignore_eos": True})


@pytest.mark.parametrize("which, body, param", [
    ("decode", {"do_remote_decode": True}, "kv_transfer_params.do_remote_decode"),
    ("prefill", {"do_remote_prefill": True, "remote_engine_id": "p", "transfer_id": "t",
                 "remote_bootstrap_addr": "http://127.0.0.1:1"},
     "kv_transfer_params.do_remote_prefill"),
    ("prefill", {"do_remote_decode": 1}, "kv_transfer_params.do_remote_decode"),
    ("prefill", {"remote_host": "h"}, "kv_transfer_params.remote_host"),
])
def test_bad_params_are_a_400_naming_the_field(cluster, which, body, param):
    r = httpx.post(f"{cluster[which].url}/v1/completions", timeout=30,
                   json={"prompt": "w3 w4", "max_tokens": 1, "kv_transfer_params": body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_several_prompts_with_one_hand_off_are_a_400(cluster):
    r = httpx.post(f"{cluster['prefill'].url}/v1/completions", timeout=30,
                   json={"prompt": ["w3", "w4"], "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params"


def test_a_killed_producer_makes_the_consumer_prefill_locally(cluster):
    pre2, dec = cluster["colocated"], cluster["decode"]
    prompt = words(70, 200)
    expected = colocated(pre2, prompt)
    params = prefill(pre2, prompt, "xfer-killed")
    pre2.proc.send_signal(signal.SIGKILL)         # NOTE: last test: the fixture's "colocated"
    pre2.proc.wait(10)
    failures0 = metric(dec.url, "kvmesh:kv_transfer_failures_total")
    computed0 = metric(dec.url, "kvmesh:prompt_tokens_computed_total")
    assert decode(dec, prompt, params) == expected
    assert metric(dec.url, "kvmesh:kv_transfer_failures_total") == failures0 + 1
    assert metric(dec.url, "kvmesh:prompt_tokens_computed_total") - computed0 == 200
    assert "reading its prompt KV failed; computing it here" in dec.log()
