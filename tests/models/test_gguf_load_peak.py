"""GGUF weights come straight into the served dtype (issue 27): a bf16 / f16 tensor is converted
from the mapped file in one copy, a block tensor is dequantized a slice of rows at a time, so no
float32 copy of a whole tensor is ever made on the way to bf16. The peak is measured with
tracemalloc, which sees every numpy allocation (the gguf package dequantizes in numpy)."""
from __future__ import annotations

import tracemalloc

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from kvmesh.engine.models import gguf_tensors
from kvmesh.engine.models.gguf import GGUFFile, unpermute_rows

ROWS, COLS, HEADS = 2048, 256, 4          # the embedding: 512 Ki elements, 2 MiB as float32
FP32_BYTES = ROWS * COLS * 4


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A llama GGUF with the same random matrix stored four ways (only its tensors are read)."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((ROWS, COLS), dtype=np.float32)
    path = tmp_path_factory.mktemp("gguf") / "peak.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", quantize(emb, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output.weight", emb.astype(np.float16))
    bf16 = torch.from_numpy(emb).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    w.add_tensor("blk.0.attn_q.weight", bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.add_tensor("output_norm.weight", emb[0].copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, emb


def _load_bf16(path) -> dict[str, torch.Tensor]:
    f = GGUFFile(path)
    return dict(f.weights(HEADS, HEADS, dtype=torch.bfloat16))


def test_every_tensor_comes_in_the_served_dtype_with_the_stored_values(model_file):
    path, emb = model_file
    got = _load_bf16(path)
    assert {n: t.dtype for n, t in got.items()} == dict.fromkeys(
        ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
         "model.norm.weight"], torch.bfloat16)
    q8 = dequantize(quantize(emb, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    want_emb = torch.from_numpy(q8.reshape(ROWS, COLS)).to(torch.bfloat16)
    assert torch.equal(got["model.embed_tokens.weight"], want_emb)
    assert torch.equal(got["lm_head.weight"],
                       torch.from_numpy(emb.astype(np.float16)).to(torch.bfloat16))
    as_bf16 = torch.from_numpy(emb).to(torch.bfloat16)
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], unpermute_rows(as_bf16, HEADS))
    assert torch.equal(got["model.norm.weight"], as_bf16[0])
    # each owns its memory: nothing served is a view of the file's mapping
    assert all(t.untyped_storage().nbytes() == t.numel() * 2 for t in got.values())


def test_no_float32_copy_of_a_whole_tensor_is_made_on_the_way_to_bf16(model_file, monkeypatch):
    path, _ = model_file
    monkeypatch.setattr(gguf_tensors, "DEQUANT_SLICE_ELEMS", 64 * COLS)    # 1/32 of the tensor
    _load_bf16(path)                       # imports and caches outside the measurement
    tracemalloc.start()
    try:
        got = _load_bf16(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(got) == 4
    # the whole-tensor dequantization this replaced peaked above FP32_BYTES (2 MiB)
    assert peak < FP32_BYTES // 4, peak


def test_the_slices_cover_every_row_when_the_rows_do_not_divide_evenly(model_file, monkeypatch):
    path, _ = model_file
    whole = _load_bf16(path)["model.embed_tokens.weight"]
    monkeypatch.setattr(gguf_tensors, "DEQUANT_SLICE_ELEMS", 300 * COLS)   # 2048 = 6 x 300 + 248
    assert torch.equal(_load_bf16(path)["model.embed_tokens.weight"], whole)
