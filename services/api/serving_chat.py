"""POST /v1/chat/completions (the model's chat template)."""
from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator

from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from kvmesh.api.errors import bad_request
from kvmesh.api.prompt_logprobs import vllm_prompt_logprobs
from kvmesh.api.protocol import ChatCompletionRequest, ChatMessage
from kvmesh.api.serving_common import (SSE_DONE, Admission, ServingContext, UsageOptions, admit,
                                       cancel_on_disconnect, chat_logprobs, check_context,
                                       checked_params, close_all, final_outputs, message_chars,
                                       new_id, now_s, off_loop, running_usage, sse_chunk,
                                       sse_usage_chunk, stream_body, structured_spec, usage)
from kvmesh.api.serving_tools import ChoiceDeltas, chat_message, output_constraint, tool_plan
from kvmesh.api.tools import ToolPlan
from kvmesh.common.tracing import current_context
from kvmesh.engine.async_engine import RequestStream
from kvmesh.engine.outputs import RequestOutput


def apply_template(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat template's token ids; any template error (jinja raise_exception, no template)
    is about the client's messages: a 400. The tokenizer normalises the messages (prompt.messages)
    and renders the tools (its template's way, or the default one: prompt.tools)."""
    dicts = [m.model_dump(exclude_none=True) for m in messages]
    try:
        # NOTE: tools= only when there are tools: a tokenizer whose apply_chat_template has no
        # such keyword still renders plain chats
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as e:  # noqa: BLE001 - ValueError, jinja2 TemplateError, ...
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from None


def render_prompt(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    return apply_template(ctx.tokenizer, req.messages, req.add_generation_prompt, req.tools)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 http: HTTPRequest):
    request_id = new_id("chatcmpl")
    ctx.engine.check_capacity(1)
    names = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    plan = tool_plan(ctx, req)
    params = checked_params(ctx, req, req.requested_max_tokens, req.num_logprobs, names,
                            output_constraint(plan, structured_spec(req)),
                            prompt_logprobs=req.prompt_logprobs)
    if plan is not None and plan.parser is not None and plan.parser.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    ids = await off_loop(message_chars(req.messages), render_prompt, ctx, req)
    check_context(len(ids), ctx.max_model_len, req.requested_max_tokens, "messages")
    streams = await admit(ctx, req, [Admission(request_id, ids, ids, params)],
                          current_context("chat"))
    if req.stream:
        return StreamingResponse(stream_body(_stream_parts(ctx, req, request_id, streams[0],
                                                           len(ids), plan), streams),
                                 media_type="text/event-stream",
                                 background=BackgroundTask(close_all, streams))
    (out,) = await cancel_on_disconnect(http, final_outputs(streams))
    # NOTE: prompt logprobs decode (1 + k) tokens per prompt token (see completions)
    size = len(ids) * (1 + req.prompt_logprobs) if req.prompt_logprobs is not None else 0
    return JSONResponse(await off_loop(size, _full_response, ctx, req, request_id, out, plan))


def _logprobs(ctx, req, token_ids, steps):
    if not req.logprobs:
        return None
    return chat_logprobs(ctx.tokenizer, token_ids, steps, req.top_logprobs or 0)


def _full_response(ctx: ServingContext, req: ChatCompletionRequest, request_id: str,
                   out: RequestOutput, plan: ToolPlan | None) -> dict[str, Any]:
    choices = []
    for c in out.outputs:
        message, reason = chat_message(plan, c.text, c.finish_reason)
        choices.append({
            "index": c.index,
            "message": message,
            "logprobs": _logprobs(ctx, req, c.token_ids, c.logprobs or []),
            "finish_reason": reason,
            "stop_reason": c.stop_reason,
        })
    if req.prompt_logprobs is not None:
        field = vllm_prompt_logprobs(ctx.tokenizer, out.prompt_token_ids,
                                     out.prompt_logprobs or [], req.prompt_logprobs)
        for choice in choices:
            choice["prompt_logprobs"] = field
    completion = sum(len(c.token_ids) for c in out.outputs)
    body = {"id": request_id, "object": "chat.completion", "created": now_s(),
            "model": ctx.model_name, "choices": choices,
            "usage": usage(len(out.prompt_token_ids), completion, out.num_cached_tokens)}
    if out.kv_transfer_params is not None:
        body["kv_transfer_params"] = out.kv_transfer_params
    return body


async def _stream_parts(ctx: ServingContext, req: ChatCompletionRequest, request_id: str,
                        gen: RequestStream, prompt_len: int,
                        plan: ToolPlan | None) -> AsyncIterator[str]:
    created = now_s()
    usage_opts = UsageOptions.of(req)
    completion = [0] * req.n                # tokens so far, per choice
    deltas = [ChoiceDeltas(plan) for _ in range(req.n)]   # content, or content and tool calls

    def chunk(index: int, delta: dict, logprobs, finish_reason, kv_params=None) -> str:
        return sse_chunk(request_id, "chat.completion.chunk", created, ctx.model_name,
                         {"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason}, usage_opts,
                         running_usage(prompt_len, completion[index]), kv_params)

    for i in range(req.n):
        yield chunk(i, {"role": "assistant", "content": ""}, None, None)
    finished: set[int] = set()
    cached = 0
    async for out in gen:
        for c in out.outputs:
            if c.index in finished:
                continue
            completion[c.index] += len(c.delta_token_ids)
            lps = None
            if req.logprobs and c.delta_token_ids:
                lps = chat_logprobs(ctx.tokenizer, c.delta_token_ids, c.delta_logprobs or [],
                                    req.top_logprobs or 0)
            parts = deltas[c.index].feed(c.delta_text, c.finished)
            if lps and not parts:
                parts = [{"content": ""}]
            for k, delta in enumerate(parts):
                yield chunk(c.index, delta, lps if k == 0 else None, None)
            if c.finished:
                finished.add(c.index)
                yield chunk(c.index, {}, None, deltas[c.index].finish_reason(c.finish_reason),
                            out.kv_transfer_params)
        if out.finished:
            cached = out.num_cached_tokens
    if usage_opts.include:
        yield sse_usage_chunk(request_id, "chat.completion.chunk", created, ctx.model_name,
                              usage(prompt_len, sum(completion), cached))
    yield SSE_DONE
