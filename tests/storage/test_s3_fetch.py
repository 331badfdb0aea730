"""Fetching s3:// models from a real S3-protocol server (moto.server, a child process on
loopback), in this process: files, cache hits, checks and every failure the fetch names."""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time

import pytest
from throttle_proxy import ThrottleProxy  # tests/support
from upload import upload

from kvmesh.common.storage import FetchError, FetchOptions, fetch

JUNK = ("README.md", "pytorch_model.bin")       # beside the model in the bucket, never fetched


def _names(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _model_files(model_dir) -> list[str]:
    return sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.name not in JUNK)


def test_fetch_takes_the_model_files_and_caches_them(moto_server, s3_env, bucket, tiny_model):
    sent = upload(moto_server.client(), bucket, "team/tiny-llama", tiny_model)
    assert len(sent) == len(_model_files(tiny_model)) + len(JUNK) + 1     # + extra/model.safetensors
    expected = _model_files(tiny_model)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(expected)

    first = fetch(f"s3://{bucket}/team/tiny-llama")
    assert first.path.parent.parent == s3_env and first.path.name == "tiny-llama"
    assert first.name == "tiny-llama"
    assert _names(first.path) == expected             # no README, .bin, sub-folder, .partial
    for n in expected:
        assert (first.path / n).read_bytes() == (tiny_model / n).read_bytes()
    assert first.fetched_bytes == sum((tiny_model / n).stat().st_size for n in expected)
    record = json.loads((first.path.parent / "entry.json").read_text())
    assert (record["uri"], record["bytes"]) == (f"s3://{bucket}/team/tiny-llama", first.fetched_bytes)

    again = fetch(f"s3://{bucket}/team/tiny-llama/")        # same URI, normalised
    assert (again.path, again.fetched_bytes) == (first.path, 0)


def test_multipart_objects_are_checked_against_their_etag(moto_server, s3_env, bucket, tiny_model,
                                                          caplog):
    client = moto_server.client()
    upload(client, bucket, "mp", tiny_model, part_bytes=256 << 10)
    etag = client.head_object(Bucket=bucket, Key="mp/model.safetensors")["ETag"].strip('"')
    size = (tiny_model / "model.safetensors").stat().st_size
    assert etag.endswith(f"-{-(-size // (256 << 10))}")       # really a multipart ETag
    with caplog.at_level(logging.INFO, logger="kvmesh.fetch"):
        got = fetch(f"s3://{bucket}/mp", FetchOptions(chunk_bytes=100_000, workers=4))
    assert (got.path / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    assert "checked by size only" not in caplog.text


def test_a_changed_object_is_a_new_cache_entry(moto_server, s3_env, bucket, tiny_model):
    client = moto_server.client()
    upload(client, bucket, "m", tiny_model)
    old = fetch(f"s3://{bucket}/m")
    config = json.loads((tiny_model / "config.json").read_text()) | {"kvmesh_note": "v2"}
    client.put_object(Bucket=bucket, Key="m/config.json", Body=json.dumps(config).encode())
    new = fetch(f"s3://{bucket}/m")
    assert new.path != old.path and new.fetched_bytes > 0
    assert json.loads((new.path / "config.json").read_text())["kvmesh_note"] == "v2"


def test_size_bound_evicts_the_least_recently_used(moto_server, s3_env, bucket, tiny_model):
    upload(moto_server.client(), bucket, "a", tiny_model)
    upload(moto_server.client(), bucket, "b", tiny_model)
    upload(moto_server.client(), bucket, "c", tiny_model)
    one = sum((tiny_model / n).stat().st_size for n in _model_files(tiny_model))
    bound = FetchOptions(max_bytes=2 * one + one // 2)          # room for two models, not three
    a = fetch(f"s3://{bucket}/a", bound)
    b = fetch(f"s3://{bucket}/b", bound)
    assert fetch(f"s3://{bucket}/a", bound).fetched_bytes == 0   # a used again: b is the LRU
    c = fetch(f"s3://{bucket}/c", bound)
    assert a.path.is_dir() and c.path.is_dir() and not b.path.parent.exists()
    with pytest.raises(FetchError) as e:
        fetch(f"s3://{bucket}/a", FetchOptions(max_bytes=one // 2, cache_dir=s3_env.parent / "small"))
    assert e.value.reason == "cache_full" and "does not fit the model cache's bound" in str(e.value)


def test_missing_bucket_and_prefix(moto_server, s3_env, bucket):
    with pytest.raises(FetchError) as e:
        fetch("s3://no-such-bucket-here/m")
    assert e.value.reason == "not_found"
    assert str(e.value) == (f"s3://no-such-bucket-here/m: no such bucket 'no-such-bucket-here' "
                            f"at {moto_server.url}")
    with pytest.raises(FetchError) as e:
        fetch(f"s3://{bucket}/nothing-here")
    assert e.value.reason == "not_found" and str(e.value).startswith(
        f"s3://{bucket}/nothing-here: no model files under this prefix")


def test_no_credentials(moto_server, s3_env, bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(FetchError) as e:
        fetch(f"s3://{bucket}/m")
    assert e.value.reason == "credentials"
    assert str(e.value).startswith(f"s3://{bucket}/m: no S3 credentials: set AWS_ACCESS_KEY_ID")


def test_wrong_credentials_are_refused_and_never_printed(moto_server, s3_env, bucket, tiny_model,
                                                         monkeypatch):
    upload(moto_server.client(), bucket, "m", tiny_model)
    moto_server.set_auth(True)
    try:
        # the right key pair reads the model: the server really checks signatures
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_server.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_server.secret_key)
        assert (fetch(f"s3://{bucket}/m").path / "config.json").is_file()
        wrong_secret = "wrong-" + hashlib.sha256(b"x").hexdigest()[:30]
        for key_id, secret, code in [(moto_server.access_key, wrong_secret, "SignatureDoesNotMatch"),
                                     ("AKIAUNKNOWNKEY000000", wrong_secret, "InvalidAccessKeyId")]:
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
            with pytest.raises(FetchError) as e:
                fetch(f"s3://{bucket}/other")
            assert e.value.reason == "credentials"
            assert str(e.value) == (f"s3://{bucket}/other: the store refused the credentials "
                                    f"({code}): check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
            assert secret not in str(e.value) and key_id not in str(e.value)
    finally:
        moto_server.set_auth(False)


def test_access_denied_names_the_file(moto_server, s3_env, bucket, tiny_model, monkeypatch):
    upload(moto_server.client(), bucket, "m", tiny_model)
    key_id, secret = moto_server.list_only           # may list the bucket, not read objects
    moto_server.set_auth(True)
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        with pytest.raises(FetchError) as e:
            fetch(f"s3://{bucket}/m", FetchOptions(workers=1))
    finally:
        moto_server.set_auth(False)
    assert e.value.reason == "denied"
    assert str(e.value) == (f"s3://{bucket}/m (config.json): access denied (AccessDenied): the "
                            "credentials may not read this bucket or prefix")


def test_a_stream_broken_midway_is_read_again(moto_server, s3_env, bucket, tiny_model, monkeypatch,
                                              caplog):
    upload(moto_server.client(), bucket, "m", tiny_model)
    proxy = ThrottleProxy(moto_server.port, cut_once_after=300_000)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.fetch"):
            got = fetch(f"s3://{bucket}/m", FetchOptions(workers=1, chunk_bytes=1 << 20))
    finally:
        proxy.close()
    assert proxy.cuts == 1
    assert "reading that range again (2 of 3)" in caplog.text
    for n in _model_files(tiny_model):
        assert (got.path / n).read_bytes() == (tiny_model / n).read_bytes()


def test_an_object_replaced_midway_is_an_error(moto_server, s3_env, bucket, tiny_model, monkeypatch):
    client = moto_server.client()
    upload(client, bucket, "m", tiny_model)
    proxy = ThrottleProxy(moto_server.port, bytes_per_s=300_000)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            fetch(f"s3://{bucket}/m", FetchOptions(workers=1, chunk_bytes=128 << 10))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not list(s3_env.glob("*/m/model.safetensors.partial.state")) or len(
                next(s3_env.glob("*/m/model.safetensors.partial.state")).read_text().splitlines()) < 2:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        client.put_object(Bucket=bucket, Key="m/model.safetensors", Body=b"replaced")
        thread.join(60)
    finally:
        proxy.close()
    assert len(outcome) == 1 and isinstance(outcome[0], FetchError), outcome
    assert outcome[0].reason == "changed"
    assert str(outcome[0]) == (f"s3://{bucket}/m (model.safetensors): the object changed while it "
                               "was fetched; run the fetch again")


def test_a_file_that_does_not_parse_is_named(moto_server, s3_env, bucket, tiny_model):
    client = moto_server.client()
    upload(client, bucket, "m", tiny_model)
    client.put_object(Bucket=bucket, Key="m/config.json", Body=b'{"architectures": [')
    with pytest.raises(FetchError) as e:
        fetch(f"s3://{bucket}/m")
    assert e.value.reason == "unparsable"
    assert str(e.value).startswith(f"s3://{bucket}/m: config.json: not valid JSON")
    client.put_object(Bucket=bucket, Key="m/config.json", Body=(tiny_model / "config.json").read_bytes())
    weights = (tiny_model / "model.safetensors").read_bytes()
    client.put_object(Bucket=bucket, Key="m/model.safetensors", Body=weights[:len(weights) // 2])
    with pytest.raises(FetchError) as e:
        fetch(f"s3://{bucket}/m")
    assert e.value.reason == "unparsable"
    assert str(e.value).startswith(f"s3://{bucket}/m: model.safetensors: truncated")


def test_an_unreachable_store_falls_back_to_the_cached_copy(moto_server, s3_env, bucket, tiny_model,
                                                            monkeypatch, caplog):
    from processes import free_port

    upload(moto_server.client(), bucket, "m", tiny_model)
    cached = fetch(f"s3://{bucket}/m").path
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")   # nobody listens
    with caplog.at_level(logging.WARNING, logger="kvmesh.fetch"):
        assert fetch(f"s3://{bucket}/m").path == cached
    assert "using the copy cached at" in caplog.text
    with pytest.raises(FetchError) as e:
        fetch(f"s3://{bucket}/never-fetched")
    assert e.value.reason == "network" and "cannot read from the store at http://127.0.0.1:" in str(e.value)


def test_the_router_reads_the_tokenizer_of_an_s3_model(moto_server, s3_env, bucket, tiny_model):
    from kvmesh.prompt.sources import load_tokenizer
    from kvmesh.router.main import _default_model_name

    upload(moto_server.client(), bucket, "team/tiny-llama", tiny_model)
    remote = load_tokenizer(f"s3://{bucket}/team/tiny-llama")
    local = load_tokenizer(str(tiny_model))
    assert remote.encode("w5 w9 w1000") == local.encode("w5 w9 w1000") and len(local.encode("w5 w9")) >= 2
    assert _default_model_name(f"s3://{bucket}/team/tiny-llama") == "tiny-llama"
    assert _default_model_name("hf://org/name@v1") == "org/name"
