"""Quantized GEMM: the GGUF block kernels (kernels/quant) against the dense GEMM of the same weights.

    python benchmarks/quant_gemm.py [--formats Q4_1,Q8_0,Q4_K] [--shapes qkv,o,gate_up,down,lm_head]
                                    [--rows 1,4,8,16,32,64,256] [--reps 5] [--threads 0]

The built-in model's projection shapes (SmolLM2-135M: hidden 576, MLP 1536, 9 query / 3 KV heads
of 64, vocabulary 49,152; q/k/v and gate/up fused as the engine runs them), each format's blocks
of random weights, M activation rows. Per call, in microseconds (the 20th percentile of --reps
passes: robust to other processes on the cores):

    rows        quant_linear(path="rows"), float32 activations: the per-row kernel
    rows i8     quant_linear(path="rows", activations="int8"): the per-row kernel, activations
                quantized to int8 per 32-block (integer dot products)
    tiled       quant_linear(path="tiled"), float32 activations: float32 tiles
    tiled bf16  quant_linear(path="tiled"), bfloat16 activations: bf16 tiles (AVX512-BF16) or
                float32 tiles on the widened activations (other CPUs)
    slabs       quant_linear(path="slabs"), float32 activations: the weight dequantized a slab
                at a time into a reused buffer, each slab through oneDNN's dense GEMM
    slabs bf16  the same with bfloat16 activations (bf16 slabs on AVX512-BF16)
    amx bf16    quant_linear(path="amx"), bfloat16 activations: 32 weight rows dequantized at a
                time and multiplied on AMX bf16 tiles (nan where the CPU has none)
    dense f32   kvmesh.kernels.linear on the dequantized float32 weight (--quantization none)
    dense bf16  the same on the weight rounded to bfloat16 (--dtype bfloat16)
    auto/bf16   dense bf16 time over what quant_linear picks for bf16 activations (gemm_path):
                above 1, the blocks are faster than the dense bf16 model
    i8/bf16     dense bf16 time over the per-row int8 kernel's
    GB/s i8     the int8 kernel's weight bytes read a second (the blocks, once a call): against
                the machine's memory bandwidth, how far the kernel is from streaming speed
    GB/s bf16   the same for dense bf16 (2 bytes a weight)

Each weight is cycled through enough copies (--working-set MB of float32) that the weights come
from memory as in a whole model rather than from cache; every column runs in the same process,
interleaved per row count. The bf16 paths' largest difference, relative to |x|.|W|, is printed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.offline_throughput import describe_machine  # noqa: E402
from kvmesh.kernels.linear import linear  # noqa: E402
from kvmesh.kernels.quant import QuantizedWeight, dequantize, quant_linear  # noqa: E402
from kvmesh.kernels.quant.weight import FP16_SCALES  # noqa: E402
from kvmesh.kernels.quant.ops import (AMX_MIN_ROWS, AMX_SLAB_MIN_ROWS, INT8_TILED_MIN_ROWS,  # noqa: E402
                                      SLAB_MIN_ROWS, TILED_MIN_ROWS,
                                      amx_ready, gemm_path, tiled_isa)  # noqa: E402

HIDDEN, INTER, VOCAB, HEAD_DIM, HEADS, KV_HEADS = 576, 1536, 49152, 64, 9, 3
SHAPES = {   # name -> (N, K) as the engine multiplies them
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}
COLUMNS = ("rows", "rows i8", "tiled", "tiled bf16", "slabs", "slabs bf16", "amx bf16", "dense f32",
           "dense bf16")


def random_weight(fmt: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """[n, k] blocks of `fmt`: gguf's quantizer on normal(0, 0.02) weights where it has one, else
    random bytes with small fp16 scales (gguf has no K-quant quantizer; any bit pattern is a block)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[fmt]
    rng = np.random.default_rng(seed)
    if int(qtype) not in FP16_SCALES:
        raw = quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32), qtype)
    else:
        qk, size = GGML_QUANT_SIZES[qtype]
        at, width = FP16_SCALES[int(qtype)]
        raw = rng.integers(0, 256, (n, k // qk, size), dtype=np.uint8)
        scales = np.float16(rng.uniform(1e-4, 1e-3, (n, k // qk, width // 2))).view(np.uint8)
        raw[..., at:at + width] = scales.reshape(n, k // qk, width)
        raw = raw.reshape(n, -1)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(raw)), int(qtype), (n, k), "float")


def low_us(fn, xs: torch.Tensor, weights: list, reps: int) -> float:
    """Microseconds per call: the 20th percentile of every call over `reps` passes through the
    copies (after one warm-up pass), so a call that another process delayed does not count."""
    for w in weights:
        fn(xs, w)
    times = []
    for _ in range(reps):
        for w in weights:
            t0 = time.perf_counter()
            fn(xs, w)
            times.append(time.perf_counter() - t0)
    return float(np.percentile(times, 20)) * 1e6


def bench_shape(fmt: str, name: str, rows: list[int], reps: int, working_set_mb: float) -> None:
    n, k = SHAPES[name]
    if k % (256 if fmt.endswith("_K") else 32):
        print(f"# {fmt} {name}: K={k} is not a whole number of {fmt} blocks (256): skipped")
        return
    qw = random_weight(fmt, n, k, seed=zlib.crc32(f"{fmt}{name}".encode()))
    copies = max(1, int(working_set_mb * 2**20 // (n * k * 4)))
    quant = [QuantizedWeight(qw.data.clone(), qw.qtype, qw.shape, "float") for _ in range(copies)]
    f32 = dequantize(qw)
    dense32 = [f32.clone() for _ in range(copies)]
    dense16 = [f32.to(torch.bfloat16) for _ in range(copies)]
    fns = {
        "rows": (lambda x, w: quant_linear(x, w, path="rows"), quant, torch.float32),
        "rows i8": (lambda x, w: quant_linear(x, w, path="rows", activations="int8"), quant,
                    torch.float32),
        "tiled": (lambda x, w: quant_linear(x, w, path="tiled"), quant, torch.float32),
        "tiled bf16": (lambda x, w: quant_linear(x, w, path="tiled"), quant, torch.bfloat16),
        "slabs": (lambda x, w: quant_linear(x, w, path="slabs"), quant, torch.float32),
        "slabs bf16": (lambda x, w: quant_linear(x, w, path="slabs"), quant, torch.bfloat16),
        "amx bf16": (lambda x, w: quant_linear(x, w, path="amx"), quant, torch.bfloat16),
        "dense f32": (linear, dense32, torch.float32),
        "dense bf16": (linear, dense16, torch.bfloat16),
    }
    if not amx_ready():
        del fns["amx bf16"]
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        us = {col: low_us(fn, x.to(dt), ws, reps) for col, (fn, ws, dt) in fns.items()}
        us.setdefault("amx bf16", float("nan"))
        picked = {"rows": "rows", "tiled": "tiled bf16", "slabs": "slabs bf16",
                  "amx": "amx bf16"}[gemm_path(m, torch.bfloat16)]
        xb = x.to(torch.bfloat16)
        got = quant_linear(xb, qw).double()
        want = linear(xb, dense16[0]).double()
        scale = xb.double().abs() @ dense16[0].double().abs().T
        err = ((got - want).abs() / scale.clamp_min(1e-30)).max().item()
        print(f"{fmt:5} {name:8} {n:6} {k:5} {m:5} "
              + " ".join(f"{us[c]:11.1f}" for c in COLUMNS)
              + f" {us['dense bf16'] / us[picked]:9.2f} {us['dense bf16'] / us['rows i8']:7.2f}"
              + f" {qw.data.numel() / us['rows i8'] / 1e3:7.1f} {n * k * 2 / us['dense bf16'] / 1e3:9.1f}"
              + f" {err:9.1e}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="Q4_1,Q8_0,Q4_K", help="GGUF formats (Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--rows", default="1,4,8,16,32,64,256", help="activation rows per call (M)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--working-set", type=float, default=128.0,
                   help="MB of float32 weights cycled per shape (copies of one weight)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; use {', '.join(SHAPES)}")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {describe_machine()}")
    print(f"# load average at start: {os.getloadavg()}")
    print(f"# int8 activations take the tiled path from {INT8_TILED_MIN_ROWS} rows (None: never)")
    print(f"# tiled kernels: {tiled_isa()}; quant_linear takes the tiled path from "
          + ", ".join(f"{n} rows ({kind} tiles)" for kind, n in TILED_MIN_ROWS.items())
          + "; the slabs from " + ", ".join(f"{n} rows ({kind})" for kind, n in SLAB_MIN_ROWS.items())
          + (f"; on AMX: bf16 from {AMX_MIN_ROWS['float']} rows (int8 activations from "
             f"{AMX_MIN_ROWS['int8']}), the slabs from {AMX_SLAB_MIN_ROWS}" if amx_ready() else ""))
    print(f"# {'fmt':5} {'shape':8} {'N':>6} {'K':>5} {'M':>5} "
          + " ".join(f"{c:>11}" for c in COLUMNS) + f" {'auto/bf16':>9} {'i8/bf16':>7} {'GB/s i8':>7} {'GB/s bf16':>9} {'bf16 err':>9}"
          + "   (us per call)")
    for fmt in args.formats.split(","):
        for name in args.shapes.split(","):
            bench_shape(fmt, name, rows, args.reps, args.working_set)
    print(f"# load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
