"""Keep the garbage collector's pauses off the serving path: freeze what start-up built.

NOTE: CPython's full (generation 2) collection walks every tracked object, and after a model
load those are hundreds of thousands (modules, parameters, the KV-cache bookkeeping: one Block
object per cache block). Nothing of that ever becomes garbage, yet each full collection walks
it again: at 1024 running requests that was a pause of ~1 s (docs/BENCHMARKS.md).
`gc.freeze()` moves everything alive at the end of start-up into a permanent generation that
collections skip; what requests allocate later is collected as usual.
"""
from __future__ import annotations

import gc


def freeze_after_startup() -> int:
    """Collect what start-up left behind, then freeze every object alive now; returns how
    many objects are frozen (they are never collected: call it once, when start-up is done)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
