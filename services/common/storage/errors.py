"""The one error a model fetch raises: what failed, for which URI, and why, never a secret."""
from __future__ import annotations

# Why a fetch failed (FetchError.reason; the operator's ModelReady condition shows it).
REASONS = ("invalid", "credentials", "denied", "not_found", "revision", "checksum", "changed",
           "unparsable", "cache_full", "network")


class FetchError(ValueError):
    """A model source that cannot be fetched. str() is the user's message: the URI, then what
    went wrong and how to fix it. A ValueError, so the CLIs' `error: ...`, exit 2 path takes it."""

    def __init__(self, uri: str, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{uri}: {message}")
        self.uri, self.reason = uri, reason
