"""hf:// from a prepared Hub cache directory with HF_HUB_OFFLINE=1 (the Hub's own layout, as
huggingface_hub writes it: blobs, snapshot symlinks, refs), through huggingface_hub itself."""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from kvmesh.common.storage import FetchError, fetch

SHA_MAIN = hashlib.sha1(b"main").hexdigest()
SHA_V1 = hashlib.sha1(b"v1").hexdigest()


def _hub_repo(cache, repo_id: str, revisions: dict[str, str], model_dir) -> None:
    """models--org--name/{blobs,snapshots/<sha>,refs/<name>} holding `model_dir`'s files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for ref, sha in revisions.items():
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            if f.is_file():
                blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
                shutil.copyfile(f, blob)
                os.symlink(os.path.relpath(blob, snap), snap / f.name)


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model):
    cache = tmp_path / "hub"
    _hub_repo(cache, "kvmesh-test/tiny-llama", {"main": SHA_MAIN, "v1": SHA_V1}, tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hf_from_the_hub_cache_offline(hub, tiny_model):
    got = fetch("hf://kvmesh-test/tiny-llama")
    assert got.path == hub / "models--kvmesh-test--tiny-llama" / "snapshots" / SHA_MAIN
    assert got.name == "kvmesh-test/tiny-llama"
    assert (got.path / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    tagged = fetch("hf://kvmesh-test/tiny-llama@v1")
    assert tagged.path == hub / "models--kvmesh-test--tiny-llama" / "snapshots" / SHA_V1
    by_commit = fetch(f"hf://kvmesh-test/tiny-llama@{SHA_V1}")
    assert by_commit.path == tagged.path


def test_hf_missing_repo_offline(hub):
    with pytest.raises(FetchError) as e:
        fetch("hf://kvmesh-test/absent")
    assert e.value.reason == "not_found"
    assert str(e.value) == f"hf://kvmesh-test/absent: not in the Hub cache {hub} and HF_HUB_OFFLINE is set"


def test_hf_missing_revision_offline(hub):
    with pytest.raises(FetchError) as e:
        fetch("hf://kvmesh-test/tiny-llama@v2")
    assert e.value.reason == "revision"
    assert str(e.value) == (f"hf://kvmesh-test/tiny-llama@v2: revision 'v2' is not in the Hub cache "
                            f"{hub} (HF_HUB_OFFLINE is set); cached: main, v1")


def test_hf_snapshot_whose_config_does_not_parse(hub, tmp_path, tiny_model):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text("{not json")
    _hub_repo(hub, "kvmesh-test/broken", {"main": SHA_MAIN}, broken)
    with pytest.raises(FetchError) as e:
        fetch("hf://kvmesh-test/broken")
    assert e.value.reason == "unparsable"
    assert str(e.value).startswith("hf://kvmesh-test/broken: config.json: not valid JSON")
