"""Exact expectations for the free functions: penalties, top-k / top-p / min-p, stop_by_token."""
from __future__ import annotations

import math

import pytest
import torch

from kvmesh.engine.output_processor import stop_by_token
from kvmesh.engine.sampler import apply_penalties, apply_top_k_top_p_min_p
from kvmesh.engine.sampling_params import SamplingParams

NEG = float("-inf")


def _masked(row: torch.Tensor) -> list[int]:
    return [i for i, x in enumerate(row.tolist()) if x == NEG]


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    out = apply_penalties(
        logits.clone(), prompt_token_ids=[[0, 1], [0, 1]], output_token_ids=[[1, 3, 3], [1, 3, 3]],
        presence_penalties=[0.5, 0.0], frequency_penalties=[0.25, 0.0], repetition_penalties=[2.0, 1.0])
    # Row 0: repetition over prompt+output {0, 1, 3}: 2/2, -1*2, 3/2; then frequency (counts
    # 1: 1, 3: 2) and presence over output only: 1: -2 - .25 - .5, 3: 1.5 - .5 - .5.
    assert out[0].tolist() == [1.0, -2.75, 0.5, 0.5, -2.0, 0.0]
    # Row 1: neutral values leave the row bit-for-bit unchanged.
    assert torch.equal(out[1], logits[1])


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    out = apply_penalties(logits, [[0, 1, 2]], [[2, 2, 2]], [1.0], [0.5], [1.0])
    assert out[0].tolist() == [0.0, 0.0, -2.5, 0.0]


def test_repetition_penalty_below_one_boosts():
    logits = torch.tensor([[4.0, -4.0, 1.0]])
    out = apply_penalties(logits, [[0]], [[1]], [0.0], [0.0], [0.5])
    assert out[0].tolist() == [8.0, -2.0, 1.0]


def test_penalties_ignore_out_of_vocab_ids():
    logits = torch.ones(1, 3)
    out = apply_penalties(logits, [[7, -1]], [[5, 0]], [1.0], [0.0], [2.0])
    assert out[0].tolist() == [-0.5, 1.0, 1.0]


def test_top_k_keeps_k_best_and_ties_at_kth():
    logits = torch.tensor([[1.0, 4.0, 2.0, 4.0, 3.0, 0.0]] * 4)
    out = apply_top_k_top_p_min_p(logits.clone(), top_k=[2, 3, 1, 0], top_p=[1.0] * 4, min_p=[0.0] * 4)
    assert _masked(out[0]) == [0, 2, 4, 5]
    assert _masked(out[1]) == [0, 2, 5]
    assert _masked(out[2]) == [0, 2, 4, 5]          # k=1 with a tie at the top keeps both
    assert torch.equal(out[3], logits[3])             # 0 disables
    kept = out[1] != NEG
    assert torch.equal(out[1][kept], logits[1][kept])  # kept logits are untouched


def _log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs by id: 0: .125, 1: .5, 2: .125, 3: .25; sorted: 1, 3, 0, 2 (stable on the tie).
    row = _log_probs(0.125, 0.5, 0.125, 0.25)
    logits = row.repeat(4, 1)
    out = apply_top_k_top_p_min_p(logits, top_k=[0] * 4, top_p=[0.4, 0.6, 0.8, 1.0], min_p=[0.0] * 4)
    assert _masked(out[0]) == [0, 2, 3]
    assert _masked(out[1]) == [0, 2]
    assert _masked(out[2]) == [2]                    # tie at .125: the lower id is kept
    assert _masked(out[3]) == []


def test_top_p_applies_after_top_k():
    logits = _log_probs(0.5, 0.25, 0.125, 0.125).repeat(2, 1)
    out = apply_top_k_top_p_min_p(logits, top_k=[2, 0], top_p=[0.6, 0.6], min_p=[0.0, 0.0])
    assert _masked(out[0]) == [1, 2, 3]   # after top-2: (2/3, 1/3); 2/3 >= .6 already
    assert _masked(out[1]) == [2, 3]


def test_min_p_relative_to_best():
    logits = _log_probs(0.5, 0.25, 0.125, 0.125).repeat(3, 1)
    out = apply_top_k_top_p_min_p(logits, top_k=[0] * 3, top_p=[1.0] * 3, min_p=[0.3, 0.2, 0.0])
    assert _masked(out[0]) == [2, 3]
    assert _masked(out[1]) == []
    assert _masked(out[2]) == []


def test_best_token_always_survives():
    logits = torch.tensor([[0.0, 10.0, 9.0]])
    out = apply_top_k_top_p_min_p(logits, top_k=[1], top_p=[0.01], min_p=[1.0])
    assert _masked(out[0]) == [0, 2]


# stop_by_token ---------------------------------------------------------------------------

EOS = 2


@pytest.mark.parametrize("token, n_out, kwargs, max_tokens, expected", [
    (EOS, 1, {}, 16, ("stop", EOS)),
    (EOS, 3, {"ignore_eos": True}, 16, None),
    (EOS, 16, {"ignore_eos": True}, 16, ("length", None)),
    (9, 1, {"stop_token_ids": [9]}, 16, ("stop", 9)),
    (9, 1, {"stop_token_ids": [9], "ignore_eos": True}, 16, ("stop", 9)),
    (9, 2, {"stop_token_ids": [9], "min_tokens": 3}, 16, None),
    (9, 3, {"stop_token_ids": [9], "min_tokens": 3}, 16, ("stop", 9)),
    (EOS, 2, {"min_tokens": 3}, 16, None),
    (5, 15, {}, 16, None),
    (5, 16, {}, 16, ("length", None)),
    (EOS, 16, {}, 16, ("stop", EOS)),        # a stop token on the last position says "stop"
    (5, 4, {"max_tokens": 100}, 4, ("length", None)),  # the cap passed in wins (context room)
])
def test_stop_by_token(token, n_out, kwargs, max_tokens, expected):
    params = SamplingParams(**kwargs)
    assert stop_by_token(token, n_out, params, (EOS, 7), max_tokens) == expected


def test_stop_by_token_any_eos_id():
    assert stop_by_token(7, 1, SamplingParams(), (EOS, 7), 16) == ("stop", 7)
