"""Admin endpoints need a key even when /v1/* is open (--admin-api-key); a non-loopback bind
without an API key is warned about. In-process app, no model."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvmesh.api.app import ServerState, create_app
from kvmesh.api.server import parse_args
from kvmesh.common.auth import open_bind_warning, resolve_api_key


def _post(state: ServerState, path: str, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": "hi"} if path == "/v1/completions" else {}
    return TestClient(create_app(state)).post(path, headers=headers, json=body)


def test_reset_prefix_cache_needs_the_admin_key_even_without_an_api_key():
    state = ServerState(admin_api_key="adm")
    for key in (None, "wrong"):
        r = _post(state, "/reset_prefix_cache", key)
        assert r.status_code == 401
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    # past the check: the model is not loaded yet (503), the OpenAI routes stay open
    assert _post(state, "/reset_prefix_cache", "adm").json()["error"]["code"] == "not_ready"
    assert _post(state, "/v1/completions", None).json()["error"]["code"] == "not_ready"


def test_the_api_key_does_not_open_admin_endpoints_when_an_admin_key_is_set():
    state = ServerState(api_key="user", admin_api_key="adm")
    assert _post(state, "/reset_prefix_cache", "user").status_code == 401
    assert _post(state, "/reset_prefix_cache", "adm").status_code == 503
    assert _post(state, "/v1/completions", "adm").status_code == 401


def test_without_an_admin_key_admin_endpoints_take_the_api_key():
    state = ServerState(api_key="user")
    assert _post(state, "/reset_prefix_cache", None).status_code == 401
    assert _post(state, "/reset_prefix_cache", "user").status_code == 503


def test_admin_key_flags(tmp_path, monkeypatch):
    args = parse_args(["--admin-api-key", "a"])
    assert resolve_api_key(args.admin_api_key, args.admin_api_key_file,
                           "KVMESH_ADMIN_API_KEY") == "a"
    monkeypatch.setenv("KVMESH_ADMIN_API_KEY", "env")
    args = parse_args([])
    assert resolve_api_key(args.admin_api_key, args.admin_api_key_file,
                           "KVMESH_ADMIN_API_KEY") == "env"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "engine.example"])
def test_a_non_loopback_bind_without_a_key_is_warned_about(host):
    msg = open_bind_warning(host, None)
    assert msg == (f"the server listens on {host} (not loopback) without an API key: anyone who "
                   "can reach it can use it; set --api-key, --api-key-file or $KVMESH_API_KEY")


@pytest.mark.parametrize("host,key", [("127.0.0.1", None), ("localhost", None), ("::1", None),
                                      ("[::1]", None), ("0.0.0.0", "k")])
def test_no_warning_on_loopback_or_with_a_key(host, key):
    assert open_bind_warning(host, key) is None
