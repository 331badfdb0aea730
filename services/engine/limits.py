"""The bounds a request must stay within, in one place: the input processor and SamplingParams
check them, the API's request models declare them to clients (pydantic `ge` / `le`)."""
from __future__ import annotations

# NOTE: scheduling policies do arithmetic on the priority (the dynamic one multiplies it by a
# float weight): a bounded int keeps schedule() from overflowing on a client-chosen value.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
# NOTE: top_k >= vocab means "all tokens", so 2**31 - 1 is no real limit; it keeps the sampler's
# long tensor from overflowing on a client-chosen value.
TOP_K_MAX = 2**31 - 1
# torch.Generator.manual_seed takes a signed or unsigned 64-bit value; sample i of n uses
# seed + i, so a signed 64-bit seed always stays within what it accepts.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Top logprobs per token the API serves (OpenAI's limit).
MAX_LOGPROBS = 20
