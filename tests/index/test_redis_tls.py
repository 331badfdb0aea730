"""rediss:// with the CA bundle from KVMESH_REDIS_CA_FILE: the publisher and the KV-bytes store
talk to a real TLS redis-server (certificates made here with the openssl CLI)."""
from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

from processes import REDIS_BIN, free_port
from kvmesh.index.connect import redis_client_kwargs
from kvmesh.index.kv_bytes import RedisKVStore
from kvmesh.index.publisher import KVEventPublisher

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def tls_redis(tmp_path):
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=tmp_path)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr", cwd=tmp_path)
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", "ext.cnf", "-out", "server.crt",
            cwd=tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [REDIS_BIN, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", "server.crt", "--tls-key-file", "server.key",
         "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no", "--save", "",
         "--appendonly", "no", "--loglevel", "warning"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"rediss://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, ssl_ca_certs=str(tmp_path / "ca.crt"))
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
    yield url, tmp_path / "ca.crt", client
    client.close()
    proc.kill()
    proc.wait(5)


def test_kwargs_name_the_ca_only_for_rediss(monkeypatch, tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    monkeypatch.setenv("KVMESH_REDIS_CA_FILE", str(ca))
    assert redis_client_kwargs("rediss://r:6380/0") == {"ssl_ca_certs": str(ca)}
    assert redis_client_kwargs("redis://r:6379/0") == {}
    monkeypatch.setenv("KVMESH_REDIS_CA_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="KVMESH_REDIS_CA_FILE"):
        redis_client_kwargs("rediss://r:6380/0")


def test_publisher_and_kv_store_use_the_ca_bundle(monkeypatch, tls_redis):
    url, ca, client = tls_redis
    monkeypatch.setenv("KVMESH_REDIS_CA_FILE", str(ca))
    pub = KVEventPublisher(url, pod_id="p0", model="m", pod_url="http://p0",
                           snapshot_fn=lambda: [(b"\x01" * 8, "gpu")])
    try:
        assert pub.flush(10) and pub.connected
    finally:
        pub.close()
    store = RedisKVStore(url, "m", "float32", (4,))
    try:
        store.save(b"\x02" * 8, b"abcd")
        store.flush()
        assert store.blocks_stored == 1 and store.errors == 0
        store.prefetch("r", [b"\x02" * 8])
        assert store.settle(10)
        assert store.lookup("r", [b"\x02" * 8]) == [b"abcd"]
    finally:
        store.close()
