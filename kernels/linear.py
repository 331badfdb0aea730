"""y = x @ W^T + b for the model's projections, on the fastest GEMM the tensors' device offers.

On CPU, PyTorch's `F.linear` runs float32 through the BLAS it was built with (MKL), which on
some x86 CPUs (AMD EPYC here) takes a path that reaches half of what oneDNN does for the same
shapes (`docs/BENCHMARKS.md`, "Optimisations made": oneDNN GEMMs). oneDNN's linear primitive
can take the dense weight as it is, but runs 1.2x (64 rows) to 1.5x (8 rows) faster on a copy
reordered once into its blocked layout (`docs/BENCHMARKS.md`, "Side by side on an idle machine";
the results are the same bits for the engine's batch sizes). So CPU float32 / bfloat16 go there, each weight reordered on its
first use and the copy kept on the weight tensor itself (`_kvmesh_packed`, dropped with it, and
rebuilt when the weight is written in place or replaced); everything else (CUDA, other dtypes, a
torch built without oneDNN) uses `F.linear`. The copy costs the weights' memory once more (the
dense weight stays: the embedding, state_dict, tensor-parallel sharding and the reference read
it), which the engine subtracts before sizing the KV cache (`packed_copy_bytes`);
`KVMESH_PACK_WEIGHTS=0` turns the reordering off.

bfloat16 on a CPU without bf16 dot products (no AVX512-BF16 or AMX: `cpu_features`): oneDNN
would emulate the bf16 GEMM at a third of float32's speed (docs/BENCHMARKS.md, "bfloat16 on an
AVX2 CPU"). There each bf16 weight gets a float32 copy instead (reordered as above), and the GEMM
runs in float32 on the activations widened exactly, its result rounded to bf16 once: the same
arithmetic as a bf16 GEMM with float32 accumulation, at float32's speed. The copy is twice the
bf16 weight's bytes, which `packed_copy_bytes` counts.

A GEMM of a few rows (a decode step: 1-16 tokens, a speculative verification's k + 1) is a read
of the weight, and oneDNN's fixed cost of ~20-40 µs a call dominates the small ones. Where the
C++ kernels have a path for the dtype (float32: AVX-512 / AVX2 FMA; bf16: AVX512-BF16), the
rows are at most its crossover (`small_gemm.MAX_ROWS`; float32 only where oneDNN's few-row GEMMs
are not padded, `gemm_rows`) and the weight is not an LM head's
(`small_gemm.MAX_WEIGHT_BYTES`), such a GEMM runs on `kernels/small_gemm.py` instead, on the
dense weight itself (it builds no copy; the packed one is still built by the first larger
GEMM, and counted as before). Its rows are batch-invariant (each row's result bitwise the same
alone or in any batch). `KVMESH_SMALL_GEMM=0` keeps every GEMM on oneDNN.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.kernels import small_gemm
from kvmesh.kernels.cpu_features import native_bf16_flags
from kvmesh.kernels.gemm_rows import onednn_linear

# The batch size oneDNN tunes the blocked layout for; the layout it picks for 16..256 measured the
# same here at 1..512 rows.
PACK_HINT = 64


def _probe(dtypes: tuple[torch.dtype, ...],
           prepare: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.dtype, ...]:
    """Those of `dtypes` for which oneDNN's linear on `prepare(weight)` runs here and agrees with
    F.linear on a probe (a CPU without the instructions oneDNN wants for a dtype may refuse to
    create the primitive, and then that dtype stays on F.linear)."""
    ok = []
    for dtype in dtypes:
        x = torch.arange(8, dtype=torch.float32).view(2, 4).to(dtype)
        w = torch.ones(3, 4, dtype=dtype)
        try:
            y = torch.ops.mkldnn._linear_pointwise(x, prepare(w), None, "none", [None], "")
        except (AttributeError, RuntimeError):
            continue
        if torch.equal(y, F.linear(x, w)):
            ok.append(dtype)
    return tuple(ok)


def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN's linear takes here (dense weights)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return _probe((torch.float32, torch.bfloat16), lambda w: w)


def _packable_dtypes(dtypes: tuple[torch.dtype, ...]) -> tuple[torch.dtype, ...]:
    """Those of `dtypes` whose reordered weight oneDNN accepts here and multiplies right."""
    if os.environ.get("KVMESH_PACK_WEIGHTS", "1").lower() in ("0", "false", "no", "off"):
        return ()
    return _probe(dtypes, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT))


_ONEDNN_DTYPES = _onednn_dtypes()
_ONEDNN = bool(_ONEDNN_DTYPES)
_PACK_DTYPES = _packable_dtypes(_ONEDNN_DTYPES)
# bf16 GEMMs as float32 ones on weights widened once (see the module doc)
_BF16_VIA_FLOAT32 = torch.float32 in _ONEDNN_DTYPES and not native_bf16_flags()


def _stamp(weight: torch.Tensor) -> tuple[int, int]:
    """What changes when a weight's values may have: its storage, or an in-place write."""
    try:
        version = weight._version
    except RuntimeError:          # an inference tensor: no version counter, written only in place
        version = -1
    return weight.data_ptr(), version


def packed_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`weight` (converted to `dtype`, if given) reordered into oneDNN's blocked layout where it
    can be, built on first use and kept on the tensor."""
    stamp = (*_stamp(weight), dtype or weight.dtype)
    cached = getattr(weight, "_kvmesh_packed", None)
    if cached is not None and cached[1] == stamp:
        return cached[0]
    with torch.inference_mode(False), torch.no_grad():
        packed = weight.detach().to(dtype or weight.dtype).contiguous()
        if packed.dtype in _PACK_DTYPES:
            packed = torch.ops.mkldnn._reorder_linear_weight(packed, PACK_HINT)
    weight._kvmesh_packed = (packed, stamp)
    return packed


def packed_copy_bytes(model: nn.Module) -> int:
    """Host memory the reordered copies will take once every projection of `model` has run (they
    are built on first use, after the KV cache is sized: the engine sets this much aside). Fused
    q/k/v and gate/up weights are concatenations of these, so they count the same bytes."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            w = module.weight
            if w.device.type != "cpu" or w.dim() != 2:
                continue
            if _BF16_VIA_FLOAT32 and w.dtype == torch.bfloat16:
                total += w.numel() * 4
            elif w.dtype in _PACK_DTYPES:
                total += w.numel() * w.element_size()
    return total


def bf16_via_float32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs a bf16 GEMM as float32 on a widened weight (see the doc)."""
    return _BF16_VIA_FLOAT32 and x.dtype == torch.bfloat16 and _dense_2d(x, weight, torch.float32)


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs on oneDNN (CPU, float32 / bfloat16, dense, 2-D)."""
    return _dense_2d(x, weight, x.dtype)


def uses_small_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` (with no bias, or a contiguous one of x's dtype) runs on the
    small-row kernel (`small_gemm`): a oneDNN GEMM of at most the dtype's crossover rows on a
    weight under `small_gemm.MAX_WEIGHT_BYTES`."""
    return (uses_onednn(x, weight) and not bf16_via_float32(x, weight)
            and small_gemm.takes(x.shape[0], weight))


def _dense_2d(x: torch.Tensor, weight: torch.Tensor, gemm_dtype: torch.dtype) -> bool:
    # NOTE: asked on every projection (121 a step for SmolLM2): `is_cpu` and `ndim` are
    # attributes where `device.type` builds a device object and `dim()` is a call (1.6 -> 0.9 µs)
    return (_ONEDNN and x.is_cpu and weight.is_cpu and gemm_dtype in _ONEDNN_DTYPES
            and weight.dtype == x.dtype and x.ndim == 2 and weight.ndim == 2
            and x.shape[0] > 0 and x.shape[1] == weight.shape[1] and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's contract ([..., in] x [out, in] (+ [out]) -> [..., out])."""
    # NOTE: the oneDNN op has no backward; with grad enabled and a tensor that requires it,
    # F.linear keeps autograd working (the engine itself runs under inference_mode).
    if bf16_via_float32(x, weight):
        wide_bias = None if bias is None else bias.float()
        y = onednn_linear(x.float(), packed_weight(weight, torch.float32), wide_bias)
        return y.to(torch.bfloat16)
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return F.linear(x, weight, bias)
    if small_gemm.takes(x.shape[0], weight):
        return small_gemm.run(x, weight, bias)
    if weight.dtype in _PACK_DTYPES:
        weight = packed_weight(weight)
    # NOTE: 1- and 2-row products padded to gemm_rows.MIN_ROWS rows (cheaper on AMD, see there)
    return onednn_linear(x, weight, bias)
