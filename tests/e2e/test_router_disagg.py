"""The router's P/D mode over real processes (issue 26): redis-server, two prefill engines
(kv_producer), one decode engine (kv_consumer), two `kvmesh router --prefill-backends ...
--decode-backends ...`, through the official `openai` client.

Router A sees one prefill engine and the decode engine, each behind a recording relay (a real
HTTP hop that records the bodies: tests/support/recording_relay.py), so the test reads exactly
what each hop carried. Router B also sees a second prefill engine, reached directly, whose
process kills itself (SIGKILL, from a sitecustomize on its PYTHONPATH: production code has no
fault hooks) at its first forward once a trigger file exists: a prefill engine dying
mid-request, with the connection broken after the request was written.

Every answer is compared with the decode engine's own, asked directly: greedy float32 outputs
through the two hops equal one engine's, whether the decode engine read the prompt's KV or
(no KV transfer, or a failed one) computed the prompt itself.
"""
from __future__ import annotations

import json
import os
import signal

import httpx
import openai
import pytest
import redis
from processes import RedisServer, free_port
from recording_relay import RecordingRelay
from servers import with_float32
from waiting import wait_until

from kvmesh.router.disagg import prefill_body

from .router_fixtures import _spawn, _wait_ready, metric_sum, scrape

pytestmark = pytest.mark.slow
# NOTE: the engines' KV transfer (Mooncake) is the pd extra, in the test extra too
pytest.importorskip("mooncake.engine", reason="needs the pd extra (mooncake-transfer-engine-non-cuda)")

ENGINE_ARGS = ("--num-kv-blocks", "96", "--max-model-len", "512", "--max-num-seqs", "4")
MODEL = "tiny"       # a tiny random Llama (fast to start), served under its directory's name
VOCAB = 128
MAX_TOKENS = 12


def words(seed: int, n: int) -> str:
    """A prompt of `n` tokens of the tiny word-level tokenizer."""
    return " ".join(f"w{3 + (seed * 17 + i * 5) % (VOCAB - 3)}" for i in range(n))


# NOTE: several full KV blocks each (16 tokens a block), so the decode engine has blocks to read
PROMPTS = [words(1, 40), words(2, 45), words(3, 50)]

# the process SIGKILLs itself at its first forward once the trigger file exists
KILL_ON_FORWARD = '''
import os
import signal
from kvmesh.engine import model_runner

_execute = model_runner.ModelRunner.execute

def _dying_execute(self, out):
    if os.path.exists(os.environ["KVMESH_TEST_KILL_FILE"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return _execute(self, out)

model_runner.ModelRunner.execute = _dying_execute
'''


def _role(role: str) -> tuple[str, ...]:
    # NOTE: kv_port 0: two producers on one machine must not both bind the default port
    return ("--kv-transfer-config", json.dumps({"kv_connector": "MooncakeConnector",
                                                "kv_role": role, "kv_port": 0}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import save_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = save_tiny_model(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("m") / MODEL, seed=5)
    conf_path = path / "tokenizer_config.json"      # a chat template, for the chat endpoint
    conf = json.loads(conf_path.read_text())
    conf["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    conf_path.write_text(json.dumps(conf))
    return path


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny):
    tmp = tmp_path_factory.mktemp("pd")
    (tmp / "fault").mkdir()
    (tmp / "fault" / "sitecustomize.py").write_text(KILL_ON_FORWARD)
    trigger = tmp / "kill-prefill-b"
    rs = RedisServer()
    rs.start()
    procs, relays = [], []
    try:
        ports = {name: free_port() for name in ("prefill-a", "prefill-b", "decode")}
        relays = {name: RecordingRelay(f"http://127.0.0.1:{ports[name]}")
                  for name in ("prefill-a", "decode")}
        engines = {}
        for name, role in (("prefill-a", "kv_producer"), ("prefill-b", "kv_producer"),
                           ("decode", "kv_consumer")):
            # NOTE: a relayed engine advertises the relay's URL: the router's heartbeat match
            advertise = relays[name].url if name in relays else f"http://127.0.0.1:{ports[name]}"
            if name == "prefill-b":
                os.environ["PYTHONPATH"] = str(tmp / "fault")
                os.environ["KVMESH_TEST_KILL_FILE"] = str(trigger)
            try:
                engines[name] = _spawn(name, [
                    "serve", "--model", str(tiny), "--host", "127.0.0.1", "--port", str(ports[name]),
                    "--redis-url", rs.url, "--pod-id", name, "--advertise-url", advertise, "--log-level",
                    "warning", *with_float32((*ENGINE_ARGS, *_role(role)))], ports[name], tmp, 1)
            finally:
                os.environ.pop("PYTHONPATH", None)
                os.environ.pop("KVMESH_TEST_KILL_FILE", None)
            procs.append(engines[name])
        routers = {}
        for name, prefill in (("router-a", [relays["prefill-a"].url]),
                              ("router-b", [relays["prefill-a"].url, engines["prefill-b"].url])):
            port = free_port()
            routers[name] = _spawn(name, [
                "router", "--model", str(tiny), "--host", "127.0.0.1", "--port", str(port),
                "--redis-url", rs.url,
                "--prefill-backends", *prefill, "--decode-backends", relays["decode"].url,
                "--lookup-timeout", "2", "--expose-route-headers", "--log-level", "warning"],
                port, tmp, None)
            procs.append(routers[name])
        _wait_ready(procs, 240.0)
        yield {"engines": engines, "relays": relays, "routers": routers, "trigger": trigger,
               "redis": rs}
    finally:
        for p in procs:
            if p.alive():
                p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
        for r in relays.values() if isinstance(relays, dict) else ():
            r.stop()
        rs.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _direct(pd, prompt: str) -> str:
    """The decode engine's own answer (no router, no relay)."""
    return _client(pd["engines"]["decode"].url).completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text


def _streamed(client: openai.OpenAI, prompt: str) -> str:
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _router_metric(pd, router: str, name: str, **labels: str) -> float:
    return metric_sum(scrape(pd["routers"][router].url), name, **labels)


def _wait_healthy(pd, router: str, *urls: str) -> None:
    """Until `router` counts every backend in `urls` healthy. NOTE: on a loaded machine a health
    check can miss its 1 s deadline; a test that depends on the router's choice waits it out."""
    assert wait_until(lambda: all(_router_metric(pd, router, "kvmesh_router_backend_healthy",
                                                 backend=u) == 1 for u in urls), 30, 0.2)


def test_each_request_is_prefilled_on_one_engine_and_decoded_on_another(pd):
    relays = pd["relays"]
    _wait_healthy(pd, "router-a", relays["prefill-a"].url, relays["decode"].url)
    client = _client(pd["routers"]["router-a"].url)
    answers = []
    for p in PROMPTS:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=p,
                                                          max_tokens=MAX_TOKENS, temperature=0)
        assert raw.headers["x-kvmesh-prefill-backend"] == relays["prefill-a"].url
        assert raw.headers["x-kvmesh-backend"] == relays["decode"].url
        answers.append(raw.parse().choices[0].text)
    answers.append(_streamed(client, PROMPTS[0]))
    # NOTE: asked after the routed requests: the decode engine had none of these prompts cached
    expected = {p: _direct(pd, p) for p in PROMPTS}
    assert answers == [*(expected[p] for p in PROMPTS), expected[PROMPTS[0]]]

    # the prefill hop: the client's body, one token, not streamed, a remote decode asked for
    sent = [{"model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
            for p in PROMPTS] + [{"model": MODEL, "prompt": PROMPTS[0],
                                  "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}]
    prefills = relays["prefill-a"].posts("/v1/completions")
    assert len(prefills) == 4
    transfer_ids = [ex.body["kv_transfer_params"]["transfer_id"] for ex in prefills]
    assert len(set(transfer_ids)) == 4
    for ex, body, tid in zip(prefills, sent, transfer_ids):
        assert ex.body == prefill_body(body, tid)
        assert (ex.status, ex.answer["usage"]["completion_tokens"]) == (200, 1)
    # the decode hop: the client's body, plus what the prefill engine answered in
    # kv_transfer_params (nothing when it returned none: the decode engine prefills)
    decodes = relays["decode"].posts("/v1/completions")
    assert len(decodes) == 4
    for ex, body, pre, tid in zip(decodes, sent, prefills, transfer_ids):
        params = pre.answer["kv_transfer_params"]
        assert (params["do_remote_prefill"], params["do_remote_decode"], params["transfer_id"]) == \
            (True, False, tid)
        assert ex.body == {**body, "kv_transfer_params": params}
        assert ex.status == 200
    m = "kvmesh_router_prefill_requests_total"
    assert _router_metric(pd, "router-a", m, outcome="handoff") == 4
    assert _router_metric(pd, "router-a", m, outcome="no-params") == 0
    assert _router_metric(pd, "router-a", "kvmesh_router_decode_requests_total",
                          kind="remote-prefill") == 4
    assert _router_metric(pd, "router-a", "kvmesh_router_prefill_seconds_count") == 4
    # the decode engine read the prompts' KV from the prefill engine, and none failed
    decode = scrape(pd["engines"]["decode"].url)
    assert metric_sum(decode, "kvmesh:kv_transfer_bytes_total") > 0
    assert metric_sum(decode, "kvmesh:kv_transfer_failures_total") == 0


def test_a_chat_request_streams_through_both_hops(pd):
    relays = pd["relays"]
    _wait_healthy(pd, "router-a", relays["prefill-a"].url, relays["decode"].url)
    n_pre = len(relays["prefill-a"].posts("/v1/chat/completions"))
    messages = [{"role": "user", "content": words(4, 40)}]
    expected = _client(pd["engines"]["decode"].url).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    chunks = _client(pd["routers"]["router-a"].url).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    text, usage = "", None
    for c in chunks:
        text += "".join(ch.delta.content or "" for ch in c.choices)
        usage = c.usage or usage
    assert text == expected.choices[0].message.content
    assert usage.completion_tokens == expected.usage.completion_tokens
    pre = relays["prefill-a"].posts("/v1/chat/completions")[n_pre:]
    assert len(pre) == 1
    assert "stream_options" not in pre[0].body and pre[0].body["max_tokens"] == 1
    assert pre[0].body["stream"] is False


def test_a_request_the_prefill_engine_refuses_is_the_clients_400_and_never_decoded(pd):
    relays = pd["relays"]
    _wait_healthy(pd, "router-a", relays["prefill-a"].url, relays["decode"].url)
    n_dec = len(relays["decode"].posts("/v1/completions"))
    with pytest.raises(openai.BadRequestError) as e:
        _client(pd["routers"]["router-a"].url).completions.create(
            model=MODEL, prompt=words(5, 8), max_tokens=4, temperature=-1)
    assert "temperature" in e.value.message
    assert len(relays["decode"].posts("/v1/completions")) == n_dec
    assert _router_metric(pd, "router-a", "kvmesh_router_prefill_requests_total",
                          outcome="refused") == 1


def test_with_no_decode_engine_reachable_nothing_is_prefilled_and_the_client_gets_a_503(pd):
    relays = pd["relays"]
    _wait_healthy(pd, "router-a", relays["prefill-a"].url, relays["decode"].url)
    relays["decode"].stop()          # the decode engine unreachable: its address refuses
    try:
        assert wait_until(lambda: _router_metric(pd, "router-a", "kvmesh_router_backend_healthy",
                                                 backend=relays["decode"].url) == 0, 30, 0.2)
        n_pre = len(relays["prefill-a"].posts("/v1/completions"))
        with pytest.raises(openai.APIStatusError) as e:
            _client(pd["routers"]["router-a"].url).completions.create(
                model=MODEL, prompt=words(6, 8), max_tokens=4)
        assert (e.value.status_code, e.value.body["code"]) == (503, "no_healthy_backend")
        # the prefill engine was never asked: no KV pinned for a decode that cannot come
        assert len(relays["prefill-a"].posts("/v1/completions")) == n_pre
    finally:
        old = relays["decode"]
        relays["decode"] = RecordingRelay(old.target, old.port)


def test_a_prefill_engine_killed_mid_request_is_retried_on_another_then_the_decode_engine_prefills_alone(pd):
    engines, relays = pd["engines"], pd["relays"]
    client = _client(pd["routers"]["router-b"].url)
    # NOTE: prefill-b alone holds this prompt's blocks (asked directly): the router's prefix
    # lookup sends the prefill hop there
    prompt = words(7, 48)
    _client(engines["prefill-b"].url).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    held = redis.Redis(port=pd["redis"].port)
    try:
        assert wait_until(lambda: any(held.scard(k) >= 2 for k in held.keys("*:podblk:prefill-b")),
                          10)
    finally:
        held.close()
    _wait_healthy(pd, "router-b", relays["prefill-a"].url, engines["prefill-b"].url,
                  relays["decode"].url)
    pd["trigger"].touch()
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt,
                                                      max_tokens=MAX_TOKENS, temperature=0)
    assert engines["prefill-b"].proc.wait(5) == -signal.SIGKILL
    assert raw.status_code == 200
    assert raw.headers["x-kvmesh-prefill-backend"] == relays["prefill-a"].url
    assert raw.parse().choices[0].text == _direct(pd, prompt)
    assert _router_metric(pd, "router-b", "kvmesh_router_prefill_requests_total",
                          outcome="failed") == 1

    # no prefill engine left: the decode engine gets the client's own body and prefills it
    engines["prefill-a"].kill()
    n_dec = len(relays["decode"].posts("/v1/completions"))
    prompt = words(8, 40)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt,
                                                      max_tokens=MAX_TOKENS, temperature=0)
    assert raw.status_code == 200 and "x-kvmesh-prefill-backend" not in raw.headers
    assert raw.parse().choices[0].text == _direct(pd, prompt)
    decoded = relays["decode"].posts("/v1/completions")[n_dec:]
    assert [ex.body for ex in decoded] == [
        {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}]
    assert _router_metric(pd, "router-b", "kvmesh_router_prefill_fallbacks_total") == 1
    assert httpx.get(f"{pd['routers']['router-b'].url}/ready").json()["ready"] is True

