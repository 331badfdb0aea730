"""The finalizer's cleanup of an external rediss:// Redis trusts redis.caBundle: a real TLS
redis-server whose certificate is signed by a CA made here (openssl CLI), not in the system store."""
from __future__ import annotations

import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kvmesh.index.layout import KeySpace
from kvmesh.operator import redis_cleanup
from processes import REDIS_BIN, free_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")  # NOTE: much faster to make than RSA


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, redis.Redis]]:
    """(rediss:// URL, the CA's PEM, a client) of a redis-server serving TLS only."""
    tmp_path = tmp_path_factory.mktemp("tls-redis")
    _openssl("req", "-x509", *EC_KEY, "-nodes", "-days", "1", "-subj", "/CN=kvmesh-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=tmp_path)
    _openssl("req", *EC_KEY, "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
             "-out", "server.csr", cwd=tmp_path)
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "1", "-extfile", "ext.cnf", "-out", "server.crt", cwd=tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [REDIS_BIN, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", "server.crt",
         "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--loglevel", "warning"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, pem = f"rediss://127.0.0.1:{port}/0", (tmp_path / "ca.crt").read_text()
    client = redis.Redis.from_url(url, ssl_ca_data=pem)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.skip("this redis-server does not start with TLS")
            time.sleep(0.05)
    yield url, pem, client
    client.close()
    proc.kill()
    proc.wait(5)


@pytest.fixture
def tls_redis(tls_server: tuple[str, str, redis.Redis]) -> tuple[str, str, redis.Redis]:
    tls_server[2].flushdb()
    return tls_server


def test_cleanup_verifies_the_server_with_the_ca_bundle(tls_redis: tuple[str, str, redis.Redis]) -> None:
    url, pem, client = tls_redis
    mine, other = KeySpace("team-a", "smol").prefix, KeySpace("team-a", "other").prefix
    client.mset({f"{mine}block:1": b"x", f"{mine}pods": b"y", f"{other}block:1": b"z"})
    assert redis_cleanup.cleanup(url, None, "team-a", "smol", pem) == 2
    assert sorted(client.keys("*")) == [f"{other}block:1".encode()]


def test_without_the_ca_bundle_the_server_is_not_trusted(tls_redis: tuple[str, str, redis.Redis]) -> None:
    """What the finalizer did before honouring caBundle: the system store refuses the private CA."""
    url, _, client = tls_redis
    client.set(f"{KeySpace('team-a', 'smol').prefix}block:1", b"x")
    with pytest.raises(redis.ConnectionError) as err:
        redis_cleanup.cleanup(url, None, "team-a", "smol")
    assert isinstance(err.value.__context__, ssl.SSLCertVerificationError) or "certificate verify failed" in str(
        err.value)
    assert client.dbsize() == 1  # nothing was deleted


def test_a_wrong_ca_bundle_is_refused_too(tls_redis: tuple[str, str, redis.Redis], tmp_path: Path) -> None:
    url, _, client = tls_redis
    other = tmp_path / "other"
    other.mkdir()
    _openssl("req", "-x509", *EC_KEY, "-nodes", "-days", "1", "-subj", "/CN=someone-else",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=other)
    client.set(f"{KeySpace('team-a', 'smol').prefix}block:1", b"x")
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        redis_cleanup.cleanup(url, None, "team-a", "smol", (other / "ca.crt").read_text())
    assert client.dbsize() == 1
