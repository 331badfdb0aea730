"""One home per default: every flag that sets a config dataclass's field takes that field's default
(issue 31). A flag written with its own literal default fails here as soon as the two diverge."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

import pytest

from kvmesh.api import server
from kvmesh.cli import build_parser as cli_parser
from kvmesh.common.cache_salt import CacheSaltSource
from kvmesh.common.config import EngineConfig, add_field_flag, engine_config_from_args
from kvmesh.engine.pooling_params import PoolingParams
from kvmesh.router import main as router_main
from kvmesh.router.config import RouterConfig

ROUTER_REQUIRED = ["--redis-url", "redis://127.0.0.1:1/0", "--backends", "http://127.0.0.1:9"]


def diverging(parser: argparse.ArgumentParser, cls: type) -> tuple[set[str], list[str]]:
    """(the dests compared, "flag: flag default != field default" for each that differs)."""
    defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
    seen, bad = set(), []
    for action in parser._actions:
        name = action.dest
        if not action.option_strings or name not in defaults or _required(parser, action):
            continue
        seen.add(action.dest)
        if action.default != defaults[name] or type(action.default) is not type(defaults[name]):
            bad.append(f"{action.option_strings[0]}: {action.default!r} != {defaults[name]!r}")
    return seen, bad


def _required(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    """A flag the command line must give (alone or in a required group): its default is unused."""
    return action.required or any(g.required and action in g._group_actions
                                  for g in parser._mutually_exclusive_groups)


ENGINE_FLAGS = {f.name for f in fields(EngineConfig)} - {
    # set by `kvmesh serve` from other flags (--redis-url, --kv-share), or only in code
    "enable_kv_events", "kv_share_url", "sjf_aging_tokens_per_s", "dynamic_weights",
    "recompute_tokens_per_s", "swap_bytes_per_s"}


def _generate_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


@pytest.mark.parametrize("parser", [server.build_parser(), _generate_parser()],
                         ids=["serve", "generate"])
def test_every_engine_flag_default_is_the_engine_configs(parser):
    seen, bad = diverging(parser, EngineConfig)
    assert bad == []
    assert seen == ENGINE_FLAGS


def test_serve_with_no_flags_builds_the_default_engine_config_and_its_other_defaults():
    args = server.parse_args([])
    assert engine_config_from_args(args) == EngineConfig()
    assert PoolingParams(args.pooling) == PoolingParams()
    assert CacheSaltSource.parse(args.cache_salt_from) == CacheSaltSource()


def test_every_router_flag_default_is_the_router_configs():
    parser = router_main.build_parser()
    seen, bad = diverging(parser, RouterConfig)
    assert bad == []
    assert seen == {"backend_port", "backend_kind", "kv_events_port", "kv_events_replay_port",
                    "kv_events_topic", "strategy", "model", "tokenizer", "block_size",
                    "hash_seed", "api_key", "expose_route_headers", "cache_salt_from",
                    "session_header", "namespace", "service", "lookup_timeout_s",
                    "lora_load_on_demand", "hold_timeout_s", "max_held_requests",
                    # --backends and P/D mode's role flags: no group is required, the config
                    # checks that exactly one way names the engines
                    "backends", "prefill_backends", "decode_backends", "prefill_discover",
                    "decode_discover"}
    cfg = router_main.config_from_args(parser.parse_args(ROUTER_REQUIRED))
    assert cfg == RouterConfig(redis_url="redis://127.0.0.1:1/0", backends=("http://127.0.0.1:9",))


def test_router_and_engines_agree_on_block_size_and_hash_seed_by_default():
    assert (RouterConfig(backends=("x",)).block_size, RouterConfig(backends=("x",)).hash_seed) \
        == (EngineConfig().block_size, EngineConfig().hash_seed) == (16, "kvmesh")


def test_a_flag_with_its_own_literal_default_is_caught():
    p = argparse.ArgumentParser()
    add_field_flag(p, EngineConfig, "--block-size", type=int)
    p.add_argument("--max-num-seqs", type=int, default=256)      # a second home that drifted
    p.add_argument("--swap-space", type=int, default=1)          # equal, but an int for a float
    seen, bad = diverging(p, EngineConfig)
    assert seen == {"block_size", "max_num_seqs", "swap_space"}
    assert bad == ["--max-num-seqs: 256 != 128", "--swap-space: 1 != 1.0"]


def test_add_field_flag_refuses_a_flag_without_a_field():
    with pytest.raises(AttributeError, match="EngineConfig has no field 'max_num_seq'"):
        add_field_flag(argparse.ArgumentParser(), EngineConfig, "--max-num-seq", type=int)
