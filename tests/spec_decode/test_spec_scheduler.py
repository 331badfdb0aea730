"""The scheduler's side of speculative decoding, with a real KVCacheManager and exact block ids:
drafts count in the token budget, get KV slots in the step, roll back when rejected, never
preempt anyone, and only committed tokens are ever hashed and published."""
from __future__ import annotations

from kvmesh.common.config import EngineConfig
from kvmesh.common.kv_events import BlockStored
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import ModelRunnerOutput
from kvmesh.engine.scheduler import Scheduler

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2}


def _setup(num_blocks=16, budget=None, spec=SPEC):
    cfg = EngineConfig(block_size=4, num_kv_blocks=num_blocks, max_model_len=64,
                       max_num_batched_tokens=budget, speculative_config=spec)
    kv = KVCacheManager(num_blocks, 4, enable_caching=True, enable_events=True)
    return Scheduler(cfg, kv, 64, 1024), kv


def _add(sched, rid, prompt, max_tokens=20):
    req = Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), 0.0,
                  eos_token_ids=(2,), max_model_len=64)
    sched.add_request(req)
    return req


def _step(sched, sampled=None, spec=None):
    out = sched.schedule()
    result = ModelRunnerOutput(sampled=sampled or {}, logprobs={}, spec_tokens=spec or {})
    sched.update_from_output(out, result)
    sched.end_step(out)
    return out


def _stored(kv):
    return [(e.token_ids) for e in kv.take_events() if isinstance(e, BlockStored)]


def test_a_decode_schedules_its_drafts_with_slots_and_rolls_back_the_rejected():
    sched, kv = _setup()
    req = _add(sched, "r", [5, 6, 7, 5, 6])
    out = _step(sched, sampled={"r": [7]})                     # the prefill; block 0 is full
    assert out.scheduled[0].spec_token_ids == ()
    assert _stored(kv) == [[5, 6, 7, 5]]
    # tokens 5 6 7 5 6 7: the 2-gram "6 7" occurred at 1, so the drafts are 5 6 7
    out = sched.schedule()
    sr = out.scheduled[0]
    assert (sr.start, sr.num_tokens, list(sr.spec_token_ids)) == (5, 4, [5, 6, 7])
    assert sr.sample and sr.is_decode
    assert sr.block_ids == [0, 1, 2]                           # positions 5..8: a third block
    assert out.stats.num_scheduled_tokens == 4 and out.stats.num_decode_reqs == 1
    assert req.num_computed_tokens == 9
    # the target accepts draft 5, rejects 6 and samples 9 instead
    sched.update_from_output(out, ModelRunnerOutput({}, {}, spec_tokens={"r": [5, 9]}))
    sched.end_step(out)
    assert req.output_token_ids == [7, 5, 9]
    assert req.num_computed_tokens == 7                        # 9 known, the last not computed
    assert (out.stats.spec_num_drafts, out.stats.spec_num_draft_tokens,
            out.stats.spec_num_accepted_tokens, out.stats.spec_num_accepted_per_pos) == \
        (1, 3, 1, (1, 0, 0))
    assert _stored(kv) == []
    # "9" never occurred before: no drafts; block 1 now full of committed tokens 6 7 5 9
    out = _step(sched, sampled={"r": [11]})
    sr = out.scheduled[0]
    assert (sr.start, sr.num_tokens, sr.spec_token_ids) == (7, 1, ())
    assert sr.block_ids == [0, 1, 2]                           # the rejected draft's block, reused
    assert _stored(kv) == [[6, 7, 5, 9]]                       # never 6 7 5 6
    kv.check_invariants(["r"])


def test_the_token_budget_counts_and_caps_the_drafts():
    sched, kv = _setup(budget=2)
    req = _add(sched, "q", [5, 6, 5])
    out = _step(sched)                                         # prompt chunk 5 6 (no sample)
    assert out.scheduled[0].num_tokens == 2 and not out.scheduled[0].sample
    # the last prompt token is a decode: "5" occurred at 0, so the drafts would be 6 5 ...,
    # capped at 1 by the budget left after the token itself
    out = sched.schedule()
    sr = out.scheduled[0]
    assert (sr.start, sr.num_tokens, list(sr.spec_token_ids)) == (2, 2, [6])
    assert out.stats.num_scheduled_tokens == 2 == out.stats.token_budget
    assert req.num_computed_tokens == 4


def test_drafts_never_preempt_another_request():
    # 3 blocks of 4: "a" holds 2 (6 tokens + room), "b" holds 1; a's drafts would need a 3rd
    sched, kv = _setup(num_blocks=3)
    a = _add(sched, "a", [5, 6, 7, 5, 6, 7])
    b = _add(sched, "b", [8, 9])
    _step(sched, sampled={"a": [5], "b": [9]})
    assert kv.num_free_blocks == 0
    out = sched.schedule()
    by_id = {sr.request.request_id: sr for sr in out.scheduled}
    assert by_id["a"].spec_token_ids == () and by_id["a"].num_tokens == 1
    assert out.stats.num_preempted == 0
    assert a.status.name == b.status.name == "RUNNING"


def test_speculation_stops_short_of_max_tokens():
    sched, kv = _setup()
    req = _add(sched, "r", [5, 6, 7, 5, 6], max_tokens=3)
    _step(sched, sampled={"r": [7]})
    out = sched.schedule()                     # 1 output, max 3: at most 1 draft (2 tokens)
    assert list(out.scheduled[0].spec_token_ids) == [5]
    assert req.num_computed_tokens == 7
