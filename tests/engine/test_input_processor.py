"""The input processor: one validation, a frozen EngineRequest, exact errors; no model needed."""
from __future__ import annotations

import dataclasses
import re

import pytest

from kvmesh.engine.input_processor import EngineRequest, InputProcessor
from kvmesh.engine.limits import RequestLimits
from kvmesh.engine.sampling_params import SamplingParams, SamplingParamsError


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


@pytest.fixture
def processor() -> InputProcessor:
    return InputProcessor(_Tok(), vocab_size=200, max_model_len=8)


def test_text_prompt_becomes_a_frozen_request(processor):
    params = SamplingParams(max_tokens=3, stop="x")
    req = processor.process("r1", "abc", params, priority=-2, cache_salt="t", arrival_time=5.0,
                            trace_context="ctx")
    assert req == EngineRequest("r1", (97, 98, 99), "abc", SamplingParams(max_tokens=3, stop=["x"]),
                                -2, "t", 5.0, "ctx")
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.priority = 0
    # the engine holds its own copy: the caller's later edits never reach it
    assert req.params is not params and req.params.stop is not params.stop
    params.max_tokens, params.stop[0] = 99, "y"
    assert (req.params.max_tokens, req.params.stop) == (3, ["x"])


def test_token_ids_and_ids_the_caller_already_has(processor):
    req = processor.process("r", [5, 6], prompt_text="hi")
    assert (req.prompt_token_ids, req.prompt_text, req.params) == ((5, 6), "hi", SamplingParams())
    # ids from the chat template or processor.tokenize: not looked up in the vocabulary again
    req = processor.process("r", "text", prompt_ids=[300, 301])
    assert (req.prompt_token_ids, req.prompt_text) == ((300, 301), "text")


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": ""}, "prompt must not be empty"),
    ({"prompt": []}, "prompt must not be empty"),
    ({"prompt": "x", "prompt_ids": []}, "prompt must not be empty"),
    ({"prompt": [1, 200]}, r"prompt token id 200 is outside the vocabulary \[0, 200\)"),
    ({"prompt": [1, True]}, r"prompt token id True is outside the vocabulary"),
    ({"prompt": "12345678"}, "prompt is 8 tokens long but max_model_len is 8: at least one token"),
    ({"prompt": "a", "params": {"max_tokens": 1}}, "sampling_params must be a SamplingParams"),
    ({"prompt": "a", "priority": 2**31}, r"priority must be an integer in \[-2147483648, 2147483647\], got 2147483648"),
    ({"prompt": "a", "priority": 1.5}, "priority must be an integer, got 1.5"),
    ({"prompt": "a", "cache_salt": 7}, "cache_salt must be a string, got 7"),
    ({"prompt": "a", "request_id": 3}, "request_id must be a string, got 3"),
])
def test_bad_requests_are_value_errors(processor, kwargs, message):
    kwargs = {"request_id": "r", **kwargs}
    with pytest.raises(ValueError, match=message):
        processor.process(kwargs.pop("request_id"), kwargs.pop("prompt"), kwargs.pop("params", None),
                          **kwargs)


def test_params_changed_after_construction_are_checked(processor):
    params = SamplingParams()
    params.top_p = 7.0
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 7.0"):
        processor.process("r", "a", params)


_SMALL = RequestLimits(max_n=2, max_stop_strings=2, max_stop_string_length=3,
                       max_stop_token_ids=2, max_logprobs=4, max_tokens=5)


@pytest.mark.parametrize("kwargs, param, message", [
    ({"n": 3}, "n", "n must be <= 2, got 3"),
    ({"max_tokens": 6}, "max_tokens", "max_tokens must be <= 5, got 6"),
    ({"stop": ["a", "b", "c"]}, "stop", "at most 2 stop strings are allowed, got 3"),
    ({"stop": ["ab", "abcd"]}, "stop", "a stop string may be at most 3 characters long, got 4"),
    ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids", "at most 2 stop_token_ids are allowed, got 3"),
    ({"stop_token_ids": [1, 200]}, "stop_token_ids",
     r"stop_token_ids must be in the vocabulary [0, 200), got 200"),
    ({"logprobs": 5}, "logprobs", "logprobs must be <= 4, got 5"),
])
def test_params_over_the_deployment_limits_are_refused_naming_the_field(kwargs, param, message):
    processor = InputProcessor(_Tok(), vocab_size=200, max_model_len=8, limits=_SMALL)
    kwargs = {"max_tokens": 5, **kwargs}
    with pytest.raises(SamplingParamsError) as e:
        processor.process("r", "a", SamplingParams(**kwargs))
    assert (e.value.param, str(e.value)) == (param, message)
    # refused before the prompt is tokenized: a bad prompt does not hide it
    with pytest.raises(SamplingParamsError, match=re.escape(message)):
        processor.process("r", "", SamplingParams(**kwargs))


def test_params_at_the_limits_pass_and_max_tokens_none_gets_the_cap():
    processor = InputProcessor(_Tok(), vocab_size=200, max_model_len=8, limits=_SMALL)
    at = SamplingParams(n=2, max_tokens=5, stop=["abc", "x"], stop_token_ids=[1, 199], logprobs=4)
    assert processor.process("r", "a", at).params == at
    assert processor.process("r", "a", SamplingParams(max_tokens=None)).params.max_tokens == 5
    # without a cap (the default, 0), None stays "up to the context length"
    assert InputProcessor(_Tok(), 200, 8).process(
        "r", "a", SamplingParams(max_tokens=None)).params.max_tokens is None


def test_the_default_limits():
    assert InputProcessor(_Tok(), 200, 8).limits == RequestLimits(
        max_request_body_bytes=8 * 1024 * 1024, max_prompts_per_request=128, max_n=16,
        max_stop_strings=16, max_stop_string_length=1024, max_stop_token_ids=256,
        max_logprobs=20, max_tokens=0, max_pending_outputs=256)


@pytest.mark.parametrize("field, value, message", [
    ("max_n", 0, "--max-n must be an integer >= 1, got 0"),
    ("max_pending_outputs", -1, "--max-pending-outputs must be an integer >= 1, got -1"),
    ("max_tokens", -1, "--max-tokens must be an integer >= 0, got -1"),
    ("max_logprobs", True, "--max-logprobs must be an integer >= 1, got True"),
])
def test_limits_out_of_range_name_their_flag(field, value, message):
    with pytest.raises(ValueError) as e:
        RequestLimits(**{field: value})
    assert str(e.value) == message


def test_stop_token_ids_are_a_set_and_bad_ones_are_refused():
    params = SamplingParams(stop_token_ids=[5, 3, 5])
    assert params.stop_token_ids == frozenset({3, 5})
    for bad in ([-1], ["5"], [[1]], [1.5]):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(stop_token_ids=bad)
        assert (e.value.param, str(e.value)) == ("stop_token_ids",
                                                 "stop_token_ids must be a list of integers >= 0")
