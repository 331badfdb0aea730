"""GrammarBitmask: which tokens each constrained row of one step may sample.

Rows follow the step's logits rows (the scheduled requests with `sample`, in order; a speculating
request has one per drafted position and one after its drafts), the same order the runner projects
to logits, so applying it needs no lookup by request id.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xgrammar as xgr
from kvmesh.engine.sched_output import SchedulerOutput
from kvmesh.engine.spec_decode.tokens import PendingDrafts


@dataclass(slots=True)
class GrammarBitmask:
    bitmask: torch.Tensor      # [num_sampling_rows, ceil(V / 32)] int32, bit set = allowed
    rows: list[int]            # the constrained sampling rows (others stay unmasked)
    # request id -> its first row, for constrained requests whose drafts a draft model still
    # has to propose: that row is filled, the rows after it are left all-allowed for the draft
    # model to fill as it proposes (spec_decode/draft_model.py)
    pending: dict[str, int] = field(default_factory=dict)

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens of the constrained rows -> -inf, in place ([rows, V] logits).

        NOTE: applied before the sampler, so penalties, top-k / top-p / min-p, the sampled token
        and its logprobs all see the same masked distribution."""
        assert logits.shape[0] == self.bitmask.shape[0], (logits.shape, self.bitmask.shape)
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                        indices=self.rows)


def is_sampling_row(sr) -> bool:
    """The runner projects this scheduled request to a logits row. NOTE: a pooling (embeddings)
    request reaches its last token without sampling; the runner skips it, so must the mask."""
    return sr.sample and sr.request.pooling is None


def build_bitmask(sched: SchedulerOutput, vocab_size: int) -> GrammarBitmask | None:
    """The step's bitmask, or None when no sampling row is constrained (nothing is allocated)."""
    rows: list[int] = []
    todo = []                 # (first row, grammar, drafts, request id)
    num_rows = 0
    for sr in sched.scheduled:
        if not is_sampling_row(sr):
            continue
        grammar = sr.request.grammar
        drafts = sr.spec_token_ids
        # NOTE: a fork's children (n > 1) draw from this row at their first token; every sample's
        # matcher is still at the start then, so sample 0's mask is theirs too.
        if grammar is not None and not grammar.terminated:
            rows.extend(range(num_rows, num_rows + 1 + len(drafts)))
            todo.append((num_rows, grammar, drafts, sr.request.request_id))
        num_rows += 1 + len(drafts)     # a speculating request: one row per drafted position
    if not rows:
        return None
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    pending: dict[str, int] = {}
    for row, grammar, drafts, rid in todo:
        if isinstance(drafts, PendingDrafts):
            grammar.fill_bitmask(bitmask, row)
            pending[rid] = row
        elif drafts:
            grammar.fill_draft_bitmasks(bitmask, row, drafts)
        else:
            grammar.fill_bitmask(bitmask, row)
    return GrammarBitmask(bitmask, rows, pending)
