"""Who speculates in a step and with how many drafts; what each verification accepted.

The scheduler owns one Speculator (when `--speculative-config` is set) and asks it for the
drafts of each decode it schedules. Speculation is off:
  - for the whole step while more than `disable_by_batch_size` requests run (vLLM's switch: at
    large batches the forward is compute-bound and rejected drafts cost real work);
  - for a request whose acceptance stays low: after `WINDOW` verifications accepting less than
    `LOW_ACCEPTANCE` of their drafts it pauses for `PAUSE_MIN` decodes, doubling up to
    `PAUSE_MAX` while it keeps failing (a request that starts copying again is retried);
A prompt-lookup draft for a request with a grammar ends before its first token the grammar
refuses (RequestGrammar.valid_prefix); the verification then masks every drafted position. A
draft model proposes after scheduling, so its drafts are placeholders here (`PendingDrafts`):
the draft model masks its own logits at each position with the grammar, which fills the
target's mask for that position as it goes (draft_model.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.speculative_config import SpeculativeConfig
from kvmesh.engine.request import Request
from kvmesh.engine.sched_output import SchedulerStats
from kvmesh.engine.spec_decode.ngram import propose_ngram
from kvmesh.engine.spec_decode.tokens import PendingDrafts

WINDOW = 8              # verifications per acceptance check
LOW_ACCEPTANCE = 0.2    # accepted / drafted below this over a window: pause the request
PAUSE_MIN = 16          # decodes without drafts after a low window ...
PAUSE_MAX = 256         # ... doubling up to this

_NO_DRAFTS: list[int] = []


@dataclass(slots=True)
class _Acceptance:
    """One request's acceptance since its last check, and its pause."""
    rounds: int = 0        # verifications in the current window
    drafted: int = 0       # draft tokens in the current window
    accepted: int = 0      # ... of which accepted
    paused: int = 0        # decodes left without drafts
    pause: int = PAUSE_MIN  # the next pause's length


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.active = True          # this step speculates (disable_by_batch_size)
        self._requests: dict[str, _Acceptance] = {}

    def begin_step(self, num_running: int) -> None:
        limit = self.config.disable_by_batch_size
        self.active = limit is None or num_running <= limit

    def propose(self, req: Request, budget: int) -> list[int]:
        """Drafts for a decode of `req` (none when speculation is off for it), at most `budget`
        and never more than its max_tokens leave room for after the token they follow."""
        if not self.active:
            return _NO_DRAFTS
        state = self._requests.get(req.request_id)
        if state is not None and state.paused:
            state.paused -= 1
            return _NO_DRAFTS
        # NOTE: k drafts yield up to k + 1 tokens; max_tokens is bounded by the context, so
        # this also keeps every drafted position inside max_model_len.
        k = min(self.k, budget, req.max_tokens - len(req.output_token_ids) - 1)
        if k <= 0:
            return _NO_DRAFTS
        c = self.config
        if c.method == "draft_model":
            # NOTE: placeholders: the runner's draft model fills them in before the forward
            return PendingDrafts([0] * k)
        drafts = propose_ngram(req.all_token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
        if drafts and req.grammar is not None:
            del drafts[req.grammar.valid_prefix(drafts):]
        return drafts

    def record(self, request_id: str, num_drafts: int, num_accepted: int,
               stats: SchedulerStats) -> None:
        """One verification: `num_accepted` of `num_drafts` drafts kept (the leading ones)."""
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += num_drafts
        stats.spec_num_accepted_tokens += num_accepted
        per_pos = list(stats.spec_num_accepted_per_pos) or [0] * self.k
        for i in range(num_accepted):
            per_pos[i] += 1
        stats.spec_num_accepted_per_pos = tuple(per_pos)
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _Acceptance()
        state.rounds += 1
        state.drafted += num_drafts
        state.accepted += num_accepted
        if state.rounds >= WINDOW:
            if state.accepted < LOW_ACCEPTANCE * state.drafted:
                state.paused = state.pause
                state.pause = min(2 * state.pause, PAUSE_MAX)
            else:
                state.pause = PAUSE_MIN
            state.rounds = state.drafted = state.accepted = 0

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
