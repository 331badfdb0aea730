"""One GGUF tensor -> a torch tensor in the dtype it is served in, read from the file's mapping.

A float tensor (F32, F16, BF16) is converted straight from the mapped bytes into its final dtype:
one copy, never a float32 one on the way to bf16. A block tensor is dequantized a slice of rows
at a time (the `gguf` package dequantizes to float32) into the preallocated result, so the
float32 copy alive at once is one slice, not the whole tensor (a 128k-row embedding of a
1B-class model would be ~1 GB of float32 beside its bf16 self).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from kvmesh.common.gguf_reader import GGUFTensor

F32, F16, BF16 = 0, 1, 30
# float32 elements dequantized at once: the bound on the transient float32 copy (4 MiB)
DEQUANT_SLICE_ELEMS = 1 << 20


def float_view(t: GGUFTensor) -> torch.Tensor:
    """The F32 / F16 / BF16 tensor `t` as a read-only torch view of the mapped file."""
    data = t.data.view(np.int16) if t.ggml_type == BF16 else t.data
    with warnings.catch_warnings():
        # NOTE: the view is only ever read, by the copy that converts it
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        view = torch.from_numpy(data)
    if t.ggml_type == BF16:
        view = view.view(torch.bfloat16)
    return view.reshape(t.shape)


def tensor_in_dtype(t: GGUFTensor, dtype: torch.dtype, dequantize) -> torch.Tensor:
    """`t`'s values in `dtype`, shaped `t.shape`, owning its memory. `dequantize(rows, qtype)` is
    the gguf package's (raw block rows -> float32 array)."""
    from gguf.constants import GGMLQuantizationType  # noqa: PLC0415

    if t.ggml_type in (F32, F16, BF16):
        return float_view(t).to(dtype, copy=True)
    qtype = GGMLQuantizationType(t.ggml_type)
    out = torch.empty(t.shape, dtype=dtype)
    cols = t.shape[-1]
    rows_out = out.view(-1, cols)
    rows_in = t.data.reshape(rows_out.shape[0], -1)
    step = max(1, DEQUANT_SLICE_ELEMS // cols)
    for i in range(0, rows_in.shape[0], step):
        part = np.asarray(dequantize(rows_in[i:i + step], qtype), dtype=np.float32)
        rows_out[i:i + step] = torch.from_numpy(part.reshape(-1, cols))
    return out
