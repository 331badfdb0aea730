"""OpenAI's `logit_bias`: a per-request additive bias on chosen tokens' logits.

The runner applies it to the sampled rows' logits right after the LM head, before the sampler:
penalties, masks, sampling and the generated tokens' logprobs all see the biased logits, as
OpenAI's API does. Prompt logprobs (echo, `prompt_logprobs`) are the model's own: a bias shapes
what is generated, not what the prompt was.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from kvmesh.engine.sampling_params import SamplingParams


def apply_logit_bias(logits: torch.Tensor,                  # [R, V], modified in place
                     params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's bias to its tokens' logits; rows without a bias are untouched (a batch
    with no bias at all costs one Python loop over its rows)."""
    assert logits.dim() == 2 and logits.shape[0] == len(params), (tuple(logits.shape), len(params))
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            for token, bias in p.logit_bias.items():
                rows.append(i)
                tokens.append(token)
                values.append(bias)
    if rows:
        # NOTE: the input processor checked every id against the vocabulary; index_put_ with
        # accumulate adds (ids are unique per row, so nothing is added twice).
        idx = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(idx, torch.tensor(values, dtype=logits.dtype, device=logits.device),
                          accumulate=True)
    return logits
