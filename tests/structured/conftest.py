"""Grammar fixtures (tests/support/grammar_fixtures.py)."""
from grammar_fixtures import matches, pool, tokenizer  # noqa: F401
