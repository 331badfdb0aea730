"""The input processor: one validation, a frozen EngineRequest, exact errors; no model needed."""
from __future__ import annotations

import dataclasses

import pytest

from kvmesh.engine.input_processor import EngineRequest, InputProcessor
from kvmesh.engine.sampling_params import SamplingParams


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
