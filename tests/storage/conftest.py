"""Fixtures of the model-storage tests: a real S3-protocol server (moto's, a child process),
a tiny random model, and buckets holding it."""
from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

from s3_server import MotoServer  # tests/support

sys.path.insert(0, str(Path(__file__).parent))

_buckets = itertools.count()


@pytest.fixture(scope="session")
def moto_server():
    """One moto server for the folder; authentication off unless a test turns it on."""
    server = MotoServer()
    server.start()
    server.create_user()
    server.list_only = server.create_user("kvmesh-list-only", ("s3:ListBucket",))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama (about 1.6 MiB of float32 weights) with a word-level tokenizer, plus
    files a model does not need (README.md, a .bin copy, a sub-folder), which no fetch takes."""
    import transformers
    from tiny_models import save_tiny_model

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                                   tie_word_embeddings=True)
    path = save_tiny_model(transformers.LlamaForCausalLM(cfg), tmp_path_factory.mktemp("src") / "tiny-llama")
    (path / "README.md").write_text("# not a model file\n")
    (path / "pytorch_model.bin").write_bytes(os.urandom(1000))
    (path / "extra").mkdir()
    (path / "extra" / "model.safetensors").write_bytes(b"nested: never fetched")
    return path


@pytest.fixture
def s3_env(moto_server, tmp_path, monkeypatch) -> Path:
    """This process's AWS variables point at the moto server; a private model cache
    (KVMESH_MODEL_CACHE_DIR), which it returns."""
    for k, v in moto_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("KVMESH_MODEL_CACHE_MAX_SIZE", raising=False)
    monkeypatch.setenv("KVMESH_MODEL_CACHE_DIR", str(tmp_path / "models"))
    return tmp_path / "models"


@pytest.fixture
def bucket(moto_server) -> str:
    """A new, empty bucket."""
    name = f"models-{next(_buckets)}-{os.getpid()}"
    moto_server.client().create_bucket(Bucket=name)
    return name
