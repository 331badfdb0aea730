"""POST /v1/completions."""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from kvmesh.api.errors import bad_request
from kvmesh.api.protocol import CompletionRequest
from kvmesh.api.serving_common import (SSE_DONE, Admission, ServingContext, UsageOptions, admit,
                                       cancel_on_disconnect, check_context, checked_params,
                                       close_all, completion_logprobs, final_outputs,
                                       merge_streams, new_id, now_s, off_loop, running_usage,
                                       sse_chunk, sse_usage_chunk, stream_body, structured_spec,
                                       usage)
from kvmesh.common.tracing import current_context
from kvmesh.engine.async_engine import RequestStream
from kvmesh.engine.outputs import RequestOutput


async def create_completion(ctx: ServingContext, req: CompletionRequest, http: HTTPRequest):
    request_id = new_id("cmpl")
    prompts = req.prompts()
    limit = ctx.limits.max_prompts_per_request
    if len(prompts) > limit:
        raise bad_request(f"at most {limit} prompts are allowed in one request, got "
                          f"{len(prompts)}", param="prompt")
    ctx.engine.check_capacity(len(prompts))
    max_tokens = req.max_tokens
    if "max_tokens" not in req.model_fields_set and ctx.limits.max_tokens:
        max_tokens = min(max_tokens, ctx.limits.max_tokens)   # OpenAI's default 16, capped
    params = checked_params(ctx, req, max_tokens, req.logprobs, structured=structured_spec(req))
    prepared = await off_loop(sum(map(len, prompts)), _tokenize, ctx, prompts, max_tokens)
    admissions = [Admission(f"{request_id}-{i}", prompt, ids, params)
                  for i, (prompt, (_, ids)) in enumerate(zip(prompts, prepared))]
    prompt_texts = [text for text, _ in prepared]
    prompt_lens = [len(ids) for _, ids in prepared]
    gens = await admit(ctx, req, admissions, current_context())
    if req.stream:
        return StreamingResponse(stream_body(_stream_parts(ctx, req, request_id, gens,
                                                           prompt_texts, prompt_lens), gens),
                                 media_type="text/event-stream",
                                 background=BackgroundTask(close_all, gens))
    outs = await cancel_on_disconnect(http, final_outputs(gens))
    return JSONResponse(_full_response(ctx, req, request_id, outs, prompt_texts))


def _tokenize(ctx: ServingContext, prompts: list[str | list[int]],
              max_tokens: int | None) -> list[tuple[str, list[int]]]:
    """(text, token ids) of every prompt, each within the context length (maybe on a worker
    thread: see off_loop)."""
    prepared = []
    for prompt in prompts:
        try:
            text, ids = ctx.input_processor.tokenize(prompt)
        except ValueError as e:
            raise bad_request(str(e), param="prompt") from None
        check_context(len(ids), ctx.max_model_len, max_tokens, "prompt")
        prepared.append((text if text is not None else ctx.tokenizer.decode(ids), ids))
    return prepared


def _choice_logprobs(ctx, req, token_ids, steps, offset):
    if req.logprobs is None:
        return None
    return completion_logprobs(ctx.tokenizer, token_ids, steps, offset)


def _full_response(ctx: ServingContext, req: CompletionRequest, request_id: str,
                   outs: list[RequestOutput], prompt_texts: list[str]) -> dict[str, Any]:
    choices, completion_tokens, prompt_tokens, cached = [], 0, 0, 0
    for p, out in enumerate(outs):
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        prefix = prompt_texts[p] if req.echo else ""
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choices.append({
                "index": p * req.n + c.index,
                "text": prefix + c.text,
                "logprobs": _choice_logprobs(ctx, req, c.token_ids, c.logprobs or [], len(prefix)),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            })
    return {"id": request_id, "object": "text_completion", "created": now_s(),
            "model": ctx.model_name, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached)}


async def _stream_parts(ctx: ServingContext, req: CompletionRequest, request_id: str,
                        gens: list[RequestStream], prompt_texts: list[str],
                        prompt_lens: list[int]) -> AsyncIterator[str]:
    created = now_s()
    usage_opts = UsageOptions.of(req)
    started: set[int] = set()
    finished: set[int] = set()
    offsets: dict[int, int] = {}
    completion: dict[int, int] = {}            # tokens so far, per choice index
    cached = 0

    def chunk(p: int, index: int, text: str, logprobs, finish_reason) -> str:
        return sse_chunk(request_id, "text_completion", created, ctx.model_name,
                         {"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": finish_reason}, usage_opts,
                         running_usage(prompt_lens[p], completion.get(index, 0)))

    async for p, out in merge_streams(gens):
        for c in out.outputs:
            index = p * req.n + c.index
            if index in finished:
                continue
            text = c.delta_text
            if req.echo and index not in started:
                text = prompt_texts[p] + text
            started.add(index)
            completion[index] = completion.get(index, 0) + len(c.delta_token_ids)
            lps = None
            if req.logprobs is not None and c.delta_token_ids:
                lps = completion_logprobs(ctx.tokenizer, c.delta_token_ids,
                                          c.delta_logprobs or [], offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lps["tokens"])
            if c.finished:
                finished.add(index)
            if text or lps or c.finished:
                yield chunk(p, index, text, lps, c.finish_reason)
        if out.finished:
            cached += out.num_cached_tokens
    if usage_opts.include:
        yield sse_usage_chunk(request_id, "text_completion", created, ctx.model_name,
                              usage(sum(prompt_lens), sum(completion.values()), cached))
    yield SSE_DONE
