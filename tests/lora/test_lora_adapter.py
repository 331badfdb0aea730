"""Reading PEFT adapters: rank / alpha / rsLoRA scaling, and every refusal a clear error that
leaves the engine as it was (rank over --max-lora-rank, a target module the base lacks, a shape
that does not fit the base, missing files); the host LRU keeps the adapters live requests use."""
from __future__ import annotations

import json
import math
import shutil

import pytest
from lora_adapters import make_adapter
from safetensors.torch import load_file, save_file

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.lora import LoRARequest
from kvmesh.engine.lora.adapter import LoRAAdapterError
from kvmesh.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(llama_base):
    return LLMEngine(EngineConfig(model=str(llama_base), enable_lora=True, max_loras=1,
                                  max_cpu_loras=2, max_lora_rank=8, dtype="float32", device="cpu",
                                  num_kv_blocks=32, block_size=4))


def test_rank_alpha_and_rslora_scaling(engine, llama_adapters):
    full = engine.read_lora(LoRARequest("all", 1, str(llama_adapters["all"])))
    assert (full.rank, full.scaling) == (8, 2.0)                         # alpha / r
    assert len(full.weights) == 2 * 7                                   # 2 layers x 7 modules
    a, b = full.weights["model.layers.1.self_attn.k_proj"]
    assert tuple(a.shape) == (8, 64) and tuple(b.shape) == (32, 8)       # k: 2 KV heads x 16
    rs = engine.read_lora(LoRARequest("qv", 2, str(llama_adapters["qv-rslora"])))
    assert (rs.rank, rs.scaling) == (4, 8 / math.sqrt(4))               # alpha / sqrt(r)
    assert sorted(rs.weights) == [f"model.layers.{i}.self_attn.{m}_proj" for i in (0, 1) for m in "qv"]
    assert engine.list_loras() == set()                                 # reading changes nothing


def _refused(engine, path, match: str) -> None:
    with pytest.raises(LoRAAdapterError, match=match):
        engine.add_lora(LoRARequest("bad", 9, str(path)))
    assert engine.list_loras() == set()


def test_a_rank_over_max_lora_rank_is_refused(engine, llama_adapters):
    _refused(engine, llama_adapters["o-down"],
             r"LoRA adapter 'bad': rank 16 exceeds --max-lora-rank 8; raise --max-lora-rank")


def test_a_target_module_the_base_lacks_is_refused(engine, llama_adapters, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(llama_adapters["all"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "qkv_proj"]                      # Phi-3's name on Llama
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    _refused(engine, bad, r"target module\(s\) qkv_proj not in the base model \(its adaptable "
                          r"modules: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj\)")


def test_an_adapter_of_lm_head_is_refused(engine, llama_base, tmp_path):
    path = make_adapter(llama_base, tmp_path / "head", ["lm_head"], r=4, alpha=4)
    _refused(engine, path, r"target module\(s\) lm_head not in the base model")


def test_a_shape_that_does_not_fit_the_base_is_refused(engine, llama_adapters, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(llama_adapters["all"], bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    tensors[key] = tensors[key][:80].contiguous()                       # 96 rows on the base
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    _refused(engine, bad, r"model.layers.0.mlp.up_proj has lora_A \[8, 64\] and lora_B \[80, 8\], "
                          r"the base model needs \[8, 64\] and \[96, 8\]")


def test_missing_files_are_refused(engine, llama_adapters, tmp_path):
    _refused(engine, tmp_path, r"no adapter_config.json in")
    bad = tmp_path / "weightless"
    bad.mkdir()
    shutil.copy(llama_adapters["all"] / "adapter_config.json", bad)
    _refused(engine, bad, r"no adapter_model.safetensors in")


def test_the_host_lru_keeps_adapters_in_use(engine, llama_base, tmp_path):
    paths = [make_adapter(llama_base, tmp_path / f"a{i}", ["q_proj"], r=2, alpha=2, seed=i)
             for i in range(3)]
    loras = [LoRARequest(f"a{i}", 10 + i, str(p)) for i, p in enumerate(paths)]
    engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=2), lora_request=loras[0])
    assert engine.list_loras() == {10}
    assert engine.add_lora(loras[1]) and engine.add_lora(loras[2])      # --max-cpu-loras 2 ...
    assert engine.list_loras() == {10, 12}                              # ... a0 is in use: a1 went
    assert not engine.add_lora(loras[2])                                # already loaded
    engine.abort_request("busy")
    assert engine.remove_lora(10) and engine.remove_lora(12) and not engine.remove_lora(11)
    assert engine.list_loras() == set()


def test_generate_with_a_bad_adapter_adds_no_request(llama_base, tmp_path):
    llm = LLM(str(llama_base), enable_lora=True, dtype="float32", device="cpu", num_kv_blocks=16,
              block_size=4)
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        llm.generate([[5, 6], [7, 8]], lora_request=[None, LoRARequest("x", 1, str(tmp_path))])
    assert not llm.engine.has_unfinished_requests()


def test_an_adapter_without_enable_lora_is_refused(llama_base, llama_adapters):
    llm = LLM(str(llama_base), dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="start it with --enable-lora"):
        llm.generate([[5, 6]], lora_request=LoRARequest("all", 1, str(llama_adapters["all"])))


def test_max_cpu_loras_below_max_loras_is_refused():
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
