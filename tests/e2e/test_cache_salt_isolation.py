"""--cache-salt-from: tenants share prefix-cache blocks only with themselves. A real server with
prefix caching; the salt function itself is checked exactly."""
from __future__ import annotations

import hashlib
import hmac
import uuid

import httpx
import pytest

from kvmesh.common.cache_salt import CacheSaltSource
from servers import start_server

LONG = ("The quarterly logistics report covers inbound freight, warehouse dwell times, carrier "
        "performance and the exceptions raised by customs brokers in every region. ") * 6


def _tenant(value: str) -> str:
    return hmac.new(b"kvmesh-cache-salt-v1", value.encode(), hashlib.sha256).hexdigest()


def test_salt_from_the_api_key_or_a_header_with_the_client_salt_appended():
    by_key = CacheSaltSource.parse("api-key")
    assert by_key.salt({"authorization": "Bearer k1"}, None) == _tenant("k1")
    assert by_key.salt({"authorization": "Bearer k1"}, "") == _tenant("k1")
    assert by_key.salt({"authorization": "Bearer k1"}, "mine") == _tenant("k1") + ":mine"
    assert by_key.salt({}, None) == _tenant("")
    # a client cannot pick another tenant's salt
    assert by_key.salt({"authorization": "Bearer k1"}, _tenant("k2")) != _tenant("k2")
    by_header = CacheSaltSource.parse("header:X-Tenant")
    assert by_header.header == "x-tenant"
    assert by_header.salt({"x-tenant": "acme"}, None) == _tenant("acme")
    assert CacheSaltSource.parse("none").salt({"authorization": "Bearer k"}, "s") == "s"
    assert CacheSaltSource.parse(None).salt({}, "") is None
    for bad in ("header:", "apikey", "header"):
        with pytest.raises(ValueError, match="--cache-salt-from must be none, api-key or "
                                             "header:NAME"):
            CacheSaltSource.parse(bad)


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("salt"), "--cache-salt-from", "header:X-Tenant",
                       "--num-kv-blocks", "256", "--max-model-len", "1024")
    yield srv
    assert srv.stop() == 0


def _cached(server, tenant: str | None, prompt: str, **body) -> int:
    headers = {"X-Tenant": tenant} if tenant is not None else {}
    r = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=120,
                   json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_never_hits_another_tenants_prompt_blocks(tenant_server):
    prompt = f"{uuid.uuid4().hex} {LONG}"
    assert _cached(tenant_server, "acme", prompt) == 0
    hit = _cached(tenant_server, "acme", prompt)
    assert hit >= 64                                  # the same tenant's repeat hits
    assert _cached(tenant_server, "globex", prompt) == 0
    assert _cached(tenant_server, None, prompt) == 0  # no header: the anonymous tenant
    # a client salt cannot step into another tenant's cache (nor does it open its own)
    assert _cached(tenant_server, "globex", prompt, cache_salt=_tenant("acme")) == 0
    assert _cached(tenant_server, "acme", prompt) == hit
