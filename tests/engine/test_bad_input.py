"""Bad input: a clear ValueError, and the engine's state untouched (no request, no block held)."""
from __future__ import annotations

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def engine(smollm):
    return LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=256), loaded=smollm)


def assert_untouched(engine):
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == 64
    engine.kv_manager.check_invariants([])


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt must not be empty"),
    ([], "prompt must not be empty"),
    ([1, 2, 10**9], r"prompt token id 1000000000 is outside the vocabulary \[0, 49152\)"),
    ([1, -5], "prompt token id -5 is outside the vocabulary"),
    (list(range(1, 300)), "prompt is 299 tokens long but max_model_len is 256"),
    (list(range(1, 257)), "prompt is 256 tokens long but max_model_len is 256"),
])
def test_bad_prompts_are_rejected_and_change_nothing(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams())
    assert_untouched(engine)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"max_tokens": -3}, "max_tokens must be an integer >= 1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"n": 0}, "n must be an integer >= 1"),
    ({"top_k": -2}, "top_k must be -1, 0"),
    ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens \(5\) must be <= max_tokens \(2\)"),
    ({"stop": [""]}, "stop must be a list of non-empty strings"),
])
def test_bad_sampling_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_mutated_after_construction_are_checked_again(engine):
    params = SamplingParams()
    params.top_p = 7.0
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("bad", [1, 2, 3], params)
    assert_untouched(engine)


def test_duplicate_request_id_is_rejected_without_touching_the_first(engine):
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [4, 5, 6], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert_untouched(engine)


def test_llm_generate_validates_every_prompt_before_adding_any(smollm):
    llm = LLM.__new__(LLM)                  # share the loaded model: no second load
    import itertools
    llm.engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=128), loaded=smollm)
    llm._ids = itertools.count()
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.num_free_blocks == 64
    out = llm.generate(["fine prompt"], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2


def test_model_path_that_does_not_exist_is_a_clear_value_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=f"model path does not exist: {missing}"):
        LLM(model=str(missing))


def test_unknown_engine_argument_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(max_num_sequences=4)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 3}, "block_size must be a power of two"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of"),
    ({"preemption_mode": "drop"}, "preemption_mode must be one of"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"swap_space": -1}, "swap_space must be >= 0"),
])
def test_bad_engine_config_fails_fast(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_chunking_off_with_a_budget_below_the_context_says_how_to_fix(smollm):
    with pytest.raises(ValueError, match="raise --max-num-batched-tokens"):
        LLMEngine(EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64,
                               max_model_len=128, num_kv_blocks=64), loaded=smollm)


def test_max_model_len_larger_than_the_kv_cache_says_how_to_fix(smollm):
    with pytest.raises(ValueError, match="raise --num-kv-blocks"):
        LLMEngine(EngineConfig(num_kv_blocks=4, max_model_len=512), loaded=smollm)
