"""GGUF blocks on a GPU: which formats stay quantized there, and as what.

The block kernels that serve GGUF files as they are run on CPUs (csrc/). On CUDA the loader
converts each block tensor once, at load, into a layout a Triton GEMM reads:

  * Q4_0 / Q4_1 / Q4_K: int4 groups of 32 (`gguf_int4.py`), the W4A16 GEMM AWQ checkpoints use;
  * every other format the CPU kernels read (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL,
    IQ4_XS): one code a byte with a scale and zero point per 16 or 32 elements
    (`gguf_int8.py`), the 8-bit group GEMM (`triton_w8g.py`).

Formats without a kernel (IQ2, IQ3, ...) are dequantized by the reader, as on a CPU.
"""
from __future__ import annotations

from kvmesh.kernels.quant.gguf_int4 import INT4_FORMATS, to_int4_groups
from kvmesh.kernels.quant.gguf_int8 import to_int8_groups
from kvmesh.kernels.quant.hf_weight import Int4GroupWeight, Int8GroupWeight
from kvmesh.kernels.quant.weight import QuantizedWeight


def to_gpu_weight(w: QuantizedWeight) -> Int4GroupWeight | Int8GroupWeight:
    """`w`'s blocks in the layout of the GPU's GEMM for its format (on `w`'s device)."""
    return to_int4_groups(w) if w.qtype in INT4_FORMATS else to_int8_groups(w)
