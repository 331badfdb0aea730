"""Write a Hugging Face float checkpoint as an AWQ, GPTQ or compressed-tensors (W8A8 / FP8) one.

The quantized checkpoints the tests and benchmarks serve are made here from float ones:
compressed-tensors' own library writes the W8A8 / FP8 config and rounds the weights (`quantize`);
AutoAWQ and AutoGPTQ do not install without CUDA, so their tensors are packed per the formats'
documented layouts (AWQ: int32 [K, N/8] along N in the nibble order 0,2,4,6,1,3,5,7; GPTQ v1:
int32 [K/8, N] along K, zeros stored minus one, g_idx for act-order). The 4-bit rounding is
min/max per (row, group) (asymmetric) or absmax (symmetric), scales stored as fp16: the layout
a real quantizer writes, not its calibration.

    make_checkpoint(float_dir, out, "awq")                          # 4-bit, groups of 128
    make_checkpoint(float_dir, out, "gptq", desc_act=True, sym=False)
    make_checkpoint(float_dir, out, "compressed-tensors", kind="int")   # W8A8; kind="float": FP8
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_int32(cols: np.ndarray) -> np.ndarray:
    """[R, 8 C] nibbles -> int32 [R, C]: nibble i (bits 4i..) of word c from column 8c + i."""
    r, c8 = cols.shape
    nib = cols.reshape(r, c8 // 8, 8).astype(np.uint32)
    return sum(nib[..., i] << np.uint32(4 * i) for i in range(8)).astype(np.uint32).view(np.int32)


def _asym_groups(w: torch.Tensor, groups: torch.Tensor, n_groups: int):
    """Per (row, group) min/max 4-bit quantization: codes [N, K], scales fp16 [N, G], zeros [N, G],
    and the dequantized weight with the stored (fp16) scales."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.int64)
    scales, zeros = torch.empty(n, n_groups), torch.empty(n, n_groups, dtype=torch.int64)
    deq = torch.empty(n, k)
    for g in range(n_groups):
        cols = (groups == g).nonzero().flatten()
        part = w[:, cols]
        lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
        s = ((hi - lo) / 15).half().float()
        z = torch.round(-lo / s).clamp(0, 15).long()
        q = (torch.round(part / s[:, None]) + z[:, None]).clamp(0, 15).long()
        codes[:, cols], scales[:, g], zeros[:, g] = q, s, z
        deq[:, cols] = (q - z[:, None]).float() * s[:, None]
    return codes, scales.half(), zeros, deq


def _sym_groups(w, groups, n_groups):
    n, k = w.shape
    codes, deq = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k)
    scales = torch.empty(n, n_groups)
    for g in range(n_groups):
        cols = (groups == g).nonzero().flatten()
        s = (w[:, cols].abs().amax(1) * 2 / 15).half().float()
        q = (torch.round(w[:, cols] / s[:, None]) + 8).clamp(0, 15).long()
        codes[:, cols], scales[:, g], deq[:, cols] = q, s, (q - 8).float() * s[:, None]
    return codes, scales.half(), torch.full((n, n_groups), 8), deq


def awq_tensors(w: torch.Tensor, group: int):
    """AWQ (GEMM version) tensors of float weight `w` [N, K] and the weight they dequantize to."""
    k = w.shape[1]
    codes, scales, zeros, deq = _asym_groups(w, torch.arange(k) // group, k // group)

    def pack(a: torch.Tensor) -> torch.Tensor:   # [R, N] -> AWQ's interleaved int32 [R, N / 8]
        order = np.concatenate([np.array(AWQ_ORDER) + 8 * c for c in range(a.shape[1] // 8)])
        return torch.from_numpy(_pack_int32(a.numpy()[:, order]))
    return {"qweight": pack(codes.T), "qzeros": pack(zeros.T), "scales": scales.T.contiguous()}, deq


def gptq_tensors(w: torch.Tensor, group: int, act_order: bool, sym: bool, gen: torch.Generator):
    """GPTQ (v1) tensors of `w` [N, K]; act-order spreads each group over K (g_idx)."""
    n, k = w.shape
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.argsort(torch.randperm(k, generator=gen))]   # groups spread over K
    if sym:
        codes, scales, zeros, deq = _sym_groups(w, g_idx, k // group)
    else:
        codes, scales, zeros, deq = _asym_groups(w, g_idx, k // group)
    # word (r, n), nibble i: element 8r + i of row n
    by_word = codes.numpy().reshape(n, k // 8, 8).transpose(1, 0, 2).reshape(k // 8 * n, 8)
    along_k = torch.from_numpy(_pack_int32(by_word).reshape(k // 8, n))
    stored = ((zeros - 1) & 0x0F).T.numpy()             # v1: zero - 1 (0 is stored as 15)
    return {"qweight": along_k, "qzeros": torch.from_numpy(_pack_int32(stored)),
            "scales": scales.T.contiguous(), "g_idx": g_idx.int()}, deq


def ct_tensors(w: torch.Tensor, kind: str):
    """compressed-tensors' own rounding: int8 (W8A8) or fp8 e4m3 channel-wise weights."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    if kind == "int":
        scale = w.abs().amax(1, keepdim=True) / 127
        args, dtype = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"), torch.int8
    else:
        scale = w.abs().amax(1, keepdim=True) / 448
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        dtype = torch.float8_e4m3fn
    q = quantize(w, scale, torch.zeros_like(scale, dtype=torch.int8 if kind == "int" else torch.float32),
                 args, dtype=dtype)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def ct_config(kind: str, ignore: list[str], weight_only: bool = False) -> dict:
    """compressed-tensors' quantization_config: W8A8 (int8 per channel, int8 dynamic per token) or
    FP8_DYNAMIC (e4m3 per channel, e4m3 per token; `weight_only`: activations left as they are)."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    preset, fmt = ("W8A8", "int-quantized") if kind == "int" else ("FP8_DYNAMIC", "float-quantized")
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                            format=fmt, ignore=ignore, quantization_status="compressed").model_dump(mode="json")
    if weight_only:
        qc["config_groups"]["group_0"]["input_activations"] = None
    return qc


def load_float_tensors(float_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(float_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise FileNotFoundError(f"{float_dir}: no *.safetensors")
    return tensors


def quant_config(method: str, *, group_size: int = 128, ignore: list[str] | None = None, **opts) -> dict:
    """config.json's quantization_config for `method` as make_checkpoint's options name it;
    `ignore`: the float modules compressed-tensors lists (AWQ / GPTQ name none)."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": opts["desc_act"],
                "sym": opts["sym"], "checkpoint_format": "gptq"}
    return ct_config(opts["kind"], ignore or [], weight_only=opts.get("weight_only", False))


def write_checkpoint(src_dir: Path, out: Path, tensors: dict[str, torch.Tensor], qc: dict) -> Path:
    """The new directory `out`: `src_dir`'s config.json with `qc` as its quantization_config,
    `tensors` as one model.safetensors, and every other file of `src_dir` (tokenizer, generation
    config) copied."""
    from safetensors.torch import save_file

    src_dir, out = Path(src_dir), Path(out)
    cfg = json.loads((src_dir / "config.json").read_text())
    out.mkdir(parents=True)
    for f in src_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    return out


def make_checkpoint(float_dir, out, method: str, *, group_size: int = 128, keep_dequantized: bool = True,
                    **opts):
    """`float_dir`'s model with every decoder projection quantized by `method` (awq, gptq with
    `desc_act` / `sym`, compressed-tensors with `kind` int / float and `weight_only`) and written
    to the new directory `out`; the other tensors (embedding, head, norms) are copied as they are.
    Returns (out, {module name: the float32 weight it dequantizes to}), that map empty unless
    `keep_dequantized` (a 1B model's would be 4 GB)."""
    float_dir, out = Path(float_dir), Path(out)
    gen = torch.Generator().manual_seed(5)
    tensors = load_float_tensors(float_dir)
    cfg = json.loads((float_dir / "config.json").read_text())
    deq = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj in PROJ:
            module = f"model.layers.{layer}.{proj}"
            w = tensors.pop(f"{module}.weight").float()
            if method == "awq":
                pieces, d = awq_tensors(w, group_size)
            elif method == "gptq":
                pieces, d = gptq_tensors(w, group_size, opts["desc_act"], opts["sym"], gen)
            else:
                pieces, d = ct_tensors(w, opts["kind"])
            if keep_dequantized:
                deq[module] = d
            tensors.update({f"{module}.{leaf}": t for leaf, t in pieces.items()})
    write_checkpoint(float_dir, out, tensors,
                     quant_config(method, group_size=group_size, ignore=["lm_head"], **opts))
    return out, deq
