"""Model sources, the allow-list, sizes and ETags: pure functions, no server."""
from __future__ import annotations

import hashlib
import os

import pytest

from kvmesh.common.storage import FetchError, parse_source
from kvmesh.common.storage.cache import parse_size
from kvmesh.common.storage.etag import matches
from kvmesh.common.storage.files import wanted


def test_s3_uri_parts_and_served_name():
    s = parse_source("s3://models-1/team/llama-3b/")
    assert (s.scheme, s.uri, s.location, s.prefix, s.remote, s.name) == (
        "s3", "s3://models-1/team/llama-3b", "models-1", "team/llama-3b/", True, "llama-3b")
    whole = parse_source("s3://models-1")
    assert (whole.prefix, whole.name) == ("", "models-1")


def test_hf_uri_with_and_without_revision():
    s = parse_source("hf://Org/Name-1.5B@v2.0")
    assert (s.scheme, s.location, s.revision, s.name, s.uri) == (
        "hf", "Org/Name-1.5B", "v2.0", "Org/Name-1.5B", "hf://Org/Name-1.5B@v2.0")
    assert parse_source("hf://Org/Name").revision is None


def test_pvc_uri_resolves_under_the_mount(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_PVC_MOUNT", str(tmp_path))
    s = parse_source("pvc://claim-a/llama/8b")
    assert (s.scheme, s.location, s.remote, s.name) == ("pvc", str(tmp_path / "llama" / "8b"), False, "8b")
    monkeypatch.delenv("KVMESH_PVC_MOUNT")
    assert parse_source("pvc://claim-a").location == "/models"


def test_local_path_is_kept():
    s = parse_source("~/models/x")
    assert (s.scheme, s.location, s.remote) == ("local", os.path.expanduser("~/models/x"), False)


@pytest.mark.parametrize("uri, says", [
    ("gs://bucket/model", "AWS_ENDPOINT_URL=https://storage.googleapis.com"),
    ("ftp://host/model", "unsupported scheme ftp://"),
    ("s3://No_Such/model", "'No_Such' is not a valid bucket name"),
    ("hf://just-a-name", "expected hf://org/name"),
    ("hf://org/name@", "expected hf://org/name"),
    ("pvc:///path", "expected pvc://claim/path"),
    ("pvc://claim/../etc", "may not leave its claim"),
])
def test_bad_uris_are_named_errors(uri, says):
    with pytest.raises(FetchError) as e:
        parse_source(uri)
    assert e.value.reason == "invalid"
    assert str(e.value).startswith(f"{uri}: ") and says in str(e.value)


@pytest.mark.parametrize("name, want", [
    ("config.json", True), ("model-00001-of-00002.safetensors", True),
    ("model.safetensors.index.json", True), ("tokenizer.json", True), ("tokenizer.model", True),
    ("tokenizer_config.json", True), ("special_tokens_map.json", True),
    ("chat_template.jinja", True), ("generation_config.json", True), ("m.Q4_K_M.gguf", True),
    ("pytorch_model.bin", False), ("README.md", False), ("original/consolidated.00.pth", False),
    ("extra/model.safetensors", False), ("onnx/model.onnx", False),
])
def test_only_the_files_a_model_needs(name, want):
    assert wanted(name) is want


@pytest.mark.parametrize("text, n", [("1000", 1000), ("10G", 10**10), ("500Mi", 500 << 20),
                                     ("1.5k", 1500), ("2GiB", 2 << 30), ("3 tb", 3 * 10**12)])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_parse_size_rejects_words():
    with pytest.raises(ValueError, match="cannot read 'lots' as a size"):
        parse_size("lots")


def _multipart_etag(data: bytes, part: int) -> str:
    digests = [hashlib.md5(data[i:i + part]).digest() for i in range(0, len(data), part)]
    return f'"{hashlib.md5(b"".join(digests)).hexdigest()}-{len(digests)}"'


def test_etags_simple_and_multipart(tmp_path):
    data = os.urandom(300_000)
    f = tmp_path / "blob"
    f.write_bytes(data)
    assert matches(f, f'"{hashlib.md5(data).hexdigest()}"', len(data)) is True
    assert matches(f, f'"{hashlib.md5(data[1:]).hexdigest()}"', len(data)) is False
    # a part size the store reported (100 000) is tried before the common ones
    assert matches(f, _multipart_etag(data, 100_000), len(data), (100_000,)) is True
    # ... and without it, ceil(size / parts) (here exact) finds it
    assert matches(f, _multipart_etag(data, 100_000), len(data)) is True
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert matches(f, _multipart_etag(data, 100_000), len(data), (100_000,)) is False
    assert matches(f, '"not-an-md5"', len(data)) is None
