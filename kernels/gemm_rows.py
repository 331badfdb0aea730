"""The fewest rows oneDNN's CPU GEMM is called with: a 1- or 2-row product is padded to 4 rows.

On the AMD EPYC (Zen 5) the benchmarks run on, oneDNN's brgemm kernel on the reordered weights
(`kernels/linear.py`) is slower for 1 and 2 activation rows than for 3 to 5: SmolLM2-135M's 121
projections at one thread, thread CPU time, median of 12 interleaved passes (float32: 1 row
44.7 ms, 2 rows 53.9, 3 rows 39.9, 4 rows 40.3, 5 rows 40.1; bfloat16: 23.3 / 25.3 / 20.5 / 19.4 /
19.9 ms; docs/BENCHMARKS.md, "The plain step of a speculating engine"). So a batch-1 decode step
costed more than a 5-row speculative verify step, and a speculating engine's steps without drafts
more than its steps with them. Padding the rows with zeros to MIN_ROWS and keeping the first ones
gives the 4-row cost.

It also makes a row's result independent of the batch it runs in: oneDNN's 1-row path sums in
another order than its path for 2 or more rows where K is large (SmolLM2's down_proj, K = 1536:
up to 9e-5 apart), while rows of a 2..16-row product are bitwise those of any other; so a
speculative verify row and a plain decode row of the same token now agree to the bit.

The floor is a measured property of one kind of CPU: the default is 4 on AMD CPUs with AVX-512
(measured on a Zen 5) and 1 (no padding) elsewhere (an Intel Xeon's 1-row GEMM measured cheaper
than its 3-row one; AMD's AVX2-only parts are not measured); `KVMESH_GEMM_MIN_ROWS=N` sets it
(1 turns the padding off).
"""
from __future__ import annotations

import functools
import os

import torch

from kvmesh.kernels.cpu_features import cpu_flags, cpu_vendor

ENV = "KVMESH_GEMM_MIN_ROWS"
AMD_MIN_ROWS = 4        # AMD EPYC Zen 5 (AVX-512): 3..5 rows the cheapest, 1 and 2 the dearest


def default_min_rows(vendor: str, flags: frozenset[str]) -> int:
    """The measured floor for a CPU (its vendor and feature flags; 1: no padding)."""
    return AMD_MIN_ROWS if vendor == "AuthenticAMD" and "avx512f" in flags else 1


def parse_min_rows(value: str) -> int:
    """KVMESH_GEMM_MIN_ROWS's value: a whole number of rows from 1 to 64."""
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if not 1 <= rows <= 64:
        raise ValueError(f"{ENV}={value!r}: a whole number of rows from 1 to 64 "
                         "(1 turns the padding off)")
    return rows


def min_rows_from_env() -> int:
    value = os.environ.get(ENV)
    return default_min_rows(cpu_vendor(), cpu_flags()) if value is None else parse_min_rows(value)


MIN_ROWS = min_rows_from_env()


@functools.lru_cache(maxsize=64)
def _zeros(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    # NOTE: read-only: torch.cat copies it, so one tensor serves every caller and thread
    with torch.inference_mode(False):
        return torch.zeros(rows, k, dtype=dtype)


def padded(x: torch.Tensor, min_rows: int) -> torch.Tensor:
    """x ([M, K], contiguous) with zero rows appended up to `min_rows` (x itself when M is
    already at least that)."""
    m = x.shape[0]
    if m >= min_rows:
        return x
    return torch.cat((x, _zeros(min_rows - m, x.shape[1], x.dtype)))


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  min_rows: int | None = None) -> torch.Tensor:
    """oneDNN's linear (`_linear_pointwise`) on x [M, K] with at least `min_rows` (default
    MIN_ROWS) rows computed; the first M rows of the result ([M, N], contiguous)."""
    m = x.shape[0]
    floor = MIN_ROWS if min_rows is None else min_rows
    y = torch.ops.mkldnn._linear_pointwise(padded(x.contiguous(), floor), weight, bias,
                                           "none", [None], "")
    return y if y.shape[0] == m else y[:m]
