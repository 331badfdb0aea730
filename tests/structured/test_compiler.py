"""GrammarCompilerPool: compiled once per spec, on the pool's thread, in a bounded LRU; a failed
compile is not kept."""
from __future__ import annotations

import threading

import pytest
from kvmesh.engine.structured.compiler import GrammarCompilerPool
from kvmesh.engine.structured.spec import StructuredOutputSpec as Spec


@pytest.fixture
def small_pool(tokenizer):
    p = GrammarCompilerPool(tokenizer.hf, 49152, tokenizer.eos_token_ids, max_entries=2)
    yield p
    p.shutdown()


def test_one_compile_per_spec_shared_by_concurrent_requests(small_pool):
    a1 = small_pool.compile(Spec.regex("a+"))
    a2 = small_pool.compile(Spec.regex("a+"))
    assert a1 is a2 and small_pool.num_compiles == 1
    assert a1.result(timeout=60) is a2.result(timeout=60)


def test_the_cache_is_a_bounded_lru(small_pool):
    a, b, c = Spec.regex("a"), Spec.regex("b"), Spec.regex("c")
    for s in (a, b):
        small_pool.compile(s).result(timeout=60)
    small_pool.compile(a)                   # a is now the most recent
    small_pool.compile(c).result(timeout=60)  # evicts b, the least recent
    assert len(small_pool) == 2 and small_pool.num_compiles == 3
    small_pool.compile(a)
    assert small_pool.num_compiles == 3     # still cached
    small_pool.compile(b).result(timeout=60)
    assert small_pool.num_compiles == 4     # compiled again


def test_compiles_run_off_the_calling_thread(small_pool, monkeypatch):
    seen = []
    real = small_pool._compile

    def spy(spec):
        seen.append(threading.current_thread().name)
        return real(spec)
    monkeypatch.setattr(small_pool, "_compile", spy)
    small_pool.compile(Spec.regex("x+")).result(timeout=60)
    assert seen and seen[0].startswith("kvmesh-grammar")


def test_a_failed_compile_is_reported_and_not_cached(small_pool, monkeypatch):
    real = small_pool._compile
    calls = []

    def flaky(spec):
        calls.append(spec)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(spec)
    monkeypatch.setattr(small_pool, "_compile", flaky)
    fut = small_pool.compile(Spec.regex("z+"))
    with pytest.raises(RuntimeError, match="injected"):
        fut.result(timeout=60)
    assert len(small_pool) == 0
    assert small_pool.compile(Spec.regex("z+")).result(timeout=60) is not None
    assert len(calls) == 2


def test_bad_sizes_are_refused(tokenizer):
    with pytest.raises(ValueError, match="max_entries >= 1"):
        GrammarCompilerPool(tokenizer.hf, 49152, (2,), max_entries=0)
