"""Two real engines in one process, Mooncake's TCP transport between them: the decode engine's
trace holds one kvmesh.kv_transfer span under its request, and a prompt whose blocks the
producer holds for another prompt is computed locally (hash check), never answered wrongly."""
from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.common.config import EngineConfig
from kvmesh.common.tracing import get_tracer, init_tracing, shutdown_tracing
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.kv_transfer.params import KVTransferParams, parse_kv_transfer_params
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.tracing_hooks import EngineTracer

pytest.importorskip("mooncake.engine", reason="needs the pd extra (mooncake-transfer-engine-non-cuda)")

PROMPT = [3 + (i * 7) % 120 for i in range(100)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from tiny_models import save_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = save_tiny_model(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("m") / "tiny", seed=3)

    def engine(role: str | None, eid: str = "e") -> LLMEngine:
        kt = None if role is None else {"kv_connector": "MooncakeConnector", "kv_role": role,
                                        "engine_id": eid, "kv_port": 0}
        return LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32,
                                      max_model_len=512, swap_space=0, kv_transfer_config=kt))

    made = {"colocated": engine(None), "prefill": engine("kv_producer", "p0"),
            "decode": engine("kv_consumer", "d0")}
    yield made
    for e in made.values():
        e.shutdown()


def run(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int,
        kt: KVTransferParams | None = None):
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   ignore_eos=True, kv_transfer_params=kt))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def test_the_read_is_a_span_under_the_request(engines):
    exporter = InMemorySpanExporter()
    init_tracing(exporter=exporter, simple=True)
    tracer = EngineTracer(get_tracer(), "tiny").attach(engines["decode"])
    try:
        out = run(engines["prefill"], "p1", PROMPT, 1,
                  KVTransferParams(do_remote_decode=True, transfer_id="t-span"))
        got = run(engines["decode"], "d1", PROMPT, 8,
                  parse_kv_transfer_params(out.kv_transfer_params))
    finally:
        tracer.detach(engines["decode"])
        shutdown_tracing()
    assert got.outputs[0].token_ids == run(engines["colocated"], "c1", PROMPT, 8).outputs[0].token_ids
    spans = exporter.get_finished_spans()
    (transfer,) = [s for s in spans if s.name == "kvmesh.kv_transfer"]
    (request,) = [s for s in spans if s.name == "kvmesh.request"]
    assert transfer.parent.span_id == request.context.span_id
    assert dict(transfer.attributes) == {
        "kvmesh.kv_transfer.transfer_id": "t-span", "kvmesh.kv_transfer.ok": True,
        "kvmesh.kv_transfer.num_blocks": 6, "kvmesh.kv_transfer.bytes": 6 * 4 * 2048}
    assert transfer.end_time > transfer.start_time


def test_blocks_of_another_prompt_are_never_used(engines):
    out = run(engines["prefill"], "p2", PROMPT, 1,
              KVTransferParams(do_remote_decode=True, transfer_id="t-other"))
    other = [5] + PROMPT[1:]                      # differs in block 0: every hash differs
    kt = parse_kv_transfer_params(out.kv_transfer_params)
    stats0 = engines["decode"].kv_transfer.transfer_stats()
    got = run(engines["decode"], "d2", other, 8, kt)
    assert got.outputs[0].token_ids == run(engines["colocated"], "c2", other, 8).outputs[0].token_ids
    stats = engines["decode"].kv_transfer.transfer_stats()
    assert (stats.failures - stats0.failures, stats.bytes_read - stats0.bytes_read) == (1, 0)
    assert stats.read_seconds == stats0.read_seconds            # refused before any read
    # the consumer told the producer it was done, failure or not: the pin is gone
    prefill = engines["prefill"]
    prefill.poll_kv_transfers()
    assert prefill.kv_transfer.transfer_stats().pinned_blocks == 0
    assert prefill.kv_manager.num_free_blocks == 32


def test_vllms_proxy_form_without_block_ids_is_read_too(engines):
    """vLLM's Mooncake proxy builds the decode leg's params itself, without remote_block_ids:
    the consumer takes them from the side channel by transfer_id."""
    prompt = [3 + (i * 11) % 120 for i in range(100)]      # new to the decode engine
    out = run(engines["prefill"], "p3", prompt, 1,
              KVTransferParams(do_remote_decode=True, transfer_id="t-vllm"))
    params = {k: v for k, v in out.kv_transfer_params.items() if k != "remote_block_ids"}
    stats0 = engines["decode"].kv_transfer.transfer_stats()
    got = run(engines["decode"], "d3", prompt, 8, parse_kv_transfer_params(params))
    stats = engines["decode"].kv_transfer.transfer_stats()
    assert (stats.failures, stats.bytes_read - stats0.bytes_read) == (stats0.failures, 6 * 4 * 2048)
    # Mooncake's read alone is a part of the whole load's time (side-channel round trips added)
    assert 0 < stats.read_seconds - stats0.read_seconds < stats.seconds - stats0.seconds
    assert got.outputs[0].token_ids == run(engines["colocated"], "c3", prompt, 8).outputs[0].token_ids
