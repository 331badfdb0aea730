"""The quantized linear and embedding operations, on the C++ kernels (`csrc/gemm.cpp`, `csrc/tiled.cpp`,
`csrc/amx.cpp`).

    quant_linear(x, w, bias, activations)   y = x @ W^T (+ b), W a QuantizedWeight
    gemm_path(rows, dtype, activations)     which kernel a call of `rows` activation rows takes
    amx_ready()                             whether the AMX path runs on this CPU and kernel
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

"amx", where the CPU has AMX bf16 tiles (and the kernel grants this process their registers),
takes bf16 activations from AMX_MIN_ROWS rows (one for float activations, 8 for int8) up to the
slabs (from AMX_SLAB_MIN_ROWS there) instead of "rows" and "tiled": 32 weight rows at a time are
dequantized into a bf16 scratch by the tiles' arithmetic and multiplied by every activation row
on the tiles (csrc/amx.cpp): the bf16 tiles' result at several times their speed.

"slabs", from `slab_min_rows(dtype)` rows on (a prefill's hundreds of rows): the weight is
dequantized a slab of rows at a time into one reused scratch buffer (at most SLAB_BYTES: a few layers' rows,
never the matrix) by the tiles' own arithmetic, and each slab multiplied by oneDNN's dense GEMM,
whose register blocking the tile micro-kernel does not match at that many rows (docs/KERNELS.md,
"Many rows"). The dequantization is read once per call and its cost spread over the rows, so the
result is the tiled path's (bf16 slabs for bf16 activations on AVX512-BF16, float32 otherwise) at
the dense GEMM's speed; the weight stays in blocks.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvmesh.kernels import linear as dense
from kvmesh.kernels.quant.build import load
from kvmesh.kernels.quant.weight import QuantizedWeight

ACTIVATIONS = ("float", "int8")
PATHS = ("rows", "tiled", "amx", "slabs")
# NOTE: the fewest activation rows at which the tiled kernel beat the per-row one on the built-in
# model's shapes (benchmarks/quant_gemm.py, docs/KERNELS.md): bf16 tiles (vdpbf16ps, 32 products
# an instruction) pay for the tile from 8 rows, float32 tiles only from 32.
TILED_MIN_ROWS = {"bf16": 8, "float32": 32}
# NOTE: int8 activations (the per-row int8 kernel) take the tiled kernel, on float activations, from
# this many rows: at 8 bf16 rows the bf16 tiles overtook the int8 kernel on the built-in model's
# shapes (benchmarks/quant_gemm.py, docs/KERNELS.md), while float32 tiles stayed behind it up to
# 64 rows (None: never). The tiled result is the more exact one (no activation rounding).
INT8_TILED_MIN_ROWS: dict[str, int | None] = {"bf16": 8, "float32": None}
# NOTE: the fewest rows at which dequantizing slabs for oneDNN beat the tiles on the built-in
# model's shapes (benchmarks/quant_gemm.py's "slabs" column, docs/KERNELS.md); any activations.
SLAB_MIN_ROWS = {"bf16": 128, "float32": 64}
# NOTE: the fewest bf16 rows, per activation mode, at which the AMX path takes a call where the CPU
# has AMX (up to AMX_SLAB_MIN_ROWS). Float activations from one row: with its bf16 output the AMX
# path tied the per-row float32 kernel at one row on the layers and beat it 1.5x on the LM head,
# 1.3-5x from 2 to 7 rows (benchmarks/quant_gemm.py, docs/KERNELS.md); it is then also the kernel
# at every batch size, so a row's result does not depend on how many rows share its step. int8
# activations keep their per-row int8 kernel (the mode chosen for one-row speed) below 8 rows.
AMX_MIN_ROWS = {"float": 1, "int8": 8}
# NOTE: where the AMX path runs, bf16 activations take the slabs only from this many rows: since
# the tiles' lookup dequantization and bf16 output, they beat the slabs at 256 rows on every layer
# shape of the built-in model (1.1-1.8x, two runs), over the four shapes together at 512 and 768
# (1.03-1.21x, four runs), and tie them at 1024 (benchmarks/quant_gemm.py, docs/KERNELS.md; 256
# before, when the slabs won there). A 512-token prefill budget's full steps stay on the tiles.
AMX_SLAB_MIN_ROWS = 1024
# the scratch slab's budget: rows of W dequantized at once (the LM head takes several slabs)
SLAB_BYTES = 4 << 20


def tile_kind(dtype: torch.dtype) -> str:
    """"bf16" or "float32": the tiles a call with activations of `dtype` multiplies."""
    return "bf16" if dtype == torch.bfloat16 and tiled_isa() == "avx512_bf16" else "float32"


def slab_min_rows(dtype: torch.dtype) -> int:
    """The fewest activation rows of `dtype` that take the slabs on this CPU."""
    kind = tile_kind(dtype)
    return AMX_SLAB_MIN_ROWS if kind == "bf16" and amx_ready() else SLAB_MIN_ROWS[kind]


def gemm_path(rows: int, dtype: torch.dtype = torch.float32, activations: str = "float") -> str:
    """"slabs", "amx", "tiled" or "rows": the kernel quant_linear runs for `rows` activation rows
    of `dtype`."""
    if rows >= slab_min_rows(dtype):
        return "slabs"
    if rows >= AMX_MIN_ROWS[activations] and tile_kind(dtype) == "bf16" and amx_ready():
        return "amx"
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
    # NOTE: the layers' calls are 2-D: no reshape and view back (a few µs a call, 4 calls a layer)
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    if path is not None and (path not in PATHS or (path == "tiled" and activations != "float")):
        raise ValueError(f"path must be one of {PATHS} ('tiled' takes float activations), got {path!r}")
    if path == "amx" and not (x2.dtype == torch.bfloat16 and amx_ready()):
        raise ValueError("path 'amx' takes bfloat16 activations on a CPU with AMX bf16 tiles")
    path = path or gemm_path(x2.shape[0], x2.dtype, activations)
    if path == "slabs":
        y = _slab_gemm(x2, w)
    elif path == "amx":
        # NOTE: without a bias the kernel rounds its accumulators to bf16 itself (the bits
        # torch's conversion gives): no float32 [M, N] result and no conversion pass, which took
        # ~2% of a decode-heavy run's CPU samples
        y = _ext().quant_gemm_amx(x2.contiguous(), w.data, w.qtype, w.shape[1], bias is None)
    elif path == "tiled":
        # NOTE: bf16 activations go in as they are: the bf16 tile path reads them directly
        xt = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()
        y = _ext().quant_gemm_tiled(xt, w.data, w.qtype, w.shape[1])
    else:
        xf = x2 if x2.dtype == torch.float32 else x2.float()
        y = _ext().quant_gemm(xf, w.data, w.qtype, w.shape[1], activations == "int8")
    if bias is not None:
        y.add_(bias)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if flat else y.view(*x.shape[:-1], w.shape[0])


_scratch: dict[torch.dtype, torch.Tensor] = {}


def _slab_gemm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """[M, N] in x's dtype (float32 for float32 slabs): x @ W^T, W dequantized slab by slab."""
    n, k = w.shape
    slab_dtype = torch.bfloat16 if tile_kind(x.dtype) == "bf16" else torch.float32
    xs = x.contiguous() if x.dtype == slab_dtype else x.to(slab_dtype).contiguous()
    per_slab = max(1, min(n, SLAB_BYTES // (k * (2 if slab_dtype == torch.bfloat16 else 4))))
    buf = _scratch.get(slab_dtype)
    if buf is None or buf.numel() < per_slab * k:
        # NOTE: kept between calls: a fresh multi-MB tensor each call is an mmap, page faults and
        # a munmap (glibc), about as long as the dequantization itself
        buf = _scratch[slab_dtype] = torch.empty(per_slab * k, dtype=slab_dtype)
    y = torch.empty(x.shape[0], n, dtype=slab_dtype) if per_slab < n else None
    ext = _ext()
    for n0 in range(0, n, per_slab):
        rows = min(per_slab, n - n0)
        slab = buf[:rows * k].view(rows, k)
        ext.dequantize_into(w.data, n0, slab, w.qtype, k)
        # NOTE: not kernels.linear.linear: it caches a reordered copy on the weight tensor, and this
        # scratch is rewritten in place by C++ (no version bump): the unpacked oneDNN primitive
        part = (torch.ops.mkldnn._linear_pointwise(xs, slab, None, "none", [None], "")
                if dense.uses_onednn(xs, slab) else F.linear(xs, slab))
        if y is None:
            return part
        y[:, n0:n0 + rows] = part
    return y


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


@functools.lru_cache(maxsize=1)
def amx_ready() -> bool:
    """Whether the AMX path runs here: built with AMX bf16 tiles (this CPU has them) and the
    kernel let this process use the tile registers."""
    return _ext().amx_isa() == "amx_bf16"


def int8_isa() -> str:
    """Which int8 dot product this machine's build uses: avx512vnni, avxvnni, avx2 or scalar."""
    return _ext().int8_isa()
