"""Data passed from the scheduler to the model runner and back: one step's decisions and results."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.engine.request import Logprob, Request

if TYPE_CHECKING:
    from kvmesh.engine.structured.bitmask import GrammarBitmask


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step. NOTE: the scheduler keeps one per live request and
    refills it each step it is scheduled (no per-step object per request, which would drive
    the garbage collector at large batches): read it within the step that produced it."""
    request: Request           # in-process reference: the runner reads token ids and sampling settings
    start: int                 # first position computed this step (num_computed_tokens before the step)
    num_tokens: int            # tokens computed this step (1 for a decode)
    block_ids: list[int]       # the request's block table after this step's allocation
    sample: bool               # the chunk reaches the last known token: a next token is sampled
    fork_children: Sequence[Request] = ()  # n > 1: samples drawn from this row too
    # speculative decoding: draft tokens computed after the last known one (counted in
    # num_tokens; their rows are verified, see engine/spec_decode)
    spec_token_ids: Sequence[int] = ()

    @property
    def is_decode(self) -> bool:
        return (self.num_tokens - len(self.spec_token_ids) == 1 and self.sample
                and self.start >= len(self.request.prompt_token_ids))


@dataclass(slots=True)
class SchedulerStats:
    """What one step decided; exposed by tracing (one span per step) and metrics."""
    step: int = 0
    policy: str = ""
    token_budget: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_reqs: int = 0          # requests computing more than their last token
    num_decode_reqs: int = 0
    num_chunked_prefills: int = 0      # prefills cut short by the budget
    num_preempted: int = 0
    num_preempted_recompute: int = 0
    num_preempted_swap: int = 0
    num_swapped_in: int = 0
    num_swapped_out: int = 0
    blocks_allocated: int = 0
    blocks_freed: int = 0
    blocks_evicted: int = 0
    cow_copies: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    external_hit_tokens: int = 0       # prompt tokens whose KV was loaded from another pod (kv-share, P/D)
    # prompt tokens run through the model (not prefix-cache hits, not loaded KV)
    num_prompt_tokens_computed: int = 0
    remote_kv_waits: int = 0           # requests that began waiting for their KV prefetch
    remote_kv_timeouts: int = 0        # ... and whose wait ran out with the fetch still in flight
    kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    # speculative decoding, filled when the step's drafts are verified (vLLM's spec_decode_*
    # metrics): verifications, draft tokens, accepted ones, and per draft position (0 = the
    # first draft) how many verifications accepted it
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # NOTE: a tuple, as a span attribute reads it back
    spec_num_accepted_per_pos: tuple[int, ...] = ()


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions, for the runner and the step's observers; valid until the next
    schedule() (its ScheduledRequests are reused)."""
    step: int
    scheduled: list[ScheduledRequest]
    # NOTE: block moves in the order the scheduler decided them: ("copy", src, dst) for
    # copy-on-write, ("swap_out", gpu, cpu), ("swap_in", cpu, gpu), ("load", i, gpu) for KV
    # bytes kv_loads[i] from another pod. No fixed order of kinds is safe: a copy-on-write may
    # target a block a swap-out freed earlier in the step, and a swap-out may carry a block
    # whose copy-on-write was decided before it.
    block_ops: list[tuple[str, int, int]]
    preempted_ids: list[str]
    stats: SchedulerStats
    kv_loads: list[bytes] = field(default_factory=list)   # data of the "load" block ops
    # structured outputs: allowed tokens of the constrained sampling rows (None: no row is)
    grammar: GrammarBitmask | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return self.stats.num_scheduled_tokens


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, list[int]]                          # request id -> tokens (one per sample)
    logprobs: dict[str, list[dict[int, Logprob]] | None]   # request id -> per-sample logprobs
    model_time_s: float = 0.0                              # forward + sampling wall time
    sample_window: tuple[float, float] | None = None       # monotonic s: sampler start, end
    # request id -> (index of the first prompt token scored, entries): this step's chunk of
    # prompt logprobs (engine/prompt_logprobs.py)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)   # request id -> embedding
    # speculative decoding: request id -> the accepted drafts then the token sampled after them
    # (these requests are not in `sampled`), and their logprobs (None: not requested)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[dict[int, Logprob]] | None] = field(default_factory=dict)
