"""AsyncLLMEngine admission around the engine thread's end."""
from __future__ import annotations

import asyncio

import pytest

from kvmesh.common.config import EngineConfig
from kvmesh.engine.async_engine import AsyncLLMEngine, ClientTooSlowError, EngineDeadError
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.limits import RequestLimits
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


async def test_a_reader_too_far_behind_is_aborted_and_its_queue_stays_bounded(smollm):
    """A stream nobody reads while the engine generates: at most max_pending_outputs outputs
    wait for it, then the request is aborted (its blocks freed) and the reader gets a clear error."""
    llm = LLMEngine(EngineConfig(num_kv_blocks=32, max_model_len=256), loaded=smollm)
    engine = AsyncLLMEngine(llm, limits=RequestLimits(max_pending_outputs=4))
    engine.start()
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
        stream = await engine.add_request("slow", [1, 2, 3], params)
        queue, sizes = stream._stream.queue, []
        async with asyncio.timeout(120):
            while llm.has_unfinished_requests() or engine._commands.qsize():
                sizes.append(queue.qsize())
                await asyncio.sleep(0.005)
        assert max(sizes) <= 4 and queue.qsize() == 1          # only the error is left
        with pytest.raises(ClientTooSlowError) as e:
            async for _ in stream:
                pass
        assert str(e.value) == ("the client fell 4 outputs behind the generation of request "
                                "'slow', which was aborted; read the stream as it arrives")
        assert llm.kv_manager.num_free_blocks == 32 and engine.num_in_flight == 0
        # a reader that keeps up, under the same bound, gets every token
        outs = [o async for o in engine.generate("fast", [1, 2, 3], params)]
        assert len(outs[-1].outputs[0].token_ids) == 40
        assert outs[-1].outputs[0].finish_reason == "length"
    finally:
        engine.shutdown()


async def test_a_final_only_reader_gets_the_whole_result_however_late_it_reads(smollm):
    """A non-streaming reader (final_only) that reads nothing until the request is done is not
    too slow: its queue holds the finished output alone, which carries every token."""
    llm = LLMEngine(EngineConfig(num_kv_blocks=32, max_model_len=256), loaded=smollm)
    engine = AsyncLLMEngine(llm, limits=RequestLimits(max_pending_outputs=2))
    engine.start()
    try:
        params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0, logprobs=1)
        stream = await engine.add_request("late", [1, 2, 3], params, final_only=True)
        queue, sizes = stream._stream.queue, []
        async with asyncio.timeout(120):
            while llm.has_unfinished_requests() or not queue.qsize():
                sizes.append(queue.qsize())
                await asyncio.sleep(0.005)
        outs = [o async for o in stream]
        assert max(sizes) == 0 and len(outs) == 1 and outs[0].finished
        (c,) = outs[0].outputs
        assert (len(c.token_ids), len(c.logprobs), c.finish_reason) == (20, 20, "length")
        assert llm.kv_manager.num_free_blocks == 32 and engine.num_in_flight == 0
    finally:
        engine.shutdown()


async def test_a_steps_outputs_reach_the_event_loop_in_one_wake_up(smollm):
    """Three requests decoding together: each step that produced outputs wakes the event loop
    once (one call_soon_threadsafe), not once per request, and every reader gets every token."""
    llm = LLMEngine(EngineConfig(num_kv_blocks=32, max_model_len=256), loaded=smollm)
    engine = AsyncLLMEngine(llm)
    loop = asyncio.get_running_loop()
    wakeups, steps_with_outputs = [], []
    call_soon_threadsafe, step = loop.call_soon_threadsafe, llm.step

    def counting_call(callback, *args):
        wakeups.append(getattr(callback, "__name__", ""))
        return call_soon_threadsafe(callback, *args)

    def counting_step():
        outputs = step()
        if outputs:
            steps_with_outputs.append(len(outputs))
        return outputs

    loop.call_soon_threadsafe = counting_call
    llm.step = counting_step
    try:
        params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
        engine.start()
        async with asyncio.timeout(120):
            streams = [await engine.add_request(f"r{i}", [1, 2, 3 + i], params) for i in range(3)]
            outs = [[o async for o in s] for s in streams]
    finally:
        del loop.call_soon_threadsafe
        engine.shutdown()
    assert [sum(len(o.outputs[0].delta_token_ids) for o in r) for r in outs] == [16, 16, 16]
    assert wakeups.count("_offer_batch") == len(steps_with_outputs)
    assert sum(steps_with_outputs) > len(steps_with_outputs)   # steps with several outputs
