"""Per-request sampling settings (vLLM's names and semantics), validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


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
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (in token ids)
    ignore_eos: bool = False          # keep generating past EOS (benchmarks)
    logprobs: int | None = None       # top-k logprobs per generated token (0: chosen only)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed range."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
