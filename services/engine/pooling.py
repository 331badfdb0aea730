"""Pooling: an embeddings request's hidden states (after the final norm) -> one vector.

A pooled request is a prefill scheduled like any other (chunked, batched with generation) that
is never sampled: the chunk that reaches its last prompt token yields the pooled vector and the
engine finishes the request in the same step, which frees its blocks. `last` takes the last
token's hidden state; `mean` averages every position, summed chunk by chunk into a `PoolState`
on the request (mean-pooled requests skip the prefix cache, so every position is computed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from kvmesh.engine.sched_output import ScheduledRequest


@dataclass(slots=True)
class PoolState:
    """A mean-pooled request's running sum between its prefill chunks."""
    total: torch.Tensor        # [hidden] float32: the sum of the hidden states of positions < upto
    upto: int                  # positions summed so far (a recompute after preemption re-adds none)


@dataclass(slots=True)
class PoolSpan:
    """One pooled request's chunk in the step's packed hidden states."""
    sr: ScheduledRequest
    row_start: int             # the chunk's first row in [T, hidden]


def pool(hidden: torch.Tensor,               # [T, hidden], the step's rows after the final norm
         spans: list[PoolSpan]) -> dict[str, list[float]]:
    """request id -> its pooled (and normalised, if asked) vector, for the requests whose
    prefill completes this step; mean-pooled requests still running accumulate their chunk."""
    out: dict[str, list[float]] = {}
    for span in spans:
        sr, req = span.sr, span.sr.request
        params = req.pooling
        assert params is not None
        rows = hidden[span.row_start:span.row_start + sr.num_tokens]
        if params.pooling == "mean":
            state = req.pool_state
            if state is None:
                state = req.pool_state = PoolState(
                    torch.zeros(hidden.shape[1], dtype=torch.float32, device=hidden.device), 0)
            skip = max(0, state.upto - sr.start)     # positions a recompute computes again
            state.total += rows[skip:].to(torch.float32).sum(dim=0)
            state.upto = max(state.upto, sr.start + sr.num_tokens)
            if not sr.sample:
                continue
            vec = state.total / req.num_prompt_tokens
        else:
            if not sr.sample:
                continue
            vec = rows[-1].to(torch.float32)
        if params.normalize:
            vec = torch.nn.functional.normalize(vec, dim=-1)
        out[req.request_id] = vec.tolist()
    return out
