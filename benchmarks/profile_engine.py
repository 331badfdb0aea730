"""Where kvmesh's engine step spends its time, by category, on one offline workload.

    python benchmarks/profile_engine.py --workload decode-heavy
    python benchmarks/profile_engine.py --workload prefill-heavy --torch-profile 20
    python benchmarks/profile_engine.py --workload decode-heavy --dtype bfloat16

Runs the same requests as `offline_throughput.py` (same workloads, same engine settings) once,
with light timers around the engine's parts (kernels ops, the GEMMs, the sampler, scheduler
and output stage), and prints one table: seconds and share of the run for

    gemm            the model's projections (q/k/v, o, gate/up, down), oneDNN or F.linear
    lm_head         the logits GEMM (sampled rows only)
    attention       paged attention (decode groups and prefill chunks, gathers included)
    kv_write        storing this step's K/V in the paged cache
    norm            RMSNorm (with the fused residual add)
    rope            rotary embedding
    activation      SiLU(gate) * up
    sampling        the sampler (penalties, argmax / draws, logprobs)
    forward_other   the rest of the forward: embedding, reshapes, module calls (Python)
    runner_input    the model runner's input building (ids, positions, metadata) and block ops
    scheduler       Scheduler.schedule + update_from_output + end_step
    output          the output stage (detokenize, stop checks, RequestOutput)
    step_other      the engine step's remaining Python

`--torch-profile N` also records N steps (after 10 warm ones) with torch.profiler and prints its
top ops by self CPU time.

py-spy gives the same picture from outside, Python frames included:

    py-spy record --native -r 200 -f raw -o /tmp/kvmesh.txt -- \
        .venv/bin/python benchmarks/offline_throughput.py --workload decode-heavy --systems kvmesh
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import offline_throughput as ot  # noqa: E402

CATEGORIES = ("gemm", "lm_head", "attention", "kv_write", "norm", "rope", "activation", "sampling",
              "forward_other", "runner_input", "scheduler", "output", "step_other")


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.depth = 0         # nested timed calls count once, in the outermost category

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            if self.depth:
                return fn(*a, **kw)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[name] += time.perf_counter() - t0
                self.depth -= 1
        return timed


def instrument(engine, timers: Timers) -> None:
    """Replace the engine's parts by timed wrappers (the model's modules keep their weights)."""
    import kvmesh.engine.layers.attention as attention_mod
    import kvmesh.engine.layers.causal_lm as causal_lm_mod
    import kvmesh.engine.layers.mlp as mlp_mod
    from kvmesh.engine.layers.mlp import GatedMLP

    runner = engine.runner
    model = runner.model
    forward_wrapped = runner.model.forward

    for mod in (attention_mod, mlp_mod):
        mod.linear = timers.wrap("gemm", mod.linear)
    causal_lm_mod.linear = timers.wrap("lm_head", causal_lm_mod.linear)
    ops = model.model.layers[0].self_attn.ops
    for name, cat in (("paged_attention", "attention"), ("write_kv_cache", "kv_write"),
                      ("rms_norm", "norm"), ("rotary_embedding", "rope")):
        setattr(ops, name, timers.wrap(cat, getattr(ops, name)))
    # NOTE: SiLU MLPs call the fused kernel (mlp.silu_and_mul); others their own activation.
    mlp_mod.silu_and_mul = timers.wrap("activation", mlp_mod.silu_and_mul)
    for m in model.modules():
        if isinstance(m, GatedMLP) and m.act is not torch.nn.functional.silu:
            act = m.act
            m.act = timers.wrap("activation", lambda x, _a=act: _a(x))

    # forward = everything inside the model call; its named parts are subtracted afterwards
    fwd = defaultdict(float)

    def forward(*a, **kw):
        t0 = time.perf_counter()
        depth, timers.depth = timers.depth, 0
        try:
            return forward_wrapped(*a, **kw)
        finally:
            timers.depth = depth
            fwd["t"] += time.perf_counter() - t0
    model.forward = forward
    timers.forward = fwd
    runner.sampler = _TimedCallable(timers, "sampling", runner.sampler)
    execute = runner.execute

    def timed_execute(out):
        t0 = time.perf_counter()
        r = execute(out)
        timers.total["_execute"] += time.perf_counter() - t0
        return r
    runner.execute = timed_execute
    s = engine.scheduler
    for name in ("schedule", "update_from_output", "end_step"):
        setattr(s, name, timers.wrap("scheduler", getattr(s, name)))
    engine.output.process = timers.wrap("output", engine.output.process)


class _TimedCallable:
    """The sampler, timed through both ways the runner calls it: `sampler(...)` (speculative
    verification) and `sampler.sample(...)` (every other step: the draws on the device)."""

    def __init__(self, timers: Timers, name: str, inner) -> None:
        self._call = timers.wrap(name, inner.__call__)
        self.sample = timers.wrap(name, inner.sample)
        self._inner = inner

    def __call__(self, *a, **kw):
        return self._call(*a, **kw)

    def __getattr__(self, item):
        return getattr(self._inner, item)


def breakdown(timers: Timers, wall: float) -> list[tuple[str, float]]:
    t = dict(timers.total)
    forward = timers.forward["t"]
    named_fwd = sum(t.get(k, 0.0) for k in ("gemm", "lm_head", "attention", "kv_write", "norm", "rope",
                                            "activation"))
    lm_head = t.get("lm_head", 0.0)
    # NOTE: compute_logits runs outside model.forward: lm_head is not part of `forward`.
    rows = [(k, t.get(k, 0.0)) for k in ("gemm", "attention", "kv_write", "norm", "rope", "activation")]
    rows.append(("forward_other", forward - (named_fwd - lm_head)))
    rows.append(("lm_head", lm_head))
    rows.append(("sampling", t.get("sampling", 0.0)))
    execute = t.get("_execute", 0.0)
    rows.append(("runner_input", execute - forward - lm_head - t.get("sampling", 0.0)))
    rows.append(("scheduler", t.get("scheduler", 0.0)))
    rows.append(("output", t.get("output", 0.0)))
    rows.append(("step_other", wall - execute - t.get("scheduler", 0.0) - t.get("output", 0.0)))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="decode-heavy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=0, help="first N requests only (0: all)")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "cpu", "reference"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                   help="the model's dtype (auto: as `kvmesh serve` resolves it on this CPU)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--torch-profile", type=int, default=0, metavar="N")
    p.add_argument("--quantization", default="auto", choices=("auto", "gguf", "none"),
                   help="load_model's GGUF quantization (auto: the blocks, as `kvmesh serve`)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling_params import SamplingParams

    loaded = load_model(None, dtype=args.dtype, device="cpu", attention_backend=args.attention_backend,
                        quantization=args.quantization)
    ns = argparse.Namespace(workload=args.workload, seed=args.seed, scale=10.0, max_total_len=1024,
                            prompt_fraction=0.5, num_requests=64)
    reqs, summary = ot.build_requests(loaded.tokenizer, ns)
    if args.num_requests:
        reqs = reqs[:args.num_requests]
        summary = {"requests": len(reqs), "prompt_tokens": sum(len(r.prompt_ids) for r in reqs)}
    block = 16
    need = sum(-(-(len(r.prompt_ids) + r.output_len) // block) for r in reqs) + len(reqs)
    cfg = EngineConfig(num_kv_blocks=max(need, 64), max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, block_size=block,
                       swap_space=0.0, dtype=args.dtype, device="cpu", kv_cache_dtype=args.kv_cache_dtype)
    engine = LLMEngine(cfg, loaded=loaded)

    def add(batch, tag):
        for i, r in enumerate(batch):
            engine.add_request(f"{tag}{i}", r.prompt_ids, SamplingParams(
                temperature=0.0, max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True))

    add(ot._warmup_requests(reqs), "w")
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()       # as offline_throughput: the warm-up's prompts are not reused
    timers = Timers()
    instrument(engine, timers)
    add(reqs, "r")
    prof = None
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if args.torch_profile and steps == 10:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        engine.step()
        steps += 1
        if prof is not None and steps == 10 + args.torch_profile:
            prof.__exit__(None, None, None)
    wall = time.perf_counter() - t0
    out_tokens = sum(r.output_len for r in reqs)
    dtype = str(loaded.dtype).removeprefix("torch.")
    print(f"# {args.workload} ({loaded.attention_backend} backend, {dtype}): {summary['requests']} requests, {summary['prompt_tokens']} prompt / "
          f"{out_tokens} output tokens, {steps} steps, {wall:.1f} s ({out_tokens / wall:.1f} output "
          f"tok/s, instrumented), load average {os.getloadavg()[0]:.2f}")
    print()
    print("| part | seconds | share | ms per step |")
    print("|---|---:|---:|---:|")
    for name, sec in breakdown(timers, wall):
        print(f"| {name} | {sec:.4f} | {100 * sec / wall:.1f}% | {1000 * sec / steps:.3f} |")
    print(f"| **step total** | {wall:.4f} | 100% | {1000 * wall / steps:.2f} |")
    if prof is not None:
        print()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
