"""POST /v1/completions."""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from kvmesh.api.errors import bad_request
from kvmesh.api.prompt_logprobs import echo_logprobs, join_logprobs, vllm_prompt_logprobs
from kvmesh.api.protocol import CompletionRequest
from kvmesh.api.serving_common import (SSE_DONE, Admission, ServingContext, UsageOptions, admit,
                                       cancel_on_disconnect, check_context, checked_params,
                                       close_all, completion_logprobs, final_outputs,
                                       merge_streams, new_id, now_s, off_loop, running_usage,
                                       sse_chunk, sse_usage_chunk, stream_body, structured_spec,
                                       tokenize_input, usage)
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
    if req.kv_transfer_params is not None and len(prompts) > 1:
        raise bad_request("kv_transfer_params names one hand-off: send one prompt per request",
                          param="kv_transfer_params")
    ctx.engine.check_capacity(len(prompts))
    max_tokens = req.max_tokens
    if "max_tokens" not in req.model_fields_set and ctx.limits.max_tokens:
        max_tokens = min(max_tokens, ctx.limits.max_tokens)   # OpenAI's default 16, capped
    # NOTE: echo with max_tokens 0 (lm-eval's loglikelihood requests): the engine computes the
    # prompt and samples one token, which the answer leaves out; the prompt needs room for it.
    engine_max_tokens = 1 if req.echo_only else max_tokens
    params = checked_params(ctx, req, engine_max_tokens, req.logprobs, structured=structured_spec(req),
                            prompt_logprobs=req.engine_prompt_logprobs)
    prepared = await off_loop(sum(map(len, prompts)), _tokenize, ctx, prompts,
                              None if req.echo_only else max_tokens)
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
    # NOTE: prompt logprobs decode (1 + k) tokens per prompt token: a long prompt's answer is
    # built on a worker thread, as its tokenization was
    size = sum(prompt_lens) * (1 + req.engine_prompt_logprobs) if req.engine_prompt_logprobs else 0
    body = await off_loop(size, _full_response, ctx, req, request_id, outs, prompt_texts)
    return JSONResponse(body)


def _tokenize(ctx: ServingContext, prompts: list[str | list[int]],
              max_tokens: int | None) -> list[tuple[str, list[int]]]:
    """(text, token ids) of every prompt, each within the context length (maybe on a worker
    thread: see off_loop)."""
    prepared = []
    for prompt in prompts:
        text, ids = tokenize_input(ctx, prompt, "prompt")
        check_context(len(ids), ctx.max_model_len, max_tokens, "prompt")
        prepared.append((text if text is not None else ctx.tokenizer.decode(ids), ids))
    return prepared


def _choice_logprobs(ctx: ServingContext, req: CompletionRequest, out: RequestOutput,
                     token_ids: list[int], steps, offset: int) -> dict[str, Any] | None:
    """The choice's legacy logprobs: the echoed prompt's (from its prefill) when echo is on,
    then the generated tokens' (`token_ids`, their text offsets from `offset`)."""
    if req.logprobs is None:
        return None
    generated = completion_logprobs(ctx.tokenizer, token_ids, steps, offset) if token_ids else None
    if not req.echo:
        return generated or completion_logprobs(ctx.tokenizer, [], [], offset)
    prompt = echo_logprobs(ctx.tokenizer, out.prompt_token_ids, out.prompt_logprobs or [],
                           req.logprobs)
    return join_logprobs(prompt, generated)


def _prompt_logprobs_field(ctx: ServingContext, req: CompletionRequest, out: RequestOutput):
    return vllm_prompt_logprobs(ctx.tokenizer, out.prompt_token_ids, out.prompt_logprobs or [],
                                req.prompt_logprobs)


def _full_response(ctx: ServingContext, req: CompletionRequest, request_id: str,
                   outs: list[RequestOutput], prompt_texts: list[str]) -> dict[str, Any]:
    choices, completion_tokens, prompt_tokens, cached = [], 0, 0, 0
    for p, out in enumerate(outs):
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        prefix = prompt_texts[p] if req.echo else ""
        for c in out.outputs:
            token_ids = [] if req.echo_only else c.token_ids
            completion_tokens += len(token_ids)
            choice = {
                "index": p * req.n + c.index,
                "text": prefix + ("" if req.echo_only else c.text),
                "logprobs": _choice_logprobs(ctx, req, out, token_ids, c.logprobs or [],
                                             len(prefix)),
                "finish_reason": "length" if req.echo_only else c.finish_reason,
                "stop_reason": None if req.echo_only else c.stop_reason,
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs_field(ctx, req, out)
            choices.append(choice)
    body = {"id": request_id, "object": "text_completion", "created": now_s(),
            "model": ctx.model_name, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached)}
    kv_params = [o.kv_transfer_params for o in outs if o.kv_transfer_params is not None]
    if kv_params:
        body["kv_transfer_params"] = kv_params[0]     # NOTE: one prompt only (checked above)
    return body


async def _stream_parts(ctx: ServingContext, req: CompletionRequest, request_id: str,
                        gens: list[RequestStream], prompt_texts: list[str],
                        prompt_lens: list[int]) -> AsyncIterator[str]:
    created = now_s()
    usage_opts = UsageOptions.of(req)
    started: set[int] = set()
    finished: set[int] = set()
    offsets: dict[int, int] = {}               # text offset of the next token, per choice index
    completion: dict[int, int] = {}            # tokens so far, per choice index
    cached = 0

    def chunk(p: int, index: int, text: str, logprobs, finish_reason, kv_params=None) -> str:
        return sse_chunk(request_id, "text_completion", created, ctx.model_name,
                         {"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": finish_reason}, usage_opts,
                         running_usage(prompt_lens[p], completion.get(index, 0)), kv_params)

    async for p, out in merge_streams(gens):
        for c in out.outputs:
            index = p * req.n + c.index
            if index in finished:
                continue
            first = index not in started
            started.add(index)
            # NOTE: echo with max_tokens 0: the one token the engine sampled is not shown
            delta_ids = [] if req.echo_only else c.delta_token_ids
            text = "" if req.echo_only else c.delta_text
            if req.echo and first:
                text = prompt_texts[p] + text
                offsets[index] = len(prompt_texts[p])
            completion[index] = completion.get(index, 0) + len(delta_ids)
            lps = None
            if req.logprobs is not None and delta_ids:
                lps = completion_logprobs(ctx.tokenizer, delta_ids, c.delta_logprobs or [],
                                          offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lps["tokens"])
            if req.logprobs is not None and req.echo and first:
                lps = join_logprobs(echo_logprobs(ctx.tokenizer, out.prompt_token_ids,
                                                  out.prompt_logprobs or [], req.logprobs), lps)
            if c.finished:
                finished.add(index)
            if text or lps or c.finished:
                yield chunk(p, index, text, lps,
                            ("length" if req.echo_only else c.finish_reason) if c.finished else None,
                            out.kv_transfer_params if c.finished else None)
        if out.finished:
            cached += out.num_cached_tokens
    if usage_opts.include:
        yield sse_usage_chunk(request_id, "text_completion", created, ctx.model_name,
                              usage(sum(prompt_lens), sum(completion.values()), cached))
    yield SSE_DONE
