"""AsyncLLMEngine: the engine stepping on its own thread, driven from asyncio.

NOTE: the model's forward pass holds the CPU/GPU for tens of milliseconds, so the step loop runs
on a dedicated thread and never blocks the event loop. The scheduler is not thread-safe: every
mutation (add, abort) is a command the engine thread applies between steps. Outputs are handed
to each request's asyncio queue with call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from kvmesh.engine.engine import LLMEngine, PromptInput
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvmesh.async_engine")


class EngineDeadError(RuntimeError):
    """The engine thread failed; the server must be restarted."""


class QueueFullError(RuntimeError):
    """Back-pressure: the waiting queue is over its limit."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    trace_context: object = None     # OpenTelemetry context parenting the request's spans


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


StepHook = Callable[[LLMEngine, list[RequestOutput], float], None]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 step_hooks: list[StepHook] | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.step_hooks = list(step_hooks or [])   # metrics, KV-event publishing, tracing
        self.abort_hooks: list[Callable[[str], None]] = []
        self.shutdown_hooks: list[Callable[[], None]] = []   # after the engine thread stops
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
        for hook in self.shutdown_hooks:
            hook()

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

    def validate(self, prompt: PromptInput, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a request on the caller's thread (pure): ValueError if bad."""
        text, ids = self.engine.tokenize_prompt(prompt)
        self.engine.check_request(ids, params)
        return text, ids

    async def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       prompt_ids: list[int] | None = None,
                       trace_context=None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; cancelling the iteration aborts the request.
        `trace_context` (the HTTP server span's context) parents its spans when tracing is on."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead!r}")
        if prompt_ids is None:
            text, prompt_ids = self.validate(prompt, params)
        else:
            text = prompt if isinstance(prompt, str) else None
            self.engine.check_request(prompt_ids, params)
        self.check_capacity(1)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        with self._lock:
            self._pending_adds += 1
        self._commands.put(_Add(request_id, prompt_ids, text, params, priority, cache_salt,
                                time.monotonic(), trace_context))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    # ---- the engine thread ---------------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                with self._lock:
                    self._pending_adds -= 1
                if cmd.request_id not in self._streams:
                    continue                      # cancelled before it reached the engine
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params,
                                            arrival_time=cmd.arrival_time, priority=cmd.priority,
                                            cache_salt=cmd.cache_salt, prompt_text=cmd.prompt_text,
                                            trace_context=cmd.trace_context)
                except ValueError as e:
                    self._deliver(cmd.request_id, e)
            else:
                self.engine.abort_request(cmd[1])
                for hook in self.abort_hooks:
                    hook(cmd[1])

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wakeup.clear()
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(0.5)
                    continue
                t0 = time.monotonic()
                outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out.request_id, out)
                for hook in self.step_hooks:
                    hook(self.engine, outputs, t0)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting client
            logger.exception("engine thread failed")
            self.dead = e
            err = EngineDeadError(f"engine failed: {e!r}")
            for rid in list(self._streams):
                self._deliver(rid, err)
