"""--speculative-config (vLLM's flag and keys): parsed and validated once, clear errors naming
the key; the CLI exits 2 on a bad one; LLM(speculative_config=...) takes a mapping."""
from __future__ import annotations

import pytest

from kvmesh.cli import main as cli_main
from kvmesh.common.config import EngineConfig, engine_config_from_kwargs
from kvmesh.common.speculative_config import SpeculativeConfig, parse_speculative_config


def test_ngram_json_is_parsed_with_vllms_lookup_defaults():
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == \
        SpeculativeConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5)
    # one bound given: the other takes its value
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 4}) == \
        SpeculativeConfig("ngram", 2, prompt_lookup_min=4, prompt_lookup_max=4)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 2, "disable_by_batch_size": 8}) == \
        SpeculativeConfig("ngram", 2, 2, 2, disable_by_batch_size=8)


def test_a_model_without_a_method_is_a_draft_model():
    assert parse_speculative_config({"model": "/m", "num_speculative_tokens": 4}) == \
        SpeculativeConfig("draft_model", 4, model="/m")


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}',
     "unknown key(s) 'lookahead'"),
    ('{"method": "ngram", num_speculative_tokens: 3}', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"num_speculative_tokens": 3}', '"method" is required'),
    ('{"method": "ngram"}', '"num_speculative_tokens" is required'),
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "'eagle3' is not supported by kvmesh"),
    ('{"method": "lookup", "num_speculative_tokens": 3}', "method must be one of ngram, draft_model"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 3}', "prompt_lookup_min (4) must be <= prompt_lookup_max (3)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
     "prompt_lookup_min must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}', "takes no model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
     "disable_by_batch_size must be an integer >= 1"),
])
def test_bad_configs_name_what_is_wrong(value, message):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(value)
    assert message in str(e.value)
    assert str(e.value).startswith("--speculative-config")


def test_engine_config_and_llm_kwargs_take_json_or_a_mapping():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert cfg.speculative_config == SpeculativeConfig("ngram", 2, 5, 5)
    cfg = engine_config_from_kwargs(None, speculative_config={"method": "ngram",
                                                              "num_speculative_tokens": 4})
    assert cfg.speculative_config.num_speculative_tokens == 4
    assert EngineConfig().speculative_config is None


def test_the_cli_exits_2_naming_the_unknown_key(capsys):
    rc = cli_main(["generate", "hi", "--speculative-config",
                   '{"method": "ngram", "num_speculative_tokens": 2, "typo_key": 1}'])
    assert rc == 2
    err = capsys.readouterr().err
    assert "kvmesh generate: error: --speculative-config: unknown key(s) 'typo_key'" in err
