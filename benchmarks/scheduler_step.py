"""Scheduler micro-benchmark: CPU time of one decode step's scheduling and KV bookkeeping.

    python benchmarks/scheduler_step.py [--requests 64,256,1024] [--steps 2000] [--gc both]
                                        [--async-scheduling]

A real Scheduler and KVCacheManager (block size 16, prefix caching on), no model: N requests
with distinct 128-token prompts are prefilled first (not timed), then every timed step is
`schedule()` + `update_from_output()` with a fake runner output (one token per request), so each
step appends a token to every request, allocates a block every 16 tokens and hashes every
block that fills up. Building the fake output is not timed. With `--async-scheduling` the
scheduler runs as the engine's async mode drives it: step n + 1 is scheduled (its decodes on
placeholders) before step n's output is applied. Reported per step: CPU time of the
process (time.process_time_ns) and wall time, mean / p50 / p99 / max in microseconds.

Garbage collection, per `--gc` mode: `default` (Python's collector as it comes) or `freeze`
(`kvmesh.common.gc_freeze.freeze_after_startup()` once the requests are prefilled, as
`kvmesh serve` does after its start-up:
the long-lived objects leave the collector's generations). Reported: the collections of each
generation during the timed steps (gc.get_stats), the longest pause (gc.callbacks), and the
object churn of one step: container objects a step leaves allocated (gc.get_count with the
collector off) and the peak of Python memory allocated within a step (tracemalloc), measured
on separate, untimed steps.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc

import numpy as np

from kvmesh.common.config import EngineConfig
from kvmesh.common.gc_freeze import freeze_after_startup
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from kvmesh.engine.scheduler import Scheduler

BLOCK_SIZE = 16
PROMPT_LEN = 128
VOCAB = 49152


def _fake_output(out: SchedulerOutput, token: int) -> ModelRunnerOutput:
    sampled = {sr.request.request_id: [token] * (1 + len(sr.fork_children))
               for sr in out.scheduled if sr.sample}
    return ModelRunnerOutput(sampled=sampled, logprobs={})


def build(num_requests: int, steps: int, async_scheduling: bool = False) -> Scheduler:
    max_model_len = PROMPT_LEN + steps + 64
    blocks_per_req = -(-max_model_len // BLOCK_SIZE)
    num_blocks = num_requests * blocks_per_req + 16
    cfg = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, max_model_len=max_model_len,
                       max_num_seqs=num_requests,
                       max_num_batched_tokens=max(num_requests * PROMPT_LEN, num_requests),
                       enable_prefix_caching=True, async_scheduling=async_scheduling)
    # NOTE: KV events off, as `kvmesh serve` without --redis-url (with it, the publisher drains
    # them every step); nothing here drains them, so they would pile up and fill the heap
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, 0, enable_caching=True, enable_events=False)
    sched = Scheduler(cfg, kv, max_model_len, block_bytes=1 << 20)
    params = SamplingParams(max_tokens=steps + 32, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 7919 + j * 31) % VOCAB for j in range(PROMPT_LEN)]   # distinct prompts
        sched.add_request(Request(f"r{i}", prompt, params, float(i), max_model_len=max_model_len,
                                  parent_id=f"r{i}"))
    # prefill (not timed): the whole batch fits one step's budget
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):
        out = sched.schedule()
        sched.update_from_output(out, _fake_output(out, 7))
    return sched


def churn(sched: Scheduler, steps: int = 20) -> tuple[float, float]:
    """Per step of schedule() + update_from_output() (the fake output's own objects not
    counted): (container objects they allocate that are still alive when the step ends, its
    output included: what drives the collector; peak KiB of Python memory they allocate).
    Measured on untimed steps, with the collector off, then with tracemalloc."""
    alive = []
    gc.disable()
    try:
        for s in range(steps):
            c0 = gc.get_count()[0]
            out = sched.schedule()
            c1 = gc.get_count()[0]
            result = _fake_output(out, 7 + s % 100)
            c2 = gc.get_count()[0]
            sched.update_from_output(out, result)
            alive.append(c1 - c0 + gc.get_count()[0] - c2)
            del out, result
    finally:
        gc.enable()
    peaks = []
    tracemalloc.start()
    try:
        for s in range(steps):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            out = sched.schedule()
            peak = tracemalloc.get_traced_memory()[1] - base
            result = _fake_output(out, 7 + s % 100)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            sched.update_from_output(out, result)
            peaks.append(peak + tracemalloc.get_traced_memory()[1] - base)
            del out, result
    finally:
        tracemalloc.stop()
    return float(np.mean(alive)), float(np.mean(peaks)) / 1024


def measure(num_requests: int, steps: int, gc_mode: str = "default",
            async_scheduling: bool = False) -> dict:
    sched = build(num_requests, steps + 64, async_scheduling)
    kept, peak_kib = churn(sched)
    cpu_ns = np.empty(steps, dtype=np.int64)
    wall_ns = np.empty(steps, dtype=np.int64)
    gc.collect()
    if gc_mode == "freeze":
        freeze_after_startup()
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])
    collections0 = [g["collections"] for g in gc.get_stats()]
    gc.callbacks.append(on_gc)
    pending = None                # async: the step scheduled before, whose output is applied next
    for s in range(steps):
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        out = sched.schedule()
        c1, w1 = time.process_time_ns(), time.perf_counter_ns()
        result = _fake_output(out, 7 + s % 100)
        c2, w2 = time.process_time_ns(), time.perf_counter_ns()
        if async_scheduling:
            if pending is not None:
                sched.update_from_output(*pending)
            pending = (out, result)
        else:
            sched.update_from_output(out, result)
        c3, w3 = time.process_time_ns(), time.perf_counter_ns()
        assert len(out.scheduled) == num_requests, "every request must decode in every step"
        cpu_ns[s] = (c1 - c0) + (c3 - c2)
        wall_ns[s] = (w1 - w0) + (w3 - w2)
    gc.callbacks.remove(on_gc)
    collections = [g["collections"] - c for g, c in zip(gc.get_stats(), collections0)]
    gc.unfreeze()
    return {
        "requests": num_requests, "steps": steps, "gc": gc_mode, "collections": collections,
        "gc_max_ms": max(pauses, default=0.0) * 1e3, "kept": kept, "peak_kib": peak_kib,
        "wall_max": wall_ns.max() / 1e3,
        "cpu_mean": cpu_ns.mean() / 1e3, "cpu_p50": np.percentile(cpu_ns, 50) / 1e3,
        "cpu_p99": np.percentile(cpu_ns, 99) / 1e3,
        "wall_mean": wall_ns.mean() / 1e3, "wall_p50": np.percentile(wall_ns, 50) / 1e3,
        "wall_p99": np.percentile(wall_ns, 99) / 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", default="64,256,1024", help="comma-separated running-request counts")
    p.add_argument("--steps", type=int, default=2000, help="timed decode steps per count")
    p.add_argument("--gc", choices=("default", "freeze", "both"), default="both",
                   help="garbage-collector mode(s) to time (see the module doc)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="drive the scheduler as --async-scheduling does (see the module doc)")
    args = p.parse_args(argv)
    modes = ("default", "freeze") if args.gc == "both" else (args.gc,)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  load average {os.getloadavg()}")
    print(f"# block_size={BLOCK_SIZE}, prefix caching on, prompt {PROMPT_LEN} tokens, "
          f"{args.steps} timed decode steps; async scheduling "
          f"{'on' if args.async_scheduling else 'off'}")
    print("| running requests | gc | CPU mean µs | CPU p50 µs | CPU p99 µs | wall mean µs "
          "| wall p99 µs | wall max µs | collections gen0/1/2 | longest GC ms "
          "| objects alive / step | peak KiB / step |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for n in (int(x) for x in args.requests.split(",")):
        for mode in modes:
            r = measure(n, args.steps, mode, args.async_scheduling)
            print(f"| {n} | {mode} | {r['cpu_mean']:.0f} | {r['cpu_p50']:.0f} "
                  f"| {r['cpu_p99']:.0f} | {r['wall_mean']:.0f} | {r['wall_p99']:.0f} "
                  f"| {r['wall_max']:.0f} | {'/'.join(map(str, r['collections']))} "
                  f"| {r['gc_max_ms']:.1f} | {r['kept']:.0f} | {r['peak_kib']:.0f} |", flush=True)
    print(f"# load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
