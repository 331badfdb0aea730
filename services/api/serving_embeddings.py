"""POST /v1/embeddings: each input is a prefill-only engine request, pooled (`kvmesh serve
--pooling last|mean`) and L2-normalised; they batch with generation in the same scheduler, and
their KV blocks are freed in the step that pools them."""
from __future__ import annotations

import base64

import numpy as np
from kvmesh.api.errors import APIError, bad_request
from kvmesh.api.protocol import EmbeddingRequest
from kvmesh.api.serving_common import (
    ServingContext,
    cancel_on_disconnect,
    close_all,
    final_outputs,
    new_id,
    off_loop,
    tokenize_input,
)
from kvmesh.common.tracing import current_context
from kvmesh.engine.async_engine import RequestStream
from kvmesh.engine.pooling_params import PoolingParams
from kvmesh.engine.sampling_params import SamplingParams
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

# NOTE: nothing is sampled for a pooled request; these settings only satisfy the engine's
# request shape (one sample, one token's worth of limits).
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, http: HTTPRequest,
                           pooling: PoolingParams, hidden_size: int):
    request_id = new_id("embd")
    inputs = req.inputs()
    limit = ctx.limits.max_prompts_per_request
    if len(inputs) > limit:
        raise bad_request(f"at most {limit} inputs are allowed in one request, got "
                          f"{len(inputs)}", param="input")
    if req.dimensions is not None and req.dimensions != hidden_size:
        raise bad_request(f"dimensions {req.dimensions} is not supported: this model's "
                          f"embeddings have {hidden_size} dimensions (omit dimensions or send "
                          f"{hidden_size})", param="dimensions")
    ctx.engine.check_capacity(len(inputs))
    prepared = await off_loop(sum(map(len, inputs)), _tokenize, ctx, inputs)
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prepared):
            streams.append(await ctx.engine.add_request(
                f"{request_id}-{i}", text if text is not None else ids, _POOLING_SAMPLING,
                req.priority, req.cache_salt, prompt_ids=ids,
                trace_context=current_context("embeddings"), pooling=pooling,
                lora_request=ctx.lora_request))
    except BaseException:
        await close_all(streams)
        raise
    outs = await cancel_on_disconnect(http, final_outputs(streams))
    data = [{"object": "embedding", "index": i,
             "embedding": _encode(out.embedding, req.encoding_format)}
            for i, out in enumerate(outs)]
    prompt_tokens = sum(len(ids) for _, ids in prepared)
    return JSONResponse({"object": "list", "data": data, "model": ctx.model_name,
                         "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


def _tokenize(ctx: ServingContext, inputs: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of every input, each within the context length."""
    prepared = []
    for x in inputs:
        text, ids = tokenize_input(ctx, x, "input")
        if len(ids) > ctx.max_model_len:
            raise APIError(400, f"This model's maximum context length is {ctx.max_model_len} "
                           f"tokens. However, an input has {len(ids)} tokens. Please reduce "
                           "the length of the input.", code="context_length_exceeded",
                           param="input")
        prepared.append((text, ids))
    return prepared


def _encode(vector: list[float] | None, encoding_format: str) -> list[float] | str:
    """`float`: a JSON list; `base64`: the little-endian float32 bytes (what OpenAI's client
    decodes with numpy.frombuffer(..., dtype="float32"))."""
    assert vector is not None, "a pooled request's final output carries its embedding"
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
