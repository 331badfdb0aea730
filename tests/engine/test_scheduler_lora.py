"""The scheduler under --max-loras: at most that many distinct adapters run at once, a request
for a new adapter waits without blocking requests for the running ones behind it."""
from __future__ import annotations

from kvmesh.engine.lora import LoRARequest
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams

A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")
C = LoRARequest("c", 3, "/adapters/c")


def _add(h, rid: str, lora: LoRARequest | None, max_tokens: int = 3) -> Request:
    req = Request(rid, [100 + i for i in range(5)], SamplingParams(max_tokens=max_tokens),
                  h.clock.t, eos_token_ids=(h.EOS,), max_model_len=h.sched.max_model_len,
                  parent_id=rid, lora_request=lora)
    h.sched.add_request(req)
    return req


def _running(out) -> list[tuple[str, str | None]]:
    return [(sr.request.request_id, sr.request.lora_name) for sr in out.scheduled]


def test_a_step_runs_at_most_max_loras_adapters_and_others_are_not_starved(harness):
    h = harness(enable_lora=True, max_loras=2)
    _add(h, "a1", A)
    _add(h, "b1", B)
    _add(h, "c1", C, max_tokens=1)     # a third adapter: waits ...
    _add(h, "a2", A)                   # ... but does not block a loaded adapter behind it
    _add(h, "base", None)
    assert _running(h.step()) == [("a1", "a"), ("b1", "b"), ("a2", "a"), ("base", None)]
    assert [r.request_id for r in h.sched.waiting] == ["c1"]
    h.step()
    out = h.step()                     # the last decode of a1, b1, a2: c1 still waits
    assert ("c1", "c") not in _running(out)
    out = h.step()                     # a and b finished: c gets a slot
    assert _running(out) == [("c1", "c")]
    h.run_to_completion()


def test_base_requests_never_wait_for_adapter_slots(harness):
    h = harness(enable_lora=True, max_loras=1)
    _add(h, "a1", A)
    _add(h, "b1", B)
    _add(h, "base", None)
    assert _running(h.step()) == [("a1", "a"), ("base", None)]
    h.run_to_completion()


def test_without_enable_lora_nothing_is_bounded(harness):
    h = harness(max_loras=1)
    _add(h, "a1", A)
    _add(h, "b1", B)
    assert _running(h.step()) == [("a1", "a"), ("b1", "b")]
