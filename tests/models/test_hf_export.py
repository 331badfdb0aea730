"""kvmesh.common.hf_export: the GGUF model as an HF directory, converted once and cached. The real
conversion of the built-in model runs in `make test-vllm` (vLLM loads it and must answer like
kvmesh's engine); here: the cache key, a warm cache and the errors."""
from __future__ import annotations

import pytest

from kvmesh.common.hf_export import hf_model_dir
from kvmesh.prompt.sources import cache_key


def test_a_warm_cache_is_returned_without_converting(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    target = tmp_path / "cache" / f"{cache_key(gguf)}-hf-bfloat16"
    target.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (target / name).write_text("{}")
    import kvmesh.common.hf_export as hf_export
    monkeypatch.setattr(hf_export, "_convert_weights", lambda *a: pytest.fail("converted"))
    assert hf_model_dir(gguf, "bfloat16", tmp_path / "cache") == target


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        hf_model_dir(tmp_path / "m.gguf", "int8")
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        hf_model_dir(tmp_path / "missing.gguf")
