"""create_app: the FastAPI application (routes, errors, auth, request ids)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh.api.body_limit import BodySizeLimit
from kvmesh.api.tool_parsers import ToolParser
from kvmesh.api.errors import APIError, error_response
from kvmesh.api.lora import LoadLoRAAdapterRequest, ServedLoRAs, UnloadLoRAAdapterRequest
from kvmesh.api.metrics import EngineMetrics
from kvmesh.api.openapi import error_responses, finish_openapi
from kvmesh.api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                 EmbeddingRequest, TokenizeRequest)
from kvmesh.api.serving_chat import apply_template, create_chat_completion
from kvmesh.api.serving_common import ServingContext, message_chars, now_s, off_loop
from kvmesh.api.serving_completions import create_completion
from kvmesh.api.serving_embeddings import create_embedding
from kvmesh.common.auth import check_bearer
from kvmesh.common.cache_salt import CacheSaltSource
from kvmesh.common.disconnect import ClientDisconnected
from kvmesh.common.openai_errors import error_json
from kvmesh.common.tracing import get_tracer, server_span
from kvmesh.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from kvmesh.engine.limits import RequestLimits
from kvmesh.engine.pooling_params import PoolingParams

logger = logging.getLogger("kvmesh.api")

OPEN_PATHS = ("/health", "/ready", "/metrics")
# NOTE: admin endpoints change state shared by every client: they need a key even where the
# OpenAI routes are open (--admin-api-key, else --api-key).
ADMIN_PATHS = ("/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_JSON = b"application/json"
LOADING_RETRY_AFTER_S = 5     # Retry-After of a request answered 503 while the model loads


def _force_json_body(scope: Scope) -> Scope:
    """Every POST route takes a JSON body: read it as JSON whatever Content-Type says.

    NOTE: `curl -d '{...}'` sends application/x-www-form-urlencoded, and vLLM-compatible clients
    expect such a body to work; FastAPI would hand the raw bytes to the model (a confusing 400)."""
    if scope["method"] != "POST" or any(k.lower() == b"content-type" and _is_json_type(v)
                                        for k, v in scope["headers"]):
        return scope
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", _JSON)]}


def _is_json_type(value: bytes) -> bool:
    mime = value.split(b";", 1)[0].strip().lower()
    return mime == _JSON or (mime.startswith(b"application/") and mime.endswith(b"+json"))


def _engine_failure(state: ServerState) -> str | None:
    """Why the engine can serve no more (its thread failed), or None."""
    if state.engine_error:
        return state.engine_error
    if state.engine is not None and state.engine.dead is not None:
        return f"the engine failed: {state.engine.dead!r}"
    return None


@dataclass
class ServerState:
    """What the routes need; the engine arrives once the model is loaded."""
    api_key: str | None = None
    admin_api_key: str | None = None    # for ADMIN_PATHS (else api_key); both None: open
    cache_salt_from: CacheSaltSource = field(default_factory=CacheSaltSource)  # tenant isolation
    engine: AsyncLLMEngine | None = None
    metrics: EngineMetrics | None = None
    model_name: str | None = None
    max_model_len: int = 0
    ready: bool = False                 # model loaded and a one-token generation succeeded
    draining: bool = False              # shutting down: admit nothing new
    load_error: str | None = None
    engine_error: str | None = None     # the engine thread failed: the process exits non-zero
    stop_server: Callable[[], None] | None = None   # asks uvicorn to shut down (set by serve)
    limits: RequestLimits = field(default_factory=RequestLimits)   # kvmesh serve's --max-* flags
    tool_parser: ToolParser | None = None   # --tool-call-parser (None: chosen from the template)
    pooling: PoolingParams = field(default_factory=PoolingParams)  # /v1/embeddings (--pooling)
    loras: ServedLoRAs = field(default_factory=ServedLoRAs)  # LoRA adapters served as models
    created: int = field(default_factory=now_s)

    def context(self) -> ServingContext:
        """What a route serves with; a 503 while the server cannot serve (checked before anything
        else about the request: during loading no model name is known yet)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.load_error:
            raise APIError(503, self.load_error, code="load_failed")
        if self.engine is None or not self.ready:
            raise APIError(503, "model is loading", code="not_ready",
                           headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
        return ServingContext(self.engine, self.model_name or "", self.max_model_len,
                              self.tool_parser)


class RequestContextMiddleware:
    """Pure ASGI (keeps client-disconnect detection of streams): echoes or assigns X-Request-Id
    and enforces the bearer API key on everything but health, readiness and metrics."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        rid_header = (b"x-request-id", request_id.encode()[:256])

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        key = self.state.api_key
        if scope["path"] in ADMIN_PATHS:
            key = self.state.admin_api_key or key
        if key and not scope["path"].startswith(OPEN_PATHS):
            refused = check_bearer(headers.get("authorization", ""), key)
            if refused is not None:
                await refused(scope, receive, send_with_id)
                return
        scope = _force_json_body(scope)
        if get_tracer() is not None and not scope["path"].startswith(OPEN_PATHS):
            # NOTE: the span is current while the route runs: serving_* hand its context to the
            # engine, which parents the request's spans on it.
            with server_span(scope, headers) as on_send:
                async def send_traced(message) -> None:
                    on_send(message)
                    await send_with_id(message)
                await self.app(scope, receive, send_traced)
            return
        await self.app(scope, receive, send_with_id)


def _validation_param(exc: RequestValidationError) -> str | None:
    """The field of the first error, as OpenAI's "param" (None for a body-level error)."""
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc and err.get("type") not in ("json_invalid", "extra_forbidden"):
            return ".".join(loc)
    return None


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            return f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
        if err.get("type") == "extra_forbidden":
            parts.append(f"Unrecognized request argument supplied: {loc}")
            continue
        msg = err.get("msg", "invalid value")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def create_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="kvmesh", version="0.1.0", lifespan=lifespan)
    app.state.kvmesh = state
    _serve_openapi(app, state)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_req: Request, exc: RequestValidationError):
        return error_json(400, _validation_message(exc), param=_validation_param(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(req: Request, exc: StarletteHTTPException):
        return _http_error(req, exc)

    @app.exception_handler(APIError)
    async def _on_api_error(_req: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(ValueError)
    async def _on_value_error(_req: Request, exc: ValueError):
        return error_json(400, str(exc), param=getattr(exc, "param", None))

    @app.exception_handler(QueueFullError)
    async def _on_queue_full(_req: Request, exc: QueueFullError):
        if state.metrics is not None:
            state.metrics.count_rejected()
        return error_response(APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}))

    @app.exception_handler(EngineDeadError)
    async def _on_dead(_req: Request, exc: EngineDeadError):
        return error_response(APIError(503, str(exc), code="engine_dead"))

    @app.exception_handler(ClientDisconnected)
    async def _on_client_left(_req: Request, _exc: ClientDisconnected):
        return Response(status_code=499)      # nginx's "client closed request", as the router

    @app.exception_handler(Exception)
    async def _on_error(_req: Request, exc: Exception):
        logger.exception("unhandled error")
        return error_json(500, "internal server error")

    async def serving(model: str | None) -> ServingContext:
        """The context for a request naming `model`: 503 while loading, then 404 for a model
        this server does not serve (an adapter in --lora-resolver-dir is loaded first)."""
        ctx = state.context()
        if model is not None and model != ctx.model_name:
            lora = state.loras.get(model)
            if lora is None and state.loras.resolver is not None:
                lora = await state.loras.resolve(ctx.engine, model)
            if lora is None:
                raise APIError(404, f"The model `{model}` does not exist.",
                               code="model_not_found", param="model")
            return dataclasses.replace(ctx, model_name=model, lora_request=lora)
        return ctx

    @app.get("/health", responses=error_responses(503))
    async def health():
        failure = _engine_failure(state)
        if failure:
            return error_json(503, failure, "engine_dead")
        if state.load_error:
            return error_json(500, state.load_error)
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"description": 'Loading, draining or failed: '
                                          '{"status": "loading" | "draining" | "failed"}'}})
    async def ready():
        failed = _engine_failure(state)
        if state.ready and not state.draining and not failed:
            return {"status": "ready"}
        status = "failed" if failed else "draining" if state.draining else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses=error_responses(401, 503))
    async def models():
        ctx = state.context()
        return {"object": "list", "data": [
            {"id": ctx.model_name, "object": "model", "created": state.created,
             "owned_by": "kvmesh", "max_model_len": ctx.max_model_len,
             # NOTE: not in OpenAI's or vLLM's model card: what `--dtype auto` chose, for clients
             "dtype": str(ctx.engine.engine.loaded.dtype).removeprefix("torch."),
             # and how the weights are held: "gguf", an HF method (awq, gptq, ...) or null (float)
             "quantization": ctx.engine.engine.loaded.quantization,
             # and their bytes as held (a rank's share under tensor parallelism)
             "weight_bytes": ctx.engine.engine.loaded.weight_bytes,
             # and the KV cache's element type (--kv-cache-dtype, resolved: float8_e4m3fn, ...)
             "kv_cache_dtype": str(ctx.engine.engine.cache_dtype).removeprefix("torch.")},
            *state.loras.model_cards(state.created, ctx.max_model_len)]}

    @app.post("/v1/completions", responses=error_responses(400, 401, 404, 429, 503))
    async def completions(body: CompletionRequest, request: Request):
        ctx = await serving(body.model)
        body.cache_salt = state.cache_salt_from.salt(request.headers, body.cache_salt)
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", responses=error_responses(400, 401, 404, 429, 503))
    async def chat(body: ChatCompletionRequest, request: Request):
        ctx = await serving(body.model)
        body.cache_salt = state.cache_salt_from.salt(request.headers, body.cache_salt)
        return await create_chat_completion(ctx, body, request)

    @app.post("/v1/embeddings", responses=error_responses(400, 401, 404, 429, 503))
    async def embeddings(body: EmbeddingRequest, request: Request):
        ctx = await serving(body.model)
        body.cache_salt = state.cache_salt_from.salt(request.headers, body.cache_salt)
        return await create_embedding(ctx, body, request, state.pooling,
                                      ctx.engine.engine.loaded.config.hidden_size)

    @app.post("/tokenize", responses=error_responses(400, 401, 404, 503))
    async def tokenize(body: TokenizeRequest):
        ctx = await serving(body.model)
        if body.messages is not None:
            ids = await off_loop(message_chars(body.messages), apply_template, ctx.tokenizer,
                                 body.messages, body.add_generation_prompt)
        else:
            ids = await off_loop(len(body.prompt), ctx.tokenizer.encode, body.prompt,
                                 body.add_special_tokens)
        # NOTE: a JSONResponse, not a dict: FastAPI's jsonable_encoder walks a dict in Python
        # (seconds on the loop for a 2 MB prompt's ids); json.dumps takes milliseconds.
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len})

    @app.post("/detokenize", responses=error_responses(400, 401, 404, 503))
    async def detokenize(body: DetokenizeRequest):
        ctx = await serving(body.model)
        vocab = ctx.engine.engine.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           param="tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.post("/reset_prefix_cache", responses=error_responses(401, 409, 503))
    async def reset_prefix_cache():
        ctx = state.context()
        if not await ctx.engine.reset_prefix_cache():
            raise APIError(409, "the prefix cache cannot be reset while requests hold KV-cache "
                           "blocks; retry when the server is idle", code="prefix_cache_in_use")
        return {"status": "ok"}

    def lora_engine() -> AsyncLLMEngine:
        ctx = state.context()
        if ctx.engine.engine.lora is None:
            raise APIError(400, "this server serves no LoRA adapters; start it with --enable-lora",
                           code="lora_not_enabled")
        return ctx.engine

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
              responses=error_responses(400, 401, 503))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return PlainTextResponse(await state.loras.load(lora_engine(), body))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses=error_responses(400, 401, 404, 503))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return PlainTextResponse(await state.loras.unload(lora_engine(), body))

    # NOTE: the API key is checked before the body is read; the body's size before it is parsed.
    return RequestContextMiddleware(  # type: ignore[return-value]
        BodySizeLimit(app, state.limits.max_request_body_bytes), state)


def _serve_openapi(app: FastAPI, state: ServerState) -> None:
    """/openapi.json with the error bodies and the validators' rules (kvmesh.api.openapi); the
    model's name, vocabulary and context length appear once it is loaded (cached from then on)."""
    fastapi_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        loaded = state.engine is not None and state.ready
        # NOTE: with --enable-lora the served names change at run time: no `model` enum then
        fixed_name = loaded and state.engine.engine.lora is None
        doc = finish_openapi(fastapi_openapi(), state.model_name if fixed_name else None,
                             state.engine.engine.vocab_size if loaded else None,
                             state.max_model_len if loaded else None, state.limits,
                             state.engine.engine.loaded.config.hidden_size if loaded else None)
        if not loaded:
            app.openapi_schema = None     # NOTE: rebuilt with the model's limits once ready
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _http_error(req: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing errors (unknown path, wrong method) with OpenAI's error body."""
    if exc.status_code == 404:
        message = f"Invalid URL ({req.method} {req.url.path})"
        code = "not_found"
    elif exc.status_code == 405:
        message = f"Method {req.method} is not allowed for {req.url.path}"
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return error_json(exc.status_code, message, code, headers=exc.headers)


async def warm_up(engine: AsyncLLMEngine) -> None:
    """One single-token generation: /ready turns green only after it succeeds."""
    from kvmesh.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0)
    async for _ in engine.generate("warmup-" + uuid.uuid4().hex, [1, 2, 3], params):
        pass
    await asyncio.sleep(0)
