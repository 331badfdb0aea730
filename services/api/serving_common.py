"""Pieces shared by the completions and chat endpoints."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request as HTTPRequest

from kvmesh.api.errors import APIError, bad_request
from kvmesh.api.protocol import ChatMessage, _SamplingFields
from kvmesh.api.tool_parsers import ToolParser
from kvmesh.common.disconnect import until_disconnect
from kvmesh.common.openai_errors import error_body
from kvmesh.engine.async_engine import (AsyncLLMEngine, ClientTooSlowError, EngineDeadError,
                                        RequestStream)
from kvmesh.engine.input_processor import InputProcessor
from kvmesh.engine.kv_transfer.params import parse_kv_transfer_params
from kvmesh.engine.limits import RequestLimits
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.lora.request import LoRARequest
from kvmesh.engine.request import Logprob
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.structured.spec import StructuredOutputError, StructuredOutputSpec

T = TypeVar("T")
logger = logging.getLogger("kvmesh.api")


@dataclass(slots=True)
class ServingContext:
    engine: AsyncLLMEngine
    model_name: str
    max_model_len: int
    tool_parser: ToolParser | None = None   # --tool-call-parser (None: chosen from the template)
    # the adapter the request's `model` names (model_name is then the adapter's); None: the base
    lora_request: LoRARequest | None = None

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.engine.input_processor

    @property
    def limits(self) -> RequestLimits:
        return self.input_processor.limits


# NOTE: tokenizing runs at about 0.2-1 MB/s on one core (a 2 MB prompt took 7-10 s on this
# loaded machine), and the event loop serves every stream's tokens and the probes. Inputs of at
# least this many characters (or token ids, which are checked one by one) are tokenized on a
# worker thread: the Rust tokenizer releases the GIL. Smaller ones run inline, where the thread
# hop (measured: about 1.5 ms a call here, 0.07 ms for the encode of a short prompt) costs
# more than the work.
OFF_LOOP_MIN_SIZE = 1024


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), on a worker thread when `size` (characters or token ids) is large."""
    if size < OFF_LOOP_MIN_SIZE:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def message_chars(messages: list[ChatMessage]) -> int:
    """The characters of a chat's contents: what rendering its template costs."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(part.text) for part in m.content)
    return total


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def context_error(limit: int, prompt_len: int, max_tokens: int | None,
                  prompt_param: str = "messages") -> APIError:
    if max_tokens is None:
        msg = (f"This model's maximum context length is {limit} tokens. However, your prompt has "
               f"{prompt_len} tokens; at least one token must be left for the completion. "
               "Please reduce the length of the prompt.")
    else:
        msg = (f"This model's maximum context length is {limit} tokens. However, you requested "
               f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
               "the completion). Please reduce the length of the prompt or max_tokens.")
    return APIError(400, msg, code="context_length_exceeded",
                    param=prompt_param if max_tokens is None else "max_tokens")


def structured_spec(req: _SamplingFields) -> tuple[StructuredOutputSpec, str] | None:
    """The request's structured-output constraint and the field it came from (api/structured.py)."""
    try:
        return req.structured_spec()
    except StructuredOutputError as e:
        raise bad_request(str(e), param=e.param) from None


def checked_params(ctx: ServingContext, req: _SamplingFields, max_tokens: int | None,
                   logprobs: int | None, names: dict[str, str] | None = None,
                   structured: tuple[StructuredOutputSpec, str] | None = None,
                   prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams, checked by the input processor against this deployment's
    limits before any prompt is tokenized; a 400 whose param (and message) use the client's
    field name: `names` maps SamplingParams fields to it (chat's `top_logprobs`). `structured`:
    the output constraint (structured_spec, or the tools') and the field it came from."""
    params = req.sampling_params(max_tokens, logprobs, prompt_logprobs)
    try:
        params.kv_transfer_params = parse_kv_transfer_params(req.kv_transfer_params)
    except ValueError as e:
        raise bad_request(str(e), param=getattr(e, "param", "kv_transfer_params")) from None
    if structured is not None:
        params.structured_outputs = structured[0]
        names = {**(names or {}), "structured_outputs": structured[1]}
    try:
        return ctx.input_processor.check_params(params)
    except ValueError as e:
        param = getattr(e, "param", None)
        message = str(e)
        if names and param in names:
            if message.startswith(param):
                message = names[param] + message[len(param):]
            param = names[param]
        raise bad_request(message, param=param) from None


def tokenize_input(ctx: ServingContext, value: str | list[int], param: str) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt or input, as the input processor tokenizes it; a 400
    on `param` (the client's field) for a bad value or one without a single token."""
    try:
        text, ids = ctx.input_processor.tokenize(value)
    except ValueError as e:
        raise bad_request(str(e), param=param) from None
    if not ids:
        raise bad_request(f"{param} {value!r} has no tokens (the tokenizer drops every character "
                          "of it)", param=param)
    return text, ids


def check_context(prompt_len: int, max_model_len: int, max_tokens: int | None,
                  prompt_param: str) -> None:
    """OpenAI's context-length errors for one prompt (`max_tokens` as the client sent it;
    `prompt_param` the client's field: prompt or messages)."""
    if prompt_len >= max_model_len:
        raise context_error(max_model_len, prompt_len, None, prompt_param)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise context_error(max_model_len, prompt_len, max_tokens)


@dataclass(slots=True)
class Admission:
    """One engine request of an HTTP request (completions may carry several prompts)."""
    request_id: str
    prompt: str | list[int]
    prompt_ids: list[int]
    params: SamplingParams


async def admit(ctx: ServingContext, req: _SamplingFields, admissions: list[Admission],
                trace_context) -> list[RequestStream]:
    """Add every request to the engine before any response starts: a refusal (queue full,
    bad request, dead engine) raises here, and the ones already admitted are aborted.

    NOTE: a non-streaming request's stream carries its final output alone: its queue never
    fills, however long the answer, and no step output is copied to it in vain."""
    streams: list[RequestStream] = []
    try:
        for a in admissions:
            streams.append(await ctx.engine.add_request(
                a.request_id, a.prompt, a.params, req.priority, req.cache_salt,
                prompt_ids=a.prompt_ids, trace_context=trace_context,
                final_only=not req.stream, lora_request=ctx.lora_request))
    except BaseException:
        await close_all(streams)
        raise
    return streams


async def close_all(streams: list[RequestStream]) -> None:
    """Abort whatever has not finished (idempotent; also the streaming responses' cleanup)."""
    for s in streams:
        await s.aclose()


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.hf.decode([token_id])


def completion_logprobs(tokenizer, token_ids: list[int], steps: list[dict[int, Logprob]],
                        offset: int) -> dict[str, Any]:
    """The legacy completions logprobs object for a run of tokens."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, step in zip(token_ids, steps):
        text = token_text(tokenizer, tid)
        tokens.append(text)
        token_lps.append(step[tid].logprob)
        tops.append({token_text(tokenizer, t): lp.logprob for t, lp in step.items()})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], steps: list[dict[int, Logprob]],
                  top_n: int) -> dict[str, Any]:
    content = []
    for tid, step in zip(token_ids, steps):
        text = token_text(tokenizer, tid)
        ranked = sorted(step.values(), key=lambda lp: lp.rank)[:top_n]
        content.append({
            "token": text, "logprob": step[tid].logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := token_text(tokenizer, lp.token_id)),
                              "logprob": lp.logprob, "bytes": list(t.encode())} for lp in ranked],
        })
    return {"content": content}


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """stream_options.continuous_usage_stats: the usage so far, on every chunk (vLLM's shape)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {**running_usage(prompt_tokens, completion_tokens),
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def stream_body(parts: AsyncIterator[str],
                      streams: list[RequestStream]) -> AsyncIterator[str]:
    """A streaming response's body: `parts`, then every engine stream closed (which aborts
    what is unfinished). NOTE: once the 200 is out, an engine failure, or a client too slow to
    read what it asked for, can only be told inside the stream: one OpenAI-style error event,
    then [DONE], instead of a dropped connection."""
    try:
        async for part in parts:
            yield part
    except EngineDeadError as e:
        yield sse(error_body(503, str(e), code="engine_dead"))
        yield SSE_DONE
    except ClientTooSlowError as e:
        yield sse(error_body(408, str(e), code="client_too_slow"))
        yield SSE_DONE
    except Exception:  # noqa: BLE001 - a bug mid-stream: tell the client, do not drop it
        logger.exception("streaming response failed")
        yield sse(error_body(500, "internal server error while streaming the response",
                             code="internal_error"))
        yield SSE_DONE
    finally:
        await close_all(streams)


@dataclass(slots=True)
class UsageOptions:
    include: bool = False           # stream_options.include_usage: a final usage-only chunk
    continuous: bool = False        # ... and continuous_usage_stats: usage on every chunk

    @classmethod
    def of(cls, req: _SamplingFields) -> "UsageOptions":
        opts = req.stream_options
        if opts is None or not opts.include_usage:
            return cls()
        # NOTE: as vLLM, continuous_usage_stats only counts together with include_usage.
        return cls(True, opts.continuous_usage_stats)


def sse_chunk(request_id: str, obj: str, created: int, model: str, choice: dict[str, Any],
              usage_opts: UsageOptions, usage_so_far: dict[str, Any] | None = None,
              kv_transfer_params: dict[str, Any] | None = None) -> str:
    """One streamed chunk with one choice. When the client asked for usage, `usage` is null on
    every chunk but the last (OpenAI), or the usage so far with continuous_usage_stats (vLLM).
    `kv_transfer_params`: the finished request's (vLLM puts them on its last chunk)."""
    body = {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [choice]}
    if usage_opts.include:
        body["usage"] = usage_so_far if usage_opts.continuous else None
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return sse(body)


def sse_usage_chunk(request_id: str, obj: str, created: int, model: str,
                    final_usage: dict[str, Any]) -> str:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return sse({"id": request_id, "object": obj, "created": created, "model": model,
                "choices": [], "usage": final_usage})


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive: yields (stream index, item)."""
    if len(streams) == 1:
        # NOTE: one stream (a chat request, a completion of one prompt): read it directly; a
        # pump task and a queue would cost a task switch and two queue hops per token.
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await _aclose(streams[0])
        return
    # NOTE: bounded, so that a consumer that stops (a slow client) stops the pumps too, and the
    # outputs wait in each request's own bounded queue, which aborts a reader too far behind.
    queue: asyncio.Queue = asyncio.Queue(maxsize=max(1, len(streams)))
    sentinel = object()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, sentinel))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is sentinel:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await _aclose(s)


async def _aclose(stream: AsyncIterator) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except RuntimeError:
            pass


async def final_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Consume every stream; the last output of each (finished) is returned in order."""
    last: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        last[i] = out
    return [o for o in last if o is not None]


async def cancel_on_disconnect(http: HTTPRequest, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """Run `work`; if the client goes away first, cancel it (which aborts its requests) and
    raise ClientDisconnected, which the app answers with a 499 nobody reads (the access log
    says what happened; no traceback: a client leaving is not a server error)."""
    return await until_disconnect(http, work, poll_s)
