"""WAITING_FOR_GRAMMAR (vLLM's WAITING_FOR_FSM): a request whose grammar still compiles is
skipped, not blocking anyone behind it, and admitted at the first step after its compile."""
from __future__ import annotations

from concurrent.futures import Future

from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.structured.request_grammar import RequestGrammar
from kvmesh.engine.structured.spec import StructuredOutputSpec as Spec


def add_constrained(h, rid: str, compiled: Future, n: int = 1) -> Request:
    params = SamplingParams(max_tokens=2, n=n)
    req = Request(rid, [100 + i for i in range(8)], params, h.clock.t, eos_token_ids=(h.EOS,),
                  max_model_len=h.sched.max_model_len, parent_id=rid,
                  grammar=RequestGrammar(Spec.regex("a+"), compiled))
    h.sched.add_request(req)
    for i in range(1, n):
        child = Request(f"{rid}#{i}", req.prompt_token_ids, params, h.clock.t, sample_index=i,
                        eos_token_ids=(h.EOS,), max_model_len=h.sched.max_model_len,
                        parent_id=rid, grammar=RequestGrammar(Spec.regex("a+"), compiled))
        h.sched.add_fork(req, child)
    return req


def scheduled_ids(out) -> list[str]:
    return [sr.request.request_id for sr in out.scheduled]


def test_a_compiling_request_is_skipped_until_its_grammar_is_ready(harness):
    h = harness()
    compiled: Future = Future()
    g = add_constrained(h, "g", compiled)
    h.add(8, rid="plain")
    assert g.status == RequestStatus.WAITING_FOR_GRAMMAR
    assert scheduled_ids(h.step()) == ["plain"]      # not blocked behind the compile
    assert scheduled_ids(h.step()) == ["plain"]
    assert g.status == RequestStatus.WAITING_FOR_GRAMMAR and g in h.sched.waiting
    compiled.set_result(object())
    out = h.step()
    assert scheduled_ids(out) == ["plain", "g"] and g.status == RequestStatus.RUNNING
    h.run_to_completion()
    assert g.finish_reason == "length"


def test_a_failed_compile_is_never_scheduled_and_an_abort_frees_it(harness):
    h = harness()
    compiled: Future = Future()
    g = add_constrained(h, "g", compiled, n=2)
    compiled.set_exception(RuntimeError("broken"))
    assert scheduled_ids(h.step()) == []
    assert g.status == RequestStatus.WAITING_FOR_GRAMMAR
    # NOTE: the engine finishes it (LLMEngine._fail_broken_grammars) through abort_requests
    aborted = h.sched.abort_requests(["g"])
    assert [r.request_id for r in aborted] == ["g#1", "g"]
    assert h.sched.waiting == [] and h.sched.requests == {}
    assert g.finish_reason == "abort"
    h.kv.check_invariants(h.sched.requests.keys())
