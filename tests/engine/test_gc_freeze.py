"""freeze_after_startup: start-up garbage is collected, everything alive leaves the collector."""
from __future__ import annotations

import gc
import weakref

from kvmesh.common.gc_freeze import freeze_after_startup


class _Node:
    def __init__(self) -> None:
        self.other = self


def test_start_up_garbage_is_collected_and_what_lives_is_frozen():
    garbage = _Node()                       # a cycle: only the collector frees it
    gone = weakref.ref(garbage)
    del garbage
    kept = [[i] for i in range(1000)]       # long-lived start-up state
    try:
        frozen = freeze_after_startup()
        still = gc.get_freeze_count()
        assert gone() is None
        # NOTE: frozen objects can still be freed (by refcount) afterwards, e.g. by a thread an
        # earlier test left running (CI saw 787,374 frozen, then 787,372): the count can only fall
        assert len(kept) <= still <= frozen
        assert gc.get_count()[0] < 100      # the young generation starts empty
        young = {id(o) for g in range(3) for o in gc.get_objects(g)}
        assert not young & {id(x) for x in kept}       # no generation holds them any more
    finally:
        gc.unfreeze()


def test_the_offline_llm_freezes_its_start_up_and_returns_it_at_shutdown():
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling_params import SamplingParams

    gc.unfreeze()
    llm = LLM(dtype="float32", device="cpu", num_kv_blocks=64)
    try:
        frozen = gc.get_freeze_count()
        # the model's modules, parameters and the block pool's Block objects among them
        assert frozen >= len(llm.engine.scheduler.kv.pool.blocks) == 64
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0
