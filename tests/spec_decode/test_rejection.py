"""Verification keeps the target distribution exactly: token frequencies over many seeded draws
on a 6-token vocabulary against the target's exact probabilities (chi-square, significance
0.001; seeded, so the test is deterministic), and greedy verification picks the argmax."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from kvmesh.engine.request import Request
from kvmesh.engine.sampler import Sampler, SamplingRow
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.spec_decode.rejection import spec_group, verify

V = 6
ALPHA = 0.001          # significance level of every chi-square test here
GROUPS = 1000          # requests verified per call
CALLS = 4              # -> 4000 samples of the first token


def _request(params: SamplingParams, i: int = 0) -> Request:
    return Request(f"r{i}", [3, 4], params, 0.0, eos_token_ids=(0,), max_model_len=64)


def _target(row: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The exact distribution of one logits row: temperature, then top-k (independent of the
    sampler's code)."""
    x = row / temperature
    keep = x.topk(top_k).indices
    masked = torch.full_like(x, float("-inf"))
    masked[keep] = x[keep]
    return torch.softmax(masked.double(), dim=-1)


def _draw(params, logits, drafts, seed):
    """GROUPS verifications of `drafts` against the same 3 logits rows; the emitted tokens."""
    sampler = Sampler(generator=torch.Generator().manual_seed(seed))
    k = len(drafts)
    groups = [spec_group(_request(params, g), drafts, g * (k + 1)) for g in range(GROUPS)]
    tiled = logits.repeat(GROUPS, 1)
    v = verify(sampler, tiled, groups)
    return [v.tokens[f"r{g}"] for g in range(GROUPS)]


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
def test_sampled_tokens_follow_the_target_distribution(temperature, top_k):
    logits = torch.tensor([[1.2, 0.3, 2.0, -0.5, 0.9, 0.1],
                           [0.2, 1.5, 0.4, 1.1, -1.0, 0.6],
                           [0.0, 0.3, -0.2, 0.8, 1.4, 0.5]])
    drafts = [2, 3]     # d0 likely under row 0 (so d1 is verified often), d1 middling
    params = SamplingParams(temperature=temperature, top_k=top_k)
    emitted = [t for seed in range(CALLS) for t in _draw(params, logits, drafts, seed)]
    kk = top_k or V
    p0 = _target(logits[0], temperature, kk)
    p1 = _target(logits[1], temperature, kk)

    first = torch.bincount(torch.tensor([t[0] for t in emitted]), minlength=V).double()
    assert (first[p0 == 0] == 0).all()                 # top-k's masked tokens never appear
    live = p0 > 0
    assert chisquare(first[live], p0[live] * len(emitted)).pvalue > ALPHA
    # the test has power: the same counts are far from a distribution leaning on the draft
    leaning = p0.clone()
    leaning[drafts[0]] += 0.25
    leaning /= leaning.sum()
    assert chisquare(first[live], leaning[live] * len(emitted)).pvalue < ALPHA

    # the token after an accepted d0 follows row 1's target (the distribution given d0)
    second = [t[1] for t in emitted if t[0] == drafts[0]]
    assert len(second) > 1500
    counts = torch.bincount(torch.tensor(second), minlength=V).double()
    live = p1 > 0
    assert (counts[p1 == 0] == 0).all()
    assert chisquare(counts[live], p1[live] * len(second)).pvalue > ALPHA


def test_a_seeded_request_verifies_the_same_way_every_time():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=11)

    def once():
        req = _request(params)
        req.generator = torch.Generator().manual_seed(11)
        sampler = Sampler(generator=torch.Generator().manual_seed(0))
        return [verify(sampler, logits, [spec_group(req, [1, 2], 0)]).tokens["r0"]
                for _ in range(20)]

    assert once() == once()


def test_greedy_verification_keeps_drafts_that_are_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0],      # argmax 1
                           [0.0, 0.0, 5.0, 1.0],      # argmax 2
                           [4.0, 0.0, 1.0, 0.0],      # argmax 0
                           [0.0, 0.0, 0.0, 3.0]])     # argmax 3 (the bonus row)
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    cases = {(1, 2, 0): [1, 2, 0, 3], (1, 2, 3): [1, 2, 0], (2, 2, 0): [1], (1, 0, 0): [1, 2]}
    for drafts, expected in cases.items():
        got = verify(sampler, logits, [spec_group(_request(greedy), list(drafts), 0)])
        assert got.tokens["r0"] == expected, drafts


def test_each_drafted_position_sees_the_drafts_before_it_as_output():
    # frequency penalty 2: at row 1, draft 1 (accepted at row 0) counts as output, so row 1's
    # argmax moves from token 1 (4.0) to token 2 (2.5 > 4.0 - 2)
    logits = torch.tensor([[0.0, 5.0, 1.0],
                           [0.0, 4.0, 2.5],
                           [0.0, 0.0, 1.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    got = verify(sampler, logits, [spec_group(_request(params), [1, 1], 0)])
    assert got.tokens["r0"] == [1, 2]
    # the same as the plain sampler on row 1 with that output
    row = SamplingRow(params, [3, 4], [1])
    assert sampler(logits[1:2].clone(), [row]).token_ids == [[2]]


def test_logit_rows_of_several_requests_are_verified_independently():
    logits = torch.tensor([[0.0, 5.0, 0.0], [5.0, 0.0, 0.0],       # request a: 2 rows
                           [0.0, 0.0, 5.0], [0.0, 5.0, 0.0],       # request b: 3 rows
                           [5.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler()
    a = spec_group(_request(greedy, 0), [1], 0)
    b = spec_group(_request(greedy, 1), [2, 0], 2)
    got = verify(sampler, logits, [a, b]).tokens
    assert got == {"r0": [1, 0], "r1": [2, 1]}


def test_a_rejected_draft_whose_residual_has_no_mass_falls_back_to_the_target_row():
    # fault injection: a row whose only mass is on the draft, yet the draft was rejected (a
    # rounding case); the token comes from the row itself instead of from an empty residual
    from kvmesh.engine.spec_decode.rejection import _draw_final
    params = SamplingParams(temperature=1.0)
    group = spec_group(_request(params), [1], 0)
    probs = torch.tensor([[0.0, 0.9, 0.0], [0.2, 0.3, 0.5]])
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    assert _draw_final(sampler, probs, [group], [0], [0]) == [1]
