"""A request's known tokens followed by its drafts, as the input batch reads them."""
from __future__ import annotations

from collections.abc import Sequence


class WithDrafts:
    """`token_ids + drafts` for indexing and slicing, without copying `token_ids` (a long
    context would otherwise be copied every speculative step for the 1 + k tokens it computes)."""
    __slots__ = ("token_ids", "drafts")

    def __init__(self, token_ids: Sequence[int], drafts: Sequence[int]) -> None:
        self.token_ids, self.drafts = token_ids, drafts

    def __len__(self) -> int:
        return len(self.token_ids) + len(self.drafts)

    def __getitem__(self, i):
        n = len(self.token_ids)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            assert step == 1, "contiguous slices only"
            if stop <= n:
                return self.token_ids[start:stop]
            return list(self.token_ids[start:n]) + list(self.drafts[max(0, start - n):stop - n])
        if i < 0:
            i += len(self)
        return self.token_ids[i] if i < n else self.drafts[i - n]


class PendingDrafts(list):
    """Placeholders for drafts the runner's draft model proposes after scheduling: the step's
    grammar bitmask leaves their rows for the draft model to fill as it proposes."""
    __slots__ = ()
