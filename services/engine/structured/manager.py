"""StructuredOutputManager: what the engine calls for structured outputs, and nothing else does."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvmesh.engine.request import Request
from kvmesh.engine.sched_output import SchedulerOutput
from kvmesh.engine.structured.spec import StructuredOutputSpec

logger = logging.getLogger("kvmesh.engine.structured")


class StructuredOutputManager:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int | None = None, threads: int | None = None) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._cache_size = cache_size
        self._threads = threads
        self._pool = None            # NOTE: built by the first constrained request: xgrammar's
        #                              tokenizer tables cost ~0.2 s and a server may never need them
        self._pending: dict[str, Request] = {}   # request id -> sample 0, while its compile runs

    @property
    def pool(self):
        if self._pool is None:
            from kvmesh.engine.structured.compiler import (
                DEFAULT_CACHE_SIZE,
                DEFAULT_THREADS,
                GrammarCompilerPool,
            )
            self._pool = GrammarCompilerPool(self._hf, self.vocab_size, self.eos_token_ids,
                                             self._cache_size or DEFAULT_CACHE_SIZE,
                                             self._threads or DEFAULT_THREADS)
        return self._pool

    def attach(self, request_id: str, samples: list[Request], spec: StructuredOutputSpec) -> None:
        """Give every sample its own matcher over one shared compile (started now)."""
        from kvmesh.engine.structured.request_grammar import RequestGrammar
        compiled = self.pool.compile(spec)
        for req in samples:
            req.grammar = RequestGrammar(spec, compiled)
        if not compiled.done():
            self._pending[request_id] = samples[0]

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """(request id, error) of the requests whose compile failed since the last call; drops
        the finished compiles from the pending set. Cheap when nothing is pending."""
        if not self._pending:
            return []
        failed = []
        for rid, req in list(self._pending.items()):
            if req.is_finished or req.grammar.ready:
                del self._pending[rid]
                if not req.is_finished and req.grammar.error is not None:
                    failed.append((rid, req.grammar.error))
        return failed

    def bitmask(self, sched: SchedulerOutput):
        """The step's GrammarBitmask, or None (unconstrained steps allocate nothing)."""
        if not any(sr.sample and sr.request.grammar is not None for sr in sched.scheduled):
            return None
        from kvmesh.engine.structured.bitmask import build_bitmask
        return build_bitmask(sched, self.vocab_size)

    def accept(self, touched: list[Request], num_new: dict[str, int] | None = None
               ) -> list[Request]:
        """Advance each constrained sample's matcher with its new tokens (one, or `num_new[id]`
        for a verified speculative run); returns the samples with a token the grammar refused
        (never expected: the masks allowed only grammar tokens)."""
        refused = []
        for req in touched:
            grammar = req.grammar
            if grammar is None or grammar.terminated:
                continue
            n = num_new.get(req.request_id, 1) if num_new else 1
            for token in req.output_token_ids[-n:]:
                if grammar.terminated:        # as for one token: what follows its end is free
                    break
                if not grammar.accept(token):
                    logger.error("request %s: sampled token %d is outside its grammar",
                                 req.request_id, token)
                    refused.append(req)
                    break
        return refused

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
