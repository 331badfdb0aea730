"""Verification of drafts: rejection sampling that keeps the target model's distribution exactly.

A request that speculated k drafts d_0 .. d_{k-1} has k + 1 logits rows from the one target
forward: row i scores the position after d_{i-1} (row 0: after the last known token). Row i's
target distribution p_i is built as if d_0 .. d_{i-1} were already output (penalties and
min_tokens count them; logit_bias applies to every row), by the sampler's own steps
(`Sampler.target_probs`).

    for i in 0 .. k-1:   accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
                         else draw from norm(max(p_i - q_i, 0)) and stop
    all accepted:        draw the bonus token from p_k

With a prompt-lookup draft, q_i is a point mass on d_i: d_i is accepted with probability
p_i(d_i), and the residual is p_i with d_i removed. Each emitted token is then distributed
exactly as the target's (speculative sampling, Leviathan et al. / Chen et al.). A greedy row's
p_i is a point mass on the target's argmax: a draft is kept iff it is that argmax, and the token
after the accepted run is the argmax, so greedy output is token-identical to decoding without
drafts (no random numbers drawn).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.engine.request import Logprob, Request
from kvmesh.engine.sampler import Sampler, SamplingRow, token_logprobs

_TINY = torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class SpecGroup:
    """One speculating request's rows in the step's logits."""
    request_id: str
    drafts: Sequence[int]               # the k drafts, in order
    rows: list[SamplingRow]             # k + 1: row i sees drafts[:i] as output
    offset: int                         # its first row in the step's logits
    generator: torch.Generator | None   # the request's own (seeded) generator, else None
    greedy: bool


def spec_group(req: Request, drafts: Sequence[int], offset: int) -> SpecGroup:
    params = req.sampling_params
    rows = [SamplingRow(params=params, prompt_token_ids=req.prompt_token_ids,
                        output_token_ids=req.output_token_ids if i == 0
                        else req.output_token_ids + list(drafts[:i]),
                        generators=[req.generator], eos_token_ids=req.eos_token_ids)
            for i in range(len(drafts) + 1)]
    return SpecGroup(req.request_id, drafts, rows, offset, req.generator, params.greedy)


@dataclass(slots=True)
class Verified:
    tokens: dict[str, list[int]]                               # accepted drafts + the next token
    logprobs: dict[str, list[dict[int, Logprob]] | None]       # None: not requested


def verify(sampler: Sampler, logits: torch.Tensor,            # [R, V] the step's sampled rows
           groups: list[SpecGroup]) -> Verified:
    """Accept each group's leading drafts and draw the token after them (see the module)."""
    index = [g.offset + i for g in groups for i in range(len(g.rows))]
    if index[-1] - index[0] == len(index) - 1:        # the groups' rows are one run: a view
        raw = logits[index[0]:index[-1] + 1]                            # [N, V]
    else:
        raw = logits[torch.tensor(index, device=logits.device)]
    starts, at = [], 0
    for g in groups:
        starts.append(at)
        at += len(g.rows)
    num_accepted, final = [0] * len(groups), [0] * len(groups)
    greedy = [i for i, g in enumerate(groups) if g.greedy]
    sampled = [i for i, g in enumerate(groups) if not g.greedy]
    if greedy:
        # NOTE: a greedy row's target is a point mass on its argmax: a draft is kept iff it is
        # that argmax, so no [N, V] probabilities are built (the batch-1 hot path)
        rows_at = [starts[i] + j for i in greedy for j in range(len(groups[i].rows))]
        best = sampler.greedy_tokens(
            raw if not sampled else raw[torch.tensor(rows_at, device=raw.device)],
            [r for i in greedy for r in groups[i].rows])
        j = 0
        for i in greedy:
            g = groups[i]
            k = len(g.drafts)
            n = 0
            while n < k and g.drafts[n] == best[j + n]:
                n += 1
            num_accepted[i], final[i] = n, best[j + n]
            j += k + 1
    if sampled:
        sub = [groups[i] for i in sampled]
        rows_at = [starts[i] + j for i in sampled for j in range(len(groups[i].rows))]
        for i, n, t in zip(sampled, *_verify_sampled(
                sampler, raw[torch.tensor(rows_at, device=raw.device)], sub)):
            num_accepted[i], final[i] = n, t
    tokens = {g.request_id: list(g.drafts[:n]) + [t]
              for g, n, t in zip(groups, num_accepted, final)}
    return Verified(tokens, _logprobs(raw, groups, starts, num_accepted, tokens))


def _verify_sampled(sampler: Sampler, raw: torch.Tensor,         # [N, V] the groups' rows
                    groups: list[SpecGroup]) -> tuple[list[int], list[int]]:
    """Rejection sampling for groups with temperature > 0: (accepted drafts, token after them)."""
    rows = [r for g in groups for r in g.rows]
    probs = sampler.target_probs(raw, rows)                             # [N, V]
    starts, at = [], 0
    for g in groups:
        starts.append(at)
        at += len(g.rows)
    draft_at = [s + i for g, s in zip(groups, starts) for i in range(len(g.drafts))]
    draft_tok = [d for g in groups for d in g.drafts]
    dev = probs.device
    p_draft = probs[torch.tensor(draft_at, device=dev),
                    torch.tensor(draft_tok, device=dev)].tolist()      # one transfer
    num_accepted, j = [], 0
    for g in groups:
        k = len(g.drafts)
        p = p_draft[j:j + k]
        j += k
        u = torch.rand(k, generator=g.generator or sampler.generator).tolist()
        n = 0
        while n < k and u[n] < p[n]:
            n += 1
        num_accepted.append(n)
    return num_accepted, _draw_final(sampler, probs, groups, starts, num_accepted)


def _draw_final(sampler: Sampler, probs: torch.Tensor, groups: list[SpecGroup],
                starts: list[int], num_accepted: list[int]) -> list[int]:
    """The token after each group's accepted run: from the residual at the first rejected
    position, or from the last row (the bonus token) when every draft was accepted."""
    dev = probs.device
    at = [s + n for s, n in zip(starts, num_accepted)]
    dist = probs[torch.tensor(at, device=dev)]                          # [G, V]
    rejected = [(gi, g.drafts[n]) for gi, (g, n) in enumerate(zip(groups, num_accepted))
                if n < len(g.drafts)]
    if rejected:
        gi = torch.tensor([r[0] for r in rejected], device=dev)
        tok = torch.tensor([r[1] for r in rejected], device=dev)
        before = dist[gi].clone()
        dist[gi, tok] = 0.0                       # max(p - point mass on the draft, 0)
        # NOTE: a residual with no mass left (p(d) rounded to 1 yet the draft was rejected)
        # falls back to p itself rather than drawing from nothing.
        empty = dist[gi].sum(dim=-1) <= 0
        if bool(empty.any()):
            dist[gi[empty]] = before[empty]
    q = torch.empty_like(dist)
    for i, g in enumerate(groups):
        gen = g.generator or sampler.generator
        where = gen.device if gen is not None else dev
        q[i] = torch.empty(dist.shape[1], device=where).exponential_(generator=gen).to(dev)
    q.clamp_min_(_TINY)
    return (dist / q).argmax(dim=-1).tolist()


def _logprobs(raw: torch.Tensor, groups: list[SpecGroup], starts: list[int],
              num_accepted: list[int], tokens: dict[str, list[int]]
              ) -> dict[str, list[dict[int, Logprob]] | None]:
    """Logprobs of every emitted token (raw logits, as the sampler reports them)."""
    want = [i for i, g in enumerate(groups) if g.rows[0].params.logprobs is not None]
    out: dict[str, list[dict[int, Logprob]] | None] = {g.request_id: None for g in groups}
    if not want:
        return out
    at = [starts[i] + p for i in want for p in range(num_accepted[i] + 1)]
    rows = [groups[i].rows[p] for i in want for p in range(num_accepted[i] + 1)]
    toks = [t for i in want for t in tokens[groups[i].request_id]]
    entries = token_logprobs(raw[torch.tensor(at, device=raw.device)], rows, toks)
    j = 0
    for i in want:
        n = num_accepted[i] + 1
        out[groups[i].request_id] = entries[j:j + n]
        j += n
    return out
