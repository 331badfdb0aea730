"""Whether a Hugging Face quantized checkpoint is served quantized here, or dequantized at load.

    serve_quantized(choice, cfg, where, device, tp_cut, dtype) -> method name or None

`choice` is `--quantization`: "none" dequantizes (as it does a GGUF file); "auto" serves the
checkpoint's own method where it can and otherwise dequantizes, saying why in the log; a method
name (compressed-tensors, awq, gptq, fp8) must be the checkpoint's, and is refused with the
reason where it cannot be served. `tp_cut`: why tensor parallelism would split the packed
weights through a group (parallel/sharding.py's hf_cut), None where the shards are whole.
"""
from __future__ import annotations

import logging

import torch

from kvmesh.engine.quantization.hf_config import HFQuantConfig, check_requested

log = logging.getLogger(__name__)


def serve_quantized(choice: str, cfg: HFQuantConfig | None, where: str, device: torch.device,
                    tp_cut: str | None, dtype: torch.dtype) -> str | None:
    if choice == "none":
        if cfg is not None:
            log.info("%s: %s checkpoint dequantized to %s at load (--quantization none)", where,
                     cfg.method, str(dtype).removeprefix("torch."))
        return None
    if choice != "auto":
        check_requested(choice, cfg, where)
    if cfg is None:
        return None
    why = _why_not(cfg, device, tp_cut, dtype)
    if why is None:
        return cfg.method
    if choice != "auto":
        raise ValueError(f"cannot serve {where} quantized: {why}")
    log.warning("%s: serving the %s checkpoint dequantized: %s", where, cfg.method, why)
    return None


def _why_not(cfg: HFQuantConfig, device: torch.device, tp_cut: str | None,
             dtype: torch.dtype) -> str | None:
    if tp_cut is not None:
        return f"{tp_cut}; use another --tensor-parallel-size, or --quantization none to dequantize"
    if dtype == torch.float64:
        return "the quantized kernels compute in float32, the model is float64"
    if device.type == "cuda":
        return None     # the Triton GEMMs (kernels/quant/triton_gemm.py)
    if device.type != "cpu":
        return f"no quantized kernels for device {device}"
    if cfg.scheme == "fp8":
        return ("fp8 checkpoints are served on GPU only; use --device cuda, or --quantization "
                "none to dequantize the weights at load")
    from kvmesh.kernels.quant.hf_build import load, unavailable_reason  # noqa: PLC0415
    if load() is None:
        return f"the quantized kernels are unavailable here: {unavailable_reason()}"
    return None
