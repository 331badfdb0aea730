"""CPU GEMM at a decode step's few rows: the small-row kernel (kernels/small_gemm.py) vs oneDNN's packed path.

    python benchmarks/small_gemm.py [--rows 1,2,4,5,8,16,32] [--dtypes bfloat16,float32]
                                    [--threads 1,2] [--reps 5] [--mb 64]

The shapes of SmolLM2-135M's projections (the built-in model): q/k/v fused 576 -> 960, o 576 ->
576, gate/up fused 576 -> 3072, down 1536 -> 576 and the tied LM head 576 -> 49152. Each shape
gets its own random weights, as many copies as fill --mb MB (at least one), so every call reads
its weight from memory as a decode step does, not from cache. Both paths run in one process,
interleaved rep by rep (A, B, A, B, ...), so a loaded machine slows both alike; each cell is the
best of --reps of the thread CPU time per call (`time.thread_time`, which holds where wall time
does not; with 2 threads it counts the calling thread only, so compare those by the wall column).
GB/s is the weight's bytes over the small kernel's time. Rows above the kernel's crossover
(`small_gemm.MAX_ROWS`) run on it directly here, to show where the crossover lies.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.kernels import small_gemm  # noqa: E402
from kvmesh.kernels.linear import packed_weight, uses_onednn  # noqa: E402

HIDDEN, INTER, VOCAB, QKV = 576, 1536, 49152, 960
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """oneDNN's linear on the reordered weight: linear.py's path above the crossover."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), None, "none", [None], "")


def _time(fn, x: torch.Tensor, ws: list[torch.Tensor]) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) per call over every copy of the weight."""
    c0, t0 = time.thread_time(), time.perf_counter()
    for w in ws:
        fn(x, w)
    return (time.thread_time() - c0) / len(ws), (time.perf_counter() - t0) / len(ws)


def bench(dtype: torch.dtype, rows: list[int], threads: int, reps: int, mb: int) -> list[str]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    lines = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * dtype.itemsize
        ws = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for _ in range(max(1, mb * 2**20 // nbytes))]
        for w in ws:
            packed_weight(w)                     # reordered once, as the engine does on first use
        for m in rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            small = lambda x, w: small_gemm.run(x, w)   # noqa: E731
            same = torch.equal(small(x, ws[0]).float(), onednn(x, ws[0]).float())
            diff = (small(x, ws[0]).float() - onednn(x, ws[0]).float()).abs().max().item()
            best = {"small": (9.0, 9.0), "onednn": (9.0, 9.0)}
            for _ in range(reps):
                for label, fn in (("onednn", onednn), ("small", small)):
                    cpu, wall = _time(fn, x, ws)
                    best[label] = (min(best[label][0], cpu), min(best[label][1], wall))
            (sc, sw), (oc, ow) = best["small"], best["onednn"]
            lines.append(f"| {str(dtype)[6:]} | {threads} | {name} {k}->{n} | {m} | {oc * 1e6:.1f} | "
                         f"{sc * 1e6:.1f} | {oc / sc:.2f} | {ow / sw:.2f} | {nbytes / sc / 1e9:.1f} | "
                         f"{'equal' if same else f'{diff:.1e}'} |")
            print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,5,8,16,32")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", default="1,2", help="torch intra-op threads, each in turn")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mb", type=int, default=64, help="MB of weight copies per shape (over the caches)")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    for dtype in dtypes:
        if small_gemm.max_rows(dtype) == 0 or not uses_onednn(torch.ones(1, 4, dtype=dtype),
                                                              torch.ones(2, 4, dtype=dtype)):
            print(f"{dtype}: no small-row kernel or no oneDNN path here", file=sys.stderr)
            return 2
    if max(rows) > 64:
        print("--rows: the kernel takes at most 64 rows", file=sys.stderr)
        return 2
    print(f"crossover (small_gemm.MAX_ROWS): {small_gemm.MAX_ROWS}")
    print("| dtype | threads | shape (K->N) | rows | oneDNN µs | small µs | oneDNN/small (CPU) "
          "| oneDNN/small (wall) | small GB/s | results |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        for threads in (int(t) for t in args.threads.split(",")):
            bench(dtype, rows, threads, args.reps, args.mb)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
