"""One LoRA site: the fused C++ kernel (kernels/lora_cpu) vs the torch path (kernels/lora_ops), µs per call.

    python benchmarks/lora_site.py [--tokens 32,64] [--ranks 8,16] [--slots 8] [--dim 576]
                                   [--dtypes float32,bfloat16] [--threads 2] [--reps 200]

A decode step's tokens spread over `--slots` adapters (token i of slot i mod S, in a seeded
shuffled order, as a batch of requests for different adapters lies), K = N = `--dim` (the
built-in model's o_proj: 576), the grouping built by the engine's own LoRAMapping (so the torch
path takes the layout it takes in a step: padded bmm or per-segment GEMMs). Each site's weights
are fresh per --copies copies cycled through (default 120, a forward's sites), so the weights
come from memory or L3 as in a step, not from L1. Both paths run on the same tensors,
interleaved; the table shows the median µs per call of each and the ratio, and the largest
difference of their results (they agree to float32 / bfloat16 rounding).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.offline_throughput import describe_machine  # noqa: E402
from kvmesh.engine.lora.mapping import LoRAMapping  # noqa: E402
from kvmesh.kernels import lora_cpu, lora_ops  # noqa: E402
from kvmesh.kernels.cpu_kernels import load  # noqa: E402


def _time(fn, copies: int, reps: int) -> float:
    """Median µs of one call over `reps` calls, cycling through the site copies."""
    for i in range(copies):                      # warm-up: every copy once
        fn(i)
    samples = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(r % copies)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def bench(tokens: int, rank: int, slots: int, dim: int, dtype: torch.dtype, copies: int, reps: int,
          seed: int = 0) -> tuple[float, float, float]:
    g = torch.Generator().manual_seed(seed)
    order = list(range(tokens))
    random.Random(seed).shuffle(order)
    seq_slots = [order[i] % slots for i in range(tokens)]
    mapping = LoRAMapping()
    mapping.update(seq_slots, [1] * tokens, torch.device("cpu"))
    x = torch.randn(tokens, dim, generator=g).to(dtype)
    sites = [((torch.randn(slots, rank, dim, generator=g) / dim ** 0.5).to(dtype),
              (torch.randn(slots, rank, dim, generator=g) / rank ** 0.5).to(dtype)) for _ in range(copies)]
    outs = [torch.zeros(tokens, dim, dtype=dtype) for _ in range(2)]
    cols = torch.tensor([0, dim], dtype=torch.int64)
    ranks = torch.full((slots,), rank, dtype=torch.int64)
    m = mapping

    def fused(i: int) -> None:
        a, bt = sites[i]
        lora_cpu.sgmv_add(x, a, bt, outs[0], m.rows, m.seg_starts, m.seg_slots, cols, ranks)

    def torch_path(i: int) -> None:
        a, bt = sites[i]
        lora_ops.sgmv_add(x, a, bt.transpose(1, 2), outs[1], m.rows, m.starts, m.slots, m.runs, m.padded)

    t_torch = _time(torch_path, copies, reps)
    t_fused = _time(fused, copies, reps)
    # one call each on fresh outputs: the difference of the results
    for o in outs:
        o.zero_()
    fused(0)
    torch_path(0)
    return t_fused, t_torch, (outs[0].float() - outs[1].float()).abs().max().item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="32,64")
    p.add_argument("--ranks", default="8,16")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--dim", type=int, default=576)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--copies", type=int, default=120, help="site copies cycled through (a forward's sites)")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ext = load()
    if ext is None:
        sys.exit("the C++ CPU kernels are not available here (KVMESH_CPU_KERNELS=0 or no compiler)")
    print(describe_machine())
    print(f"kernels: {ext.isa()} path, torch threads {torch.get_num_threads()}, "
          f"K = N = {args.dim}, {args.slots} slots, median of {args.reps} calls over {args.copies} site copies")
    print(f"{'dtype':>9} {'T':>4} {'R':>3} {'fused us':>9} {'torch us':>9} {'speedup':>8} {'max diff':>9}")
    for dtype in args.dtypes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for rank in (int(r) for r in args.ranks.split(",")):
                f, t, diff = bench(tokens, rank, args.slots, args.dim, getattr(torch, dtype), args.copies, args.reps)
                print(f"{dtype:>9} {tokens:>4} {rank:>3} {f:>9.1f} {t:>9.1f} {t / f:>7.2f}x {diff:>9.2e}")


if __name__ == "__main__":
    main()
