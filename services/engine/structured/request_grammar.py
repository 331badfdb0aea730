"""RequestGrammar: one sample's grammar state. It lives on the Request (not on any KV block), so
preemption by recompute or swap keeps it: the tokens it has accepted are still the request's.

Speculative decoding walks the matcher through a request's drafts twice per step (to cut them at
the first one the grammar refuses, then to fill one mask per drafted position) and rolls it back
each time: it only ever advances by the tokens the request really gets (`accept`)."""
from __future__ import annotations

from concurrent.futures import Future

import torch
import xgrammar as xgr
from kvmesh.engine.structured.spec import StructuredOutputSpec


class RequestGrammar:
    def __init__(self, spec: StructuredOutputSpec, compiled: Future) -> None:
        self.spec = spec
        self._compiled = compiled              # from GrammarCompilerPool.compile
        self._matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """The compile has finished (maybe with an error: see `error`)."""
        return self._compiled.done()

    @property
    def error(self) -> BaseException | None:
        if not self._compiled.done():
            return None
        if self._compiled.cancelled():
            return RuntimeError("the grammar compile was cancelled")
        return self._compiled.exception()

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            assert self.ready and self.error is None, "a grammar is used only once compiled"
            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` ([rows, ceil(V / 32)] int32) := the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar allows, stopping before one that would end it
        (a stop token); the matcher is left where it was."""
        matcher, n = self.matcher, 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            n += 1
            if matcher.is_terminated():
                # NOTE: the verify step needs a mask after every draft; a finished grammar has
                # none to give, so the stop token is left for the target to sample
                n -= 1
                matcher.rollback(1)
                break
        if n:
            matcher.rollback(n)
        return n

    def fill_draft_bitmasks(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts) := the tokens allowed after drafts[:i] (speculative
        decoding: the target's row i sees the drafts before it as output). The drafts are a
        `valid_prefix`; the matcher is left where it was."""
        matcher = self.matcher
        matcher.fill_next_token_bitmask(bitmask, row)
        for i, token in enumerate(drafts, start=1):
            accepted = matcher.accept_token(token)
            assert accepted, "drafts are checked against the grammar when proposed"
            matcher.fill_next_token_bitmask(bitmask, row + i)
        if drafts:
            matcher.rollback(len(drafts))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its end (a stop token) has been accepted."""
        return self._matcher is not None and self._matcher.is_terminated()
