"""The pure routing policy: exact decisions, and invariants under hypothesis."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.routing_policy import (REASONS, STRATEGIES, BackendState, PolicyConfig, choose, score)


def B(name: str, healthy: bool = True, running: int = 0, waiting: int = 0, kv: float = 0.0,
      in_flight: int = 0) -> BackendState:
    return BackendState(f"http://{name}", healthy, name, running, waiting, kv, in_flight)


def pick(backends, hits=None, n=8, strategy="kv-aware", rr=0, seed=0, **kw):
    d = choose(backends, hits or {}, n, strategy, rr, random.Random(seed), **kw)
    return None if d is None else (d.backend.pod_id, d.reason, d.prefix_blocks)


def test_prefix_hit_wins_when_loads_are_equal():
    bs = [B("a"), B("b"), B("c")]
    assert pick(bs, {"b": 5, "c": 2}) == ("b", "prefix-hit", 5)
    # the longest consecutive run wins, wherever the backend sits in the list
    assert pick(bs, {"a": 1, "c": 7}) == ("c", "prefix-hit", 7)


def test_prefix_blended_with_load():
    # b: 2/8 of the prefix, but a is idle and b has 6 requests: 2*0.25 + 0 < 0 + 1
    bs = [B("a"), B("b", running=6)]
    assert pick(bs, {"b": 2}) == ("a", "no-prefix", 0)
    # with the whole prompt cached b wins despite its load: 2*1 + 0 > 1
    assert pick(bs, {"b": 8}) == ("b", "prefix-hit", 8)
    # KV usage counts too: a full-ish cache loses a small prefix advantage
    bs = [B("a", kv=0.0), B("b", kv=0.9)]
    assert pick(bs, {"b": 3}) == ("a", "no-prefix", 0)
    assert pick(bs, {"b": 4}) == ("b", "prefix-hit", 4)


def test_exact_scores():
    cfg = PolicyConfig()
    b = B("b", running=2, waiting=1, kv=0.25)
    assert score(b, 4, 8, 6, cfg) == pytest.approx(2 * 0.5 + (1 - 3 / 6) + 0.75)
    assert score(b, 0, 0, 6, cfg) == pytest.approx(0 + 0.5 + 0.75)


def test_load_guard_moves_a_hot_prefix_off_a_busy_pod():
    # a holds the whole prompt but has 9 more outstanding requests than c (threshold 8)
    bs = [B("a", running=4, waiting=5), B("b", running=2), B("c")]
    assert pick(bs, {"a": 8}) == ("c", "load-guard", 0)
    # at exactly the threshold it stays
    bs = [B("a", running=4, waiting=4), B("b", running=2), B("c")]
    assert pick(bs, {"a": 8}) == ("a", "prefix-hit", 8)
    # the router's own in-flight count triggers it before any heartbeat arrives
    bs = [B("a", in_flight=9), B("b")]
    assert pick(bs, {"a": 8}) == ("b", "load-guard", 0)
    # the guard prefers the best other pod, prefix included
    # (a: 2*1 + 0 + 1 = 3 beats b: 2*2/8 + 0.95 + 1 = 2.45, but a is 20 above c)
    bs = [B("a", waiting=20), B("b", running=1), B("c")]
    assert pick(bs, {"a": 8, "b": 2}) == ("b", "load-guard", 2)


def test_load_guard_on_kv_usage():
    bs = [B("a", kv=0.96), B("b", kv=0.5)]
    assert pick(bs, {"a": 8}) == ("b", "load-guard", 0)
    # when every backend is overloaded there is nowhere better: keep the best score
    bs = [B("a", kv=0.97), B("b", kv=0.96)]
    assert pick(bs, {"a": 8}) == ("a", "prefix-hit", 8)


def test_no_prefix_spreads_over_idle_backends_by_rr_counter():
    bs = [B("a"), B("b"), B("c")]
    assert [pick(bs, {}, rr=i)[:2] for i in range(4)] == [
        ("a", "no-prefix"), ("b", "no-prefix"), ("c", "no-prefix"), ("a", "no-prefix")]
    assert pick(bs, {}, n=0) == ("a", "no-prefix", 0)     # a prompt shorter than one block
    bs = [B("a", running=1), B("b"), B("c", running=1)]
    assert pick(bs, {}, rr=5) == ("b", "no-prefix", 0)


def test_equal_scores_break_by_lower_load_then_rr():
    # a: prefix 2/4 and load 2 of max 4 -> 2*0.5 + 0.5 = 1.5; b: load 0 -> 1.0 + ... kv equal
    bs = [B("a", running=2), B("b", running=4), B("c", running=0)]
    # c: 0 + 1 + 1 = 2.0 ; a: 2*0.5 + 0.5 + 1 = 2.5 -> a
    assert pick(bs, {"a": 2}, n=4) == ("a", "prefix-hit", 2)
    # a: 2*0.25 + 0.5 + 1 = 2.0 ties c's 2.0: c has the lower load
    assert pick(bs, {"a": 1}, n=4) == ("c", "no-prefix", 0)


def test_unhealthy_backends_are_never_chosen():
    bs = [B("a", healthy=False), B("b")]
    for strategy in STRATEGIES:
        for rr in range(3):
            assert pick(bs, {"a": 8}, strategy=strategy, rr=rr)[0] == "b"
    assert pick([B("a", healthy=False)], {"a": 8}) is None
    assert pick([], {}) is None


def test_round_robin_random_least_loaded():
    bs = [B("a", running=3), B("b"), B("c", running=1)]
    assert [pick(bs, strategy="round-robin", rr=i)[:2] for i in range(3)] == [
        ("a", "round-robin"), ("b", "round-robin"), ("c", "round-robin")]
    assert pick(bs, {"a": 8}, strategy="least-loaded") == ("b", "least-loaded", 0)
    assert pick(bs, strategy="random", seed=1)[1] == "random"
    seen = {pick(bs, strategy="random", seed=s)[0] for s in range(30)}
    assert seen == {"a", "b", "c"}
    # least-loaded ties: lower KV usage, then rr over the rest
    bs = [B("a", kv=0.5), B("b", kv=0.1), B("c", kv=0.1)]
    assert [pick(bs, strategy="least-loaded", rr=i)[0] for i in range(2)] == ["b", "c"]


def test_redis_down_falls_back_to_least_loaded():
    bs = [B("a"), B("b", waiting=3)]
    assert pick(bs, {}, redis_ok=False) == ("a", "fallback-no-redis", 0)
    assert pick(bs, {}, redis_ok=False, fallback_reason="fallback-slow-lookup") == (
        "a", "fallback-slow-lookup", 0)
    # only the kv-aware strategy needs Redis
    assert pick(bs, redis_ok=False, strategy="round-robin", rr=1)[:2] == ("b", "round-robin")


def test_session_affinity_is_sticky_and_moves_only_when_its_backend_goes():
    bs = [B("a"), B("b"), B("c")]
    chosen = {k: pick(bs, {}, session_key=k)[0] for k in (f"user-{i}" for i in range(60))}
    assert set(chosen.values()) == {"a", "b", "c"}
    assert all(pick(bs, {"b": 8}, session_key=k, rr=7)[:2] == (v, "session-affinity")
               for k, v in chosen.items())
    bs[0].healthy = False
    for k, v in chosen.items():
        now = pick(bs, {}, session_key=k)[0]
        assert now == v if v != "a" else now in ("b", "c")


def test_bad_config_and_strategy():
    with pytest.raises(ValueError, match="strategy"):
        pick([B("a")], strategy="fastest")
    with pytest.raises(ValueError):
        PolicyConfig(w_prefix=-1)


backend_st = st.builds(
    lambda i, healthy, running, waiting, kv, inf: B(f"p{i}", healthy, running, waiting, kv, inf),
    st.integers(0, 5), st.booleans(), st.integers(0, 30), st.integers(0, 30),
    st.floats(0, 1), st.integers(0, 30))


@settings(max_examples=300, deadline=None)
@given(backends=st.lists(backend_st, max_size=6, unique_by=lambda b: b.pod_id),
       hits=st.dictionaries(st.sampled_from([f"p{i}" for i in range(6)]), st.integers(0, 16)),
       num_blocks=st.integers(0, 16), strategy=st.sampled_from(STRATEGIES),
       rr=st.integers(0, 100), seed=st.integers(0, 100), redis_ok=st.booleans(),
       session=st.one_of(st.none(), st.text(max_size=5)))
def test_invariants(backends, hits, num_blocks, strategy, rr, seed, redis_ok, session):
    hits = {k: min(v, num_blocks) for k, v in hits.items()}
    args = (backends, hits, num_blocks, strategy, rr)
    d = choose(*args, random.Random(seed), session_key=session, redis_ok=redis_ok)
    if not any(b.healthy for b in backends):
        assert d is None
        return
    assert d.backend.healthy and d.reason in REASONS
    # deterministic: same inputs, same decision
    again = choose(*args, random.Random(seed), session_key=session, redis_ok=redis_ok)
    assert (again.backend.url, again.reason) == (d.backend.url, d.reason)
    # the order of unrelated unhealthy backends does not matter
    healthy_only = [b for b in backends if b.healthy]
    if strategy == "kv-aware" and redis_ok and not session:
        d2 = choose(healthy_only, hits, num_blocks, strategy, rr, random.Random(seed))
        assert d2.backend.url == d.backend.url
        min_load = min(b.load for b in healthy_only)
        cfg = PolicyConfig()
        if d.reason != "load-guard" and any(
                b.load - min_load <= cfg.guard_threshold and b.kv_usage < cfg.guard_kv_usage
                for b in healthy_only):
            # a backend that is not overloaded exists: the guard keeps us on one of them
            assert (d.backend.load - min_load <= cfg.guard_threshold
                    and d.backend.kv_usage < cfg.guard_kv_usage)
        if d.reason == "prefix-hit":
            assert d.prefix_blocks > 0
