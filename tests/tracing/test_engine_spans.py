"""A real engine in a scripted scenario (chunked prefill, prefix hit, preemption): one span per
step whose attributes are the step's SchedulerStats, and the request span trees and links."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from kvmesh.common.config import EngineConfig
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.common.tracing import extract_context, get_tracer, init_tracing, shutdown_tracing
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.tracing_hooks import STEP_PREFIX, EngineTracer

from .conftest import by_name, children

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
PREFIX = [100 + i for i in range(20)]          # shared by A and B: 5 full blocks of 4
MAX_LINKS = 4


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _run(engine: LLMEngine, stats: list[dict]) -> None:
    while engine.has_unfinished_requests():
        engine.step()
        stats.append(asdict(engine.last_stats))


@pytest.fixture(scope="module", params=["recompute", "swap"])
def scenario(request, smollm):
    """Runs once per preemption mode; returns (mode, engine, per-step stats, finished spans)."""
    mode = request.param
    exporter = InMemorySpanExporter()
    init_tracing(exporter=exporter, simple=True)
    # 8 blocks of 4 tokens, a 16-token budget: a 24-token prompt is chunked; two 8-token
    # prompts decoding 12 tokens each (5 blocks each) cannot both fit and one is preempted.
    config = EngineConfig(block_size=4, num_kv_blocks=8, max_model_len=32,
                          max_num_batched_tokens=16, enable_prefix_caching=True,
                          preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    engine = LLMEngine(config, loaded=smollm)
    EngineTracer(get_tracer(), engine.model_name, max_links=MAX_LINKS).attach(engine)
    stats: list[dict] = []
    parent = extract_context({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    try:
        engine.add_request("A", PREFIX + [300, 301, 302, 303], _params(3), trace_context=parent)
        _run(engine, stats)
        engine.add_request("B", PREFIX + [400, 401, 402, 403], _params(2))
        _run(engine, stats)
        engine.add_request("C", [500 + i for i in range(8)], _params(12))
        engine.add_request("D", [600 + i for i in range(8)], _params(12))
        _run(engine, stats)
    finally:
        shutdown_tracing()
    return mode, engine, stats, exporter.get_finished_spans()


def _request_span(spans, rid: str):
    (span,) = [s for s in by_name(spans, "kvmesh.request") if s.attributes["kvmesh.request_id"] == rid]
    return span


def test_scenario_exercises_chunking_prefix_hits_and_preemption(scenario):
    mode, _, stats, _ = scenario
    assert any(s["num_chunked_prefills"] for s in stats)
    assert any(s["prefix_hit_tokens"] == 20 for s in stats)
    assert any(s[f"num_preempted_{mode}"] for s in stats)
    if mode == "swap":
        assert any(s["num_swapped_in"] for s in stats)


_KEYS = ("num_scheduled_tokens", "num_prefill_reqs", "num_decode_reqs", "num_chunked_prefills",
         "num_preempted", "num_swapped_in", "num_swapped_out", "blocks_allocated", "blocks_freed",
         "blocks_evicted", "prefix_query_tokens", "prefix_hit_tokens", "kv_usage", "num_running",
         "num_waiting", "num_swapped")
# Worked out by hand from the scenario (8 blocks of 4 tokens, a 16-token budget):
_EXPECTED = {
    1: (16, 1, 0, 1, 0, 0, 0, 4, 0, 0, 24, 0, 0.5, 1, 0, 0),    # A's first chunk: 4 blocks
    2: (8, 1, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0.75, 1, 0, 0),     # the rest of A's 24 tokens
    3: (1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0.875, 1, 0, 0),    # token 25 opens block 7
    4: (1, 0, 1, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0.875, 1, 0, 0),    # A's 3rd token: 7 blocks freed
    5: (4, 1, 0, 0, 0, 0, 0, 1, 0, 0, 24, 20, 0.75, 1, 0, 0),   # B hits the 5 prefix blocks
    6: (1, 0, 1, 0, 0, 0, 0, 1, 7, 0, 0, 0, 0.875, 1, 0, 0),
    7: (16, 2, 0, 0, 0, 0, 0, 4, 0, 3, 16, 0, 0.5, 2, 0, 0),    # C, D: 1 free + 3 evicted
    8: (2, 0, 2, 0, 0, 0, 0, 2, 0, 2, 0, 0, 0.75, 2, 0, 0),
    12: (2, 0, 2, 0, 0, 0, 0, 2, 0, 2, 0, 0, 1.0, 2, 0, 0),     # the cache is full
}
_PREEMPTION_STEP = {   # token 17 of C needs a 5th block: D (the latest arrival) is preempted
    "recompute": (1, 0, 1, 0, 1, 0, 0, 1, 4, 1, 0, 0, 0.625, 1, 1, 0),
    "swap": (1, 0, 1, 0, 1, 0, 1, 1, 4, 1, 0, 0, 0.625, 1, 0, 1),
}


def test_step_stats_are_the_decisions_worked_out_by_hand(scenario):
    mode, _, stats, _ = scenario
    got = {s["step"]: tuple(s[k] for k in _KEYS) for s in stats}
    assert {n: got[n] for n in _EXPECTED} == _EXPECTED
    assert got[16] == _PREEMPTION_STEP[mode]
    assert all(s["token_budget"] == 16 and s["policy"] == "fcfs" for s in stats)


def test_one_step_span_per_step_with_the_schedulers_decisions(scenario):
    _, engine, stats, spans = scenario
    steps = sorted(by_name(spans, "kvmesh.step"), key=lambda s: s.attributes[STEP_PREFIX + "step"])
    assert len(steps) == engine.num_steps == len(stats)
    got = [{k[len(STEP_PREFIX):]: v for k, v in s.attributes.items()} for s in steps]
    assert got == stats
    for s in steps:
        assert s.parent is None                     # every step is its own trace


def test_step_child_spans(scenario):
    _, _, stats, spans = scenario
    for step in by_name(spans, "kvmesh.step"):
        kids = children(spans, step)
        assert sorted(k.name for k in kids) == ["kvmesh.step.execute", "kvmesh.step.postprocess",
                                                "kvmesh.step.schedule"]
        for k in kids:
            assert step.start_time <= k.start_time <= k.end_time <= step.end_time
        (execute,) = [k for k in kids if k.name == "kvmesh.step.execute"]
        sample = children(spans, execute)
        assert [k.name for k in sample] == ([] if not _samples(step) else ["kvmesh.step.sample"])
        if sample:
            assert execute.start_time <= sample[0].start_time <= sample[0].end_time <= execute.end_time


def _samples(step) -> bool:
    a = step.attributes
    # a step samples unless every scheduled request was a chunk cut short by the budget
    return a[STEP_PREFIX + "num_decode_reqs"] + a[STEP_PREFIX + "num_prefill_reqs"] > \
        a[STEP_PREFIX + "num_chunked_prefills"]


def test_request_tree_attributes_and_incoming_parent(scenario):
    _, engine, _, spans = scenario
    a = _request_span(spans, "A")
    assert f"{a.context.trace_id:032x}" == TRACE_ID
    assert f"{a.parent.span_id:016x}" == PARENT_ID
    assert a.attributes["gen_ai.request.model"] == engine.model_name
    assert a.attributes["gen_ai.request.max_tokens"] == 3
    assert a.attributes["gen_ai.request.temperature"] == 0.0
    assert a.attributes["gen_ai.request.top_p"] == 1.0
    assert a.attributes["gen_ai.usage.input_tokens"] == 24
    assert a.attributes["gen_ai.usage.output_tokens"] == 3
    assert a.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert a.attributes["kvmesh.ttft_s"] > 0
    assert a.attributes["kvmesh.cached_tokens"] == 0
    assert a.attributes["kvmesh.num_preemptions"] == 0
    kids = sorted(children(spans, a), key=lambda s: s.start_time)
    assert [k.name for k in kids] == ["kvmesh.queue", "kvmesh.prefill", "kvmesh.prefill",
                                      "kvmesh.decode"]
    for k in kids:
        assert k.context.trace_id == a.context.trace_id
        assert a.start_time <= k.start_time <= k.end_time <= a.end_time
    assert [(k.attributes["kvmesh.prefill.start_token"], k.attributes["kvmesh.prefill.num_tokens"],
             k.attributes["kvmesh.prefill.last_chunk"]) for k in kids[1:3]] == \
        [(0, 16, False), (16, 8, True)]
    assert kids[0].end_time <= kids[1].start_time          # queue ends before the first chunk

    b = _request_span(spans, "B")
    assert b.parent is None
    assert b.attributes["kvmesh.cached_tokens"] == 20
    assert b.attributes["gen_ai.usage.cache_read.input_tokens"] == 20
    (prefill,) = by_name(children(spans, b), "kvmesh.prefill")
    assert (prefill.attributes["kvmesh.prefill.start_token"],
            prefill.attributes["kvmesh.prefill.num_tokens"]) == (20, 4)


def test_links_to_the_steps_that_served_each_request(scenario):
    _, _, _, spans = scenario
    steps = {s.context.span_id: s for s in by_name(spans, "kvmesh.step")}
    for rid in "ABCD":
        req = _request_span(spans, rid)
        kids = children(spans, req)
        for p in by_name(kids, "kvmesh.prefill"):
            (link,) = p.links
            step = steps[link.context.span_id]
            assert step.attributes[STEP_PREFIX + "step"] == p.attributes["kvmesh.step"]
            assert step.attributes[STEP_PREFIX + "num_prefill_reqs"] >= 1
        (decode,) = by_name(kids, "kvmesh.decode")
        n = decode.attributes["kvmesh.decode.num_steps"]
        linked = [steps[link.context.span_id] for link in decode.links]
        assert len(linked) == min(n, MAX_LINKS) == decode.attributes["kvmesh.decode.num_links"]
        nums = [s.attributes[STEP_PREFIX + "step"] for s in linked]
        assert nums == sorted(set(nums))
        assert all(s.attributes[STEP_PREFIX + "num_decode_reqs"] >= 1 for s in linked)
        assert linked[-1].end_time == decode.end_time       # the last link: the finishing step
        if rid in "AB":
            assert n == req.attributes["gen_ai.usage.output_tokens"] - 1
    c = by_name(children(spans, _request_span(spans, "C")), "kvmesh.decode")[0]
    assert c.attributes["kvmesh.decode.num_steps"] > MAX_LINKS    # the cap was exercised


def test_preemption_and_swap_events(scenario):
    mode, _, stats, spans = scenario
    preempted = [(e.attributes["kvmesh.step"], e.attributes["kvmesh.preemption.mode"])
                 for r in by_name(spans, "kvmesh.request") for e in r.events if e.name == "preempted"]
    expected = [(s["step"], mode) for s in stats for _ in range(s["num_preempted"])]
    assert sorted(preempted) == expected
    victims = [r for r in by_name(spans, "kvmesh.request")
               if any(e.name == "preempted" for e in r.events)]
    for r in victims:
        assert r.attributes["kvmesh.num_preemptions"] == \
            sum(e.name == "preempted" for e in r.events)
    swapped_in = [e.attributes["kvmesh.step"] for r in by_name(spans, "kvmesh.request")
                  for e in r.events if e.name == "swapped_in"]
    assert sorted(swapped_in) == [s["step"] for s in stats for _ in range(s["num_swapped_in"])]
    if mode == "recompute":
        recomputes = [p for r in victims for p in by_name(children(spans, r), "kvmesh.prefill")
                      if p.attributes["kvmesh.recompute"]]
        assert recomputes          # (the prefix cache may serve part of a recompute)


def test_abort_ends_the_request_tree(smollm, spans_exporter):
    engine = LLMEngine(EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=64),
                       loaded=smollm)
    EngineTracer(get_tracer(), engine.model_name).attach(engine)
    engine.add_request("q", [5, 6, 7], _params(8))
    engine.abort_request("q")                           # never scheduled
    engine.add_request("r", [5, 6, 7, 8], _params(8))
    engine.step()
    engine.step()
    engine.abort_request("r")
    assert not engine.has_unfinished_requests()
    spans = spans_exporter.get_finished_spans()
    q, r = _request_span(spans, "q"), _request_span(spans, "r")
    assert q.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert [k.name for k in children(spans, q)] == ["kvmesh.queue"]
    assert r.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert sorted(k.name for k in children(spans, r)) == ["kvmesh.decode", "kvmesh.prefill",
                                                           "kvmesh.queue"]


def test_detached_engine_emits_nothing(smollm, spans_exporter):
    engine = LLMEngine(EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=64),
                       loaded=smollm)
    tracer = EngineTracer(get_tracer(), engine.model_name).attach(engine)
    tracer.detach(engine)
    assert tracer not in engine.observers and not hasattr(engine.runner.sampler, "inner")
    engine.add_request("x", [5, 6, 7], _params(2))
    while engine.has_unfinished_requests():
        engine.step()
    assert spans_exporter.get_finished_spans() == ()
