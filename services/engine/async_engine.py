"""AsyncLLMEngine: the engine stepping on its own thread, driven from asyncio.

NOTE: the model's forward pass holds the CPU/GPU for tens of milliseconds, so the step loop runs
on a dedicated thread and never blocks the event loop. The scheduler is not thread-safe: every
mutation (add, abort) is a command the engine thread applies between steps. A step's outputs are
handed to the requests' asyncio queues with one call_soon_threadsafe per event loop; a queue is
bounded (`RequestLimits.max_pending_outputs`), so a reader that stops reading cannot grow the
memory.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.input_processor import EngineRequest, PromptInput
from kvmesh.engine.limits import RequestLimits
from kvmesh.engine.lora.request import LoRARequest
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.pooling_params import PoolingParams
from kvmesh.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvmesh.async_engine")


class EngineDeadError(RuntimeError):
    """The engine thread failed; the server must be restarted."""


class QueueFullError(RuntimeError):
    """Back-pressure: the waiting queue is over its limit."""


class ClientTooSlowError(RuntimeError):
    """The request's reader fell `max_pending_outputs` outputs behind: the request was aborted."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future          # set once the engine thread has added (or refused) it
    final_only: bool = False          # the reader wants the final output alone (non-streaming)
    overflowed: bool = False          # the reader fell too far behind: outputs are dropped


@dataclass(slots=True)
class _ResetPrefixCache:
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future              # the engine's answer: True when the cache was reset


@dataclass(slots=True)
class _EngineCall:
    """A call made on the engine thread between two steps (adapters: add, remove)."""
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future              # the call's result, or its exception
    fn: Callable[[], object]


class RequestStream:
    """The outputs of one admitted request. It ends after the finished output; closing it
    earlier (aclose) aborts the request. Closing is idempotent."""

    def __init__(self, owner: "AsyncLLMEngine", request_id: str, stream: _Stream) -> None:
        self._owner = owner
        self.request_id = request_id
        self._stream = stream
        self._closed = False
        self._finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self._close()
            raise item
        if item.finished:
            self._finished = True
            self._close()
        return item

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._owner._streams.pop(self.request_id, None)
        if not self._finished:
            self._owner.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 limits: RequestLimits | None = None) -> None:
        self.engine = engine      # metrics, tracing, index publishing: engine.observers
        self.max_waiting = max_waiting
        if limits is not None:
            # NOTE: the input processor checks every request against them; LLMEngine builds
            # it with the defaults, the server's flags replace them here, before any request.
            engine.input_processor.limits = limits
        self.max_pending_outputs = engine.input_processor.limits.max_pending_outputs
        # called once on the engine thread after a failure has been sent to every client
        self.on_dead = on_dead
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0                     # queued adds the engine thread has not applied
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self.dead: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for obs in list(self.engine.observers):
            obs.on_shutdown()
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending_adds

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ------------------------------------------------------------------------
    def check_capacity(self, num_requests: int = 1) -> None:
        """Back-pressure: QueueFullError if admitting these would overflow the waiting queue."""
        if self.max_waiting is not None and self.num_waiting + num_requests > self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); "
                                 "retry later")

    async def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                          priority: int = 0, cache_salt: str | None = None,
                          prompt_ids: list[int] | None = None,
                          trace_context=None, final_only: bool = False,
                          pooling: PoolingParams | None = None,
                          lora_request: LoRARequest | None = None) -> "RequestStream":
        """Admit a request and return its output stream. Every refusal (EngineDeadError,
        QueueFullError, ValueError) is raised here, before any output, so a server can still
        answer with a proper status code; iterate the stream to its end or close it (aclose).

        `final_only` (a non-streaming reader): the stream yields the finished output alone,
        which holds the whole result; nothing queues behind a reader that waits for it.
        With `pooling` it is an embeddings request: one output, carrying the embedding."""
        stream = self._submit(request_id, prompt, params, priority, cache_salt, prompt_ids,
                              trace_context, final_only, pooling, lora_request)
        try:
            await stream.accepted
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream)

    async def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       prompt_ids: list[int] | None = None,
                       trace_context=None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; cancelling the iteration aborts the request.
        `trace_context` (the HTTP server span's context) parents its spans when tracing is on."""
        outputs = await self.add_request(request_id, prompt, params, priority, cache_salt,
                                         prompt_ids, trace_context)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    def _submit(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                priority: int, cache_salt: str | None, prompt_ids: list[int] | None,
                trace_context, final_only: bool = False,
                pooling: PoolingParams | None = None,
                lora_request: LoRARequest | None = None) -> _Stream:
        """Build the validated request on the caller's thread and queue it for the engine thread."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead!r}")
        if self._stop.is_set():
            raise EngineDeadError("engine is shut down")
        request = self.engine.input_processor.process(
            request_id, prompt, params, prompt_ids=prompt_ids, priority=priority,
            cache_salt=cache_salt, trace_context=trace_context, pooling=pooling,
            lora_request=lora_request)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_capacity(1)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), loop.create_future(), final_only)
        self._streams[request_id] = stream
        with self._lock:
            self._pending_adds += 1
        self._commands.put(request)
        self._wakeup.set()
        if self.dead is not None or self._stop.is_set():
            # NOTE: the engine thread stopped after the checks above; its last act failed the
            # streams registered then, maybe before this one: never leave it waiting.
            _resolve(loop, stream.accepted, error=EngineDeadError("engine is shut down"))
        return stream

    async def reset_prefix_cache(self) -> bool:
        """Reset the prefix cache between two steps; False while running requests hold blocks."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead!r}")
        loop = asyncio.get_running_loop()
        cmd = _ResetPrefixCache(loop, loop.create_future())
        self._commands.put(cmd)
        self._wakeup.set()
        return await cmd.done

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter: read and checked on a worker thread (LoRAAdapterError, nothing
        changed), then cached between two steps, so no step sees it half loaded."""
        lora = await asyncio.to_thread(self.engine.read_lora, lora_request)
        return await self._call(lambda: self.engine.add_lora(lora))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call(lambda: self.engine.remove_lora(lora_int_id))

    async def _call(self, fn: Callable[[], object]):
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead!r}")
        loop = asyncio.get_running_loop()
        cmd = _EngineCall(loop, loop.create_future(), fn)
        self._commands.put(cmd)
        self._wakeup.set()
        return await cmd.done

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    # ---- the engine thread ---------------------------------------------------------------
    def _queued_commands(self) -> Iterator[object]:
        """Take every command queued so far, oldest first."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for cmd in self._queued_commands():
            if isinstance(cmd, EngineRequest):
                self._apply_add(cmd)
            elif isinstance(cmd, _ResetPrefixCache):
                self._apply_reset(cmd)
            elif isinstance(cmd, _EngineCall):
                try:
                    _resolve(cmd.loop, cmd.done, result=cmd.fn())
                except Exception as e:  # noqa: BLE001  (the caller's error, raised where it waits)
                    _resolve(cmd.loop, cmd.done, error=e)
            else:
                self.engine.abort_request(cmd[1])

    def _apply_add(self, request: EngineRequest) -> None:
        with self._lock:
            self._pending_adds -= 1
        stream = self._streams.get(request.request_id)
        if stream is None:
            return                                # cancelled before it reached the engine
        try:
            self.engine.add_request(request)      # trusted: built by the input processor
        except ValueError as e:                   # its id is still in use in the engine
            _resolve(stream.loop, stream.accepted, error=e)
            return
        _resolve(stream.loop, stream.accepted, result=None)

    def _apply_reset(self, cmd: _ResetPrefixCache) -> None:
        _resolve(cmd.loop, cmd.done, result=self.engine.reset_prefix_cache())

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if stream.final_only and isinstance(item, RequestOutput) and not item.finished:
            return            # NOTE: the final output holds the whole result; deltas are moot
        stream.loop.call_soon_threadsafe(self._offer, request_id, stream, item)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to their event loops with one wake-up per loop.

        NOTE: one call_soon_threadsafe per request was one self-pipe write and one loop
        iteration per request per step (16 at 16 running requests); batching them makes it one,
        and the loop queues every stream's output in one go."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[str, _Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or (stream.final_only and not out.finished):
                continue          # NOTE: as _deliver: a final-only reader gets the last alone
            batches.setdefault(stream.loop, []).append((out.request_id, stream, out))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(self._offer_batch, batch)
            except RuntimeError:
                pass                              # NOTE: the loop is closed: nobody is waiting

    def _offer_batch(self, batch: list[tuple[str, _Stream, RequestOutput]]) -> None:
        for request_id, stream, item in batch:
            self._offer(request_id, stream, item)

    def _offer(self, request_id: str, stream: _Stream, item) -> None:
        """On the event loop: queue an output, unless the reader is too far behind.

        NOTE: outputs are not coalesced (keeping only the latest when the reader lags): each
        carries the delta since the previous one, which the stream sends. A reader
        `max_pending_outputs` behind (a client that stopped reading its stream) is aborted: its
        backlog is dropped, its blocks freed, and it reads ClientTooSlowError next."""
        if stream.overflowed:
            return
        if isinstance(item, BaseException) or stream.queue.qsize() < self.max_pending_outputs:
            stream.queue.put_nowait(item)
            return
        stream.overflowed = True
        while not stream.queue.empty():
            stream.queue.get_nowait()
        stream.queue.put_nowait(ClientTooSlowError(
            f"the client fell {self.max_pending_outputs} outputs behind the generation of "
            f"request {request_id!r}, which was aborted; read the stream as it arrives"))
        self.abort(request_id)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wakeup.clear()
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_health()    # a worker process may die while idle
                    self.engine.poll_kv_transfers()   # P/D: pins read or timed out are freed
                    self._wakeup.wait(0.5)
                    continue
                # NOTE: step() has told its observers before any client sees an output, so once
                # a client has its final output, /metrics counts it.
                outputs = self.engine.step()
                if not self.engine.last_stats.num_scheduled_tokens:
                    # NOTE: nothing could run (a request waits for its remote KV): do not spin,
                    # the fetch thread needs the GIL.
                    self._wakeup.wait(0.005)
                if outputs:
                    self._deliver_step(outputs)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting client
            logger.exception("engine thread failed")
            self.dead = e
            err = EngineDeadError(f"engine failed: {e!r}")
            for rid in list(self._streams):
                self._deliver(rid, err)
        finally:
            self._fail_pending()
        if self.dead is not None and self.on_dead is not None:
            self.on_dead(self.dead)

    def _fail_pending(self) -> None:
        """The engine thread is gone: admissions and resets still queued will never run."""
        err = EngineDeadError(f"engine is dead: {self.dead!r}" if self.dead is not None
                              else "engine is shut down")
        for stream in list(self._streams.values()):
            _resolve(stream.loop, stream.accepted, error=err)
        for cmd in self._queued_commands():
            if isinstance(cmd, (_ResetPrefixCache, _EngineCall)):
                _resolve(cmd.loop, cmd.done, error=err)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result=None,
             error: BaseException | None = None) -> None:
    """Complete an asyncio future from the engine thread (no-op if it is already done)."""
    def apply() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    try:
        loop.call_soon_threadsafe(apply)
    except RuntimeError:
        pass                                      # NOTE: the loop is closed: nobody is waiting
