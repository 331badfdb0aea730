"""Decode-step memory-bandwidth utilisation of the whole engine (issue 7's engine target).

    python benchmarks/decode_bandwidth.py --device cuda --dtype bfloat16 --model random-1b --batch 64
    python benchmarks/decode_bandwidth.py                  # built-in model, float32 on this CPU
    python benchmarks/decode_bandwidth.py --device cuda --dtype bfloat16 --model random-1b --batch 64 \
        --async-scheduling                                 # the same, step n + 1 scheduled while n runs
    python benchmarks/decode_bandwidth.py --device cuda --dtype bfloat16 --model random-1b --batch 64 \
        --context 4096 --kv-cache-dtype fp8                # 8-bit K/V: half the context bytes a step
    python benchmarks/decode_bandwidth.py ... --torch-profile 8   # then 8 more steps under torch's
                                                       # profiler: its top ops by self device time

B requests with C-token prompts are prefilled; then S engine steps, each one decode token for all
B sequences, are timed (CUDA synchronised). Per step the engine must read every weight once (a
tied embedding / lm_head matrix counted once) and every sequence's K/V context of every layer:

    utilisation = (weight bytes + K/V bytes read per step) / step time / copy bandwidth

where copy bandwidth is measured on the same device just before: (read + write bytes) / time of
one large tensor copy. A decode step cannot read faster than that, so the ratio says how much of
the step is spent moving the bytes that must move. The step time is the engine's (`LLMEngine.step`:
scheduling, the model, sampling, detokenisation), not the forward pass alone.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import RANDOM_MODELS, resolve_model  # noqa: E402
from benchmarks.offline_throughput import describe_machine  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Bytes per second moved by `dst.copy_(src)` (read + write), best of `reps`."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def prefill_steps_bound(batch: int, context: int, budget: int) -> int:
    """Engine steps that prefill `batch` prompts of `context` tokens at most, under a per-step
    token budget: each step every running sequence decodes one token first and the prompts get
    the rest, at least `budget - batch` tokens."""
    return -(-batch * context // (budget - batch)) + 1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin", help=f"builtin, {', '.join(RANDOM_MODELS)} or an "
                   "HF model directory")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                   help="a tokenizer directory (tokenizer.json): a random model's, where the "
                   "built-in GGUF is not at hand (benchmarks/models.py)")
    p.add_argument("--model-cache", default=str(Path(__file__).resolve().parent / "results" / "models"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batch", type=int, default=64, help="sequences decoding together")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="the prefill's per-step token budget (default: the largest of 2048, "
                   "--context and 2 x --batch)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                   help="the engine's --kv-cache-dtype (auto, fp8, fp8_e4m3, fp8_e5m2); the K/V bytes "
                        "a step reads are counted at the cache's element size")
    p.add_argument("--torch-profile", type=int, default=0, metavar="N",
                   help="after the timed steps, N more under torch.profiler; print its top ops by self "
                        "device time (CUDA) or self CPU time")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the engine's --async-scheduling: each timed step schedules the next "
                   "while the device runs it (run once with and once without to compare)")
    p.add_argument("--copy-mib", type=int, default=0, help="copy-probe size (default: 1024 on "
                   "CUDA, 256 on CPU)")
    args = p.parse_args(argv)
    for name in ("batch", "context", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.torch_profile < 0:
        p.error("--torch-profile must be at least 0")
    budget = args.max_num_batched_tokens or max(2048, args.context, 2 * args.batch)
    if budget <= args.batch:
        p.error(f"--max-num-batched-tokens ({budget}) must exceed --batch ({args.batch}): every "
                "running sequence decodes a token of each step's budget before prompts get the rest")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")

    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling_params import SamplingParams

    loaded = load_model(resolve_model(args.model, Path(args.model_cache), args.tokenizer),
                        dtype=args.dtype, device=args.device, tokenizer_path=args.tokenizer)
    device, mc = loaded.device, loaded.config
    block = 16
    warm = 2
    prefill_steps = prefill_steps_bound(args.batch, args.context, budget)
    # NOTE: the first prompts decode while the last ones prefill; outputs long enough for the
    # whole prefill schedule keep every sequence running through the timed steps.
    max_tokens = prefill_steps + warm + args.steps + args.torch_profile + 1
    total_len = args.context + max_tokens
    blocks = args.batch * -(-total_len // block) + 8
    cfg = EngineConfig(num_kv_blocks=blocks, block_size=block, max_num_seqs=args.batch,
                       max_num_batched_tokens=budget, max_model_len=total_len + block,
                       swap_space=0.0, dtype=args.dtype, device=args.device,
                       async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype)
    engine = LLMEngine(cfg, loaded=loaded)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        ids = torch.randint(100, min(mc.vocab_size, 30000), (args.context,), generator=g).tolist()
        engine.add_request(f"d{i}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                        ignore_eos=True))
    sched = engine.scheduler
    # prefill everything, then a couple of untimed decode steps
    limit = prefill_steps
    while len(sched.running) < args.batch or any(r.num_computed_tokens < r.num_prompt_tokens
                                                 for r in sched.running):
        engine.step()
        limit -= 1
        if limit < 0:
            sys.exit(f"the {args.batch} prompts were not all prefilled and running together "
                     f"within {prefill_steps} steps (running {len(sched.running)}, waiting "
                     f"{len(sched.waiting)})")
    for _ in range(warm):
        engine.step()
    contexts = [r.num_computed_tokens for r in sched.running]
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    _sync(device)
    step_s = (time.perf_counter() - t0) / args.steps
    if len(sched.running) != args.batch:
        sys.exit(f"only {len(sched.running)} of the {args.batch} sequences decoded to the end of "
                 "the timed steps")

    itemsize = engine.cache_dtype.itemsize      # the cache as the engine resolved --kv-cache-dtype
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * itemsize
    # the mean context over the timed steps: each step adds one token per sequence
    kv_bytes = sum(c + (args.steps + 1) / 2 for c in contexts) * kv_per_token
    w_bytes = loaded.weight_bytes   # as held: quantized blocks too, a tied head once
    bw = copy_bandwidth(device, (args.copy_mib or (1024 if device.type == "cuda" else 256)) << 20)
    moved = (w_bytes + kv_bytes) / step_s
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {describe_machine()}; load average {os.getloadavg()[0]:.2f}")
    print(f"# model {args.model} ({loaded.path.name}), {args.dtype} on {dev_name}: "
          f"{w_bytes / 1e9:.3f} GB of weights; batch {args.batch}, prompt {args.context}, "
          f"{args.steps} timed steps; KV cache {args.kv_cache_dtype}; async scheduling {'on' if args.async_scheduling else 'off'}")
    print("| batch | context | step ms | tokens/s | weights GB/step | K/V GB/step | GB/s moved "
          "| copy GB/s | utilisation |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.batch} | {args.context} | {step_s * 1e3:.2f} | {args.batch / step_s:.0f} "
          f"| {w_bytes / 1e9:.3f} | {kv_bytes / 1e9:.3f} | {moved / 1e9:.1f} | {bw / 1e9:.1f} "
          f"| {moved / bw:.1%} |")
    if args.torch_profile:
        print(profile_steps(engine, device, args.torch_profile))
        if len(sched.running) != args.batch:
            sys.exit(f"only {len(sched.running)} of the {args.batch} sequences decoded to the end of "
                     "the profiled steps")


def profile_steps(engine, device: torch.device, steps: int, rows: int = 20) -> str:
    """`steps` engine steps under torch.profiler: its table of the top ops, by self device time on
    CUDA (kernels replayed from CUDA graphs included), by self CPU time otherwise."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(steps):
            engine.step()
        _sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return f"# torch.profiler, {steps} steps, by {key}\n" + prof.key_averages().table(sort_by=key, row_limit=rows)


if __name__ == "__main__":
    main()
