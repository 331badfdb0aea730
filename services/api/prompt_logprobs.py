"""The prompt's log-probs as the API shows them: OpenAI's legacy completions `logprobs` object
for `echo` (the first token has none: null), and vLLM's `prompt_logprobs` field of a choice.

The engine computes one list per request (`RequestOutput.prompt_logprobs`: per prompt token
its own log-prob and rank plus the top-k of the larger k asked for); each view keeps its own k.
"""
from __future__ import annotations

from typing import Any

from kvmesh.api.serving_common import token_text
from kvmesh.engine.request import Logprob


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: (lp.rank, lp.token_id))[:k]


def echo_logprobs(tokenizer, prompt_ids: list[int],
                  prompt_logprobs: list[dict[int, Logprob] | None], k: int) -> dict[str, Any]:
    """The legacy `logprobs` object of the echoed prompt: `tokens`, `token_logprobs` (null for
    the first), `top_logprobs` (null for the first; the top-k and the prompt token itself, by
    text) and `text_offset` from the start of the prompt's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = 0
    for tid, entry in zip(prompt_ids, prompt_logprobs):
        text = token_text(tokenizer, tid)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tid].logprob)
        top = {token_text(tokenizer, lp.token_id): lp.logprob for lp in _top(entry, k)}
        top.setdefault(text, entry[tid].logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def join_logprobs(prompt: dict[str, Any], generated: dict[str, Any] | None) -> dict[str, Any]:
    """The echoed prompt's logprobs followed by the generated tokens' (offsets already counted
    from the start of the echoed text)."""
    if generated is None:
        return prompt
    return {key: prompt[key] + generated[key] for key in prompt}


def vllm_prompt_logprobs(tokenizer, prompt_ids: list[int],
                         prompt_logprobs: list[dict[int, Logprob] | None],
                         k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token null (the first) or
    {token id: {"logprob", "rank", "decoded_token"}} for the prompt token and the top-k."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, entry in zip(prompt_ids, prompt_logprobs):
        if entry is None:
            out.append(None)
            continue
        keep = {tid: entry[tid]}
        for lp in _top(entry, k):
            keep.setdefault(lp.token_id, lp)
        out.append({str(t): {"logprob": lp.logprob, "rank": lp.rank,
                             "decoded_token": token_text(tokenizer, t)} for t, lp in keep.items()})
    return out
