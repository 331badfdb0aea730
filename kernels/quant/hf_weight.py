"""The canonical in-memory weights of Hugging Face quantized checkpoints (AWQ, GPTQ,
compressed-tensors W8A8, FP8), whatever packing the file used (docs/KERNELS.md).

The loader (`kvmesh.engine.quantization`) converts every checkpoint into one of these; the CPU
kernels (`hf_ops.py`, `csrc/hf_gemm.cpp`) and the Triton GEMMs (`triton_gemm.py`) read exactly
this layout. Weights are [N, K] = [out_features, in_features], as nn.Linear's.

The classes hold tensors only (no checks on construction: a module rebuilds its weight on every
forward); `validate()` checks one at the load boundary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Int4GroupWeight:
    """4-bit codes with one scale and one zero per `group_size` elements of a row (AWQ, GPTQ, and
    GGUF Q4_0 / Q4_1 / Q4_K on a GPU: gguf_int4.py):
    w[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]."""

    qweight: torch.Tensor   # uint8 [N, K // 2]: element k in byte k // 2, low nibble for even k
    scales: torch.Tensor    # [N, K // group_size] float32 on CPU (float16 / bfloat16 as stored on GPU)
    # NOTE: uint8 0..15 (a symmetric checkpoint: all 8); float32 (-offset / scale) for GGUF
    # Q4_1 / Q4_K, GPU only
    zeros: torch.Tensor     # [N, K // group_size]
    group_size: int         # K elements per scale / zero
    perm: torch.Tensor | None = None   # int64 [K] (GPTQ act-order): the GEMM takes x[:, perm]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1] * 2)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    @property
    def format(self) -> str:
        return f"int4 g{self.group_size}" + (" act-order" if self.perm is not None else "")

    def validate(self) -> None:
        n, k = self.shape
        g = self.group_size
        if g <= 0 or g % 32 or k % g:
            raise ValueError(f"int4 weight [{n}, {k}]: group size {g} must be a multiple of 32 dividing K")
        _want(self.qweight, torch.uint8, (n, k // 2), "qweight")
        _want(self.zeros, torch.float32 if self.zeros.dtype == torch.float32 else torch.uint8, (n, k // g),
              "zeros")
        _want(self.scales, None, (n, k // g), "scales")
        if self.perm is not None:
            _want(self.perm, torch.int64, (k,), "perm")

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 in the GEMM's K order (tests and `--quantization none` only)."""
        q = torch.stack([self.qweight & 0x0F, self.qweight >> 4], dim=-1).flatten(1).float()
        z = self.zeros.float().repeat_interleave(self.group_size, dim=1)
        return (q - z) * self.scales.float().repeat_interleave(self.group_size, dim=1)

    def dequantize_original(self) -> torch.Tensor:
        """[N, K] float32 in the checkpoint's K order (act-order undone): the float weight."""
        w = self.dequantize()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


@dataclass(slots=True)
class Int8GroupWeight:
    """8-bit codes with one scale and one zero per `group_size` (16 or 32) elements of a row: the
    GGUF formats other than Q4_0 / Q4_1 / Q4_K on a GPU (gguf_int8.py), each code in a byte:
    w[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]."""

    qweight: torch.Tensor   # uint8 [N, K]
    scales: torch.Tensor    # [N, K // group_size] float16 or float32
    zeros: torch.Tensor     # [N, K // group_size] uint8, or float32 (a format with an offset)
    group_size: int         # 16 or 32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    @property
    def format(self) -> str:
        return f"int8 g{self.group_size}"

    def validate(self) -> None:
        n, k = self.shape
        g = self.group_size
        if g not in (16, 32) or k % g:
            raise ValueError(f"int8 group weight [{n}, {k}]: group size {g} must be 16 or 32 dividing K")
        _want(self.qweight, torch.uint8, (n, k), "qweight")
        _want(self.zeros, torch.float32 if self.zeros.dtype == torch.float32 else torch.uint8, (n, k // g),
              "zeros")
        _want(self.scales, torch.float32 if self.scales.dtype == torch.float32 else torch.float16, (n, k // g),
              "scales")

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 (tests and `--quantization none` only)."""
        z = self.zeros.float().repeat_interleave(self.group_size, dim=1)
        return (self.qweight.float() - z) * self.scales.float().repeat_interleave(self.group_size, dim=1)

    dequantize_original = dequantize


class _PerChannelScaled:
    """A [N, K] `weight` of one byte an element with a float32 `weight_scale`: its shape and
    bytes (the fields are the subclasses')."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.weight_scale.numel() * 4


@dataclass(slots=True)
class Int8ChannelWeight(_PerChannelScaled):
    """int8 weights with one float32 scale per output row (compressed-tensors W8A8); the
    activations are quantized per token to int8 on the fly."""

    weight: torch.Tensor        # int8 [N, K]
    weight_scale: torch.Tensor  # float32 [N]
    # NOTE: int32 [N], the sum of each row's codes: the CPU's VNNI path feeds activations as
    # u8 = q + 128 and takes 128 * w_sum off (csrc/hf_gemm.cpp); computed once at load.
    w_sum: torch.Tensor

    @property
    def format(self) -> str:
        return "int8 W8A8"

    def validate(self) -> None:
        n, k = self.shape
        _want(self.weight, torch.int8, (n, k), "weight")
        _want(self.weight_scale, torch.float32, (n,), "weight_scale")
        _want(self.w_sum, torch.int32, (n,), "w_sum")

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    dequantize_original = dequantize


@dataclass(slots=True)
class Fp8Weight(_PerChannelScaled):
    """float8 e4m3 weights with a per-tensor ([1]) or per-row ([N]) float32 scale (GPU only), and
    how the checkpoint quantizes the activations that multiply them."""

    weight: torch.Tensor        # torch.float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # float32 [1] or [N]
    activations: str = "tensor"     # e4m3 per "tensor" / per "token", or "none" (weight-only)

    @property
    def format(self) -> str:
        return "fp8 e4m3"

    def validate(self) -> None:
        n, k = self.shape
        _want(self.weight, torch.float8_e4m3fn, (n, k), "weight")
        if self.weight_scale.dtype != torch.float32 or self.weight_scale.numel() not in (1, n):
            raise ValueError(f"fp8 weight [{n}, {k}]: weight_scale must be float32 [1] or [{n}], got "
                             f"{self.weight_scale.dtype} {tuple(self.weight_scale.shape)}")

    def dequantize(self) -> torch.Tensor:
        s = self.weight_scale.reshape(-1, 1) if self.weight_scale.numel() > 1 else self.weight_scale
        return self.weight.float() * s

    dequantize_original = dequantize


HFWeight = Int4GroupWeight | Int8GroupWeight | Int8ChannelWeight | Fp8Weight
HF_WEIGHTS = (Int4GroupWeight, Int8GroupWeight, Int8ChannelWeight, Fp8Weight)


def concat(weights: list[HFWeight]) -> HFWeight | None:
    """The weights stacked along N (one GEMM for q/k/v or gate/up), or None when they cannot
    share one: different kinds, group sizes, act-order permutations or per-tensor fp8 scales."""
    first = weights[0]
    if any(type(w) is not type(first) or w.shape[1] != first.shape[1] for w in weights):
        return None
    if isinstance(first, Int4GroupWeight):
        if any(w.group_size != first.group_size or not _same_perm(w.perm, first.perm) for w in weights):
            return None
        return Int4GroupWeight(torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]),
                               torch.cat([w.zeros for w in weights]), first.group_size, first.perm)
    if isinstance(first, Int8GroupWeight):
        if any(w.group_size != first.group_size for w in weights):
            return None
        return Int8GroupWeight(torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]),
                               torch.cat([w.zeros for w in weights]), first.group_size)
    if isinstance(first, Int8ChannelWeight):
        return Int8ChannelWeight(torch.cat([w.weight for w in weights]),
                                 torch.cat([w.weight_scale for w in weights]),
                                 torch.cat([w.w_sum for w in weights]))
    if any(w.weight_scale.numel() != w.shape[0] or w.activations != first.activations for w in weights):
        return None     # NOTE: per-tensor scales differ between q, k and v: one GEMM each
    return Fp8Weight(torch.cat([w.weight for w in weights]), torch.cat([w.weight_scale for w in weights]),
                     first.activations)


def to_device(w: HFWeight, device: torch.device) -> HFWeight:
    """`w` with every tensor on `device` (the loader reads checkpoints on the CPU)."""
    if isinstance(w, Int4GroupWeight):
        perm = None if w.perm is None else w.perm.to(device)
        return Int4GroupWeight(w.qweight.to(device), w.scales.to(device), w.zeros.to(device), w.group_size, perm)
    if isinstance(w, Int8GroupWeight):
        return Int8GroupWeight(w.qweight.to(device), w.scales.to(device), w.zeros.to(device), w.group_size)
    if isinstance(w, Int8ChannelWeight):
        return Int8ChannelWeight(w.weight.to(device), w.weight_scale.to(device), w.w_sum.to(device))
    return Fp8Weight(w.weight.to(device), w.weight_scale.to(device), w.activations)


def rows(w: HFWeight, lo: int, hi: int) -> HFWeight:
    """Rows lo..hi of `w` (views: a fused weight's share of one projection)."""
    if isinstance(w, Int4GroupWeight):
        return Int4GroupWeight(w.qweight[lo:hi], w.scales[lo:hi], w.zeros[lo:hi], w.group_size, w.perm)
    if isinstance(w, Int8GroupWeight):
        return Int8GroupWeight(w.qweight[lo:hi], w.scales[lo:hi], w.zeros[lo:hi], w.group_size)
    if isinstance(w, Int8ChannelWeight):
        return Int8ChannelWeight(w.weight[lo:hi], w.weight_scale[lo:hi], w.w_sum[lo:hi])
    return Fp8Weight(w.weight[lo:hi], w.weight_scale[lo:hi] if w.weight_scale.numel() > 1 else w.weight_scale,
                     w.activations)


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _want(t: torch.Tensor, dtype: torch.dtype | None, shape: tuple[int, ...], what: str) -> None:
    if (dtype is not None and t.dtype != dtype) or tuple(t.shape) != shape:
        raise ValueError(f"{what} must be {dtype or 'float'} {shape}, got {t.dtype} {tuple(t.shape)}")
