"""A draft model's proposals for a structured-output request: each draft is the draft model's
best token among those the grammar allows after the drafts before it, and the mask it was picked
under is the target's mask for that position (the verification masks every drafted position as
for prompt lookup).

    target row r + i  (the step's GrammarBitmask) = tokens allowed after drafts[:i]
        filled by the scheduler for i = 0, by `take` for i > 0 as the drafts are chosen

NOTE: a draft that ends the grammar (its stop token) leaves the rows after it all-allowed, as
decoding without drafts would (a finished grammar constrains nothing); the matcher is walked
through the drafts and rolled back, so it only ever advances by the tokens the request gets.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from kvmesh.engine.structured.request_grammar import RequestGrammar


class GrammarDrafts:
    def __init__(self, grammar: RequestGrammar, bitmask: torch.Tensor, row: int) -> None:
        self.matcher = grammar.matcher     # the request's grammar state (walked, then rolled back)
        self.bitmask = bitmask             # [rows, ceil(V / 32)] int32: the step's target masks
        self.row = row                     # the request's first row in it
        self.taken = 0                     # drafts the matcher accepted (rolled back at the end)
        self.ended = False                 # a draft ended the grammar

    def mask(self, logits: torch.Tensor, i: int) -> None:
        """Tokens the grammar refuses at draft position i -> -inf in `logits` ([1, V], in place)."""
        if not self.ended:
            r = self.row + i
            xgr.apply_token_bitmask_inplace(logits, self.bitmask[r:r + 1].to(logits.device),
                                            vocab_size=logits.shape[1])

    def take(self, token: int) -> None:
        """Draft `token` (chosen under `mask`) at the next position; fill the mask after it."""
        if self.ended:
            return
        accepted = self.matcher.accept_token(token)
        assert accepted, "a draft is chosen among the tokens the grammar allows"
        self.taken += 1
        if self.matcher.is_terminated():
            self.ended = True
        else:
            self.matcher.fill_next_token_bitmask(self.bitmask, self.row + self.taken)

    def finish(self) -> None:
        """Put the matcher back where the request stands."""
        if self.taken:
            self.matcher.rollback(self.taken)
        self.taken = 0
