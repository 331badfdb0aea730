"""One module's checkpoint tensors -> its canonical weight (kvmesh.kernels.quant.hf_weight).

    convert(cfg, module, pieces, device) -> Int4GroupWeight | Int8ChannelWeight | Fp8Weight

The file layouts, as the formats define them:
  AWQ (version gemm): qweight int32 [K, N / 8] and qzeros int32 [K / G, N / 8], each int32 holding
      8 consecutive output columns in the nibble order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i, bits
      4i..4i+3, is column 8c + order[i]); scales [K / G, N]; w = (q - z) * s.
  GPTQ (checkpoint_format gptq, "v1"): qweight int32 [K / 8, N] packed along K (nibble i of row r
      is element 8r + i); qzeros int32 [K / G, N / 8] packed along N in plain order, each stored
      as zero - 1 (so + 1, mod 16, on reading); scales [K / G, N]; g_idx int32 [K], the group of
      each input element: with act-order not sorted, and K is permuted at load so that it is.
  compressed-tensors int8: weight int8 [N, K], weight_scale [N, 1] (channel strategy).
  FP8 (compressed-tensors float-quantized, fp8): weight float8_e4m3fn [N, K], weight_scale [1],
      [] or [N, 1].
Every shape is checked against the others; a mismatch is a ValueError naming the tensor.
"""
from __future__ import annotations

import torch

from kvmesh.engine.quantization.hf_config import HFQuantConfig
from kvmesh.kernels.quant.hf_weight import Fp8Weight, HFWeight, Int4GroupWeight, Int8ChannelWeight

# The tensors (leaf names) a quantized module of each scheme holds: required, optional.
LEAVES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "w4a16": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "w8a8_int8": (("weight", "weight_scale"), ()),
    "fp8": (("weight", "weight_scale"), ()),
}
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble i of an AWQ int32 holds column 8c + _AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def convert(cfg: HFQuantConfig, module: str, pieces: dict[str, torch.Tensor],
            device: torch.device) -> HFWeight:
    try:
        if cfg.scheme == "w4a16":
            w = _awq(cfg, pieces) if cfg.method == "awq" else _gptq(cfg, pieces)
            if device.type == "cpu":
                w.scales = w.scales.float()     # NOTE: the CPU kernel multiplies float32 scales
        elif cfg.scheme == "w8a8_int8":
            w = _int8(pieces)
        else:
            w = _fp8(pieces, cfg.activations)
        w.validate()
    except ValueError as e:
        raise ValueError(f"{cfg.method} module {module}: {e}") from None
    return w


def _nibbles_along_last(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8 C]: each int32's 8 nibbles as 8 columns (in `order`)."""
    nib = (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0x0F      # [R, C, 8]: nibble i at i
    if order is not None:
        out = torch.empty_like(nib)
        out[..., list(order)] = nib
        nib = out
    return nib.reshape(packed.shape[0], -1).to(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes 0..15 -> [N, K / 2]: element k in byte k / 2, low nibble for even k."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _int32(t: torch.Tensor, name: str, shape: tuple[int, int]) -> torch.Tensor:
    if t.dtype != torch.int32 or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be int32 {shape}, got {t.dtype} {tuple(t.shape)}")
    return t


def _group(cfg: HFQuantConfig, k: int) -> int:
    g = cfg.group_size or k
    if k % g:
        raise ValueError(f"K={k} is not a multiple of group_size {g}")
    return g


def _scales(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    if not t.is_floating_point() or tuple(t.shape) != shape:
        raise ValueError(f"scales must be float {shape}, got {t.dtype} {tuple(t.shape)}")
    return t.T.contiguous()


def _awq(cfg: HFQuantConfig, p: dict[str, torch.Tensor]) -> Int4GroupWeight:
    k, n8 = p["qweight"].shape if p["qweight"].dim() == 2 else (0, 0)
    n = n8 * 8
    g = _group(cfg, k)
    codes = _nibbles_along_last(_int32(p["qweight"], "qweight", (k, n8)), _AWQ_ORDER).T   # [N, K]
    zeros = _nibbles_along_last(_int32(p["qzeros"], "qzeros", (k // g, n8)), _AWQ_ORDER).T
    return Int4GroupWeight(_pack(codes), _scales(p["scales"], (k // g, n)), zeros.contiguous(), g)


def _gptq(cfg: HFQuantConfig, p: dict[str, torch.Tensor]) -> Int4GroupWeight:
    k8, n = p["qweight"].shape if p["qweight"].dim() == 2 else (0, 0)
    k = k8 * 8
    g = _group(cfg, k)
    q = _int32(p["qweight"], "qweight", (k8, n))
    codes = ((q[:, None, :] >> _SHIFTS[None, :, None]) & 0x0F).reshape(k, n).T.to(torch.uint8)
    if n % 8:
        raise ValueError(f"N={n} is not a multiple of 8 (qzeros packs 8 columns an int32)")
    stored = _nibbles_along_last(_int32(p["qzeros"], "qzeros", (k // g, n // 8)), None)
    zeros = ((stored.to(torch.int32) + 1) & 0x0F).to(torch.uint8).T.contiguous()   # v1: zero - 1
    perm = _act_order(p.get("g_idx"), k, g)
    if perm is not None:
        codes = codes[:, perm]
    return Int4GroupWeight(_pack(codes), _scales(p["scales"], (k // g, n)), zeros, g, perm)


def _act_order(g_idx: torch.Tensor | None, k: int, g: int) -> torch.Tensor | None:
    """The K permutation that sorts g_idx into whole groups (None: it is sorted already)."""
    if g_idx is None:
        return None
    if g_idx.dim() != 1 or g_idx.numel() != k:
        raise ValueError(f"g_idx must be [{k}], got {tuple(g_idx.shape)}")
    g_idx = g_idx.to(torch.int64)
    sequential = torch.arange(k) // g
    if torch.equal(g_idx, sequential):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], sequential):
        raise ValueError(f"g_idx does not give every group exactly {g} elements")
    return perm


def _int8(p: dict[str, torch.Tensor]) -> Int8ChannelWeight:
    w = p["weight"]
    if w.dtype != torch.int8 or w.dim() != 2:
        raise ValueError(f"weight must be int8 [N, K], got {w.dtype} {tuple(w.shape)}")
    scale = p["weight_scale"]
    if scale.numel() != w.shape[0] or scale.dim() not in (1, 2):
        raise ValueError(f"weight_scale must be [{w.shape[0]}, 1] (channel strategy), got {tuple(scale.shape)}")
    w = w.contiguous()
    return Int8ChannelWeight(w, scale.reshape(-1).float().contiguous(), w.sum(1, dtype=torch.int32))


def _fp8(p: dict[str, torch.Tensor], activations: str) -> Fp8Weight:
    w = p["weight"]
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise ValueError(f"weight must be float8_e4m3fn [N, K], got {w.dtype} {tuple(w.shape)}")
    scale = p["weight_scale"].reshape(-1).float()
    return Fp8Weight(w.contiguous(), scale.contiguous(), activations)
