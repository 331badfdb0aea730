"""Prompt lookup (vLLM's "ngram" method): drafts copied from the request's own tokens.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are searched in the
prompt + output so far; the earliest earlier occurrence wins and the tokens that followed it
are the drafts. No model: the draft distribution is a point mass on each proposed token.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k drafts for what follows `token_ids` ([] when no suffix of length lookup_min ..
    lookup_max occurs earlier, or k <= 0)."""
    n_tokens = len(token_ids)
    if k <= 0 or n_tokens <= lookup_min:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    # NOTE: candidates are the earlier positions holding the last token (a match must end
    # there, before the last position, so that at least one token follows it); the longer
    # suffixes are then checked on those few only: O(L + matches * n), not O(L * n).
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    if ends.size == 0:
        return []
    for n in range(min(lookup_max, n_tokens - 1), lookup_min - 1, -1):
        starts = ends - (n - 1)
        starts = starts[starts >= 0]
        if starts.size == 0:
            continue
        ok = np.ones(starts.size, dtype=bool)
        suffix = arr[n_tokens - n:]
        for j in range(n - 1):
            ok &= arr[starts + j] == suffix[j]
        hits = np.flatnonzero(ok)
        if hits.size:
            at = int(starts[hits[0]]) + n
            return arr[at:at + k].tolist()
    return []
