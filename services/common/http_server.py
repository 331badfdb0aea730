"""Running a uvicorn server the way every kvmesh process does."""
from __future__ import annotations

import signal

import uvicorn


def run_until_signal(config: uvicorn.Config | uvicorn.Server) -> None:
    """Serve until SIGTERM / SIGINT (or `server.should_exit`), then shut down gracefully and
    return. Pass a `uvicorn.Server` to keep a handle that can stop it from inside.

    NOTE: uvicorn re-raises the signal it caught once its graceful shutdown is done, with the
    previous handler restored; a no-op handler there turns a clean SIGTERM into exit code 0
    instead of death by signal (exit 143 in a container).
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = config if isinstance(config, uvicorn.Server) else uvicorn.Server(config)
    server.run()
