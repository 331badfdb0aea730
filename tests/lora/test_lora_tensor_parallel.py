"""LoRA under tensor parallelism (two ranks, worker processes, gloo on CPU): each rank keeps the
slices of A or B that match its shard of the layer (B's rows of q/k/v, gate/up and of each part
of Phi-3's fused qkv_proj / gate_up_proj; A's columns of o and down); rank 0 decides the slots
and the workers write the same adapters into them. Greedy output equals peft's merged model."""
from __future__ import annotations

import random

from lora_adapters import PHI3_TARGETS, VOCAB, greedy, make_adapter, make_base, merged

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.lora import LoRARequest
from kvmesh.engine.parallel.messages import Step, decode, encode
from kvmesh.engine.sampling_params import SamplingParams

NEW = 6


def _run(engine: LLMEngine, jobs: list[tuple[LoRARequest | None, list[int]]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for i, (lora, prompt) in enumerate(jobs):
        engine.add_request(f"q{i}", prompt, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"q{i}"] for i in range(len(jobs))]


def _engine(base, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(base), enable_lora=True, max_lora_rank=16,
                                  dtype="float32", device="cpu", tensor_parallel_size=2,
                                  cpu_threads=1, block_size=4, num_kv_blocks=64, **kw))


def test_two_ranks_serve_three_adapters_through_two_slots(llama_base, llama_adapters):
    rng = random.Random(4)
    names = sorted(llama_adapters)
    loras = [LoRARequest(n, i + 1, str(llama_adapters[n])) for i, n in enumerate(names)]
    jobs = [(lora, [rng.randrange(3, VOCAB) for _ in range(n)])
            for lora, n in zip([*loras, None, loras[0], loras[2]], (5, 9, 13, 7, 11, 6))]
    engine = _engine(llama_base, max_loras=2)
    try:
        got = _run(engine, jobs)
    finally:
        engine.shutdown()
    refs = {None: merged(llama_base, None),
            **{lora.lora_int_id: merged(llama_base, llama_adapters[lora.lora_name]) for lora in loras}}
    want = [greedy(refs[None if lora is None else lora.lora_int_id], p, NEW) for lora, p in jobs]
    assert got == want


def test_phi3_fused_projections_are_sliced_part_by_part(tmp_path):
    base = make_base("phi3", tmp_path / "phi3")
    adapter = make_adapter(base, tmp_path / "adapter", PHI3_TARGETS, r=8, alpha=16, seed=5)
    prompts = [[7, 19, 33, 41, 52], [100, 3, 250, 17, 18, 19, 88, 90]]
    engine = _engine(base)
    try:
        got = _run(engine, [(LoRARequest("a", 1, str(adapter)), p) for p in prompts])
    finally:
        engine.shutdown()
    ref = merged(base, adapter)
    assert got == [greedy(ref, p, NEW) for p in prompts]


def test_the_step_message_carries_the_slot_writes():
    step = Step([], None, [(1, "sql", 7, "/adapters/sql")])
    assert decode(encode(step)).lora_writes == [(1, "sql", 7, "/adapters/sql")]
    assert decode(encode(Step([], None))).lora_writes == []
