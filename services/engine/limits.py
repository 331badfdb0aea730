"""The bounds a request must stay within, in one place: the input processor and SamplingParams
check them, the API's request models declare the fixed ones to clients (pydantic `ge` / `le`),
and `RequestLimits` holds the ones a deployment chooses (`kvmesh serve --max-*` flags)."""
from __future__ import annotations

from dataclasses import dataclass, fields

# NOTE: scheduling policies do arithmetic on the priority (the dynamic one multiplies it by a
# float weight): a bounded int keeps schedule() from overflowing on a client-chosen value.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
# NOTE: top_k >= vocab means "all tokens", so 2**31 - 1 is no real limit; it keeps the sampler's
# long tensor from overflowing on a client-chosen value.
TOP_K_MAX = 2**31 - 1
# torch.Generator.manual_seed takes a signed or unsigned 64-bit value; sample i of n uses
# seed + i, so a signed 64-bit seed always stays within what it accepts.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Top logprobs per token the API serves by default (OpenAI's and vLLM's limit).
MAX_LOGPROBS = 20


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """Per-deployment bounds on one request; each field is the `kvmesh serve` flag of its name
    (`--max-n`, ...). The defaults fit a real deployment: see the README's flags table."""
    # bytes of one HTTP request body, checked before it is parsed (8 MiB: a 2 MB prompt fits
    # with room for JSON escapes)
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_prompts_per_request: int = 128   # prompts in one /v1/completions request
    max_n: int = 16                      # samples per prompt (each holds its own KV blocks)
    max_stop_strings: int = 16           # every one is searched for after every step
    max_stop_string_length: int = 1024   # characters: the search window grows with the longest
    max_stop_token_ids: int = 256        # extra stop token ids (a set: O(1) per step)
    max_logprobs: int = MAX_LOGPROBS     # completions `logprobs`, chat `top_logprobs`
    # completion tokens one request may ask for; 0: only the context length bounds it
    max_tokens: int = 0
    # outputs queued for one request whose reader has not taken them; a reader that falls this
    # far behind is aborted (`client_too_slow`), so a stalled client cannot grow the server's memory
    max_pending_outputs: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "max_tokens" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                flag = "--" + f.name.replace("_", "-")
                raise ValueError(f"{flag} must be an integer >= {least}, got {value!r}")
