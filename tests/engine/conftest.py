"""Helpers to drive a real Scheduler + KVCacheManager without a model."""
from __future__ import annotations

import itertools

import pytest

from kvmesh.common.config import EngineConfig
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.output_processor import check_stop
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from kvmesh.engine.scheduler import Scheduler


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Harness:
    """A real scheduler and KV-cache manager; the 'model' returns token 7 for every sample."""

    EOS = 2

    def __init__(self, num_blocks: int = 64, block_size: int = 4, num_cpu_blocks: int = 0,
                 max_model_len: int | None = None, block_bytes: int = 1024, kv_connector=None,
                 **cfg) -> None:
        # like the engine: no request may outgrow the whole KV cache
        max_model_len = max_model_len or min(256, num_blocks * block_size)
        cfg.setdefault("enable_prefix_caching", False)
        self.config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks,
                                   max_model_len=max_model_len, **cfg)
        self.kv = KVCacheManager(num_blocks, block_size, num_cpu_blocks,
                                 enable_caching=self.config.enable_prefix_caching)
        self.clock = FakeClock()
        self.sched = Scheduler(self.config, self.kv, max_model_len, block_bytes, clock=self.clock,
                               kv_connector=kv_connector)
        self._ids = itertools.count()
        self.next_token = 7
        self.all_requests: list[Request] = []   # every sample ever added, forks included

    def add(self, prompt_len: int, max_tokens: int = 4, priority: int = 0, arrival: float | None = None,
            prompt: list[int] | None = None, n: int = 1, rid: str | None = None, **sp) -> Request:
        rid = rid or f"r{next(self._ids)}"
        params = SamplingParams(max_tokens=max_tokens, n=n, **sp)
        ids = prompt if prompt is not None else [100 + (i % 50) for i in range(prompt_len)]
        arrival = self.clock.t if arrival is None else arrival
        req = Request(rid, ids, params, arrival, priority, eos_token_ids=(self.EOS,),
                      max_model_len=self.sched.max_model_len, parent_id=rid)
        self.sched.add_request(req)
        self.all_requests.append(req)
        for i in range(1, n):
            child = Request(f"{rid}#{i}", ids, params, arrival, priority, eos_token_ids=(self.EOS,),
                            max_model_len=self.sched.max_model_len, sample_index=i, parent_id=rid)
            self.sched.add_fork(req, child)
            self.all_requests.append(child)
        return req

    def fake_result(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for sr in out.scheduled:
            if sr.sample:
                sampled[sr.request.request_id] = [self.next_token + k
                                                  for k in range(1 + len(sr.fork_children))]
        return ModelRunnerOutput(sampled=sampled, logprobs={})

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        # NOTE: the engine's output stage without text: token stops only (no detokenizer)
        for req in self.sched.update_from_output(out, self.fake_result(out)):
            stop = check_stop(req, None)
            if stop is not None:
                self.sched.finish_request(req, *stop)
        self.sched.end_step(out)
        self.clock.t += 1.0
        return out

    def run_to_completion(self, max_steps: int = 10_000) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished_requests():
            outs.append(self.step())
            self.kv.check_invariants(self.sched.requests.keys())
            assert len(outs) < max_steps, "scheduler made no progress"
        return outs


@pytest.fixture
def harness():
    return Harness
