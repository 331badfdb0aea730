"""Weights served as GGUF blocks: the quantized linear layer's kernels (see docs/KERNELS.md).

    weight.py   QuantizedWeight: the raw blocks of an [N, K] tensor, the supported formats
    ops.py      quant_linear / embedding_rows / dequantize on the C++ kernels
    build.py    builds csrc/ per machine through kernels.cpu_kernels' build machinery
    csrc/       blocks.h (the block layouts), gemm.cpp (per-row float and int8 activation paths),
                tiled.cpp (many rows: a dequantized tile at a time, bf16 or float32), amx.cpp (the
                same rows on AMX bf16 tiles, where the CPU has them), bindings.cpp (the
                Python module)
    triton_gemm.py  GPU GEMMs for Hugging Face quantized checkpoints (W4A16, W8A8, FP8); Triton,
                    so imported only on CUDA (not from here)
    triton_quant.py their activation quantizations (per-token int8, per-tensor fp8)
"""
from kvmesh.kernels.quant.ops import ACTIVATIONS, dequantize, embedding_rows, kernels_available, quant_linear
from kvmesh.kernels.quant.weight import FORMATS, QuantizedWeight, concat, format_name, is_supported

__all__ = ["ACTIVATIONS", "FORMATS", "QuantizedWeight", "concat", "dequantize", "embedding_rows",
           "format_name", "is_supported", "kernels_available", "quant_linear"]
