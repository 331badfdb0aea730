"""vllm:lora_requests_info: the adapters of running and of waiting requests and --max-loras, as
vLLM reports them (an endpoint picker's adapter-affinity input)."""
from __future__ import annotations

import re

from kvmesh.api.metrics import EngineMetrics
from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.lora import LoRARequest
from kvmesh.engine.sampling_params import SamplingParams


def _info(metrics: EngineMetrics, prefix: str = "vllm") -> dict[str, str]:
    lines = [ln for ln in metrics.render().decode().splitlines()
             if ln.startswith(f"{prefix}:lora_requests_info{{")]
    assert len(lines) == 1
    return dict(re.findall(r'(\w+)="([^"]*)"', lines[0]))


def test_running_and_waiting_adapters(llama_base, llama_adapters):
    engine = LLMEngine(EngineConfig(model=str(llama_base), enable_lora=True, max_loras=2,
                                    max_lora_rank=16, dtype="float32", device="cpu",
                                    num_kv_blocks=64, block_size=4))
    metrics = EngineMetrics("tiny", engine)
    names = ["all", "o-down", "qv-rslora"]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for i, name in enumerate(names):
        engine.add_request(name, [5, 6, 7], params,
                           lora_request=LoRARequest(name, i + 1, str(llama_adapters[name])))
    engine.add_request("base", [5, 6, 7], params)
    assert _info(metrics) == {"max_lora": "2", "running_lora_adapters": "",
                              "waiting_lora_adapters": "all,o-down,qv-rslora"}
    engine.step()                                   # two adapters fit; the third waits
    assert _info(metrics) == {"max_lora": "2", "running_lora_adapters": "all,o-down",
                              "waiting_lora_adapters": "qv-rslora"}
    assert _info(metrics, "kvmesh")["running_lora_adapters"] == "all,o-down"
    while engine.has_unfinished_requests():
        engine.step()
    assert _info(metrics) == {"max_lora": "2", "running_lora_adapters": "",
                              "waiting_lora_adapters": ""}


def test_no_lora_gauge_without_enable_lora(llama_base):
    engine = LLMEngine(EngineConfig(model=str(llama_base), dtype="float32", device="cpu",
                                    num_kv_blocks=16, block_size=4))
    assert "lora_requests_info" not in EngineMetrics("tiny", engine).render().decode()
