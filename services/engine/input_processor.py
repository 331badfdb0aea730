"""The engine's one input boundary: (request id, prompt, SamplingParams, priority, cache salt)
-> a frozen, fully validated `EngineRequest`. Torch-free.

Every front end builds its requests here, on its own thread: AsyncLLMEngine before a request is
queued for the engine thread, the offline `LLM` before any request reaches the engine.
`LLMEngine.add_request` trusts an `EngineRequest` as is, so a bad request is refused before it
can change engine state, and each rule is checked in one place. The bounds live in limits.py.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvmesh.engine.limits import PRIORITY_MAX, PRIORITY_MIN, RequestLimits
from kvmesh.engine.lora.request import LoRARequest
from kvmesh.engine.pooling_params import PoolingParams
from kvmesh.engine.sampling_params import SamplingParams, SamplingParamsError
from kvmesh.engine.structured.validate import check_structured

if TYPE_CHECKING:
    from kvmesh.prompt.tokenizer import Tokenizer

PromptInput = str | Sequence[int]


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """A request the input processor has checked; the engine adds it without checking again."""
    request_id: str                     # user-visible id (samples of n > 1 become `id#i`)
    prompt_token_ids: tuple[int, ...]   # non-empty and shorter than max_model_len
    prompt_text: str | None             # the text the ids came from, for outputs; None if unknown
    params: SamplingParams              # the processor's validated copy: the caller's edits never reach it
    priority: int                       # in [PRIORITY_MIN, PRIORITY_MAX]; lower is served first
    cache_salt: str | None              # isolates prefix-cache sharing between tenants
    arrival_time: float                 # monotonic seconds at processing: FCFS order and aging
    trace_context: object = None        # OpenTelemetry context parenting the request's spans
    pooling: PoolingParams | None = None   # an embeddings request (n == 1): pooled, not sampled
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class InputProcessor:
    """Tokenizes prompts and validates requests against one engine's limits."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, max_model_len: int,
                 limits: RequestLimits | None = None, kv_role: str | None = None) -> None:
        self.tokenizer = tokenizer
        # --kv-transfer-config's kv_role (None: off): which kv_transfer_params it can honour
        self.kv_role = kv_role
        self.vocab_size = vocab_size          # the model's: prompt token ids must index its embedding
        self.max_model_len = max_model_len    # a prompt must leave room for one generated token
        # the deployment's bounds (kvmesh serve's --max-* flags); the defaults elsewhere
        self.limits = limits if limits is not None else RequestLimits()

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """The processor's validated copy of `params`, within this deployment's limits, or a
        SamplingParamsError naming the field. `process` calls it; a server may call it first,
        to refuse a request before the work of tokenizing its prompt."""
        params = _checked_copy(params)
        for param, ok, message in self._limit_checks(params):
            if not ok:
                raise SamplingParamsError(param, message)
        if params.structured_outputs is not None:
            check_structured(params)
        if params.max_tokens is None and self.limits.max_tokens:
            # "up to the context length", within this deployment's cap
            params = dataclasses.replace(params, max_tokens=self.limits.max_tokens)
        return params

    def _limit_checks(self, p: SamplingParams):
        """(field, within the limit?, message), as SamplingParams._checks."""
        lim = self.limits
        yield "n", p.n <= lim.max_n, f"n must be <= {lim.max_n}, got {p.n}"
        yield ("max_tokens", not lim.max_tokens or p.max_tokens is None
               or p.max_tokens <= lim.max_tokens,
               f"max_tokens must be <= {lim.max_tokens}, got {p.max_tokens}")
        yield ("stop", len(p.stop) <= lim.max_stop_strings,
               f"at most {lim.max_stop_strings} stop strings are allowed, got {len(p.stop)}")
        longest = max(map(len, p.stop), default=0)
        yield ("stop", longest <= lim.max_stop_string_length,
               f"a stop string may be at most {lim.max_stop_string_length} characters long, "
               f"got {longest}")
        yield ("stop_token_ids", len(p.stop_token_ids) <= lim.max_stop_token_ids,
               f"at most {lim.max_stop_token_ids} stop_token_ids are allowed, "
               f"got {len(p.stop_token_ids)}")
        # NOTE: the sampler indexes the logits with them (the min_tokens mask)
        yield ("stop_token_ids", all(t < self.vocab_size for t in p.stop_token_ids),
               f"stop_token_ids must be in the vocabulary [0, {self.vocab_size}), got "
               f"{max(p.stop_token_ids, default=0)}")
        yield ("logprobs", p.logprobs is None or p.logprobs <= lim.max_logprobs,
               f"logprobs must be <= {lim.max_logprobs}, got {p.logprobs}")
        yield ("prompt_logprobs", p.prompt_logprobs is None or p.prompt_logprobs <= lim.max_logprobs,
               f"prompt_logprobs must be <= {lim.max_logprobs}, got {p.prompt_logprobs}")
        # NOTE: the runner indexes the logits with them
        outside = [t for t in (p.logit_bias or ()) if t >= self.vocab_size]
        yield ("logit_bias", not outside,
               f"logit_bias token ids must be in the vocabulary [0, {self.vocab_size}), got "
               f"{min(outside, default=0)}")
        yield from self._kv_transfer_checks(p)

    def _kv_transfer_checks(self, p: SamplingParams):
        kt = p.kv_transfer_params
        if kt is None:
            return
        yield ("kv_transfer_params", self.kv_role is not None,
               "kv_transfer_params needs a server started with --kv-transfer-config")
        role = self.kv_role or ""
        yield ("kv_transfer_params.do_remote_decode",
               not kt.do_remote_decode or role in ("kv_producer", "kv_both"),
               f"kv_transfer_params.do_remote_decode needs kv_role kv_producer or kv_both; "
               f"this server is {role}")
        yield ("kv_transfer_params.do_remote_prefill",
               not kt.do_remote_prefill or role in ("kv_consumer", "kv_both"),
               f"kv_transfer_params.do_remote_prefill needs kv_role kv_consumer or kv_both; "
               f"this server is {role}")
        yield ("kv_transfer_params", not (kt.do_remote_decode or kt.do_remote_prefill)
               or p.prompt_logprobs is None,
               "kv_transfer_params: prompt_logprobs need the prompt computed here; leave it out")

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a text or token-id prompt; ValueError if it is empty or
        an id is outside the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return None, ids

    def process(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                *, prompt_ids: Sequence[int] | None = None, prompt_text: str | None = None,
                priority: int = 0, cache_salt: str | None = None,
                arrival_time: float | None = None, trace_context=None,
                pooling: PoolingParams | None = None,
                lora_request: LoRARequest | None = None) -> EngineRequest:
        """The validated request, or ValueError saying what is wrong (nothing else changes).

        `prompt` is text or token ids. `prompt_ids` are its token ids when the caller has them
        already, from `tokenize` or the chat template: they are not tokenized or looked up in
        the vocabulary again. `prompt_text` names the text token ids came from (for outputs).
        `pooling` makes it an embeddings request: its prompt may fill the whole context (no
        token is generated) and it has one sample."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        params = self.check_params(SamplingParams() if params is None else params)
        if prompt_ids is None:
            text, ids = self.tokenize(prompt)
        else:
            text, ids = (prompt if isinstance(prompt, str) else None), list(prompt_ids)
        if not ids:
            raise ValueError("prompt must not be empty")
        if pooling is not None:
            if not isinstance(pooling, PoolingParams):
                raise ValueError("pooling must be a PoolingParams")
            if params.n != 1:
                raise SamplingParamsError("n", f"an embeddings request has one sample, got n={params.n}")
            if len(ids) > self.max_model_len:
                raise ValueError(f"input is {len(ids)} tokens long but max_model_len is "
                                 f"{self.max_model_len}")
        elif len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens long but max_model_len is "
                             f"{self.max_model_len}: at least one token must be left to generate")
        _check_priority(priority)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError("lora_request must be a LoRARequest")
        return EngineRequest(
            request_id, tuple(ids), text if text is not None else prompt_text, params, priority,
            cache_salt, time.monotonic() if arrival_time is None else arrival_time, trace_context,
            pooling, lora_request)


def _checked_copy(params: SamplingParams) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ValueError("sampling_params must be a SamplingParams")
    # NOTE: replace() builds a new object through __post_init__, which validates it: fields the
    # caller changed after construction are checked here, and later changes never reach the engine.
    return dataclasses.replace(params)


def _check_priority(priority: int) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                         f"got {priority}")
