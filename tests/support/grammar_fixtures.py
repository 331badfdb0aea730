"""Fixtures for grammar tests: the built-in tokenizer, one xgrammar compiler pool, a matcher check."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from kvmesh.prompt.sources import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture(scope="session")
def pool(tokenizer):
    from kvmesh.engine.structured.compiler import GrammarCompilerPool
    p = GrammarCompilerPool(tokenizer.hf, 49152, tokenizer.eos_token_ids)
    yield p
    p.shutdown()


@pytest.fixture(scope="session")
def matches(pool):
    """matches(spec, text) -> the grammar accepts exactly `text` (complete)."""
    import xgrammar as xgr

    def check(spec, text: str) -> bool:
        m = xgr.GrammarMatcher(pool.compile(spec).result(timeout=60))
        return m.accept_string(text) and m.is_completed()
    return check
