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


def _samples(metrics: EngineMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{labels other than model_name, sorted: value} of every sample of `name`."""
    out = {}
    for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", metrics.render().decode(), re.M):
        pairs = sorted(p for p in re.findall(r'(\w+)="([^"]*)"', labels) if p[0] != "model_name")
        out[tuple(pairs)] = float(value)
    return out


def test_per_adapter_request_and_token_counters(llama_base, llama_adapters):
    """kvmesh:lora_requests_total counts each finished sample by adapter and reason (an aborted
    request as "abort"), kvmesh:lora_generation_tokens_total the adapter's tokens; the base
    model's request is in neither."""
    engine = LLMEngine(EngineConfig(model=str(llama_base), enable_lora=True, max_loras=2,
                                    max_lora_rank=16, dtype="float32", device="cpu",
                                    num_kv_blocks=64, block_size=4))
    metrics = EngineMetrics("tiny", engine)
    engine.add_observer(metrics)
    all_ = LoRARequest("all", 1, str(llama_adapters["all"]))
    od = LoRARequest("o-down", 2, str(llama_adapters["o-down"]))
    engine.add_request("a1", [5, 6, 7], SamplingParams(max_tokens=3, n=2, ignore_eos=True),
                       lora_request=all_)
    engine.add_request("a2", [5, 6, 8], SamplingParams(max_tokens=4, ignore_eos=True),
                       lora_request=od)
    engine.add_request("a3", [5, 6, 9], SamplingParams(max_tokens=50, ignore_eos=True),
                       lora_request=od)
    engine.add_request("base", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    first = {o.request_id: sum(len(c.delta_token_ids) for c in o.outputs) for o in engine.step()}
    assert first["a3"] == 1                     # its one token before the abort
    assert engine.abort_request("a3") == ["a3"]
    while engine.has_unfinished_requests():
        engine.step()
    assert _samples(metrics, "kvmesh:lora_requests_total") == {
        (("finished_reason", "length"), ("lora_name", "all")): 2.0,
        (("finished_reason", "abort"), ("lora_name", "o-down")): 1.0,
        (("finished_reason", "length"), ("lora_name", "o-down")): 1.0}
    assert _samples(metrics, "kvmesh:lora_generation_tokens_total") == {
        (("lora_name", "all"),): 6.0, (("lora_name", "o-down"),): 5.0}
    # the base request's 2 tokens are only in the model-wide counter
    assert _samples(metrics, "vllm:generation_tokens_total") == {(): 13.0}
    assert metrics.lora.live == {}              # nothing kept for finished requests


def test_no_per_adapter_counters_without_enable_lora(llama_base):
    engine = LLMEngine(EngineConfig(model=str(llama_base), dtype="float32", device="cpu",
                                    num_kv_blocks=16, block_size=4))
    text = EngineMetrics("tiny", engine).render().decode()
    assert "lora_requests_total" not in text and "lora_generation_tokens" not in text
