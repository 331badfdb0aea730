"""y = x @ W^T (+ b) for the Hugging Face quantized weights (`hf_weight.py`).

    hf_linear(x, w, bias)           F.linear's contract: [..., K] -> [..., N] in x's dtype
    quantize_rows_int8(x)           the W8A8 activation quantization (codes, per-row scales)
    reference_linear(x, w, bias)    the same product from the dequantized float32 weight (tests)

On CPU the C++ kernels (`csrc/hf_gemm.cpp`, built by `hf_build.py`) run (float32 activations,
or bf16 ones for the int4 GEMM's bf16 tiles, AMX bf16 tiles from 2 rows where the CPU has them;
W8A8 from W8A8_AMX_MIN_ROWS rows on AMX's int8 tiles where the CPU has them, `csrc/hf_amx.cpp`,
the same bits as the VNNI path); on CUDA the Triton GEMMs of `kvmesh.kernels.quant.triton_gemm`
(and `triton_w8g` for GGUF's 8-bit groups), imported only there, so a CPU process never loads
Triton.
FP8 weights run on CUDA only.
"""
from __future__ import annotations

import torch

import functools

from kvmesh.kernels.quant.hf_build import load, unavailable_reason
from kvmesh.kernels.quant.hf_weight import Fp8Weight, HFWeight, Int4GroupWeight, Int8ChannelWeight, Int8GroupWeight


# NOTE: the fewest rows at which the AMX int8 tiles beat the VNNI kernel on the built-in model's
# shapes (docs/KERNELS.md): at one row the two tie, from two the tiles win (4-5x at 64 rows).
W8A8_AMX_MIN_ROWS = 2


def kernels_available() -> bool:
    return load() is not None


def _ext():
    ext = load()
    if ext is None:
        raise RuntimeError(f"Hugging Face quantized GEMM kernels unavailable: {unavailable_reason()}")
    return ext


def hf_linear(x: torch.Tensor, w: HFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) -> [..., N] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.is_cuda:
        y = _cuda_linear(x2, w, bias)
    else:
        y = _cpu_linear(x2, w, out_bf16=bias is None)
        if bias is not None:
            y.add_(bias)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
    return y.view(*lead, w.shape[0])


def _cpu_linear(x: torch.Tensor, w: HFWeight, out_bf16: bool = False) -> torch.Tensor:
    """float32 [M, N]; bf16 where `out_bf16`, x is bf16 and the int4 AMX tiles run (the kernel
    rounds its float32 sums as torch's conversion would: no float32 result and no copy)."""
    if isinstance(w, Int4GroupWeight):
        if w.zeros.dtype != torch.uint8:
            raise ValueError("int4 weights with float zero points (GGUF Q4_1 converted for a GPU) are "
                             "served on GPU only; on CPU GGUF blocks are served as they are")
        # NOTE: bf16 activations go in as they are: from 12 rows on, on a CPU with AVX512-BF16,
        # the kernel multiplies bf16 weight tiles by them (vdpbf16ps); float32 otherwise
        xq = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        if w.perm is not None:
            xq = xq.index_select(1, w.perm)     # act-order: K was permuted at load
        return _ext().w4a16_gemm(xq.contiguous(), w.qweight, w.scales, w.zeros, w.group_size,
                                 out_bf16 and xq.dtype == torch.bfloat16)
    xf = x.float().contiguous()
    if isinstance(w, Int8ChannelWeight):
        if xf.shape[0] >= W8A8_AMX_MIN_ROWS and xf.shape[1] % 64 == 0 and w8a8_amx_ready():
            return _ext().w8a8_gemm_amx(xf, w.weight, w.weight_scale)
        return _ext().w8a8_gemm(xf, w.weight, w.weight_scale, w.w_sum)
    if isinstance(w, Int8GroupWeight):
        raise ValueError("int8 group weights (GGUF blocks converted for a GPU) are served on GPU only; on "
                         "CPU GGUF blocks are served as they are")
    raise ValueError(f"{w.format} weights are served on GPU only")


def _cuda_linear(x: torch.Tensor, w: HFWeight, bias: torch.Tensor | None) -> torch.Tensor:
    from kvmesh.kernels.quant import triton_gemm  # noqa: PLC0415
    if isinstance(w, Int4GroupWeight):
        return triton_gemm.w4a16_gemm(x, w.qweight, w.scales, w.zeros, w.group_size, perm=w.perm, bias=bias)
    if isinstance(w, Int8GroupWeight):
        from kvmesh.kernels.quant import triton_w8g  # noqa: PLC0415
        return triton_w8g.w8g_gemm(x, w.qweight, w.scales, w.zeros, w.group_size, bias=bias)
    if isinstance(w, Int8ChannelWeight):
        return triton_gemm.w8a8_gemm(x, w.weight, w.weight_scale, bias=bias)
    assert isinstance(w, Fp8Weight)
    return triton_gemm.fp8_gemm(x, w.weight, w.weight_scale, bias=bias, activations=w.activations)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], float32 [M]): each row over max|x| / 127, rounded half to even."""
    return tuple(_ext().quantize_rows_int8(x.float().contiguous()))


def reference_linear(x: torch.Tensor, w: HFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(W)^T in float32 (float activations: what the int4 GEMM must equal)."""
    y = x.float() @ w.dequantize_original().T
    return y if bias is None else y + bias


@functools.lru_cache(maxsize=1)
def w8a8_amx_ready() -> bool:
    """Whether W8A8 runs on AMX int8 tiles here (built with them, and the kernel's permission)."""
    return _ext().w8a8_amx_isa() == "amx_int8"


def isa() -> dict[str, str]:
    """The instruction sets this machine's build uses: {"w8a8": ..., "w4a16": ...} ("w8a8":
    "amx_int8+avx512vnni" where calls of W8A8_AMX_MIN_ROWS rows and more take the tiles)."""
    ext = _ext()
    w8a8 = ext.w8a8_isa() if not w8a8_amx_ready() else f"amx_int8+{ext.w8a8_isa()}"
    return {"w8a8": w8a8, "w4a16": ext.w4a16_isa()}
