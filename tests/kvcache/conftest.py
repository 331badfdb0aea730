"""Helpers for the KV-cache tests: real Requests, a scheduler-like driver, a state snapshot."""
import dataclasses
import pickle

import pytest

from kvmesh.common.block_hash import BlockHasher
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams


def make_request(rid: str, tokens, salt: str | None = None, block_size: int = 4,
                 seed: str = "kvmesh") -> Request:
    """A request hashed as the scheduler would (its BlockHasher; the manager never hashes)."""
    return Request(rid, list(tokens), SamplingParams(), 0.0, cache_salt=salt,
                   block_hasher=BlockHasher(block_size, seed))


def prefill(mgr, req):
    """Schedule the whole remaining prompt in one step (prefix hits first) and 'compute' it."""
    hit_ids, n_hit = mgr.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
    new = mgr.allocate_slots(req, req.num_tokens - req.num_computed_tokens - n_hit, hit_ids, n_hit)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hit_ids, n_hit, new


def decode(mgr, req, token: int):
    """Append a sampled token and allocate its slot (its K/V is computed by the next step)."""
    req.append_output_token(token)
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def snapshot(mgr) -> bytes:
    """Every piece of manager and pool state, serialized: equal bytes = no state change."""
    p = mgr.pool
    state = ({k: list(v) for k, v in mgr._tables.items()}, dict(mgr._num_cached),
             {k: list(v) for k, v in mgr._cpu_tables.items()}, list(mgr._cpu_free),
             [(b.block_id, b.ref_cnt, b.block_hash) for b in p.blocks], list(p.free_queue),
             {h: b.block_id for h, b in p.cached.items()}, list(p._events), list(mgr._copies),
             dataclasses.asdict(mgr.stats))
    return pickle.dumps(state)


@pytest.fixture
def helpers():
    return type("H", (), {"make_request": staticmethod(make_request),
                          "prefill": staticmethod(prefill), "decode": staticmethod(decode),
                          "snapshot": staticmethod(snapshot)})
