"""A request's state as the scheduler, the KV-cache manager and the runner see it."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvmesh.engine.lora.request import LoRARequest
from kvmesh.engine.pooling_params import PoolingParams
from kvmesh.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvmesh.engine.structured.request_grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0          # never scheduled, or preempted by recompute (blocks freed)
    WAITING_FOR_FORK = 1  # sample i > 0 of an n > 1 request, waiting for sample 0's prefill
    RUNNING = 2
    SWAPPED = 3          # preempted by swap: its KV lives in CPU swap blocks
    FINISHED_STOPPED = 4  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 5   # max_tokens or max_model_len
    FINISHED_ABORTED = 6
    WAITING_FOR_GRAMMAR = 7  # structured outputs: its grammar compiles; the scheduler skips it
    WAITING_FOR_REMOTE_KV = 8  # P/D consumer: its prompt KV is being read from a prefill engine

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ABORTED


FINISHED_STATUSES = frozenset(s for s in RequestStatus if s.finished)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    rank: int              # 1 = the most likely token


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float                      # monotonic seconds; FCFS order and aging
    priority: int = 0                        # lower is served first (priority policy)
    cache_salt: str | None = None            # isolates prefix-cache sharing between tenants
    eos_token_ids: tuple[int, ...] = ()      # the model's EOS ids (ignored with ignore_eos)
    max_model_len: int = 2048                # context limit for this request
    sample_index: int = 0                    # i-th of n samples; > 0 are forks of sample 0
    parent_id: str | None = None             # the user-visible request id of an n > 1 group
    generator: torch.Generator | None = None  # per-sample RNG when seeded
    # NOTE: set by the scheduler (its BlockHasher); keeps block_hashes in step with the tokens
    block_hasher: Callable[[Request], None] | None = None
    # structured outputs: this sample's matcher; on the request, not its KV, so it survives preemption
    grammar: RequestGrammar | None = None
    pooling: PoolingParams | None = None     # an embeddings request: pooled, never sampled
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)   # prompt + output; the KV source
    num_computed_tokens: int = 0             # tokens whose K/V is in the cache
    num_cached_tokens: int = -1              # prompt tokens served by the prefix cache (first schedule)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks (block_hasher)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None     # the stop token id or stop string that ended it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_preempted_step: int = -1            # NOTE: guards against thrashing a freshly preempted request
    # prompt_logprobs: entry j is token j's (None for j = 0), filled chunk by chunk at prefill
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    pool_state: object = None                # pooling.PoolState while a pooled prefill runs
    # prefill/decode disaggregation: the kv_transfer_params its final output returns (set at
    # finish by the kv-transfer connector; None: none)
    kv_transfer_result: dict | None = None
    # --async-scheduling: tokens sampled by a step whose result the host has not read yet;
    # the scheduler counts them as known (vLLM's num_output_placeholders)
    num_output_placeholders: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        if self.block_hasher is not None:
            self.block_hasher(self)

    def set_block_hasher(self, hasher: Callable[[Request], None] | None) -> None:
        """Hash the known tokens' full blocks with `hasher` from now on (None: stop hashing)."""
        self.block_hasher = hasher
        if hasher is not None:
            hasher(self)

    @property
    def lora_name(self) -> str | None:
        """The adapter's name (chained into the block hashes), None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def skip_prefix_cache(self) -> bool:
        """True when every prompt position must be computed here: prompt logprobs and mean
        pooling read each position's hidden state, which a cached (or remote) block skips.

        NOTE: such requests skip reading the prefix cache (and remote KV) altogether rather
        than recompute the positions they need (vLLM does the same for prompt logprobs); their
        blocks are still cached when they finish, for the requests that come after."""
        return (self.sampling_params.prompt_logprobs is not None
                or (self.pooling is not None and self.pooling.pooling == "mean"))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: max_tokens capped by what the context still holds."""
        room = self.max_model_len - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first `num_output_tokens` (a stop inside a run of
        tokens verified in one step). NOTE: for a request that finishes at once: its block
        hashes and computed count are left as they are, nothing reads them again."""
        drop = len(self.output_token_ids) - num_output_tokens
        if drop <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - drop:]
        del self.output_logprobs[num_output_tokens:]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.block_hasher is not None:
            self.block_hasher(self)
