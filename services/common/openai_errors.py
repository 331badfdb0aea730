"""OpenAI-style error bodies, one spelling for the API server and the router:
{"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from starlette.responses import JSONResponse

# NOTE: OpenAI itself answers a bad API key (401) with type "invalid_request_error" and code
# "invalid_api_key"; clients read the code.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_json(status: int, message: str, code: str | None = None, param: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status,
                        headers=headers)
