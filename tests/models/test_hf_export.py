"""The built-in GGUF as an HF directory (what vLLM loads): the same weights transformers reads
from the GGUF, a config that names the architecture without the GGUF quantization, cached."""
from __future__ import annotations

import json

import pytest
import torch

from kvmesh.engine.hf_export import builtin_hf_dir, gguf_to_hf_dir


@pytest.fixture(scope="module")
def hf_dir():
    return builtin_hf_dir()


def test_directory_has_config_weights_and_tokenizer(hf_dir):
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["dtype"], config["num_hidden_layers"], config["tie_word_embeddings"]) == ("float32", 30, True)
    assert builtin_hf_dir() == hf_dir           # cached: the same directory, not converted again


def test_weights_equal_transformers_gguf_load(hf_dir, hf_smollm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    ours, theirs = model.state_dict(), hf_smollm.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'int8'"):
        builtin_hf_dir("int8")
    with pytest.raises(FileNotFoundError, match="GGUF file .*missing.gguf does not exist"):
        gguf_to_hf_dir(tmp_path / "missing.gguf", cache_root=tmp_path)
