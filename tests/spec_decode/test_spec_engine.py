"""Speculative decoding (prompt lookup) in the whole engine: greedy output token-identical to
decoding without it for two families under chunked prefill, prefix hits and both preemption
modes; stops, max_tokens, logprobs and n > 1 inside verified runs."""
from __future__ import annotations

import pytest

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams

from .conftest import PROMPTS, greedy_requests, run_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.mark.parametrize("cfg", [
    {"max_num_batched_tokens": 20, "block_size": 4, "num_kv_blocks": 256},
    {"num_kv_blocks": 14, "max_model_len": 112, "block_size": 8, "preemption_mode": "recompute"},
    {"num_kv_blocks": 14, "max_model_len": 112, "block_size": 8, "preemption_mode": "swap",
     "swap_space": 0.01},
], ids=["chunked-prefix-cache", "recompute", "swap"])
def test_greedy_output_is_token_identical_with_speculation(tiny_family, cfg):
    _, _, loaded = tiny_family
    base = run_engine(LLMEngine(EngineConfig(**cfg), loaded=loaded), greedy_requests())
    spec = run_engine(LLMEngine(EngineConfig(**cfg, speculative_config=NGRAM), loaded=loaded),
                      greedy_requests())
    assert {k: v[0].token_ids for k, v in spec.outputs.items()} == \
        {k: v[0].token_ids for k, v in base.outputs.items()}
    # speculation did happen, and drafts were both accepted and rejected
    assert spec.drafts > 0 and 0 < spec.accepted < spec.draft_tokens, spec
    mode = cfg.get("preemption_mode")
    if mode is None:
        assert spec.cached > 0                   # the shared prefix was served from the cache
    else:
        other = "swap" if mode == "recompute" else "recompute"
        assert getattr(spec, mode) > 0 and getattr(spec, other) == 0, spec


# a forced token: logit_bias +100 outweighs every logit of the tiny model, so greedy output is
# this token whatever the model says, and prompt lookup's acceptance is computable by hand
F, Q = 7, 9


def _forced(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, logit_bias={F: 100.0}, **kw)


@pytest.mark.parametrize("params, n_tokens, finish", [
    (dict(max_tokens=9), 9, "length"),
    (dict(max_tokens=4), 4, "length"),                         # max_tokens inside a run
    (dict(max_tokens=20, stop=["w7 w7 w7"]), 3, "stop"),       # a stop string inside a run
])
def test_stops_inside_a_verified_run_end_the_output_there(tiny_llama, params, n_tokens, finish):
    _, loaded = tiny_llama
    outs = []
    for spec in (None, NGRAM):
        engine = LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=spec), loaded=loaded)
        run = run_engine(engine, [("r", [F] * 8, _forced(**params))])
        outs.append(run.outputs["r"][0])
        if spec:
            assert run.drafts > 0 and run.accepted > 0
            assert max(n for step in run.deltas["r"] for n in step) > 1   # several per delta
    base, spec = outs
    assert spec.token_ids == base.token_ids == [F] * n_tokens
    assert (spec.text, spec.finish_reason, spec.stop_reason) == \
        (base.text, base.finish_reason, base.stop_reason)
    assert spec.finish_reason == finish


def test_logprobs_of_accepted_tokens_match_decoding_without_speculation(tiny_llama):
    _, loaded = tiny_llama
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    reqs = [("a", PROMPTS[0], params), ("b", PROMPTS[3], params)]
    base = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64), loaded=loaded), reqs)
    spec = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=NGRAM),
                                loaded=loaded), reqs)
    assert spec.accepted > 0
    for rid in ("a", "b"):
        b, s = base.outputs[rid][0], spec.outputs[rid][0]
        assert s.token_ids == b.token_ids
        assert len(s.logprobs) == len(b.logprobs) == 16
        for eb, es in zip(b.logprobs, s.logprobs):
            assert list(es) == list(eb)                       # same tokens, same order
            for tok in eb:
                assert es[tok].rank == eb[tok].rank
                assert es[tok].logprob == pytest.approx(eb[tok].logprob, abs=1e-4)


def test_n_samples_speculate_each_and_keep_greedy_output(tiny_llama):
    _, loaded = tiny_llama
    greedy = SamplingParams(temperature=0.0, max_tokens=16, n=2, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, max_tokens=16, n=3, seed=4, ignore_eos=True)
    reqs = [("g", PROMPTS[0], greedy), ("s", PROMPTS[1], sampled)]
    base = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64), loaded=loaded), reqs[:1])
    spec = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=NGRAM),
                                loaded=loaded), reqs)
    assert spec.drafts > 0
    assert [c.token_ids for c in spec.outputs["g"]] == [base.outputs["g"][0].token_ids] * 2
    assert [len(c.token_ids) for c in spec.outputs["s"]] == [16, 16, 16]


def test_speculation_is_off_above_disable_by_batch_size(tiny_llama):
    _, loaded = tiny_llama
    reqs = [(f"q{i}", [F] * 8, _forced(max_tokens=12)) for i in range(3)]
    cfg = dict(NGRAM, disable_by_batch_size=2)
    off = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=cfg),
                               loaded=loaded), reqs)
    assert off.drafts == 0
    on = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=cfg),
                              loaded=loaded), reqs[:2])
    assert on.drafts > 0


def test_a_constrained_request_shares_the_step_with_speculating_ones(tiny_llama):
    """The grammar bitmask still lands on the constrained row when speculating requests add
    rows before it (the constrained request's lookup drafts, F, are all refused by its grammar)."""
    from kvmesh.engine.structured.spec import StructuredOutputSpec
    _, loaded = tiny_llama
    regex = SamplingParams(temperature=0.0, max_tokens=8,
                           structured_outputs=StructuredOutputSpec.regex("(w5|w6)+"))
    reqs = [("spec", [F] * 8, _forced(max_tokens=40)), ("constrained", [F] * 8, regex)]
    base = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64), loaded=loaded), reqs)
    spec = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=NGRAM),
                                loaded=loaded), reqs)
    assert spec.drafts > 0
    assert spec.outputs["spec"][0].token_ids == [F] * 40
    tokens = spec.outputs["constrained"][0].token_ids
    assert tokens == base.outputs["constrained"][0].token_ids
    assert tokens and set(tokens) <= {5, 6, 2}, tokens        # w5, w6 (or EOS at the end)
