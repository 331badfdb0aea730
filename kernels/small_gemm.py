"""y = x @ W^T (+ b) for a decode step's few rows on CPU, each weight byte read once: `kernels/csrc/small_gemm.cpp`.

    small_gemm.max_rows(torch.bfloat16)       # 2 here; 0: off, not built, no vector path for it
    if small_gemm.takes(x.shape[0], weight):  # rows <= max_rows(dtype), weight <= MAX_WEIGHT_BYTES
        y = small_gemm.run(x, weight, bias)   # x [M, K], weight [N, K] dense, bias [N] or None

At 1-16 rows a projection reads its weight and does little else, yet oneDNN's linear costs ~20-40
µs of fixed work a call (121 calls a step on SmolLM2-135M). The C++ kernel reads the dense
weight as the model holds it (no packed copy), split over N across torch's threads, with a
per-call cost of a few µs. Its paths: float32 with AVX-512 or AVX2 FMA, bfloat16 with
AVX512-BF16 (float32 sums, each result rounded to bf16 once); `kernels/linear.py` sends a CPU
GEMM here when its dtype has a path, its rows are at most `MAX_ROWS[dtype]` (the crossover
measured against oneDNN, docs/KERNELS.md "Small-row GEMM") and its weight at most
`MAX_WEIGHT_BYTES` (not an LM head), and to oneDNN otherwise.

Each row's result depends only on that row and the weight: bitwise the same alone, at any
position of a batch of any size, and on any thread count (speculative decoding verifies k + 1
rows and must pick the tokens one-row decoding would).

`KVMESH_SMALL_GEMM=0` turns it off (every CPU GEMM then goes to oneDNN, as before it existed).
"""
from __future__ import annotations

import os

import torch

from kvmesh.kernels import cpu_kernels, gemm_rows

# The most rows a GEMM of each dtype runs here: above them oneDNN's packed GEMM is faster
# (docs/KERNELS.md, "Small-row GEMM": the crossover measured on SmolLM2-135M's shapes). float32
# takes 5, a speculative verification's k + 1 at k = 4: its rows then see the same kernel as
# one-row decoding, so the projections agree bitwise.
MAX_ROWS = {torch.float32: 5, torch.bfloat16: 2}
# NOTE: a weight this large (an LM head: 56 MB in bf16 for SmolLM2) stays on oneDNN at any row
# count: its fixed cost is nothing beside the read, and its packed layout streams ~10% faster.
MAX_WEIGHT_BYTES = 16 * 2**20
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

# dtype -> max rows here (0: none), decided on first use: the extension's load and the variable
# are looked at once per process (tests that change either start a fresh dict).
_cache: dict[torch.dtype, int] = {}


def enabled() -> bool:
    """Whether KVMESH_SMALL_GEMM leaves the kernel on (the default)."""
    return os.environ.get("KVMESH_SMALL_GEMM", "1").lower() not in cpu_kernels._OFF


def max_rows(dtype: torch.dtype) -> int:
    """The most rows of `dtype` the kernel takes here; 0 where it does not run that dtype."""
    rows = _cache.get(dtype)
    if rows is None:
        rows = _cache[dtype] = _decide(dtype)
    return rows


def _decide(dtype: torch.dtype) -> int:
    if dtype not in MAX_ROWS or not enabled():
        return 0
    if dtype == torch.float32 and gemm_rows.MIN_ROWS > 1:
        # NOTE: where oneDNN's few-row GEMMs are padded to MIN_ROWS (AMD with AVX-512), the padded
        # float32 GEMM beat this kernel idle (benchmarks/spec_decode.py, one thread, 2026-11-26:
        # 1-row steps 45.3 vs 57.8 ms, 5-row steps 45.8 vs 65.1 ms); a padded row is also bitwise
        # the row of any larger batch, so verification stays batch-invariant without it
        return 0
    ext = cpu_kernels.load()
    if ext is None or not ext.small_gemm_supports(_NAMES[dtype]):
        return 0
    return MAX_ROWS[dtype]


def takes(rows: int, weight: torch.Tensor) -> bool:
    """Whether a GEMM of `rows` rows on `weight` runs here (`max_rows` and the weight's size)."""
    return (rows <= max_rows(weight.dtype)
            and weight.shape[0] * weight.shape[1] * weight.element_size() <= MAX_WEIGHT_BYTES)


def run(x: torch.Tensor,                  # [M, K], 1 <= M <= max_rows(dtype)
        weight: torch.Tensor,             # [N, K] contiguous, x's dtype
        bias: torch.Tensor | None = None  # [N] contiguous, x's dtype
        ) -> torch.Tensor:                # [M, N]
    """The product on the C++ kernel (x copied first if its rows are not unit-stride)."""
    return cpu_kernels.load().small_gemm(x.contiguous(), weight, bias)
