"""CPU time of one engine step at one row (one sequence decoding), on one thread (issue 28).

    python benchmarks/step_cpu.py                          # built-in SmolLM2-135M, bfloat16
    python benchmarks/step_cpu.py --model random-glue      # same depth and heads, width 72
    OTHER/.venv/bin/python benchmarks/step_cpu.py ...      # another checkout's engine (A/B)

One request (128 random prompt tokens, `ignore_eos`) decodes `--steps` tokens after
`--warmup` steps; each `LLMEngine.step()` is timed by its thread's CPU time
(`time.thread_time`), which holds on a loaded machine where wall times do not, and so does
the forward alone (`ModelRunner.run_model`). One torch thread: no OpenMP barrier waits in the
numbers. `random-glue` (benchmarks/models.py) keeps SmolLM2-135M's 30 layers and 9 / 3 heads
of 64 at width 72, where the GEMMs cost next to nothing, so its step is the per-layer Python,
the kernels' calls and the engine's own work. Run under another checkout's interpreter, the
script measures that checkout's engine (its `kvmesh` import), so interleaved runs of two
interpreters are an A/B of two versions.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.models import resolve_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin", help="builtin, random-glue, ... (models.py)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "KVMESH_CACHE_DIR", Path.home() / ".cache" / "kvmesh")) / "bench-models")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    import kvmesh
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling_params import SamplingParams

    loaded = load_model(resolve_model(args.model, args.cache), dtype=args.dtype, device="cpu")
    total = args.prompt_tokens + args.warmup + args.steps + 1
    cfg = EngineConfig(num_kv_blocks=-(-total // 16) + 4, max_num_seqs=1,
                       max_num_batched_tokens=max(512, args.prompt_tokens), block_size=16,
                       swap_space=0.0, dtype=args.dtype, device="cpu")
    engine = LLMEngine(cfg, loaded=loaded)
    forward_s = [0.0]
    run_model = engine.runner.run_model

    def timed_run_model(*a, **kw):
        t = time.thread_time()
        try:
            return run_model(*a, **kw)
        finally:
            forward_s[0] += time.thread_time() - t
    engine.runner.run_model = timed_run_model
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                   max_tokens=args.warmup + args.steps + 1))
    engine.step()                                      # the prefill
    for _ in range(args.warmup):
        engine.step()
    step_ms, fwd_ms = [], []
    for _ in range(args.steps):
        forward_s[0] = 0.0
        t = time.thread_time()
        engine.step()
        step_ms.append((time.thread_time() - t) * 1e3)
        fwd_ms.append(forward_s[0] * 1e3)
    engine.shutdown()
    where = Path(kvmesh.__file__).resolve().parents[1]
    print(f"{where}  {args.model} {args.dtype}: step CPU ms median {statistics.median(step_ms):.3f} "
          f"mean {statistics.fmean(step_ms):.3f}; forward median {statistics.median(fwd_ms):.3f}; "
          f"rest median {statistics.median(s - f for s, f in zip(step_ms, fwd_ms)):.3f} "
          f"({args.steps} steps, load {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
