"""What the engine returns to callers (vLLM's RequestOutput / CompletionOutput shape)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engine.request import Logprob


@dataclass(slots=True)
class CompletionOutput:
    """One sample's share of a RequestOutput.

    NOTE: every output carries what is new since the previous one (the delta_* fields: O(new
    tokens) per step, what streams send); the cumulative fields are assembled once, on the
    request's final output (RequestOutput.finished), and are empty ("" / [] ) before it."""
    index: int                          # sample index within the request (n > 1)
    text: str                           # cumulative text (stop string removed); final output only
    token_ids: list[int]                # cumulative generated token ids; final output only
    logprobs: list[dict[int, Logprob]] | None   # cumulative, final output only; None: not asked for
    finish_reason: str | None           # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    delta_text: str = ""                # new text since the previous output (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None   # of delta_token_ids; None: not asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(step[t].logprob for step, t in zip(self.logprobs, self.token_ids))


@dataclass(slots=True)
class RequestOutput:
    """One step's news for a request; the last one (finished) also holds the full result."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache
    # arrival, first scheduled and first token times; NOTE: one dict shared by all of a request's
    # outputs, filled in as the times become known (never changed once set)
    metrics: dict[str, float] = field(default_factory=dict)
    # prompt_logprobs: entry j for prompt token j (None for j = 0); the request's own list,
    # complete once its prefill is (shared, not copied, by every output)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None   # an embeddings request's pooled vector
    # final output only: what the other engine of a prefill/decode pair needs (vLLM's
    # kv_transfer_params: the producer's block ids and bootstrap address); None: nothing
    kv_transfer_params: dict | None = None
