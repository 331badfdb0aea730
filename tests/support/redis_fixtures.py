"""The `redis_server` fixture shared by tests/router and tests/index (each conftest imports it)."""
from __future__ import annotations

import pytest

from processes import RedisServer


@pytest.fixture
def redis_server():
    """A private redis-server per test (restartable)."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()
