"""The served /openapi.json: FastAPI's document from the request models, plus what the routes
and the validators really do, so a client (or a fuzzer) that follows it is never refused.

FastAPI derives the field ranges from the pydantic models; this module adds the OpenAI error
body for every status a route answers, drops FastAPI's 422 (validation errors are 400 here),
writes integer bounds exactly (JSON floats round 2**63 - 1 up), states the rules the model
validators check as schema keywords where JSON Schema can say them, and, once the model is
loaded, the served model name, the vocabulary and the context length.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvmesh.engine.limits import (PRIORITY_MAX, PRIORITY_MIN, SEED_MAX, SEED_MIN, TOP_K_MAX,
                                  RequestLimits)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    error: ErrorDetail


_WHY = {
    400: "Invalid request: a field out of range, an unsupported option, a prompt or "
         "prompt + max_tokens (an embeddings input) longer than the context (code "
         "context_length_exceeded)",
    401: "Missing or wrong API key (only when the server runs with --api-key)",
    404: "Unknown model (code model_not_found)",
    409: "The prefix cache is in use (code prefix_cache_in_use)",
    429: "The waiting queue is full (code queue_full; Retry-After)",
    503: "Not ready, shutting down, or the engine failed (codes not_ready, shutting_down, "
         "engine_dead)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route that can answer these statuses with an OpenAI error body."""
    return {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}


# Structured outputs (api/structured.py, engine/structured/): what JSON Schema cannot say simply.
STRUCTURED_RULES = [
    "at most one output constraint: response_format json_object / json_schema, "
    "structured_outputs (one of json, regex, choice, grammar, json_object), guided_json, "
    "guided_regex, guided_choice, guided_grammar",
    "a JSON schema must be valid and use only keywords xgrammar enforces (no uniqueItems, not, "
    "if/then/else, oneOf, patternProperties, ...; the 400 names the keyword); a regex or EBNF "
    "grammar must parse",
    "ignore_eos and min_tokens cannot be combined with an output constraint",
]

# Rules the request models check across fields; JSON Schema cannot say them simply, so they
# are documented in the schema's description (and the fuzz test generates only bodies that
# keep them: tests/e2e/test_openapi_fuzz.py).
CROSS_FIELD_RULES = {
    "CompletionRequest": [
        *STRUCTURED_RULES,
        "best_of must be omitted or equal n",
        "a text prompt has at least one token (a few control characters tokenize to none)",
        "max_tokens 0 only with echo: true",
        "prompt_logprobs not with stream: true",
        "logit_bias keys are token ids in the vocabulary",
        "stream_options only with stream: true",
        "min_tokens <= max_tokens",
        "prompt tokens + max_tokens <= max_model_len",
    ],
    "ChatCompletionRequest": [
        *STRUCTURED_RULES,
        "tool_choice \"required\" or a named function needs tools (the name among them) and no "
        "other output constraint",
        "top_logprobs requires logprobs: true",
        "prompt_logprobs not with stream: true",
        "logit_bias keys are token ids in the vocabulary",
        "stream_options only with stream: true",
        "min_tokens <= max_tokens (or max_completion_tokens)",
        "prompt tokens (after the chat template) + max_tokens <= max_model_len",
    ],
    "TokenizeRequest": ["exactly one of prompt or messages"],
    "EmbeddingRequest": ["every input within max_model_len tokens",
                         "a text input has at least one token (a few control characters "
                         "tokenize to none)"],
}

_TOOL = {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {
                         "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                         "description": {"type": "string"},
                         "parameters": {"type": "object",
                                        "description": "a JSON schema of the arguments"},
                         "strict": {"type": "boolean"}}}},
}

_EXACT_INT_BOUNDS = {PRIORITY_MIN, PRIORITY_MAX, SEED_MIN, SEED_MAX, TOP_K_MAX}


def finish_openapi(doc: dict[str, Any], model_name: str | None, vocab_size: int | None,
                   max_model_len: int | None,
                   limits: RequestLimits = RequestLimits(),
                   hidden_size: int | None = None) -> dict[str, Any]:
    """Fix up FastAPI's document in place (see the module docstring); returns it."""
    for path, ops in doc.get("paths", {}).items():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
            ok = op.get("responses", {}).get("200")
            if ok is not None and path.endswith("completions"):
                # NOTE: the schema of one event (as schemathesis and OpenAPI 3.2 read it)
                ok["content"]["text/event-stream"] = {"schema": {
                    "type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                    "description": "stream: true: one chunk (JSON) per event, an error object "
                                   "if the engine fails mid-way, then `data: [DONE]`"}}
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _exact_bounds(schemas)
    _declare_validator_rules(schemas, model_name, vocab_size, max_model_len)
    _declare_limits(schemas, limits)
    _declare_embeddings(schemas, model_name, vocab_size, hidden_size, limits)
    return doc


def _declare_embeddings(schemas: dict[str, Any], model_name: str | None, vocab_size: int | None,
                        hidden_size: int | None, limits: RequestLimits) -> None:
    """EmbeddingRequest's rules: non-empty inputs, token ids in the vocabulary, at most
    --max-prompts-per-request inputs, `dimensions` only the model's own."""
    s = schemas.get("EmbeddingRequest")
    if s is None:
        return
    props = s["properties"]
    token = {"type": "integer", "minimum": 0}
    if vocab_size:
        token["maximum"] = vocab_size - 1
    for v in _variants(props["input"]):
        if v.get("type") == "string":
            v["minLength"] = 1
        elif v.get("type") == "array":
            v["minItems"] = 1
            v["maxItems"] = limits.max_prompts_per_request
            if v["items"].get("type") == "string":
                v["items"]["minLength"] = 1
            elif v["items"].get("type") == "integer":
                v["items"] = dict(token)
                v.pop("maxItems")            # one input's token ids: max_model_len bounds them
            else:
                v["items"] = {"type": "array", "items": dict(token), "minItems": 1}
    if hidden_size:
        for v in _variants(props["dimensions"]):
            if v.get("type") == "integer":
                v["minimum"] = v["maximum"] = hidden_size
                v["description"] = "only the model's own size (no shortened embeddings)"
    if model_name:
        for v in _variants(props["model"]):
            if v.get("type") == "string":
                v["enum"] = [model_name]
    s["description"] = ("Cross-field rules: " + "; ".join(CROSS_FIELD_RULES["EmbeddingRequest"])
                        + ".")


def _declare_limits(schemas: dict[str, Any], limits: RequestLimits) -> None:
    """The deployment's request limits (the `--max-*` flags) as schema bounds."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        s = schemas.get(name)
        if s is None:
            continue
        props = s["properties"]
        for v in _variants(props.get("stop", {})):
            if v.get("type") == "string":
                v["maxLength"] = limits.max_stop_string_length
            elif v.get("type") == "array":
                v["maxItems"] = limits.max_stop_strings
                v["items"]["maxLength"] = limits.max_stop_string_length
        for key, bound in (("n", limits.max_n), ("logprobs", limits.max_logprobs),
                           ("top_logprobs", limits.max_logprobs),
                           ("prompt_logprobs", limits.max_logprobs)):
            for v in _variants(props.get(key, {})):
                if v.get("type") == "integer":
                    v["maximum"] = bound
        for v in _variants(props.get("stop_token_ids", {})):
            if v.get("type") == "array":
                v["maxItems"] = limits.max_stop_token_ids


def _exact_bounds(node: Any) -> None:
    """Integer bounds as integers: 9.223372036854776e+18 is 2**63, one past SEED_MAX."""
    if isinstance(node, dict):
        for key in ("minimum", "maximum"):
            v = node.get(key)
            if isinstance(v, float) and node.get("type") == "integer":
                exact = next((b for b in _EXACT_INT_BOUNDS if float(b) == v), None)
                node[key] = exact if exact is not None else int(v)
        for child in node.values():
            _exact_bounds(child)
    elif isinstance(node, list):
        for child in node:
            _exact_bounds(child)


def _variants(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return prop.get("anyOf", [prop])


def _declare_validator_rules(schemas: dict[str, Any], model_name: str | None,
                             vocab_size: int | None, max_model_len: int | None) -> None:
    token = {"type": "integer", "minimum": 0}
    if vocab_size:
        token["maximum"] = vocab_size - 1
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        s = schemas.get(name)
        if s is None:
            continue
        props = s["properties"]
        for v in _variants(props["stop"]):
            if v.get("type") == "string":
                v["minLength"] = 1
            elif v.get("type") == "array":
                v["items"]["minLength"] = 1
        for v in _variants(props["logit_bias"]):
            if v.get("type") == "object":
                v["propertyNames"] = {"pattern": "^[0-9]+$"}
                v["description"] = ("token id -> bias, clamped to [-100, 100]; ids must be in "
                                    "the vocabulary")
        if max_model_len:
            for key in ("max_tokens", "max_completion_tokens"):
                for v in _variants(props.get(key, {})):
                    if v.get("type") == "integer":
                        v["maximum"] = max_model_len - 1
        rules = CROSS_FIELD_RULES[name]
        s["description"] = "Cross-field rules: " + "; ".join(rules) + "."
    comp = schemas.get("CompletionRequest")
    if comp is not None:
        props = comp["properties"]
        for v in _variants(props["prompt"]):
            if v.get("type") == "string":
                v["minLength"] = 1
            elif v.get("type") == "array":
                v["minItems"] = 1
                if v["items"].get("type") == "string":
                    v["items"]["minLength"] = 1
                elif v["items"].get("type") == "integer":
                    v["items"] = dict(token)
                else:
                    v["items"] = {"type": "array", "items": dict(token), "minItems": 1}
        for v in _variants(props["suffix"]):
            if v.get("type") == "string":
                v["maxLength"] = 0
                v["description"] = "not supported: only \"\" or null"
    chat = schemas.get("ChatCompletionRequest")
    if chat is not None:
        props = chat["properties"]
        for v in _variants(props["tools"]):
            if v.get("type") == "array":
                v["items"] = _TOOL
                v["description"] = ("functions the model may call (rendered by the chat "
                                    "template, or the default Hermes-style section)")
        props["tool_choice"] = {"anyOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "additionalProperties": False,
             "properties": {"type": {"type": "string", "enum": ["function"]},
                            "function": {"type": "object", "required": ["name"],
                                         "properties": {"name": {"type": "string"}}}}},
            {"type": "null"}], "title": "Tool Choice"}
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest",
                 "DetokenizeRequest"):
        if model_name and name in schemas:
            for v in _variants(schemas[name]["properties"]["model"]):
                if v.get("type") == "string":
                    v["enum"] = [model_name]
    fmt = schemas.get("ResponseFormat")
    if fmt is not None:
        fmt["properties"]["type"] = {"type": "string", "title": "Type",
                                     "enum": ["text", "json_object", "json_schema"]}
    tok = schemas.get("TokenizeRequest")
    if tok is not None:
        for v in _variants(tok["properties"]["messages"]):
            if v.get("type") == "array":
                v["minItems"] = 1
        tok["description"] = "Cross-field rules: " + "; ".join(CROSS_FIELD_RULES["TokenizeRequest"])
    detok = schemas.get("DetokenizeRequest")
    if detok is not None:
        detok["properties"]["tokens"]["items"] = dict(token)
