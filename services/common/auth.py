"""The API-key check of the API server and the router: 'Authorization: Bearer KEY'."""
from __future__ import annotations

import hmac
import ipaddress
import os

from starlette.responses import JSONResponse

from kvmesh.common.openai_errors import error_json


def check_bearer(authorization: str, api_key: str) -> JSONResponse | None:
    """None when the Authorization header carries `api_key`, else the 401 response to send.

    NOTE: compare_digest takes the same time wherever the first wrong byte is."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    if hmac.compare_digest(token.encode(), api_key.encode()):
        return None
    msg = ("Incorrect API key provided." if token else
           "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.")
    return error_json(401, msg, code="invalid_api_key")


def resolve_api_key(api_key: str | None, api_key_file: str | None,
                    env: str = "KVMESH_API_KEY") -> str | None:
    """The key from --api-key, else --api-key-file (stripped), else $KVMESH_API_KEY; None: open."""
    if api_key:
        return api_key
    if api_key_file:
        with open(api_key_file) as f:
            return f.read().strip() or None
    return os.environ.get(env) or None


def open_bind_warning(host: str, api_key: str | None, what: str = "server") -> str | None:
    """The warning to log when `host` is not a loopback address and no API key is set, else
    None. NOTE: a name other than localhost counts as non-loopback (it may resolve anywhere)."""
    if api_key or _is_loopback(host):
        return None
    return (f"the {what} listens on {host} (not loopback) without an API key: anyone who can "
            f"reach it can use it; set --api-key, --api-key-file or $KVMESH_API_KEY")


def _is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
