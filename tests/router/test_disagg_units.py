"""P/D mode's pure parts: the two hops' bodies, when a request skips the prefill hop, the
configuration and its CLI errors."""
from __future__ import annotations

import re

import pytest

from kvmesh.engine.kv_transfer.params import parse_kv_transfer_params
from kvmesh.router import main as router_main
from kvmesh.router.config import RouterConfig
from kvmesh.router.disagg import (decode_body, local_prefill_reason, new_transfer_id,
                                  prefill_body)


def test_the_prefill_body_asks_for_one_token_without_streaming_and_a_remote_decode():
    client = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
              "stream_options": {"include_usage": True}, "min_tokens": 4, "n": 2,
              "temperature": 0, "ignore_eos": True}
    assert prefill_body(client, "t-1") == {
        "model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0,
        "ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t-1"}}
    # the client's own body is left as it came (the decode hop sends it)
    assert client["max_tokens"] == 50 and client["stream"] is True


def test_a_chat_prefill_body_drops_max_completion_tokens_which_would_override_max_tokens():
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 30}
    assert prefill_body(chat, "t") == {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t"}}


def test_the_prefill_bodys_params_and_the_transfer_id_pass_the_engines_own_check():
    tid = new_transfer_id()
    assert re.fullmatch(r"kvmesh-[0-9a-f]{32}", tid)
    assert new_transfer_id() != tid
    params = parse_kv_transfer_params(prefill_body({"prompt": "x"}, tid)["kv_transfer_params"])
    assert (params.do_remote_decode, params.do_remote_prefill, params.transfer_id) == \
        (True, False, tid)


def test_the_decode_body_is_the_clients_plus_the_prefill_engines_params():
    client = {"prompt": "hi", "max_tokens": 50, "stream": True}
    returned = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
                "remote_bootstrap_addr": "http://10.0.0.1:8998", "remote_block_ids": [3, 4],
                "transfer_id": "t"}
    assert decode_body(client, returned) == {**client, "kv_transfer_params": returned}
    assert decode_body(client, None) is client


@pytest.mark.parametrize("body, reason", [
    ({"prompt": "x"}, None),
    ({"prompt": "x", "prompt_logprobs": None}, None),
    ({"prompt": "x", "prompt_logprobs": 0},
     "prompt_logprobs need the prompt computed where the answer comes from"),
    ({"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}},
     "the client sent its own kv_transfer_params"),
    ({"prompt": "x", "n": 1, "best_of": 1}, None),
    ({"prompt": "x", "n": 2}, "several samples (n or best_of > 1)"),
    ({"prompt": "x", "best_of": 3}, "several samples (n or best_of > 1)"),
    ({"prompt": [5, 6, 7]}, None),                       # one prompt of token ids
    ({"prompt": ["x"]}, None),
    ({"prompt": ["x", "y"]}, "several prompts in one request"),
    ({"prompt": [[5, 6], [7]]}, "several prompts in one request"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "several samples (n or best_of > 1)"),
])
def test_which_requests_skip_the_prefill_hop(body, reason):
    assert local_prefill_reason(body) == reason


def test_pd_mode_config():
    cfg = RouterConfig(prefill_backends=("http://p:1",), decode_backends=("http://d:1",))
    assert cfg.disaggregated
    assert RouterConfig(prefill_discover="p", decode_discover="d").disaggregated
    assert not RouterConfig(backends=("http://b:1",)).disaggregated


@pytest.mark.parametrize("kwargs, message", [
    ({"prefill_backends": ("http://p:1",)},
     "P/D mode needs exactly one of --decode-backends URL ... or --discover-decode-service NAME"),
    ({"decode_backends": ("http://d:1",)},
     "P/D mode needs exactly one of --prefill-backends URL ... or --discover-prefill-service NAME"),
    ({"prefill_backends": ("http://p:1",), "prefill_discover": "p",
      "decode_backends": ("http://d:1",)},
     "P/D mode needs exactly one of --prefill-backends URL ... or --discover-prefill-service NAME"),
    ({"prefill_backends": ("http://p:1",), "decode_backends": ("http://d:1",),
      "backends": ("http://b:1",)},
     "--backends / --discover-headless-service cannot be combined with --prefill-backends / "
     "--decode-backends: in P/D mode the decode engines answer the clients"),
    ({"prefill_backends": ("vllm=http://p:1",), "decode_backends": ("http://d:1",)},
     "vLLM backends need --redis-url: their KV events are written to the shared prefix index"),
    ({}, "give exactly one of --backends URL ... or --discover-headless-service NAME (or, for "
     "prefill/decode disaggregation, --prefill-backends and --decode-backends)"),
])
def test_pd_mode_config_errors(kwargs, message):
    with pytest.raises(ValueError) as e:
        RouterConfig(**kwargs)
    assert str(e.value) == message


def test_the_cli_builds_a_pd_config_and_exits_2_on_a_missing_role(capsys):
    args = router_main.build_parser().parse_args([
        "--redis-url", "redis://127.0.0.1:1/0", "--prefill-backends", "http://p:1", "http://p:2",
        "--discover-decode-service", "decode.ns.svc"])
    cfg = router_main.config_from_args(args)
    assert (cfg.prefill_backends, cfg.prefill_discover, cfg.decode_backends,
            cfg.decode_discover, cfg.backends, cfg.discover) == \
        (("http://p:1", "http://p:2"), None, (), "decode.ns.svc", (), None)
    assert router_main.main(["--redis-url", "redis://127.0.0.1:1/0",
                             "--prefill-backends", "http://p:1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvmesh router: error: P/D mode needs exactly one of --decode-backends URL ... or "
        "--discover-decode-service NAME")
