"""Range checks that keep client-chosen values from overflowing inside engine.step()."""
from __future__ import annotations

import pytest
import torch

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("kwargs, param, message", [
    ({"top_k": 2**63}, "top_k",
     "top_k must be -1, 0 (disabled) or a positive integer <= 2147483647, got 9223372036854775808"),
    ({"top_k": -2}, "top_k",
     "top_k must be -1, 0 (disabled) or a positive integer <= 2147483647, got -2"),
    ({"seed": 2**64}, "seed",
     "seed must be an integer in [-9223372036854775808, 9223372036854775807], "
     "got 18446744073709551616"),
    ({"seed": -(2**63) - 1}, "seed",
     "seed must be an integer in [-9223372036854775808, 9223372036854775807], "
     "got -9223372036854775809"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", "min_tokens (5) must be <= max_tokens (3)"),
])
def test_out_of_range_values_raise_naming_the_field(kwargs, param, message):
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.param == param and str(exc.value) == message


def test_extreme_valid_seeds_are_accepted_by_torch_for_every_sample():
    for seed in (-(2**63), 2**63 - 1):
        params = SamplingParams(seed=seed, n=16)
        for i in range(params.n):
            torch.Generator().manual_seed(params.seed + i)


@pytest.fixture(scope="module")
def dynamic_engine(smollm):
    return LLMEngine(EngineConfig(num_kv_blocks=32, max_model_len=256,
                                  scheduling_policy="dynamic"), loaded=smollm)


@pytest.mark.parametrize("priority", [10**309, 2**31, -(2**31) - 1, 1.5, True])
def test_add_request_refuses_priorities_outside_int32(dynamic_engine, priority):
    with pytest.raises(ValueError, match="priority must be an integer"):
        dynamic_engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=1), priority=priority)
    assert not dynamic_engine.has_unfinished_requests()


def test_dynamic_policy_steps_with_the_extreme_priorities_and_top_k(dynamic_engine):
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=2**31 - 1, seed=2**63 - 1)
    dynamic_engine.add_request("lo", [1, 2, 3], params, priority=-(2**31))
    dynamic_engine.add_request("hi", [4, 5, 6], params, priority=2**31 - 1)
    finished = {}
    while dynamic_engine.has_unfinished_requests():
        for out in dynamic_engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {"lo": 2, "hi": 2}
