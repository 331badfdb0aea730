"""The quantized linear and embedding operations, on the C++ kernels (`csrc/gemm.cpp`, `csrc/tiled.cpp`).

    quant_linear(x, w, bias, activations)   y = x @ W^T (+ b), W a QuantizedWeight
    gemm_path(rows, dtype, activations)     which kernel a call of `rows` activation rows takes
    embedding_rows(w, ids)                  the float rows `ids` of W (a quantized embedding)
    dequantize(w)                           the whole float32 matrix (tests, comparisons only)

`activations`: "float" multiplies float32 activations by each weight row rebuilt in float32;
"int8" first quantizes the activations per row and per 32-block to int8 (scale max|x| / 127)
and uses integer dot products. A weight carries its mode (`QuantizedWeight.activations`, the
loader's choice for the model).

Two kernels take float activations (docs/KERNELS.md): "rows" rebuilds each weight for every 4
activation rows (the fastest at a few rows: nothing is written but the result); "tiled"
dequantizes 16 weight rows at a time into a scratch tile and multiplies every activation row by
it, bf16 x bf16 with vdpbf16ps where the activations are bf16 and the CPU has AVX512-BF16, float32
FMA otherwise. From TILED_MIN_ROWS rows on (per tile kind), float activations take "tiled";
int8 activations from INT8_TILED_MIN_ROWS (bf16 tiles only), where they are taken as floats.
"""
from __future__ import annotations

import functools

import torch

from kvmesh.kernels.quant.build import load
from kvmesh.kernels.quant.weight import QuantizedWeight

ACTIVATIONS = ("float", "int8")
PATHS = ("rows", "tiled")
# NOTE: the fewest activation rows at which the tiled kernel beat the per-row one on the built-in
# model's shapes (benchmarks/quant_gemm.py, docs/KERNELS.md): bf16 tiles (vdpbf16ps, 32 products
# an instruction) pay for the tile from 8 rows, float32 tiles only from 32.
TILED_MIN_ROWS = {"bf16": 8, "float32": 32}
# NOTE: int8 activations (the per-row int8 kernel) take the tiled kernel, on float activations, from
# this many rows: at 8 bf16 rows the bf16 tiles overtook the int8 kernel on the built-in model's
# shapes (benchmarks/quant_gemm.py, docs/KERNELS.md), while float32 tiles stayed behind it up to
# 64 rows (None: never). The tiled result is the more exact one (no activation rounding).
INT8_TILED_MIN_ROWS: dict[str, int | None] = {"bf16": 8, "float32": None}


def tile_kind(dtype: torch.dtype) -> str:
    """"bf16" or "float32": the tiles a call with activations of `dtype` multiplies."""
    return "bf16" if dtype == torch.bfloat16 and tiled_isa() == "avx512_bf16" else "float32"


def gemm_path(rows: int, dtype: torch.dtype = torch.float32, activations: str = "float") -> str:
    """"tiled" or "rows": the kernel quant_linear runs for `rows` activation rows of `dtype`."""
    at = (TILED_MIN_ROWS if activations == "float" else INT8_TILED_MIN_ROWS)[tile_kind(dtype)]
    return "tiled" if at is not None and rows >= at else "rows"


def kernels_available() -> bool:
    return load() is not None


def _ext():
    ext = load()
    if ext is None:
        from kvmesh.kernels.quant.build import unavailable_reason  # noqa: PLC0415
        raise RuntimeError(f"quantized GEMM kernels unavailable: {unavailable_reason()}")
    return ext


def quant_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                 activations: str | None = None, path: str | None = None) -> torch.Tensor:
    """F.linear's contract for a quantized weight: [..., K] -> [..., N], in x's dtype;
    `activations` overrides the weight's own mode, `path` the kernel `gemm_path` picks
    (benchmarks and tests)."""
    activations = activations or w.activations
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if path is not None and (path not in PATHS or (path == "tiled" and activations != "float")):
        raise ValueError(f"path must be one of {PATHS} ('tiled' takes float activations), got {path!r}")
    path = path or gemm_path(x2.shape[0], x2.dtype, activations)
    if path == "tiled":
        # NOTE: bf16 activations go in as they are: the bf16 tile path reads them directly
        xt = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()
        y = _ext().quant_gemm_tiled(xt, w.data, w.qtype, w.shape[1])
    else:
        xf = x2 if x2.dtype == torch.float32 else x2.float()
        y = _ext().quant_gemm(xf, w.data, w.qtype, w.shape[1], activations == "int8")
    if bias is not None:
        y.add_(bias)
    y = y if x.dtype == torch.float32 else y.to(x.dtype)
    return y.view(*lead, w.shape[0])


def embedding_rows(w: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """[*ids.shape, K] float32: the rows `ids`, dequantized on lookup (nothing else is)."""
    flat = ids.reshape(-1).to(torch.int64)
    return _ext().dequantize_rows(w.data, flat, w.qtype, w.shape[1]).view(*ids.shape, w.shape[1])


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """[N, K] float32, every row (for tests and the dequantized comparison; never on the hot path)."""
    return embedding_rows(w, torch.arange(w.shape[0]))


@functools.lru_cache(maxsize=1)
def tiled_isa() -> str:
    """The tiled kernel's instruction set here: avx512_bf16 (bf16 tiles for bf16 activations),
    avx512, avx2 or portable (float32 tiles)."""
    return _ext().tiled_isa()


def int8_isa() -> str:
    """Which int8 dot product this machine's build uses: avx512vnni, avxvnni, avx2 or scalar."""
    return _ext().int8_isa()
