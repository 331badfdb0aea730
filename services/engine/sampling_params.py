"""Per-request sampling settings (vLLM's names and semantics), validated at construction; the
input processor validates its own copy again (a caller may change the fields afterwards)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.engine.limits import SEED_MAX, SEED_MIN, TOP_K_MAX
from kvmesh.engine.structured.spec import StructuredOutputSpec

if TYPE_CHECKING:
    from kvmesh.engine.kv_transfer.params import KVTransferParams

_GREEDY_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A bad sampling parameter; `param` names the field (OpenAI's error "param")."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                        # samples per prompt; they share the prompt's KV blocks
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0                # nucleus mass, in (0, 1]
    top_k: int = 0                    # 0 or -1: disabled
    min_p: float = 0.0                # drop tokens below min_p * p(max)
    seed: int | None = None           # per-request generator: same seed, same tokens, any batch
    presence_penalty: float = 0.0     # OpenAI semantics, in [-2, 2]
    frequency_penalty: float = 0.0    # OpenAI semantics, in [-2, 2]
    repetition_penalty: float = 1.0   # HF/CTRL semantics over prompt + output tokens, > 0
    max_tokens: int | None = 16       # None: up to the model's context length
    min_tokens: int = 0               # EOS and stop tokens are masked until this many are out
    stop: list[str] = field(default_factory=list)           # stop strings (not in the output)
    # extra stop tokens (in token ids). NOTE: a frozenset: the sampler tests membership for
    # every sampled token, O(1) whatever the length; a list given is converted.
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False          # keep generating past EOS (benchmarks)
    logprobs: int | None = None       # top-k logprobs per generated token (0: chosen only)
    # top-k logprobs of every prompt token (vLLM's prompt_logprobs; 0: the prompt token only);
    # computed from the prefill's own forward pass (engine/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    # token id -> bias added to its logit before sampling and before logprobs (OpenAI's
    # logit_bias); values are clamped to [-100, 100] (engine/logit_bias.py applies them)
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputSpec | None = None   # constrain the output (xgrammar)
    # prefill/decode disaggregation (vLLM's kv_transfer_params, kv_transfer/params.py); None: none
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        try:
            self.stop_token_ids = frozenset(self.stop_token_ids or ())
        except TypeError:                                   # an unhashable item: [[1]]
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be a list of "
                                      "integers >= 0") from None
        if self.top_k == -1:
            self.top_k = 0
        self.validate()
        if self.logit_bias is not None:
            self.logit_bias = clamp_logit_bias(self.logit_bias)

    def validate(self) -> None:
        """Raise SamplingParamsError (a ValueError) naming the field and the allowed range."""
        for param, ok, message in self._checks():
            if not ok:
                raise SamplingParamsError(param, message)

    def _checks(self):
        """(field, valid?, message) in order; evaluated lazily, so later checks may assume
        earlier ones passed."""
        yield "n", _is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"
        yield ("temperature", self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature}")
        yield "top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"
        yield ("top_k", _is_int(self.top_k) and 0 <= self.top_k <= TOP_K_MAX,
               f"top_k must be -1, 0 (disabled) or a positive integer <= {TOP_K_MAX}, "
               f"got {self.top_k!r}")
        yield "min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"
        yield ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        yield ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        yield ("repetition_penalty", self.repetition_penalty > 0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        yield ("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens)
                                                         and self.max_tokens >= 1),
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        yield ("min_tokens", _is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        yield ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        yield ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
               f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        yield ("prompt_logprobs", self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
               f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}")
        yield ("logit_bias", self.logit_bias is None or _valid_bias(self.logit_bias),
               "logit_bias must map token ids (integers >= 0) to numbers")
        yield ("stop", all(isinstance(s, str) and s for s in self.stop),
               "stop must be a list of non-empty strings")
        yield ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be a list of integers >= 0")
        yield ("seed", self.seed is None or (_is_int(self.seed)
                                             and SEED_MIN <= self.seed <= SEED_MAX),
               f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        yield ("kv_transfer_params", self.kv_transfer_params is None or self.n == 1,
               f"kv_transfer_params needs n = 1, got n = {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


# OpenAI's range for a logit bias: -100 bans a token, +100 all but forces it.
LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0


def clamp_logit_bias(bias: dict[int, float]) -> dict[int, float]:
    """Each bias clamped to [-100, 100] (as OpenAI does); zero biases are dropped."""
    out = {int(t): min(max(float(b), LOGIT_BIAS_MIN), LOGIT_BIAS_MAX) for t, b in bias.items()}
    return {t: b for t, b in out.items() if b != 0.0}


def _valid_bias(bias: object) -> bool:
    if not isinstance(bias, dict):
        return False
    return all(_is_int(t) and t >= 0 and isinstance(b, (int, float)) and not isinstance(b, bool)
               and b == b for t, b in bias.items())      # NOTE: b == b refuses NaN


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
