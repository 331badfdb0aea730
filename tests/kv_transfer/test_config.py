"""--kv-transfer-config (vLLM's flag and keys) and kv_transfer_params (vLLM's fields): parsed and
validated once, clear errors naming the key or field; the CLI exits 2 on a bad config."""
from __future__ import annotations

import pytest

from kvmesh.cli import main as cli_main
from kvmesh.common.config import EngineConfig
from kvmesh.common.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config
from kvmesh.engine.input_processor import InputProcessor
from kvmesh.engine.kv_transfer.params import KVTransferParams, parse_kv_transfer_params
from kvmesh.engine.sampling_params import SamplingParams, SamplingParamsError


def test_config_json_is_parsed_with_defaults():
    c = parse_kv_transfer_config('{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",'
                                 ' "engine_id": "p0", "kv_port": 0, "kv_connector_extra_config":'
                                 ' {"mooncake_protocol": "tcp", "pinned_timeout_s": 2}}')
    assert c == KVTransferConfig("MooncakeConnector", "kv_producer", "p0", "127.0.0.1", 0,
                                 {"mooncake_protocol": "tcp", "pinned_timeout_s": 2})
    assert (c.is_producer, c.is_consumer, c.protocol, c.pinned_timeout_s,
            c.transfer_timeout_s) == (True, False, "tcp", 2.0, 10.0)
    both = parse_kv_transfer_config({"kv_connector": "MooncakeConnector", "kv_role": "kv_both"})
    assert (both.is_producer, both.is_consumer, both.kv_port) == (True, True, 8998)
    assert len(both.engine_id) == 36                  # a random uuid when none is given
    cfg = EngineConfig(kv_transfer_config='{"kv_connector": "MooncakeConnector", '
                                          '"kv_role": "kv_consumer", "engine_id": "d"}')
    assert cfg.kv_transfer_config.kv_role == "kv_consumer"
    assert EngineConfig().kv_transfer_config is None


@pytest.mark.parametrize("value, message", [
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_buffer": 1}',
     "unknown key(s) 'kv_buffer'"),
    ('{"kv_connector": "MooncakeConnector", kv_role: 1}', "not valid JSON"),
    ('[1]', "must be a JSON object"),
    ('{"kv_role": "kv_producer"}', '"kv_connector" is required'),
    ('{"kv_connector": "MooncakeConnector"}', '"kv_role" is required'),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}',
     "kv_connector 'NixlConnector' is not supported by kvmesh; use one of MooncakeConnector"),
    ('{"kv_connector": "Mooncake", "kv_role": "kv_producer"}',
     "kv_connector must be one of MooncakeConnector, got 'Mooncake'"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "producer"}',
     "kv_role must be one of kv_producer, kv_consumer, kv_both, got 'producer'"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_port": 70000}',
     "kv_port must be an integer in [0, 65535]"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "engine_id": "a b"}',
     "engine_id must be"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"mooncake_protocol": "efa"}}',
     "mooncake_protocol must be one of tcp, rdma, got 'efa'"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"num_workers": 4}}',
     "unknown kv_connector_extra_config key(s) 'num_workers'"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"pinned_timeout_s": 0}}',
     "pinned_timeout_s must be a number > 0, got 0"),
])
def test_bad_configs_name_what_is_wrong(value, message):
    with pytest.raises(ValueError) as e:
        parse_kv_transfer_config(value)
    assert message in str(e.value)
    assert str(e.value).startswith("--kv-transfer-config")


def test_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="--kv-transfer-config needs --tensor-parallel-size 1"):
        EngineConfig(tensor_parallel_size=2, kv_transfer_config={
            "kv_connector": "MooncakeConnector", "kv_role": "kv_both"})


def test_the_cli_exits_2_naming_the_bad_role(capsys):
    rc = cli_main(["serve", "--kv-transfer-config",
                   '{"kv_connector": "MooncakeConnector", "kv_role": "kv_sender"}'])
    assert rc == 2
    err = capsys.readouterr().err
    assert ("kvmesh serve: error: --kv-transfer-config: kv_role must be one of kv_producer, "
            "kv_consumer, kv_both, got 'kv_sender'") in err


def test_the_cli_exits_2_naming_the_unknown_connector(capsys):
    rc = cli_main(["serve", "--kv-transfer-config",
                   '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'])
    assert rc == 2
    assert "kv_connector 'LMCacheConnectorV1' is not supported by kvmesh" in capsys.readouterr().err


def test_kv_share_and_kv_transfer_are_exclusive(capsys):
    rc = cli_main(["serve", "--kv-share", "redis", "--redis-url", "redis://127.0.0.1:1/0",
                   "--kv-transfer-config", '{"kv_connector": "MooncakeConnector", '
                   '"kv_role": "kv_both"}'])
    assert rc == 2
    assert "--kv-share and --kv-transfer-config cannot be combined" in capsys.readouterr().err


def test_params_are_parsed_with_vllms_names():
    body = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-0",
            "remote_bootstrap_addr": "http://10.0.0.7:8998", "remote_block_ids": [4, 5, 9],
            "transfer_id": "xfer-cmpl-1"}
    p = parse_kv_transfer_params(body)
    assert p == KVTransferParams(False, True, "p-0", "http://10.0.0.7:8998", (4, 5, 9),
                                 "xfer-cmpl-1")
    assert p.to_dict() == body
    assert parse_kv_transfer_params({"do_remote_decode": True}).to_dict() == {
        "do_remote_decode": True, "do_remote_prefill": False}
    assert parse_kv_transfer_params(None) is None


@pytest.mark.parametrize("body, param, message", [
    ([1], "kv_transfer_params", "must be a JSON object"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode", "must be a boolean"),
    ({"remote_hostname": "h"}, "kv_transfer_params.remote_hostname", "is not a known field"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "transfer_id": "t"},
     "kv_transfer_params.remote_bootstrap_addr", "is required with do_remote_prefill"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "transfer_id": "t",
      "remote_bootstrap_addr": "10.0.0.1:8998"},
     "kv_transfer_params.remote_bootstrap_addr", "of the form http://ip:port"),
    ({"remote_block_ids": [1, -2]}, "kv_transfer_params.remote_block_ids", "integers >= 0"),
    ({"do_remote_decode": True, "do_remote_prefill": True, "remote_engine_id": "p",
      "transfer_id": "t", "remote_bootstrap_addr": "http://h:1"},
     "kv_transfer_params.do_remote_prefill", "cannot be true together with do_remote_decode"),
])
def test_bad_params_name_the_field(body, param, message):
    with pytest.raises(SamplingParamsError) as e:
        parse_kv_transfer_params(body)
    assert e.value.param == param
    assert message in str(e.value)


class _Tok:
    pass


@pytest.mark.parametrize("role, params, param", [
    (None, KVTransferParams(do_remote_decode=True), "kv_transfer_params"),
    ("kv_consumer", KVTransferParams(do_remote_decode=True), "kv_transfer_params.do_remote_decode"),
    ("kv_producer", KVTransferParams(False, True, "p", "http://h:1", None, "t"),
     "kv_transfer_params.do_remote_prefill"),
])
def test_the_input_processor_checks_the_role(role, params, param):
    proc = InputProcessor(_Tok(), 100, 64, kv_role=role)
    with pytest.raises(SamplingParamsError) as e:
        proc.check_params(SamplingParams(max_tokens=1, kv_transfer_params=params))
    assert e.value.param == param
    ok = InputProcessor(_Tok(), 100, 64, kv_role="kv_both")
    assert ok.check_params(SamplingParams(kv_transfer_params=params)).kv_transfer_params == params


def test_n_above_one_is_refused():
    with pytest.raises(SamplingParamsError, match="kv_transfer_params needs n = 1, got n = 2"):
        SamplingParams(n=2, kv_transfer_params=KVTransferParams(do_remote_decode=True))
