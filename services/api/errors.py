"""APIError: a request the server refuses (the body: common/openai_errors.py)."""
from __future__ import annotations

from starlette.responses import JSONResponse

from kvmesh.common.openai_errors import error_json


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


def error_response(err: APIError) -> JSONResponse:
    return error_json(err.status, err.message, err.code, err.param, err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)
