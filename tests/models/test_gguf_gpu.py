"""GGUF files on a GPU: Q4_0 / Q4_1 / Q4_K blocks served as int4 groups of 32 through the Triton
W4A16 GEMM (kernels/quant/gguf_int4.py), the other formats as 8-bit groups through the 8-bit
group GEMM (gguf_int8.py, triton_w8g.py; their conversions: test_gguf_int8.py).

No GPU here: `test_the_gpu_branch_end_to_end_in_the_interpreter` runs the loader's GPU branch on
CPU tensors, the int4 / 8-bit group GEMMs in the Triton interpreter (two internals patched, said there); the
CUDA test runs where a GPU is (benchmarks/gpu/session.sh).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize
from torch import nn

from kvmesh.engine import loader
from kvmesh.engine.layers.hf_quantized import HFQuantizedLinear
from kvmesh.engine.loader import load_model, resolve_quantization
from kvmesh.engine.models.gguf import GGUFFile
from kvmesh.kernels.quant import QuantizedWeight
from kvmesh.kernels.quant.gguf_int4 import INT4_FORMATS, to_int4_groups
from kvmesh.kernels.quant.gguf_int8 import INT8_FORMATS
from kvmesh.kernels.quant.hf_weight import Int4GroupWeight, Int8GroupWeight, concat
from kvmesh.kernels.quant.weight import FORMATS
from tests.kernels.test_quant_gemm import random_blocks
from tests.models.conftest import TINY_PROMPTS, assert_generates_like
from tests.models.test_gguf_quantized import write_tiny_gguf

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "0",
                                reason="needs a CUDA GPU and TRITON_INTERPRET=0 (the Triton kernels)")


def _q4(qtype: T, n: int = 6, k: int = 128, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """Blocks from gguf's own quantizer (a flat block and a zero block among them) and gguf's
    dequantization of them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[1, :32] = 0.7             # max == min: Q4_1 stores d = 0, m = 0.7
    x[2, 32:64] = 0.0
    raw = quantize(x, qtype)
    want = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(n, k)).float()
    return QuantizedWeight(torch.from_numpy(raw.copy()), int(qtype), (n, k)), want


def test_q4_0_blocks_are_int4_groups_with_zero_8_exactly():
    w, want = _q4(T.Q4_0)
    g = to_int4_groups(w)
    g.validate()
    assert g.group_size == 32 and g.zeros.dtype == torch.uint8 and (g.zeros == 8).all()
    assert g.scales.dtype == torch.float16 and g.qweight.shape == (6, 64)
    assert torch.equal(g.dequantize(), want)


def test_q4_1_blocks_are_int4_groups_with_float_zero_points():
    w, want = _q4(T.Q4_1)
    g = to_int4_groups(w)
    g.validate()
    assert g.zeros.dtype == torch.float32
    got = g.dequantize()
    # (q - (-m / d)) * d against d * q + m: the zero point's one float32 rounding, times d
    blocks = w.data.view(6, 4, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().view(6, 4).repeat_interleave(32, 1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float().view(6, 4).repeat_interleave(32, 1)
    assert ((got - want).abs() <= 2.0 ** -23 * (m.abs() + 16 * d.abs())).all()
    # the flat block (d = 0) holds m everywhere, exactly: code 1, scale m, zero 0
    assert float(d[1, 0]) == 0.0 and torch.equal(got[1, :32], want[1, :32]) and (want[1, :32] != 0).all()
    assert (g.qweight[1, :16] == 0x11).all() and float(g.zeros[1, 0]) == 0.0


def _q4_k(n: int = 4, k: int = 512, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """Random Q4_K super-blocks (gguf has no K-quant quantizer) with a zero-scale sub-block whose
    min is not zero, and gguf's dequantization of them."""
    raw = random_blocks(T.Q4_K, n, k, np.random.default_rng(seed)).reshape(n, k // 256, 144)
    raw[1, 0, 4] = 0            # sub-block 0's 6-bit scale: 0
    raw[1, 0, 8] = 5            # ... and its min: 5
    raw = raw.reshape(n, -1)
    want = torch.from_numpy(gguf_dequantize(raw, T.Q4_K).reshape(n, k)).float()
    return QuantizedWeight(torch.from_numpy(raw.copy()), int(T.Q4_K), (n, k)), want


def test_q4_k_super_blocks_are_int4_groups_of_32():
    w, want = _q4_k()
    g = to_int4_groups(w)
    g.validate()
    assert g.group_size == 32 and g.qweight.shape == (4, 256) and g.scales.shape == (4, 16)
    assert g.scales.dtype == torch.float32 and g.zeros.dtype == torch.float32
    got = g.dequantize()
    # (q - dmin m / (d sc)) * d sc against d sc q - dmin m: the zero point's rounding and the
    # subtraction's, a few units of float32 roundoff of the group's largest value
    big = want.view(4, 16, 32).abs().amax(-1, keepdim=True).expand(4, 16, 32).reshape(4, 512)
    assert ((got - want).abs() <= 2.0 ** -20 * big).all()
    assert (got != want).any()      # the bound is not vacuous: the float zero point rounds
    # the zero-scale sub-block holds -dmin * 5 everywhere, exactly: code 1, scale -dmin * 5, zero 0
    dmin = float(torch.from_numpy(w.data.numpy()[1, 2:4].copy()).view(torch.float16))
    assert torch.equal(got[1, :32], want[1, :32]) and float(want[1, 0]) == -dmin * 5
    assert (g.qweight[1, :16] == 0x11).all() and float(g.zeros[1, 0]) == 0.0


def test_q4_k_codes_are_in_element_order():
    """One super-block with scale 1 and min 0 everywhere: the int4 codes are the elements."""
    raw = np.zeros((1, 144), np.uint8)
    raw[0, 0:2] = np.array([1.0], np.float16).view(np.uint8)   # d = 1, dmin = 0
    raw[0, 4:8] = 1                                     # scales 0-3: 1
    raw[0, 12:16] = 1                                   # scales 4-7: 1 (low nibble of bytes 8-11)
    raw[0, 16:144] = np.arange(128, dtype=np.uint8)
    want = torch.from_numpy(gguf_dequantize(raw, T.Q4_K).reshape(1, 256)).float()
    g = to_int4_groups(QuantizedWeight(torch.from_numpy(raw), int(T.Q4_K), (1, 256)))
    assert torch.equal(g.dequantize(), want) and (g.scales == 1).all() and (g.zeros == 0).all()
    # chunk 0: bytes 0..31 low nibbles then high nibbles
    assert want[0, :32].tolist() == [j % 16 for j in range(32)] and want[0, 32:64].tolist() == [0] * 16 + [1] * 16


def test_mixed_q4_formats_share_one_gemm_with_float_zero_points():
    """A q/k/v of Q4_0 and Q4_K (llama.cpp's fallback for an odd size) concatenate: the uint8
    zeros and float16 scales widen to float32, values unchanged."""
    a, b = to_int4_groups(_q4(T.Q4_0, k=512)[0]), to_int4_groups(_q4_k()[0])
    fused = concat([a, b])
    fused.validate()
    assert fused.zeros.dtype == torch.float32 and fused.scales.dtype == torch.float32
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_other_formats_are_not_int4_groups():
    w, _ = _q4(T.Q8_0)
    with pytest.raises(ValueError, match=r"Q8_0 blocks cannot be int4 groups \(those are Q4_0 / Q4_1 / Q4_K"):
        to_int4_groups(w)


def test_int4_groups_with_float_zero_points_are_refused_on_the_cpu_kernels():
    from kvmesh.kernels.quant.hf_ops import hf_linear
    g = to_int4_groups(_q4(T.Q4_1)[0])
    with pytest.raises(ValueError, match="float zero points .* served on GPU only"):
        hf_linear(torch.zeros(2, 128), g)


def test_int8_groups_are_refused_on_the_cpu_kernels():
    from kvmesh.kernels.quant.hf_ops import hf_linear
    g = Int8GroupWeight(torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 1, dtype=torch.float16),
                        torch.zeros(2, 1, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="int8 group weights .* served on GPU only"):
        hf_linear(torch.zeros(2, 32), g)


def test_a_gpu_serves_every_format_the_cpu_kernels_read():
    assert sorted(INT4_FORMATS + INT8_FORMATS) == sorted(FORMATS)


def test_the_reader_keeps_every_supported_format_as_blocks(tmp_path):
    """What the loader converts on a GPU is what the CPU serves as blocks: every supported format."""
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, T.Q4_1, hidden=64, tied=False, v_type=T.Q8_0)     # embedding Q8_0
    f = GGUFFile(path)
    kept = dict(f.block_tensors())
    assert set(kept.values()) == {int(T.Q4_1), int(T.Q8_0)}
    assert kept["model.layers.0.self_attn.v_proj.weight"] == int(T.Q8_0)
    weights = dict(f.weights(4, 2, keep_quantized=True))
    assert {n for n, t in weights.items() if isinstance(t, QuantizedWeight)} == set(kept)


def test_resolve_quantization_on_a_gpu(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"")
    cuda = torch.device("cuda")
    assert resolve_quantization("auto", "float", path, cuda, None, has_blocks=True) == "gguf"
    assert resolve_quantization("gguf", "float", path, cuda, None, has_blocks=True) == "gguf"
    # a file with no block tensor: dequantized under auto, refused when insisted on
    assert resolve_quantization("auto", "float", path, cuda, None, has_blocks=False) is None
    with pytest.raises(ValueError, match="this file has no tensor in a block format the GPU's kernels read"):
        resolve_quantization("gguf", "float", path, cuda, None, has_blocks=False)
    with pytest.raises(ValueError, match="no quantized kernels for device mps"):
        resolve_quantization("gguf", "float", path, torch.device("mps"), None, has_blocks=True)


def test_int4_groups_for_an_embedding_are_held_as_floats(tmp_path):
    path = tmp_path / "q4_0.gguf"
    write_tiny_gguf(path, T.Q4_0, hidden=64, tied=True)
    model = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="none").model
    emb, want = _q4(T.Q4_0, n=512, k=64, seed=3)
    weights = [(n, t) for n, t in GGUFFile(path).weights(4, 2) if n != "model.embed_tokens.weight"]
    loader.assign_weights(model, [*weights, ("model.embed_tokens.weight", to_int4_groups(emb))],
                          torch.float32, torch.device("cpu"))
    e = model.model.embed_tokens
    assert type(e) is nn.Embedding and torch.equal(e.weight, want)


def _route_groups_to_the_interpreter(monkeypatch):
    """NOTE: no GPU here. The loader's GPU branch is taken on the CPU (`_converts_blocks_for_gpu`) and
    the group layers' CPU kernel call is replaced by the Triton W4A16 / 8-bit group GEMMs, which
    the test session runs in the interpreter (TRITON_INTERPRET=1): the code a GPU runs, on CPU
    tensors."""
    from kvmesh.kernels.quant import hf_ops, triton_gemm, triton_w8g
    monkeypatch.setattr(loader, "_converts_blocks_for_gpu", lambda dev: True)
    real = hf_ops._cpu_linear

    def linear(x, w, out_bf16=False):
        if isinstance(w, Int4GroupWeight):
            return triton_gemm.w4a16_gemm(x, w.qweight, w.scales, w.zeros, w.group_size, perm=w.perm)
        if isinstance(w, Int8GroupWeight):
            return triton_w8g.w8g_gemm(x, w.qweight, w.scales, w.zeros, w.group_size)
        return real(x, w, out_bf16)
    monkeypatch.setattr(hf_ops, "_cpu_linear", linear)


GPU_CASES = [  # (format, attn_v format, hidden)
    (T.Q4_0, T.Q8_0, 64), (T.Q4_1, None, 64), (T.Q8_0, None, 64), (T.Q5_1, T.IQ4_NL, 64),
    (T.Q4_K, T.Q6_K, 256), (T.Q5_K, T.Q3_K, 256),
]


def _kind(qtype: T) -> type:
    return Int4GroupWeight if qtype in INT4_FORMATS else Int8GroupWeight


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels in the interpreter")
@pytest.mark.parametrize("qtype, v_type, hidden", GPU_CASES,
                         ids=[f"{q.name}+{v.name}" if v else q.name for q, v, _ in GPU_CASES])
def test_the_gpu_branch_end_to_end_in_the_interpreter(qtype, v_type, hidden, tmp_path, monkeypatch, caplog):
    path = tmp_path / f"{qtype.name}.gguf"
    write_tiny_gguf(path, qtype, hidden=hidden, tied=False, v_type=v_type)
    dense = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="none")
    _route_groups_to_the_interpreter(monkeypatch)
    with caplog.at_level(logging.INFO):
        quant = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="gguf")
    assert quant.quantization == "gguf"
    assert "GGUF blocks served as int4 groups (Q4_0 / Q4_1 / Q4_K) and 8-bit groups" in caplog.text
    attn = quant.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, HFQuantizedLinear) and isinstance(quant.model.lm_head, HFQuantizedLinear)
    assert attn.q_proj.kind is _kind(qtype) and attn.v_proj.kind is _kind(v_type or qtype)
    assert type(quant.model.model.embed_tokens) is nn.Embedding
    assert quant.weight_bytes < dense.weight_bytes * 0.6
    # NOTE: at hidden 256 the interpreter takes ~4 s a one-row GEMM and 2 min for the whole
    # comparison: there the short prompt only (the routes are the same as at 64)
    small = hidden == 64
    assert_generates_like(quant.model, dense.model, new_tokens=2 if small else 1,
                          prompts=TINY_PROMPTS if small else TINY_PROMPTS[:1])
    # q / k / v in one GEMM where all three are int4 or all 8-bit groups of one size (built on
    # the first forward)
    group = {T.Q2_K: 16, T.Q3_K: 16, T.Q6_K: 16}
    one_gemm = v_type is None or (_kind(v_type) is _kind(qtype) and group.get(v_type, 32) == group.get(qtype, 32))
    assert (attn._qkv is not None) == one_gemm


@needs_cuda
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_a_gguf_file_on_cuda_keeps_its_blocks_quantized(qtype, tmp_path):
    path = tmp_path / f"{qtype.name}.gguf"
    write_tiny_gguf(path, qtype, hidden=256 if FORMATS[qtype][1] == 256 else 64, tied=True)
    quant = load_model(str(path), "float32", device="cuda", load_tokenizer=False)
    dense = load_model(str(path), "float32", device="cuda", load_tokenizer=False, quantization="none")
    assert quant.quantization == "gguf" and dense.quantization is None
    q = quant.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, HFQuantizedLinear) and q.kind is _kind(qtype) and q.weight.qweight.is_cuda
    worst = assert_generates_like(quant.model, dense.model)
    print(f"{qtype.name} on cuda: max |logit difference| {worst:.2e} of the logits' scale")
