"""OpenAI request models (pydantic). Validation errors become HTTP 400 with an OpenAI body.

Unknown fields are rejected, as OpenAI does ("Unrecognized request argument supplied");
fields OpenAI itself treats as metadata (user, metadata, store, ...) are accepted and ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from kvmesh.api.structured import StructuredFields
from kvmesh.api.tools import check_tools

from kvmesh.engine.limits import PRIORITY_MAX, PRIORITY_MIN, SEED_MAX, SEED_MIN, TOP_K_MAX
from kvmesh.engine.sampling_params import SamplingParams

NonNegInt = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(StructuredFields):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extensions). The bounds a
    deployment chooses (n, stop strings, stop_token_ids, logprobs, max_tokens: RequestLimits)
    are checked by the input processor, not here."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=TOP_K_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id (a JSON object key: a string of digits) -> bias in [-100, 100] (clamped)
    logit_bias: dict[str, float] | None = None
    # vLLM's extension: top-k logprobs of every prompt token (0: the prompt token's only)
    prompt_logprobs: int | None = Field(None, ge=0)
    # vLLM's prefill/decode hand-off fields (engine/kv_transfer/params.py checks them)
    kv_transfer_params: dict[str, Any] | None = None
    # accepted and ignored, as OpenAI ignores them for generation
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def _check_common(self) -> None:
        if self.cache_salt == "":
            self.cache_salt = None     # NOTE: the router treats an empty salt as none, too
        if self.logit_bias:
            bad = [k for k in self.logit_bias if not (k.isascii() and k.isdigit())]
            if bad:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {bad[0]!r}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream: true")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """`prompt_logprobs`: what the engine computes (the endpoint may need more than the
        field asks for: completions' echo with logprobs)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # NOTE: 0 only with echo: the prompt's logprobs and nothing generated (lm-eval's loglikelihood)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        self._check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n or be omitted)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only allowed with echo: true")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the prompt (and its logprobs) is the whole answer."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Top-k the engine computes for the prompt: echo with logprobs and prompt_logprobs
        share one computation (each view keeps its own k)."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs)
                  if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None    # assistant: the calls it made (raw JSON)
    tool_call_id: str | None = None                   # tool: the call this result answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None          # raw JSON: see api/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    _named_tool: str | None = PrivateAttr(None)        # tool_choice's function, if it names one

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        self._check_common()
        self._named_tool = check_tools(self.tools, self.tool_choice)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's fields, plus vLLM's priority and cache_salt)."""
    model_config = ConfigDict(extra="forbid")
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "EmbeddingRequest":
        if self.cache_salt == "":
            self.cache_salt = None
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        if any(isinstance(x, str) and not x for x in self.inputs()):
            raise ValueError("input must not contain empty strings")
        if any(isinstance(x, list) and not x for x in self.inputs()):
            raise ValueError("input must not contain empty token lists")
        return self

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if all(isinstance(t, int) for t in x):
            return [list(x)]
        return list(x)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[NonNegInt]
