"""The benchmarks a GPU session runs (other models, other devices), exercised here on CPU at toy size."""
from __future__ import annotations

import pytest
import torch

from benchmarks import decode_bandwidth, offline_throughput
from benchmarks.models import RANDOM_MODELS, ensure_random_model, resolve_model


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory, smollm):
    return tmp_path_factory.mktemp("bench-models")


def test_model_specs(model_cache, tmp_path):
    assert resolve_model("builtin", model_cache) is None
    assert resolve_model(str(tmp_path), model_cache) == str(tmp_path)
    with pytest.raises(SystemExit, match="random-1b, random-tiny, .* or an HF model directory"):
        resolve_model("no-such-model", model_cache)


def test_random_model_is_built_once_and_loads_with_the_preset_shape(model_cache, smollm):
    from kvmesh.engine.loader import load_model

    path = ensure_random_model("random-tiny", model_cache)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_model("random-tiny", model_cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    loaded = load_model(str(path), dtype="float32", device="cpu")
    cfg, want = loaded.config, RANDOM_MODELS["random-tiny"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (
        want["hidden_size"], want["intermediate_size"], want["num_hidden_layers"],
        want["num_attention_heads"], want["num_key_value_heads"], 49152)
    assert cfg.tie_word_embeddings
    # the tied embedding / lm_head counts once: 49152 x 64 + 2 layers + the final norm, float32
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert decode_bandwidth.weight_bytes(loaded.model) == 4 * (49152 * 64 + 2 * per_layer + 64)
    assert loaded.tokenizer.encode("hello world") == smollm.tokenizer.encode("hello world")


def test_offline_throughput_on_a_random_model_agrees_with_transformers(model_cache, capsys):
    offline_throughput.main(["--model", "random-tiny", "--model-cache", str(model_cache),
                             "--num-requests", "5", "--scale", "40", "--systems", "kvmesh,hf-static"])
    out = capsys.readouterr().out
    assert "# model: random-tiny" in out and "float32 on cpu" in out
    assert "greedy outputs identical for 5/5 requests" in out


def test_offline_throughput_on_a_random_moe_model_agrees_with_transformers(model_cache, capsys):
    from kvmesh.engine.loader import load_model

    path = ensure_random_model("random-moe-tiny", model_cache)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.architecture == "Qwen3MoeForCausalLM" and loaded.config.moe.num_experts == 8
    offline_throughput.main(["--model", "random-moe-tiny", "--model-cache", str(model_cache),
                             "--num-requests", "5", "--scale", "40", "--systems", "kvmesh,hf-static"])
    out = capsys.readouterr().out
    assert "# model: random-moe-tiny" in out
    assert "greedy outputs identical for 5/5 requests" in out


def test_decode_bandwidth_prints_one_row(model_cache, capsys):
    decode_bandwidth.main(["--model", "random-tiny", "--model-cache", str(model_cache),
                           "--batch", "3", "--context", "20", "--steps", "3", "--copy-mib", "16"])
    row = capsys.readouterr().out.strip().splitlines()[-1].strip("| ").split(" | ")
    assert row[:2] == ["3", "20"]
    assert float(row[2]) > 0 and row[-1].endswith("%") and float(row[-1][:-1]) > 0
    # weights per step: the model's distinct bytes; K/V: 3 sequences x ~22 tokens x 2 layers x
    # K and V x 2 heads x 16 dims x 4 bytes
    assert float(row[4]) == pytest.approx(0.013, abs=0.001)


def test_cuda_is_refused_cleanly_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as e:
        decode_bandwidth.main(["--device", "cuda"])
    assert e.value.code == 2 and "no CUDA device is visible" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        offline_throughput.main(["--device", "cuda"])
    assert e.value.code == 2
