"""Greedy outputs of the whole engine are token-for-token those of transformers (float32),
whatever the batch, chunking, prefix caching, preemption mode or policy."""
from __future__ import annotations

import itertools

import pytest

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams

NEW_TOKENS = 20

TEXTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Water boils at",
    "1, 2, 3, 4, 5,",
    "The three primary colours are",
    "Translate to French: I like apples. ->",
    "A haiku about autumn leaves:\n",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. Photosynthesis in plants generally "
    "involves the green pigment chlorophyll and generates oxygen as a by-product. In short,",
    "Q: What is 12 times 12?\nA:",
    "The history of the Roman Empire spans many centuries, from the founding of the city to "
    "the fall of Constantinople. Its legacy includes law, language, architecture and roads. "
    "Historians often divide it into periods: the Kingdom, the Republic and the Empire. The",
    "Dear hiring manager,",
    "Rust and Go are both",
    "x",
]
SYSTEM = ("You are a meticulous assistant for a logistics company. Answer in one short sentence, "
          "cite the relevant policy number when you know it, and never invent tracking numbers. "
          "Policies: 1) refunds within 30 days; 2) express shipping in 2 days; 3) returns free.")
QUESTIONS = ["Can I get a refund after 10 days?", "How fast is express shipping?",
             "Are returns free?", "Where is my parcel?", "Do you ship abroad?",
             "What is policy 2?", "Can I change my address?", "Who pays for returns?",
             "Is there a fee for express?", "Can I return a used item?", "How do I track it?",
             "What if the parcel is damaged?", "Do you deliver on Sundays?",
             "Can I cancel my order?", "Is policy 3 new?", "How long do refunds take?"]


@pytest.fixture(scope="module")
def prompts(smollm):
    tok = smollm.tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    ids.append([tok.bos_token_id or 1])            # a one-token prompt
    return ids


@pytest.fixture(scope="module")
def shared_prefix_prompts(smollm):
    tok = smollm.tokenizer
    return [tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(hf_greedy, prompts, shared_prefix_prompts):
    return {tuple(p): hf_greedy(p, NEW_TOKENS) for p in prompts + shared_prefix_prompts}


def make_engine(smollm, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(**kw), loaded=smollm)


def run_greedy(engine: LLMEngine, prompts, priorities=None, n=1):
    """Add every prompt, step to the end; returns (token lists per prompt and sample, totals)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=n)
    ids = [f"p{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, p, params, priority=priorities[i] if priorities else 0)
    final, totals = {}, dict.fromkeys(
        ("num_preempted_recompute", "num_preempted_swap", "num_swapped_in",
         "num_chunked_prefills", "prefix_hit_tokens", "cow_copies"), 0)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [c.token_ids for c in out.outputs]
        for k in totals:
            totals[k] += getattr(engine.last_stats, k)
        steps += 1
        assert steps < 5000
    engine.kv_manager.check_invariants([])
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks
    return [final[r] for r in ids], totals


def assert_matches(outputs, prompts, expected):
    for i, (samples, p) in enumerate(zip(outputs, prompts)):
        for s in samples:
            assert s == expected[tuple(p)], f"prompt {i} ({len(p)} tokens) diverged from transformers"


def tight_kv(prompts, block_size=16, fraction=3) -> dict:
    """A KV cache a third of what the batch needs: preemptions are certain."""
    need = [-(-(len(p) + NEW_TOKENS) // block_size) for p in prompts]
    blocks = max(max(need) + 1, sum(need) // fraction)
    return {"num_kv_blocks": blocks, "max_model_len": blocks * block_size, "block_size": block_size}


def test_default_engine_matches_transformers(smollm, prompts, expected):
    out, _ = run_greedy(make_engine(smollm), prompts)
    assert_matches(out, prompts, expected)


def test_chunked_prefill_with_a_small_budget_matches(smollm, prompts, expected):
    out, totals = run_greedy(make_engine(smollm, max_num_batched_tokens=24, block_size=8,
                                         num_kv_blocks=512), prompts)
    assert totals["num_chunked_prefills"] > 10
    assert_matches(out, prompts, expected)


def test_chunked_prefill_off_matches(smollm, prompts, expected):
    out, totals = run_greedy(make_engine(smollm, enable_chunked_prefill=False, max_model_len=512,
                                         max_num_batched_tokens=512), prompts)
    assert totals["num_chunked_prefills"] == 0
    assert_matches(out, prompts, expected)


@pytest.mark.parametrize("caching", [True, False])
def test_shared_prefixes_with_and_without_prefix_caching(smollm, shared_prefix_prompts, expected, caching):
    engine = make_engine(smollm, enable_prefix_caching=caching, block_size=8, num_kv_blocks=400)
    first, t1 = run_greedy(engine, shared_prefix_prompts)
    again, t2 = run_greedy(engine, shared_prefix_prompts)   # second round: the cache is warm
    if caching:
        assert t1["prefix_hit_tokens"] > 0 and t2["prefix_hit_tokens"] > t1["prefix_hit_tokens"]
    else:
        assert t1["prefix_hit_tokens"] == t2["prefix_hit_tokens"] == 0
    assert_matches(first, shared_prefix_prompts, expected)
    assert_matches(again, shared_prefix_prompts, expected)


def test_recompute_preemptions_keep_outputs_identical(smollm, prompts, expected):
    engine = make_engine(smollm, preemption_mode="recompute", **tight_kv(prompts))
    out, totals = run_greedy(engine, prompts)
    assert totals["num_preempted_recompute"] > 0 and totals["num_preempted_swap"] == 0
    assert_matches(out, prompts, expected)


def test_swap_preemptions_keep_outputs_identical(smollm, prompts, expected):
    engine = make_engine(smollm, preemption_mode="swap", swap_space=0.5, **tight_kv(prompts))
    out, totals = run_greedy(engine, prompts)
    assert totals["num_preempted_swap"] > 0 and totals["num_swapped_in"] > 0
    assert_matches(out, prompts, expected)


@pytest.mark.parametrize("policy", ["priority", "sjf", "dynamic"])
def test_every_policy_under_memory_pressure_matches(smollm, prompts, expected, policy):
    engine = make_engine(smollm, scheduling_policy=policy, preemption_mode="auto", swap_space=0.5,
                         **tight_kv(prompts))
    priorities = [i % 3 for i in range(len(prompts))]
    out, totals = run_greedy(engine, prompts, priorities=priorities)
    assert totals["num_preempted_recompute"] + totals["num_preempted_swap"] > 0
    assert_matches(out, prompts, expected)


def test_n_samples_share_the_prompt_and_each_matches_greedy(smollm, prompts, expected):
    out, totals = run_greedy(make_engine(smollm, block_size=8), prompts, n=3)
    assert len(prompts) >= 16 and all(len(samples) == 3 for samples in out)
    assert totals["cow_copies"] > 0
    assert_matches(out, prompts, expected)


def test_seeded_sampling_is_reproducible_across_batch_compositions(smollm, prompts):
    engine = make_engine(smollm)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=1234,
                            ignore_eos=True)
    engine.add_request("alone", prompts[3], params)
    alone = _drain(engine)["alone"]
    ids = itertools.count()
    for i, p in enumerate(prompts[:7]):
        other = SamplingParams(temperature=1.0, max_tokens=5 + i, seed=i if i % 2 else None)
        engine.add_request(f"o{next(ids)}", p, other)
    engine.add_request("crowded", prompts[3], params)
    crowded = _drain(engine)["crowded"]
    assert crowded == alone
    engine.add_request("other-seed", prompts[3], SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=99, ignore_eos=True))
    assert _drain(engine)["other-seed"] != alone


def _drain(engine):
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return final
