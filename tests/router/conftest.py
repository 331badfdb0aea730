"""Fixtures: a private redis-server per test (tests/support/redis_fixtures.py), free loopback
ports, uvicorn threads."""
from __future__ import annotations

import threading
import time

from processes import free_port  # noqa: F401  (tests/support)
from redis_fixtures import redis_server  # noqa: F401  (tests/support)


class UvicornThread:
    """An ASGI app served by uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, app, port: int | None = None) -> None:
        import uvicorn
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "UvicornThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
