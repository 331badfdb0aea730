"""The access log of kvmesh serve and the router: one line per request in uvicorn's own format,

    INFO:     127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 OK

on by default (uvicorn's `uvicorn.access` logger, on stdout), off with vLLM's
`--disable-uvicorn-access-log`. The line holds the client address, method, path, HTTP version and
status only: the query string is cut off (a client may put a key there, `?api_key=...`), and
headers and bodies (Bearer keys, prompts) are never part of it.
"""
from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
FLAG_HELP = ("no access log line per request (by default one line per request in uvicorn's "
             "format, without the query string; never a prompt or a key)")


class _NoQueryString(logging.Filter):
    """Cuts the query string off uvicorn's request path argument."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # NOTE: uvicorn logs (client, method, path with query, http version, status)
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (args[0], args[1], args[2].split("?", 1)[0], args[3], args[4])
        return True


def keep_access_log_clean() -> None:
    """Install the filter on uvicorn's access logger (after uvicorn.Config configured logging);
    idempotent."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, _NoQueryString) for f in logger.filters):
        logger.addFilter(_NoQueryString())
