"""CPU GEMM: the model's projections through F.linear (PyTorch's BLAS) vs kvmesh.kernels.linear (oneDNN).

    python benchmarks/cpu_gemm.py [--rows 1,9,16,64,256,512] [--reps 5] [--threads 0]

One decode / prefill step's GEMMs of the built-in model's shapes (SmolLM2-135M: hidden 576,
intermediate 1536, 9 query / 3 KV heads of 64, vocabulary 49,152): for each of 30 layers the fused
q/k/v, o_proj, fused gate/up and down_proj, then the lm_head, each layer with its own random
float32 weights, so the weights come from memory as in the real model (540 MB, far over the
caches), not from cache. Both paths run in the same process, interleaved per row count; the
table shows the best of --reps of each and the ratio. Both compute the same products (their
results agree to float32 rounding: the maximum difference is printed).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.offline_throughput import describe_machine  # noqa: E402
from kvmesh.kernels.linear import linear, uses_onednn  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, HEAD_DIM, HEADS, KV_HEADS = 576, 1536, 30, 49152, 64, 9, 3


def model_weights(layers: int = LAYERS, vocab: int = VOCAB, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    shapes = [(qkv, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    ws = [torch.randn(n, k, generator=g) * 0.02 for _ in range(layers) for n, k in shapes]
    return ws + [torch.randn(vocab, HIDDEN, generator=g) * 0.02]


def one_step(fn, xs: dict[int, torch.Tensor], weights: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in weights:
        fn(xs[w.shape[1]], w)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,9,16,64,256,512", help="rows per GEMM (tokens in the step)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (a smaller model)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="lm_head rows")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    weights = model_weights(args.layers, args.vocab)
    probes = {k: torch.randn(4, k) for k in (HIDDEN, INTER)}
    if not uses_onednn(probes[HIDDEN], weights[0]):
        sys.exit("oneDNN's linear is not available in this torch build: nothing to compare")
    diff = max((linear(probes[w.shape[1]], w) - F.linear(probes[w.shape[1]], w)).abs().max().item()
               for w in weights[:4] + weights[-1:])
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {describe_machine()}, load average {os.getloadavg()[0]:.2f}")
    print(f"# max |oneDNN - F.linear| on the probe: {diff:.2e}")
    print("| rows | F.linear ms / step | oneDNN ms / step | speed-up |")
    print("|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        best = {"F.linear": float("inf"), "oneDNN": float("inf")}
        fns = {"F.linear": F.linear, "oneDNN": linear}
        with torch.inference_mode():
            for fn in fns.values():
                one_step(fn, xs, weights)                    # warm-up
            for _ in range(args.reps):
                for name, fn in fns.items():
                    best[name] = min(best[name], one_step(fn, xs, weights))
        a, b = best["F.linear"] * 1e3, best["oneDNN"] * 1e3
        print(f"| {m} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)
    print(f"# load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
