"""AsyncLLMEngine admission around the engine thread's end."""
from __future__ import annotations

import asyncio

import pytest

from kvmesh.common.config import EngineConfig
from kvmesh.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams


class _StopsDuringAdmission(AsyncLLMEngine):
    """The engine thread finishes (and fails what is registered) while a request is being
    admitted: between the liveness checks and the stream's registration."""

    def check_capacity(self, num_requests: int = 1) -> None:
        super().check_capacity(num_requests)
        self.shutdown()


async def test_a_request_admitted_as_the_engine_stops_is_refused_not_left_waiting(smollm):
    engine = _StopsDuringAdmission(LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=64),
                                             loaded=smollm))
    engine.start()
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=1)),
                               timeout=10)
    assert engine.num_in_flight == 0
