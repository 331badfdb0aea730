"""Hugging Face quantized GEMMs on CPU (kernels/quant/csrc/hf_gemm.cpp) against the dense GEMM of
the same weights.

    python benchmarks/hf_quant_gemm.py [--shapes qkv,o,gate_up,down] [--rows 1,8,32,128]
                                       [--reps 7] [--threads 0] [--working-set 512]

A 1B-class Llama's projection shapes (hidden 2048, MLP 8192, 32 query / 8 KV heads of 64; q/k/v
and gate/up fused as the engine runs them), random weights, M activation rows. Per call, in
microseconds (the 20th percentile of --reps passes: robust to other processes on the cores):

    w4a16       int4 groups of 128 with zeros (AWQ / GPTQ), float32 activations
    w4a16 bf16  the same with bf16 activations (a bf16 model): what hf_linear picks (the AMX
                tiles where the CPU has them, from the row count `w4a16_gemm` takes them; bf16
                weight tiles from 12 rows on with AVX512-BF16)
    w4a16 amx   the AMX bf16 tiles at every row count (`w4a16_gemm_amx`; nan without AMX)
    w8a8        int8 per-channel weights x int8 per-token activations (compressed-tensors W8A8)
    dense f32   kvmesh.kernels.linear on the dequantized float32 weight (--quantization none)
    dense bf16  the same on the weight rounded to bfloat16 (--dtype bfloat16)
    bf16/w4, bf16/w8   dense bf16 time over the quantized kernel's (w4: the faster of the two
                w4a16 columns): above 1, the kernel is faster

Each weight is cycled through enough copies (--working-set MB of float32 weights) that weights come
from memory as in a whole model rather than from cache; every column runs in the same process,
interleaved per pass, so ratios hold on a shared machine.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.offline_throughput import describe_machine  # noqa: E402
from kvmesh.kernels.linear import linear  # noqa: E402
from kvmesh.kernels.quant import hf_ops  # noqa: E402
from kvmesh.kernels.quant.hf_ops import hf_linear, isa  # noqa: E402
from kvmesh.kernels.quant.hf_weight import Int4GroupWeight, Int8ChannelWeight  # noqa: E402

HIDDEN, INTER, HEAD_DIM, HEADS, KV_HEADS, GROUP = 2048, 8192, 64, 32, 8, 128
SHAPES = {   # name -> (N, K) as the engine multiplies them
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}
COLUMNS = ("w4a16", "w4a16 bf16", "w4a16 amx", "w8a8", "dense f32", "dense bf16")


def weights(n: int, k: int, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    w4 = Int4GroupWeight((codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(),
                         torch.rand(n, k // GROUP, generator=g) * 0.004,
                         torch.randint(0, 16, (n, k // GROUP), generator=g, dtype=torch.uint8), GROUP)
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w8 = Int8ChannelWeight(q8, torch.rand(n, generator=g) * 1e-3, q8.sum(1, dtype=torch.int32))
    dense = w4.dequantize()
    return {"w4a16": w4, "w4a16 bf16": w4, "w4a16 amx": w4, "w8a8": w8, "dense f32": dense, "dense bf16": dense.bfloat16()}


def run(column: str, x: torch.Tensor, w) -> None:
    if column in ("w4a16", "w8a8"):
        hf_linear(x, w)
    elif column == "w4a16 bf16":
        hf_linear(x.bfloat16(), w)
    elif column == "w4a16 amx":
        ext = hf_ops._ext()
        ext.w4a16_gemm_amx(x.bfloat16(), w.qweight, w.scales, w.zeros, w.group_size)
    elif column == "dense f32":
        linear(x, w)
    else:
        linear(x.bfloat16(), w)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--working-set", type=float, default=512.0, help="MB of float32 weights cycled")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_machine())
    print(f"kernels: {isa()}; torch threads {torch.get_num_threads()}")
    amx = hf_ops._ext().w4a16_amx_isa() == "amx_bf16"
    columns = [c for c in COLUMNS if c != "w4a16 amx" or amx]
    print(f"{'shape':>8} {'N x K':>12} {'rows':>5} " + " ".join(f"{c:>11}" for c in COLUMNS)
          + f" {'bf16/w4':>8} {'bf16/w8':>8}")
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        copies = max(1, int(args.working_set * 1e6 // (n * k * 4)))
        ws = [weights(n, k, seed) for seed in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {c: [] for c in COLUMNS}
            for rep in range(args.reps + 1):
                for c in columns:       # NOTE: interleaved: every column sees the same load
                    t0 = time.perf_counter()
                    for w in ws:
                        run(c, x, w[c])
                    if rep:             # the first pass warms up
                        times[c].append((time.perf_counter() - t0) / len(ws) * 1e6)
            us = {c: float(np.percentile(times[c], 20)) if times[c] else float("nan") for c in COLUMNS}
            print(f"{shape:>8} {n:>5} x {k:<5} {rows:>5} " + " ".join(f"{us[c]:>11.1f}" for c in COLUMNS)
                  + f" {us['dense bf16'] / min(us['w4a16'], us['w4a16 bf16']):>8.2f}"
                  + f" {us['dense bf16'] / us['w8a8']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
