"""The workload generator's distributions: Poisson requests per user, exponential gaps.

Fixed seeds, so every number here is deterministic; the tolerances are several standard errors
wide, so a correct generator passes for any seed, and a wrong distribution (or rate) fails.
Kolmogorov-Smirnov with numpy only (no scipy in this project).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.workload import SCENARIOS, Scenario, generate_requests

USERS, LAMBDA_REQ, RATE, SEED = 4000, 3.0, 0.5, 0
SC = Scenario("stats", user_count=USERS, lambda_requests=LAMBDA_REQ, lambda_frequency=RATE,
              weights=(0.5, 0.5), length_lambdas=(10, 20))


@pytest.fixture(scope="module")
def reqs():
    return generate_requests(SC, seed=SEED)


def _counts(reqs, users: int) -> np.ndarray:
    """Requests per user, users who sent none included (user ids are 1-based)."""
    return np.bincount([r.user_id for r in reqs], minlength=users + 1)[1:]


def _gaps(reqs) -> np.ndarray:
    """Each user's gaps: first arrival from 0, then between consecutive arrivals."""
    by_user: dict[int, list[float]] = {}
    for r in reqs:                                   # sorted by arrival: per-user order kept
        by_user.setdefault(r.user_id, []).append(r.arrival_s)
    return np.concatenate([np.diff([0.0, *ts]) for ts in by_user.values()])


def ks_exponential(x: np.ndarray, rate: float) -> float:
    """Two-sided one-sample KS statistic D_n against Exp(rate)."""
    x = np.sort(x)
    n = len(x)
    cdf = 1.0 - np.exp(-rate * x)
    i = np.arange(1, n + 1)
    return float(max(np.max(i / n - cdf), np.max(cdf - (i - 1) / n)))


def ks_bound(n: int, alpha: float = 0.001) -> float:
    """Asymptotic critical value sqrt(-ln(alpha / 2) / 2) / sqrt(n) (1.95 / sqrt(n) at 0.1%)."""
    return math.sqrt(-math.log(alpha / 2) / 2) / math.sqrt(n)


def test_fixed_seed_gives_exact_values(reqs):
    assert reqs == generate_requests(SC, seed=SEED)
    # Poisson total over 4000 users: mean 12000, sd ~110; exactly this many with SEED = 0
    assert abs(len(reqs) - USERS * LAMBDA_REQ) < 5 * math.sqrt(USERS * LAMBDA_REQ)
    assert len(reqs) == 12133
    assert _counts(reqs, USERS)[:8].tolist() == [2, 0, 1, 0, 3, 5, 3, 5]
    assert (reqs[0].user_id, reqs[0].arrival_s) == (49, pytest.approx(0.00103005, rel=1e-6))


def test_requests_per_user_are_poisson(reqs):
    counts = _counts(reqs, USERS)
    mean, var = counts.mean(), counts.var(ddof=1)
    se_mean = math.sqrt(LAMBDA_REQ / USERS)
    se_var = math.sqrt((LAMBDA_REQ + 2 * LAMBDA_REQ ** 2) / USERS)  # Var(s^2) for a Poisson
    assert abs(mean - LAMBDA_REQ) < 5 * se_mean
    assert abs(var - LAMBDA_REQ) < 5 * se_var
    # the whole pmf, not just two moments: P(k) for k = 0..6 within 5 binomial SEs
    freq = np.bincount(counts, minlength=7)[:7] / USERS
    for k, f in enumerate(freq):
        p = math.exp(-LAMBDA_REQ) * LAMBDA_REQ ** k / math.factorial(k)
        assert abs(f - p) < 5 * math.sqrt(p * (1 - p) / USERS), (k, f, p)


def test_inter_arrival_gaps_are_exponential(reqs):
    gaps = _gaps(reqs)
    assert len(gaps) == len(reqs) and (gaps > 0).all()
    n = len(gaps)
    # mean 1 / rate, sd of the mean (1 / rate) / sqrt(n); exponential: sd == mean
    assert abs(gaps.mean() - 1 / RATE) < 5 * (1 / RATE) / math.sqrt(n)
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05
    d = ks_exponential(gaps, RATE)
    assert d < ks_bound(n), d
    # the test has power: a 10% wrong rate, or a uniform with the same mean, is rejected
    assert ks_exponential(gaps, RATE * 1.1) > ks_bound(n)
    uniform = np.random.default_rng(0).uniform(0, 2 / RATE, n)
    assert ks_exponential(uniform, RATE) > ks_bound(n)


def test_ks_statistic_helper_on_known_samples():
    # exact: one point at the median of Exp(1) -> D = 1/2
    assert ks_exponential(np.array([math.log(2)]), 1.0) == pytest.approx(0.5)
    # numpy's own exponential sampler passes at the same bound
    x = np.random.default_rng(1).exponential(2.0, 20000)
    assert ks_exponential(x, 0.5) < ks_bound(len(x))
    assert ks_bound(10000) == pytest.approx(0.01949, abs=1e-4)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_builtin_scenarios_pooled_over_seeds(name):
    """The real scenarios: per-user counts and gaps over 50 seeds match their lambdas."""
    sc = SCENARIOS[name]
    counts, gaps = [], []
    for seed in range(50):
        rs = generate_requests(sc, seed=seed, scale=1000)
        counts.append(_counts(rs, sc.user_count))
        gaps.append(_gaps(rs))
    counts, gaps = np.concatenate(counts), np.concatenate(gaps)
    m = len(counts)
    assert abs(counts.mean() - sc.lambda_requests) < 5 * math.sqrt(sc.lambda_requests / m)
    assert abs(counts.var(ddof=1) / sc.lambda_requests - 1.0) < 0.25   # dispersion index ~ 1
    assert abs(gaps.mean() * sc.lambda_frequency - 1.0) < 5 / math.sqrt(len(gaps))
    assert ks_exponential(gaps, sc.lambda_frequency) < ks_bound(len(gaps))
