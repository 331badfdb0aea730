"""BodySizeLimit: the request body's size, bounded before anything parses it (413)."""
from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.common.openai_errors import error_body


class BodySizeLimit:
    """Pure ASGI: a body over `max_bytes` is answered 413 `request_too_large`, by its
    Content-Length before a byte is read, or as soon as the bytes received (a chunked body)
    pass the limit.

    NOTE: the body is read here, in full, before the app runs, and then replayed to it: FastAPI
    reads whole bodies anyway, and an error raised from inside the app's `receive` would reach
    its exception handlers as a 500. Later `receive` calls (the disconnect a stream listens
    for) go to the server's."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[Message] = []
        received = 0
        while True:
            message = await receive()
            chunks.append(message)
            if message["type"] != "http.request":
                break                               # the client went away: let the app see it
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"The request body is larger than this server's limit of {self.max_bytes} "
                   "bytes (kvmesh serve --max-request-body-bytes).")
        response = JSONResponse(error_body(413, message, code="request_too_large"),
                                status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None                         # the server rejects a malformed one
    return None
