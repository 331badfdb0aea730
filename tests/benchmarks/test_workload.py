"""The seeds' workload generator: deterministic, faithful to the class weights, exact prompts."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.workload import (SCENARIOS, Scenario, WorkloadRequest, generate_requests,
                                 make_prompt_ids, summarize)


class CharTokenizer:
    """One token per character: fast, and lengths are easy to reason about."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_same_seed_same_requests_other_seed_differs():
    a = generate_requests("medium", seed=3, scale=10)
    assert a == generate_requests("medium", seed=3, scale=10)
    assert a != generate_requests("medium", seed=4, scale=10)


def test_sorted_by_arrival_and_fields_in_range():
    reqs = generate_requests("high", seed=1, scale=20, max_total_len=512)
    assert reqs and all(isinstance(r, WorkloadRequest) for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    for r in reqs:
        assert 1 <= r.user_id <= SCENARIOS["high"].user_count
        assert 0 <= r.length_class < 4
        assert r.prompt_len >= 1 and r.output_len >= 1
        assert r.prompt_len + r.output_len <= 512


def test_request_count_matches_poisson_mean():
    sc = SCENARIOS["medium"]
    counts = [len(generate_requests(sc, seed=s, scale=100)) for s in range(40)]
    expected = sc.user_count * sc.lambda_requests
    assert abs(np.mean(counts) - expected) < 0.1 * expected


def test_class_proportions_follow_weights():
    sc = Scenario("big", user_count=400, lambda_requests=20, lambda_frequency=1.0,
                  weights=(0.2, 0.3, 0.35, 0.15), length_lambdas=(20, 100, 2000, 20000))
    reqs = generate_requests(sc, seed=0, scale=100)
    counts = np.bincount([r.length_class for r in reqs], minlength=4) / len(reqs)
    np.testing.assert_allclose(counts, sc.weights, atol=0.02)


def test_scale_divides_class_means():
    sc = Scenario("one", user_count=200, lambda_requests=10, lambda_frequency=1.0,
                  weights=(1.0,), length_lambdas=(1000,))
    reqs = generate_requests(sc, seed=0, scale=10)
    mean_total = np.mean([r.prompt_len + r.output_len for r in reqs])
    assert abs(mean_total - 100) < 3
    half = [r for r in reqs if r.prompt_len + r.output_len == 100]
    assert half and all(r.prompt_len == 50 for r in half)


def test_cap_and_prompt_fraction():
    reqs = generate_requests("high", seed=0, scale=1, max_total_len=64, prompt_fraction=0.75)
    assert max(r.prompt_len + r.output_len for r in reqs) == 64
    capped = [r for r in reqs if r.prompt_len + r.output_len == 64]
    assert all(r.prompt_len == 48 and r.output_len == 16 for r in capped)


@pytest.mark.parametrize("kwargs", [{"scale": 0}, {"prompt_fraction": 1.0}, {"max_total_len": 1}])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        generate_requests("low", **kwargs)


def test_unknown_scenario_names_the_choices():
    with pytest.raises(ValueError, match="low, medium, high"):
        generate_requests("extreme")


@pytest.mark.parametrize("n", [1, 7, 100, 5000])
def test_prompt_ids_have_exact_length_and_are_deterministic(n):
    tok = CharTokenizer()
    a = make_prompt_ids(tok, n, np.random.default_rng(5))
    assert len(a) == n
    assert a == make_prompt_ids(tok, n, np.random.default_rng(5))


def test_prompt_ids_are_real_text():
    text = "".join(map(chr, make_prompt_ids(CharTokenizer(), 300, np.random.default_rng(0))))
    assert sum(c.isalpha() for c in text) > 200


class ShiftedTokenizer(CharTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) + 1000 for c in text]


def test_each_tokenizer_gets_its_own_corpus_ids_even_at_a_reused_address():
    first = ShiftedTokenizer()
    assert min(make_prompt_ids(first, 50, np.random.default_rng(0))) >= 1000
    del first                       # a new object of the same size usually takes its address
    for _ in range(20):
        ids = make_prompt_ids(CharTokenizer(), 50, np.random.default_rng(0))
        assert max(ids) < 1000
    class NoWeakRef:
        __slots__ = ()
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]
    assert len(make_prompt_ids(NoWeakRef(), 10, np.random.default_rng(0))) == 10



def test_summarize_counts_tokens():
    reqs = [WorkloadRequest(0.0, 1, 0, 3, 4), WorkloadRequest(1.0, 2, 2, 5, 6)]
    s = summarize(reqs)
    assert s["requests"] == 2 and s["per_class"] == [1, 0, 1, 0]
    assert s["prompt_tokens"] == 8 and s["output_tokens"] == 10 and s["span_s"] == 1.0
