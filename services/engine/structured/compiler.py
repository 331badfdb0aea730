"""GrammarCompilerPool: compiles each spec once, off the engine thread, into a bounded LRU.

NOTE: compiling a JSON schema against a 49k-token vocabulary takes milliseconds to seconds
(large schemas, long regexes); the engine thread never does it. A request waits as
WAITING_FOR_GRAMMAR while its compile runs on this pool, and every later request with the same
spec reuses the result. The cache holds futures, so concurrent requests for one new spec share
one compile; a failed compile is dropped from the cache (a later request tries again).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr
from kvmesh.engine.structured.grammar import parse
from kvmesh.engine.structured.spec import StructuredOutputSpec

logger = logging.getLogger("kvmesh.engine.structured")

DEFAULT_CACHE_SIZE = 256       # compiled grammars kept (a JSON schema's is tens of KB to a few MB)
DEFAULT_THREADS = 1            # compile threads (xgrammar releases the GIL while it compiles)


class GrammarCompilerPool:
    """Compile specs for one tokenizer and model vocabulary."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_entries: int = DEFAULT_CACHE_SIZE, threads: int = DEFAULT_THREADS) -> None:
        if max_entries < 1 or threads < 1:
            raise ValueError("the grammar cache needs max_entries >= 1 and threads >= 1")
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size            # the model's logits width (>= the tokenizer's)
        self.stop_token_ids = list(stop_token_ids)
        self.max_entries = max_entries
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvmesh-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None   # built on the pool's first compile
        self.num_compiles = 0                   # compiles started (cache misses)

    def compile(self, spec: StructuredOutputSpec) -> Future:
        """A future of the spec's xgrammar CompiledGrammar (done at once on a cache hit)."""
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._executor.submit(self._compile, spec)
            self.num_compiles += 1
            self._cache[key] = fut
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f, key=key: self._drop_failed(key, f))
        return fut

    def __len__(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- on the pool's threads -------------------------------------------------------------
    def _compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        return self._get_compiler().compile_grammar(parse(spec))

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                # NOTE: vocab_size is the model's: ids past the tokenizer's are never allowed.
                info = xgr.TokenizerInfo.from_huggingface(
                    self._hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                # our own LRU keys by spec; xgrammar's cache would duplicate it, unbounded
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _drop_failed(self, key: tuple[str, str], fut: Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            if not fut.cancelled():
                logger.warning("grammar compile failed: %s", fut.exception())
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]
