"""The engine serving PEFT adapters made by peft: greedy output per adapter token-identical to
peft's merged model in transformers (float32) for two families; one batch mixing three adapters
and the base model under chunked prefill, prefix hits and preemption, each request equal to its
own adapter's reference; the prefix cache never shares a block between two adapters."""
from __future__ import annotations

import random

import pytest
from lora_adapters import (LLAMA_TARGETS, PHI3_TARGETS, VOCAB, greedy, make_adapter, make_base,
                           merged)

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.lora import LoRARequest
from kvmesh.engine.observers import EngineObserver
from kvmesh.engine.sampling_params import SamplingParams

NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_each_adapter_matches_peft_merged_in_transformers(family, tmp_path):
    base = make_base(family, tmp_path / family)
    targets = LLAMA_TARGETS if family == "llama" else PHI3_TARGETS
    adapter = make_adapter(base, tmp_path / "adapter", targets, r=8, alpha=16, seed=5)
    prompts = _prompts(1, (5, 11, 19))
    want = [greedy(merged(base, adapter), p, NEW) for p in prompts]
    want_base = [greedy(merged(base, None), p, NEW) for p in prompts]
    assert all(w != b for w, b in zip(want, want_base))      # the adapter changes every answer

    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, dtype="float32", device="cpu",
              num_kv_blocks=64, block_size=4)
    lora = LoRARequest("adapter", 1, str(adapter))
    got = llm.generate(prompts, GREEDY, lora_request=lora)
    assert [o.outputs[0].token_ids for o in got] == want
    got_base = llm.generate(prompts, GREEDY)                  # the same engine, no adapter
    assert [o.outputs[0].token_ids for o in got_base] == want_base


class _StepAdapters(EngineObserver):
    """The adapters (None: base) of each step's scheduled requests."""

    def __init__(self) -> None:
        self.steps: list[set[str | None]] = []

    def on_step(self, report) -> None:
        self.steps.append({sr.request.lora_name for sr in report.sched.scheduled})


def test_one_batch_mixes_three_adapters_and_the_base_under_pressure(llama_base, llama_adapters):
    names = sorted(llama_adapters)
    loras = {name: LoRARequest(name, i + 1, str(llama_adapters[name])) for i, name in enumerate(names)}
    shared = _prompts(7, (12,))[0]
    tails = _prompts(8, (3, 9, 6, 14))
    wave1 = [(names[0], shared + tails[0]), (names[1], shared + tails[1]),
             (names[2], tails[2]), (None, shared + tails[3])]
    # the second wave repeats prompts: the same adapter hits its own blocks; another adapter (or
    # the base) must not reuse them
    wave2 = [(names[0], shared + tails[0]), (names[1], shared + tails[0]),
             (None, shared + tails[1]), (names[2], shared + tails[3])]
    refs = {name: merged(llama_base, llama_adapters[name] if name else None) for name in [*names, None]}

    cfg = EngineConfig(model=str(llama_base), enable_lora=True, max_loras=3, max_lora_rank=16,
                       dtype="float32", device="cpu", block_size=4, num_kv_blocks=24,
                       max_model_len=64, max_num_batched_tokens=16, preemption_mode="recompute",
                       enable_prefix_caching=True)
    engine = LLMEngine(cfg)
    seen = _StepAdapters()
    engine.add_observer(seen)
    done, stats = {}, {"preempted": 0, "chunked": 0, "hits": 0}
    for i, (name, prompt) in enumerate(wave1):
        engine.add_request(f"w1-{i}", prompt, GREEDY, lora_request=loras.get(name))
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 8:
            for i, (name, prompt) in enumerate(wave2):
                engine.add_request(f"w2-{i}", prompt, GREEDY, lora_request=loras.get(name))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
        s = engine.last_stats
        stats["preempted"] += s.num_preempted_recompute
        stats["chunked"] += s.num_chunked_prefills
        stats["hits"] += s.prefix_hit_tokens
    engine.kv_manager.check_invariants([])

    assert stats["preempted"] > 0 and stats["chunked"] > 0 and stats["hits"] > 0, stats
    assert {*names, None} in seen.steps                  # three adapters and the base, one step
    assert max(len(s - {None}) for s in seen.steps) == 3
    for wave, tag in ((wave1, "w1"), (wave2, "w2")):
        for i, (name, prompt) in enumerate(wave):
            assert done[f"{tag}-{i}"][0] == greedy(refs[name], prompt, NEW), (tag, i, name)


def test_two_adapters_never_share_a_block(llama_base, llama_adapters):
    cfg = EngineConfig(model=str(llama_base), enable_lora=True, max_loras=2, max_lora_rank=16,
                       dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
                       enable_prefix_caching=True, enable_kv_events=True)
    engine = LLMEngine(cfg)
    a = LoRARequest("all", 1, str(llama_adapters["all"]))
    b = LoRARequest("o-down", 2, str(llama_adapters["o-down"]))
    prompt = _prompts(9, (17,))[0]            # 4 full blocks

    def run(rid, lora):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1),
                           lora_request=lora)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    return out.num_cached_tokens

    assert run("a1", a) == 0
    assert run("b1", b) == 0                  # another adapter: no hit on a's blocks
    assert run("base", None) == 0             # nor the base model
    assert run("a2", a) == 16                 # the same adapter hits all of its 4 blocks
    stored = [e for e in engine.kv_manager.take_events() if type(e).__name__ == "BlockStored"]
    by_lora = {}
    for e in stored:
        by_lora.setdefault((e.lora_id, e.lora_name), set()).update(e.block_hashes)
    assert set(by_lora) == {(1, "all"), (2, "o-down"), (None, None)}
    assert [len(v) for v in by_lora.values()] == [4, 4, 4]
    a_h, b_h, base_h = by_lora.values()
    assert not (a_h & b_h) and not (a_h & base_h) and not (b_h & base_h)


def test_a_step_pays_only_for_the_sites_its_adapters_touch(llama_base, llama_adapters, monkeypatch):
    from kvmesh.kernels import cpu_kernels, lora_cpu, lora_ops
    llm = LLM(str(llama_base), enable_lora=True, max_lora_rank=16, dtype="float32", device="cpu",
              num_kv_blocks=32, block_size=4)
    calls = []
    for module in (lora_ops, lora_cpu):       # the torch path and the C++ kernel alike
        real = module.sgmv_add
        monkeypatch.setattr(module, "sgmv_add",
                            lambda *a, real=real, m=module: calls.append((m, a[1].shape)) or real(*a))
    llm.generate([[5, 6, 7]], GREEDY)
    assert calls == []                                        # base only: no LoRA kernel at all
    llm.generate([[5, 6, 7]], GREEDY,
                 lora_request=LoRARequest("od", 1, str(llama_adapters["o-down"])))
    # 8 forwards x 2 layers x the o_proj and down_proj sites (q/k/v and gate/up: untouched), each
    # one call of the C++ kernel where it builds (the torch path only without it)
    kernel = lora_cpu if cpu_kernels.load() is not None else lora_ops
    assert calls == [(kernel, (1, 16, 64)), (kernel, (1, 16, 96))] * 2 * NEW


def test_prompt_lookup_speculation_with_adapters_stays_each_adapters_greedy_output(llama_base, llama_adapters):
    """--speculative-config ngram beside --enable-lora: a verified run goes through the adapter's
    sites like any other rows of its sequence, so each request (two adapters and the base, in one
    engine) still gets its own peft-merged reference, drafts both accepted and rejected."""
    names = sorted(llama_adapters)[:2]
    loras = {name: LoRARequest(name, i + 1, str(llama_adapters[name])) for i, name in enumerate(names)}
    loop = _prompts(11, (5,))[0]
    prompts = [loop * 4, _prompts(12, (6,))[0] * 3, loop * 3 + [7]]     # repeats: lookup proposes
    which = [names[0], names[1], None]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [greedy(merged(llama_base, llama_adapters[n] if n else None), p, 12) for n, p in zip(which, prompts)]
    cfg = EngineConfig(model=str(llama_base), enable_lora=True, max_loras=2, max_lora_rank=16,
                       dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
                       max_model_len=64, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    engine = LLMEngine(cfg)
    for i, (name, prompt) in enumerate(zip(which, prompts)):
        engine.add_request(f"r{i}", prompt, params, lora_request=loras.get(name))
    got, drafts, accepted = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        drafts += engine.last_stats.spec_num_draft_tokens
        accepted += engine.last_stats.spec_num_accepted_tokens
        engine.kv_manager.check_invariants(engine.scheduler.requests.keys())
    assert [got[f"r{i}"] for i in range(3)] == want
    assert 0 < accepted < drafts, (accepted, drafts)
