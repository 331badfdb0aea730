"""Small pure pieces of the router: URL matching, /metrics parsing, prompt extraction, CLI."""
from __future__ import annotations

import pytest

from kvmesh.index.lookup import PodLoad
from kvmesh.router.backends import BackendPool, normalize_url, parse_load_metrics
from kvmesh.router.config import RouterConfig
from kvmesh.router.main import config_from_args, build_parser, main
from kvmesh.router.prompt import prompt_token_ids


def test_normalize_url():
    assert normalize_url("http://LOCALHOST:8000/") == "http://127.0.0.1:8000"
    assert normalize_url("10.0.0.5:8000") == "http://10.0.0.5:8000"
    assert normalize_url("https://engine") == "https://engine:443"
    assert normalize_url("http://[fd00::1]:8000") == "http://[fd00::1]:8000"


def test_parse_load_metrics():
    text = ('# HELP x\nkvmesh:num_requests_running{model_name="m"} 3.0\n'
            'kvmesh:num_requests_waiting{model_name="m"} 7\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\nother 1\n')
    assert parse_load_metrics(text) == (3, 7, 0.5)
    assert parse_load_metrics("nothing here 1\n") is None


def test_heartbeats_map_pods_to_backends():
    pool = BackendPool(["http://localhost:8001", "http://127.0.0.1:8002"])
    pool.apply_heartbeats({"p1": PodLoad("p1", "http://127.0.0.1:8001/", "m", 2, 3, 0, 0.4, 0.0)})
    a, b = pool.states()
    assert (a.pod_id, a.running, a.waiting, a.kv_usage, a.load) == ("p1", 2, 3, 0.4, 5)
    assert (b.pod_id, b.load) == (None, 0)
    a.in_flight = 9
    assert a.load == 9
    with pytest.raises(ValueError):
        BackendPool()


def test_prompt_token_ids_shapes():
    class Tok:
        def encode(self, text):
            return [len(text)]

        def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
            self.seen, self.tools = messages, tools
            return [len(messages), int(add_generation_prompt)]

    t = Tok()
    assert prompt_token_ids(t, "completion", {"prompt": "abc"}) == [3]
    assert prompt_token_ids(t, "completion", {"prompt": ["ab", "c"]}) == [2]
    assert prompt_token_ids(t, "completion", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_token_ids(t, "completion", {"prompt": [[1, 2], [3]]}) == [1, 2]
    assert prompt_token_ids(t, "completion", {"prompt": ""}) is None
    assert prompt_token_ids(t, "completion", {}) is None
    assert prompt_token_ids(t, "chat", {"messages": [{"role": "user", "content": "x"}],
                                        "add_generation_prompt": False}) == [1, 0]
    assert prompt_token_ids(t, "chat", {"messages": "nope"}) is None
    # the tools are rendered as the engine renders them (an empty list: none)
    tools = [{"type": "function", "function": {"name": "f"}}]
    prompt_token_ids(t, "chat", {"messages": [{"role": "user", "content": "x"}], "tools": tools})
    assert t.tools == tools
    prompt_token_ids(t, "chat", {"messages": [{"role": "user", "content": "x"}], "tools": []})
    assert t.tools is None
    # rendered like the API server's ChatMessage.as_template_dict
    prompt_token_ids(t, "chat", {"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"}]})
    assert t.seen == [{"role": "system", "content": "a\nb"},
                      {"role": "assistant", "content": "", "name": "bot"}]
    assert prompt_token_ids(None, "completion", {"prompt": "abc"}) is None


def test_cli_and_config_validation(capsys):
    args = build_parser().parse_args(["--redis-url", "redis://127.0.0.1:1/0", "--backends",
                                      "http://127.0.0.1:9", "http://127.0.0.1:10",
                                      "--session-header", "X-Session-Id"])
    cfg = config_from_args(args)
    assert cfg.backends == ("http://127.0.0.1:9", "http://127.0.0.1:10")
    assert (cfg.strategy, cfg.block_size, cfg.hash_seed, cfg.session_header) == (
        "kv-aware", 16, "kvmesh", "X-Session-Id")
    # neither --backends nor discovery (nor P/D mode's roles): the config's error, exit 2
    assert main(["--redis-url", "redis://x"]) == 2
    assert "give exactly one of --backends URL ... or --discover-headless-service NAME" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--redis-url", "redis://x", "--backends", "u", "--discover-headless-service", "s"])
    assert main(["--redis-url", "redis://x", "--backends", "u", "--block-size", "3"]) == 2
    assert "--block-size" in capsys.readouterr().err
    assert config_from_args(build_parser().parse_args(
        ["--redis-url", "redis://x", "--backends", "u", "--lookup-timeout", "0.5"])
    ).lookup_timeout_s == 0.5
    assert main(["--redis-url", "redis://x", "--backends", "u", "--lookup-timeout", "0"]) == 2
    assert "--lookup-timeout must be > 0 seconds, got 0.0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="strategy"):
        RouterConfig(backends=("u",), strategy="nope")


def _hb(pod: str, url: str) -> dict[str, PodLoad]:
    return {pod: PodLoad(pod, url, "m", 1, 0, 0, 0.1, 0.0)}


def test_a_pod_id_whose_url_flips_back_is_a_duplicate_and_loses_its_prefix_hits(caplog):
    pool = BackendPool(["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
    a, b = pool.states()
    pool.apply_heartbeats(_hb("p", a.url), now=0.0)
    pool.apply_heartbeats(_hb("p", b.url), now=1.0)      # one move: a restart, still trusted
    assert (a.pod_id, b.pod_id, pool.duplicate_pod_ids) == (None, "p", {})
    with caplog.at_level("WARNING", logger="kvmesh.router"):
        pool.apply_heartbeats(_hb("p", a.url), now=2.0)  # back again: two engines share "p"
        pool.apply_heartbeats(_hb("p", b.url), now=3.0)
    assert pool.duplicate_pod_ids == {"p": {a.url, b.url}}
    assert (a.pod_id, b.pod_id, b.running) == (None, None, 1)   # load still from the heartbeat
    warnings = [r.getMessage() for r in caplog.records if "claimed by more than one" in r.message]
    assert warnings == [f"pod id 'p' is claimed by more than one backend ({a.url}, {b.url}): "
                        "prefix hits for them are ignored and they are routed by load; give "
                        "each engine its own --pod-id"]
    # 30 s without a flip: trusted again
    pool.apply_heartbeats(_hb("p", b.url), now=33.5)
    assert (pool.duplicate_pod_ids, b.pod_id) == ({}, "p")


def test_a_single_move_is_not_a_duplicate():
    pool = BackendPool(["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
    a, b = pool.states()
    for t, url in enumerate([a.url, a.url, b.url, b.url, b.url]):
        pool.apply_heartbeats(_hb("p", url), now=float(t))
    assert (pool.duplicate_pod_ids, a.pod_id, b.pod_id) == ({}, None, "p")


def test_cache_salt_from_is_validated_and_read_from_the_cli():
    with pytest.raises(ValueError, match="--cache-salt-from must be none, api-key or header:NAME"):
        RouterConfig(backends=("u",), cache_salt_from="header:")
    args = build_parser().parse_args(["--redis-url", "redis://x", "--backends", "http://e:8000",
                                      "--cache-salt-from", "api-key"])
    assert config_from_args(args).cache_salt_from == "api-key"
    assert main(["--redis-url", "redis://x", "--backends", "http://e:8000",
                 "--cache-salt-from", "tenant"]) == 2
