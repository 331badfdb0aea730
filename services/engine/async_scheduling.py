"""Async scheduling (vLLM's --async-scheduling): which steps must hand their tokens to the host
before the next step is scheduled.

With it on, the engine schedules and prepares step n + 1 while step n runs and waits only for
n's sampled ids (`LLMEngine._step_async`). A request that samples at n counts its coming token
as known (a placeholder, `Request.num_output_placeholders`); its decode at n + 1 reads that
token from n's draws on the device. Stops, detokenization and streaming see the token when it
reaches the host, one step later; a request that stopped at n has the token it computed at
n + 1 dropped (`Scheduler.update_from_output` skips finished requests), and its blocks were
freed when it stopped.

Everything that reads a request's latest token on the host to schedule or sample its next one
cannot run ahead; `sync_reason` names each case in this one place, and a step holding one is
completed before the next step is scheduled (the synchronous order, for that step only).
"""
from __future__ import annotations

from kvmesh.engine.sched_output import SchedulerOutput


def sync_reason(sched: SchedulerOutput) -> str | None:
    """Why the step after `sched` must be scheduled only once `sched`'s tokens are on the host
    (None: it may be scheduled while `sched` runs)."""
    for sr in sched.scheduled:
        req = sr.request
        if not sr.sample or req.is_finished:
            continue
        if sr.fork_children:
            return "n > 1: the other samples start from the first token"
        if req.grammar is not None:
            return "structured outputs: the next token's mask follows this token"
        p = req.sampling_params
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            return "penalties count the output tokens"
        if len(req.output_token_ids) < p.min_tokens:
            return "min_tokens counts the output tokens"
    return None
