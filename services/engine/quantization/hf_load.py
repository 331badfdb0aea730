"""The safetensors stream of a Hugging Face quantized checkpoint -> (name, weight) for assign_weights.

    hf_quantized_weights(tensors, cfg, device, dequantize) -> Iterator[(name, tensor | HFWeight)]

A quantized module's pieces (AWQ / GPTQ: qweight, qzeros, scales, g_idx; compressed-tensors and
fp8: an int8 / float8 `weight` with its `weight_scale`) are gathered by module name, in whatever
order the files list them, and each module comes out once as `<module>.weight`: its canonical
weight (served quantized), or that weight dequantized to float32 (`dequantize`: `--quantization
none`, and the reference of the tests). Every other tensor passes through as it is.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from kvmesh.engine.quantization.hf_config import HFQuantConfig
from kvmesh.engine.quantization.hf_convert import LEAVES, convert
from kvmesh.kernels.quant.hf_weight import HFWeight

_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def hf_quantized_weights(tensors: Iterable[tuple[str, torch.Tensor]], cfg: HFQuantConfig,
                         device: torch.device, dequantize: bool = False,
                         ) -> Iterator[tuple[str, torch.Tensor | HFWeight]]:
    required, optional = LEAVES[cfg.scheme]
    leaves = (*required, *optional)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf not in leaves or (leaf == "weight" and tensor.dtype not in _QUANT_DTYPES):
            yield name, tensor
            continue
        if cfg.is_ignored(module):
            raise ValueError(f"{name} is quantized, but the checkpoint's quantization_config "
                             f"lists {module} as kept in float (ignore / modules_to_not_convert)")
        pieces = pending.setdefault(module, {})
        pieces[leaf] = tensor
        if len(pieces) == len(leaves):
            yield _emit(cfg, module, pending.pop(module), device, dequantize)
    for module, pieces in pending.items():
        missing = [leaf for leaf in required if leaf not in pieces]
        if missing:
            raise ValueError(f"{cfg.method} module {module}: missing tensor(s) "
                             f"{', '.join(module + '.' + m for m in missing)}")
        yield _emit(cfg, module, pieces, device, dequantize)


def _emit(cfg: HFQuantConfig, module: str, pieces: dict[str, torch.Tensor], device: torch.device,
          dequantize: bool) -> tuple[str, torch.Tensor | HFWeight]:
    weight = convert(cfg, module, pieces, device)
    return f"{module}.weight", weight.dequantize_original() if dequantize else weight
