"""Prompt log-probs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`) from the
prefill's own forward pass.

The hidden state at position p scores the token at p + 1, so a prefill chunk computing
positions [start, end) scores prompt tokens start + 1 ... min(end, P - 1) (P: prompt length;
the last position's logits are the first sample's, not a prompt log-prob). Only requests that
asked pay: the LM head runs on their prompt rows alone, a bounded number of rows at a time.
Chunked prefill works as is: each chunk scores its own positions, and the engine writes them
into `Request.prompt_logprobs` by token index (a recompute after preemption skips the entries
it already has). Requests that ask for prompt log-probs skip the prefix cache
(`Request.skip_prefix_cache`), so every position they need is computed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvmesh.engine.request import Logprob, Request
from kvmesh.engine.sched_output import ScheduledRequest

# NOTE: [rows, vocab] logits are materialised this many rows at a time (128 rows of a 49k
# vocabulary: 25 MB in float32, 50 MB as float64 log-probs), whatever the prefill chunk's length.
ROWS_PER_PASS = 128


@dataclass(slots=True)
class PromptLogprobSpan:
    """The rows of one request's chunk in the step's packed hidden states that score prompt
    tokens."""
    request_id: str
    row_start: int             # first row in the step's [T, hidden]
    first_token: int           # index (in the prompt) of the token the first row scores
    target_ids: list[int]      # the prompt tokens scored, one per row
    num_top: int               # top-k alternatives per token (prompt_logprobs)


def prompt_logprob_span(sr: ScheduledRequest, row_start: int) -> PromptLogprobSpan | None:
    """The span of `sr`'s chunk (its first row at `row_start`), or None when it asks for no
    prompt log-probs or the chunk scores no prompt token."""
    req = sr.request
    k = req.sampling_params.prompt_logprobs
    if k is None:
        return None
    end = min(sr.start + sr.num_tokens, req.num_prompt_tokens - 1)
    start = sr.start
    # NOTE: a recompute after preemption computes the prompt again; the entries it already has
    # (a filled prefix: chunks come in order) are not scored twice
    done = req.prompt_logprobs
    while start < end and done is not None and done[start + 1] is not None:
        start += 1
    if end <= start:
        return None
    return PromptLogprobSpan(req.request_id, row_start + start - sr.start, start + 1,
                             req.prompt_token_ids[start + 1:end + 1], k)


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],   # [R, hidden] -> [R, V] float32
    hidden: torch.Tensor,                                     # [T, hidden], the step's rows
    spans: list[PromptLogprobSpan],
) -> dict[str, tuple[int, list[dict[int, Logprob]]]]:
    """request id -> (index of the first token scored, one entry per scored token: the prompt
    token's log-prob and rank plus the top-k), from the raw logits (no bias, no penalties)."""
    out: dict[str, tuple[int, list[dict[int, Logprob]]]] = {}
    for span in spans:
        entries: list[dict[int, Logprob]] = []
        for a, b in span_passes(span):
            # NOTE: log_softmax in float64: its sum over the vocabulary is float32's largest
            # error here (up to 2.6e-5 on the built-in model's 49k logits; the log-likelihoods
            # of an evaluation harness add these up), for a fraction of the forward's time
            lp = torch.log_softmax(compute_logits(hidden[a:b]).double(), dim=-1)  # [r, V]
            entries.extend(logprob_entries(lp, span.target_ids[a - span.row_start:b - span.row_start],
                                           span.num_top))
        out[span.request_id] = (span.first_token, entries)
    return out


def span_passes(span: PromptLogprobSpan) -> list[tuple[int, int]]:
    """The [start, end) row ranges of the step whose logits `compute_prompt_logprobs` computes
    for `span`, in order (at most ROWS_PER_PASS rows each). Tensor-parallel workers run the same
    LM-head passes (the logits gather is a collective), so they get these ranges too."""
    n = len(span.target_ids)
    return [(span.row_start + lo, span.row_start + min(n, lo + ROWS_PER_PASS))
            for lo in range(0, n, ROWS_PER_PASS)]


def logprob_entries(lp: torch.Tensor,          # [R, V] float32 log-probs
                    token_ids: list[int],     # [R] the token each row is scored on
                    num_top: int) -> list[dict[int, Logprob]]:
    """Per row: {token: its Logprob, then the top-`num_top` tokens by log-prob}. rank = 1 + the
    number of tokens with a strictly higher log-prob (ties share a rank), as for sampled tokens."""
    vocab = lp.shape[1]
    tok = torch.tensor(token_ids, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, tok[:, None])                                  # [R, 1]
    chosen_rank = (lp > chosen).sum(dim=-1) + 1                          # [R]
    k = min(num_top, vocab)
    top_lp_l: list[list[float]] = [[] for _ in token_ids]
    top_id_l: list[list[int]] = [[] for _ in token_ids]
    top_rank_l: list[list[int]] = [[] for _ in token_ids]
    if k > 0:
        top_lp, top_id = lp.topk(k, dim=-1)                              # [R, k], sorted
        top_rank = (top_lp[:, None, :] > top_lp[:, :, None]).sum(dim=-1) + 1
        top_lp_l, top_id_l, top_rank_l = top_lp.tolist(), top_id.tolist(), top_rank.tolist()
    entries = []
    for r, (t, c_lp, c_rank) in enumerate(zip(token_ids, chosen[:, 0].tolist(),
                                              chosen_rank.tolist())):
        entry = {t: Logprob(t, c_lp, c_rank)}
        for j in range(k):
            alt = top_id_l[r][j]
            if alt not in entry:
                entry[alt] = Logprob(alt, top_lp_l[r][j], top_rank_l[r][j])
        entries.append(entry)
    return entries


def record_prompt_logprobs(req: Request, first_token: int,
                           entries: list[dict[int, Logprob]]) -> None:
    """Write one chunk's entries into the request's list (made with the request; token 0 has
    none: None)."""
    assert req.prompt_logprobs is not None, "a request asking for prompt logprobs has the list"
    req.prompt_logprobs[first_token:first_token + len(entries)] = entries
