"""What the engine returns to callers (vLLM's RequestOutput / CompletionOutput shape)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engine.request import Logprob


@dataclass(slots=True)
class CompletionOutput:
    index: int                          # sample index within the request (n > 1)
    text: str                           # cumulative text (stop string removed)
    token_ids: list[int]                # cumulative generated token ids
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None           # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    delta_text: str = ""                # new text since the previous output (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)

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
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first token, finish times
    # prompt_logprobs: entry j for prompt token j (None for j = 0); the request's own list,
    # complete once its prefill is (shared, not copied, by every output)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None   # an embeddings request's pooled vector
