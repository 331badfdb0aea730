"""Fixtures of the prefix-index tests: a private redis-server per test."""
from redis_fixtures import redis_server  # noqa: F401  (tests/support)
