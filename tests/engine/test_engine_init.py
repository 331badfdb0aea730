"""LLMEngine's construction, part by part: the connector is built before the runner from the
layout the runner then holds, and an engine that fails to build closes the connector it made."""
from __future__ import annotations

import pytest

from kvmesh.common.config import EngineConfig
from kvmesh.engine import engine as engine_module
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.kv_connector import KVConnector, KVConnectorContext


class _Store(KVConnector):
    """An in-memory connector that records its context and whether it was closed."""

    def __init__(self, ctx: KVConnectorContext) -> None:
        self.ctx = ctx
        self.closed = False

    def prefetch(self, req_id, block_hashes):
        pass

    def lookup(self, req_id, block_hashes):
        return []

    def release(self, req_id):
        pass

    def wants(self, block_hash):
        return False

    def save(self, block_hash, data):
        pass

    def close(self):
        self.closed = True


def _factory(made: list[_Store]):
    def build(ctx: KVConnectorContext) -> _Store:
        made.append(_Store(ctx))
        return made[-1]
    return build


def _config() -> EngineConfig:
    return EngineConfig(dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=128)


def test_the_connector_gets_the_runners_block_layout(smollm):
    made: list[_Store] = []
    engine = LLMEngine(_config(), loaded=smollm, kv_connector=_factory(made))
    (store,) = made
    assert engine.kv_share is store and engine.runner.kv_connector is store
    assert store.ctx.block_layout == engine.runner.block_layout == (30, 2, 16, 3, 64, 4)
    assert len(engine.runner.block_data(0)) == engine.block_bytes


def test_an_engine_that_fails_to_build_closes_its_connector(smollm, monkeypatch):
    made: list[_Store] = []

    def no_memory(*args, **kwargs):
        raise RuntimeError("injected: the KV cache does not fit")
    monkeypatch.setattr(engine_module, "ModelRunner", no_memory)
    with pytest.raises(RuntimeError, match="injected"):
        LLMEngine(_config(), loaded=smollm, kv_connector=_factory(made))
    assert [s.closed for s in made] == [True]
