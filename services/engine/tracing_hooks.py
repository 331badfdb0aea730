"""EngineTracer: one span per engine step, a span tree per request, links between the two.

An `EngineObserver` (observers.py), attached only when tracing is on: the engine hands it each
step's `StepReport` (with the step's phase timestamps) and every add / abort. Everything here
runs on the engine's thread; spans are handed to the provider's span processor, which exports
them in the background.

    kvmesh.step                      one per step; attributes = the step's SchedulerStats
      kvmesh.step.schedule           Scheduler.schedule()
      kvmesh.step.execute            ModelRunner.execute(): block moves, forward pass, sampling
        kvmesh.step.sample           the sampler
      kvmesh.step.postprocess        new tokens, stop checks, detokenization

    <HTTP server span>               (services/api/app.py; honours an incoming traceparent)
      kvmesh.request                 arrival -> finish; GenAI attributes; events preempted / swapped_in
        kvmesh.queue                 arrival -> first scheduled
        kvmesh.kv_transfer           P/D consumer: the read of its prompt KV from a prefill engine
        kvmesh.prefill               one per prefill chunk (recomputes too); links to its step
        kvmesh.decode                first token -> finish; links to the steps that decoded it

NOTE: request spans outlive many steps, so they are built from timestamps with explicit
start / end times rather than context managers. Monotonic engine times are mapped to wall-clock
nanoseconds with one offset taken when the tracer is made.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, Tracer

from kvmesh.common.tracing import OPERATION_KEY
from kvmesh.engine.observers import EngineObserver, StepReport
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sched_output import SchedulerStats

if TYPE_CHECKING:
    from kvmesh.engine.engine import LLMEngine

STEP_PREFIX = "kvmesh.sched."      # step span attribute = STEP_PREFIX + SchedulerStats field
_ROOT = otel_context.Context()     # step spans start their own trace


def step_attributes(stats: SchedulerStats) -> dict[str, object]:
    """The step span's attributes: every SchedulerStats field, prefixed; with speculative
    decoding also the step's acceptance rate (accepted / draft tokens)."""
    attrs = {STEP_PREFIX + k: v for k, v in asdict(stats).items()}
    if stats.spec_num_draft_tokens:
        attrs["kvmesh.spec_decode.acceptance_rate"] = (stats.spec_num_accepted_tokens
                                                       / stats.spec_num_draft_tokens)
    return attrs


@dataclass(slots=True)
class _RequestTrace:
    """The open spans and bookkeeping of one user request (all its n samples)."""
    span: Span                                 # kvmesh.request, ended at finish
    ctx: otel_context.Context                  # parent context of its children
    samples: list[Request]
    arrival_ns: int
    queued: bool = True                        # the queue span is not emitted yet
    num_chunks: int = 0                        # prefill chunks so far (recomputes included)
    num_decode_steps: int = 0
    last_decode_step: int = -1                 # n > 1: samples decoded in one step count once
    decode_links: list[SpanContext] = field(default_factory=list)   # the first max_links - 1
    last_decode_link: SpanContext | None = None
    swapped: set[str] = field(default_factory=set)   # sample ids preempted by swap, not back yet


class EngineTracer(EngineObserver):
    def __init__(self, tracer: Tracer, model_name: str, max_links: int = 16) -> None:
        assert max_links >= 2, "max_links keeps the first max_links - 1 and the last"
        self.tracer = tracer
        self.model_name = model_name
        self.max_links = max_links
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._requests: dict[str, _RequestTrace] = {}      # user request id -> trace
        self._samples: dict[str, _RequestTrace] = {}       # sample request id -> trace
        # --kv-transfer-config: reads finished on the loader thread, spanned on the next step
        self._transfers: deque = deque(maxlen=1024)

    # ---- wiring --------------------------------------------------------------------------
    def attach(self, engine: LLMEngine) -> EngineTracer:
        engine.add_observer(self)
        if getattr(engine, "kv_transfer", None) is not None:
            engine.kv_transfer.transfer_listeners.append(self._transfers.append)
        return self

    def detach(self, engine: LLMEngine) -> None:
        engine.remove_observer(self)
        if getattr(engine, "kv_transfer", None) is not None:
            engine.kv_transfer.transfer_listeners.remove(self._transfers.append)

    def now_ns(self) -> int:
        return time.monotonic_ns() + self._offset_ns

    def _wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    # ---- requests ------------------------------------------------------------------------
    def on_request_added(self, request_id: str, samples: Sequence[Request],
                         parent: otel_context.Context | None = None) -> None:
        first = samples[0]
        p = first.sampling_params
        attrs: dict[str, object] = {
            "gen_ai.operation.name": operation_name(parent),
            "gen_ai.provider.name": "kvmesh",
            "gen_ai.request.model": self.model_name,
            "gen_ai.request.temperature": float(p.temperature),
            "gen_ai.request.top_p": float(p.top_p),
            "gen_ai.request.choice.count": p.n,
            "gen_ai.response.id": request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.usage.input_tokens": first.num_prompt_tokens,
            "kvmesh.request_id": request_id,
            "kvmesh.priority": first.priority,
        }
        if p.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = p.max_tokens
        if p.top_k > 0:
            attrs["gen_ai.request.top_k"] = float(p.top_k)
        if p.seed is not None:
            attrs["gen_ai.request.seed"] = p.seed
        arrival = self._wall_ns(first.arrival_time)
        span = self.tracer.start_span("kvmesh.request", context=parent, start_time=arrival,
                                      attributes=attrs)
        rt = _RequestTrace(span, trace.set_span_in_context(span), list(samples), arrival)
        self._requests[request_id] = rt
        for s in samples:
            self._samples[s.request_id] = rt

    def on_request_aborted(self, request_id: str) -> None:
        rt = self._requests.get(request_id)
        if rt is not None:
            self._finish(request_id, rt, self.now_ns())

    # ---- the step ------------------------------------------------------------------------
    def on_step(self, report: StepReport) -> None:
        sched, outputs = report.sched, report.outputs
        t_start, t_sched = self._wall_ns(report.t_start), self._wall_ns(report.t_scheduled)
        end = self._wall_ns(report.t_end)
        step_ctx = self._emit_step(sched.stats, report)
        step = sched.stats.step
        while self._transfers:
            self._emit_transfer(self._transfers.popleft())
        for sr in sched.scheduled:
            req = sr.request
            rt = self._samples.get(req.request_id)
            if rt is None:
                continue                          # added before the tracer was attached
            if rt.queued:
                rt.queued = False
                first_sched = req.first_scheduled_time
                q_end = self._wall_ns(first_sched) if first_sched is not None else t_start
                self.tracer.start_span("kvmesh.queue", context=rt.ctx,
                                       start_time=rt.arrival_ns).end(end_time=max(q_end, rt.arrival_ns))
            if req.request_id in rt.swapped:
                rt.swapped.discard(req.request_id)
                rt.span.add_event("swapped_in", {"kvmesh.step": step,
                                                 "kvmesh.sample_index": req.sample_index},
                                  timestamp=t_start)
            if sr.is_decode:
                if rt.last_decode_step != step:
                    rt.last_decode_step = step
                    rt.num_decode_steps += 1
                    if len(rt.decode_links) < self.max_links - 1:
                        rt.decode_links.append(step_ctx)
                    else:
                        rt.last_decode_link = step_ctx
                continue
            rt.num_chunks += 1
            self.tracer.start_span(
                "kvmesh.prefill", context=rt.ctx, start_time=t_sched,
                links=[Link(step_ctx)],
                attributes={"kvmesh.step": step, "kvmesh.prefill.chunk": rt.num_chunks - 1,
                            "kvmesh.prefill.start_token": sr.start,
                            "kvmesh.prefill.num_tokens": sr.num_tokens,
                            "kvmesh.prefill.last_chunk": sr.sample,
                            "kvmesh.recompute": req.num_preemptions > 0,
                            "kvmesh.sample_index": req.sample_index},
            ).end(end_time=end)
        for rid in sched.preempted_ids:
            rt = self._samples.get(rid)
            if rt is None:
                continue
            req = next(s for s in rt.samples if s.request_id == rid)
            swapped = req.status == RequestStatus.SWAPPED
            if swapped:
                rt.swapped.add(rid)
            rt.span.add_event("preempted", {"kvmesh.preemption.mode": "swap" if swapped else "recompute",
                                            "kvmesh.step": step,
                                            "kvmesh.sample_index": req.sample_index},
                              timestamp=t_start)
        for out in outputs:
            if out.finished:
                rt = self._requests.get(out.request_id)
                if rt is not None:
                    self._finish(out.request_id, rt, end)

    def _emit_step(self, stats: SchedulerStats, report: StepReport) -> SpanContext:
        tr, wall = self.tracer, self._wall_ns
        t_start, t_sched = wall(report.t_start), wall(report.t_scheduled)
        t_exec, end = wall(report.t_executed), wall(report.t_end)
        span = tr.start_span("kvmesh.step", context=_ROOT, start_time=t_start,
                             attributes=step_attributes(stats))
        ctx = trace.set_span_in_context(span)
        tr.start_span("kvmesh.step.schedule", context=ctx,
                      start_time=t_start).end(end_time=t_sched)
        execute = tr.start_span("kvmesh.step.execute", context=ctx, start_time=t_sched)
        if report.sample_window is not None:
            s0, s1 = report.sample_window
            tr.start_span("kvmesh.step.sample", context=trace.set_span_in_context(execute),
                          start_time=wall(s0)).end(end_time=wall(s1))
        execute.end(end_time=t_exec)
        tr.start_span("kvmesh.step.postprocess", context=ctx,
                      start_time=t_exec).end(end_time=end)
        span.end(end_time=end)
        return span.get_span_context()

    # ---- finish --------------------------------------------------------------------------
    def _emit_transfer(self, t) -> None:
        """One kvmesh.kv_transfer span (a kv_transfer.loader.Transfer) under its request."""
        rt = self._samples.get(t.request_id)
        if rt is None:
            return                                      # finished or aborted meanwhile
        start = int(t.start * 1e9)
        attrs: dict[str, object] = {"kvmesh.kv_transfer.transfer_id": t.transfer_id,
                                    "kvmesh.kv_transfer.ok": t.ok,
                                    "kvmesh.kv_transfer.num_blocks": t.num_blocks,
                                    "kvmesh.kv_transfer.bytes": t.num_bytes}
        if t.error:
            attrs["kvmesh.kv_transfer.error"] = t.error
        self.tracer.start_span("kvmesh.kv_transfer", context=rt.ctx, start_time=start,
                               attributes=attrs).end(end_time=start + int(t.seconds * 1e9))

    def _finish(self, request_id: str, rt: _RequestTrace, end: int) -> None:
        del self._requests[request_id]
        for s in rt.samples:
            self._samples.pop(s.request_id, None)
        if rt.queued:                                   # aborted before it was ever scheduled
            self.tracer.start_span("kvmesh.queue", context=rt.ctx,
                                   start_time=rt.arrival_ns).end(end_time=max(end, rt.arrival_ns))
        first_tokens = [s.first_token_time for s in rt.samples if s.first_token_time is not None]
        if rt.num_decode_steps:
            links = list(rt.decode_links)
            if rt.last_decode_link is not None:
                links.append(rt.last_decode_link)
            start = self._wall_ns(min(first_tokens)) if first_tokens else rt.arrival_ns
            self.tracer.start_span(
                "kvmesh.decode", context=rt.ctx, start_time=start,
                links=[Link(c) for c in links],
                attributes={"kvmesh.decode.num_steps": rt.num_decode_steps,
                            "kvmesh.decode.num_links": len(links)},
            ).end(end_time=max(end, start))
        first = rt.samples[0]
        reasons = [s.finish_reason or "abort" for s in rt.samples]
        attrs: dict[str, object] = {
            "gen_ai.response.finish_reasons": reasons,
            "gen_ai.usage.output_tokens": sum(s.num_output_tokens for s in rt.samples),
            "kvmesh.cached_tokens": max(first.num_cached_tokens, 0),
            "gen_ai.usage.cache_read.input_tokens": max(first.num_cached_tokens, 0),
            "kvmesh.num_preemptions": sum(s.num_preemptions for s in rt.samples),
            "kvmesh.num_prefill_chunks": rt.num_chunks,
        }
        if first_tokens:
            attrs["kvmesh.ttft_s"] = min(first_tokens) - first.arrival_time
        if first.first_scheduled_time is not None:
            attrs["kvmesh.queue_s"] = first.first_scheduled_time - first.arrival_time
        rt.span.set_attributes(attrs)
        rt.span.end(end_time=end)


def operation_name(parent: otel_context.Context | None) -> str:
    """The GenAI operation the server named in the request's context (offline: a completion)."""
    op = otel_context.get_value(OPERATION_KEY, parent) if parent is not None else None
    return op if isinstance(op, str) else "text_completion"
