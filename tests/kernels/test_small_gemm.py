"""The small-row CPU GEMM (kernels/small_gemm.py, csrc/small_gemm.cpp): against a float64 product of
the same values within the accumulation's error bound, batch invariance, its refusals, and the
dispatch in kernels.linear that sends a few rows there and more rows to oneDNN.

The bound: the kernel sums K products (exact in float32 for bf16 operands, one rounding each in
float32) and the bias in float32, in some order, so |y - y64| <= gamma(K + 1) * (|x| @ |w|^T + |b|)
with gamma(n) = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability, 3.1); bf16 results
are then rounded once more, adding 2^-8 * |y| (half an ulp of bf16's 8-bit significand).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import cpu_kernels, gemm_rows
from kvmesh.kernels import linear as lin
from kvmesh.kernels import small_gemm

DTYPES = [torch.float32, torch.bfloat16]


def _rows(dtype: torch.dtype) -> int:
    rows = small_gemm.max_rows(dtype)
    if rows == 0:
        pytest.skip(f"no small-row GEMM for {dtype} on this CPU / build")
    return rows


@pytest.fixture(autouse=True)
def _fresh_decision(monkeypatch):
    """Each test decides anew (a test may change KVMESH_SMALL_GEMM or the extension's load), on a
    CPU whose oneDNN GEMMs are not padded (where they are, float32 stays on oneDNN: tested below)."""
    monkeypatch.setattr(gemm_rows, "MIN_ROWS", 1)
    small_gemm._cache.clear()
    yield
    small_gemm._cache.clear()


def test_float32_stays_on_onednn_where_its_few_row_gemms_are_padded(monkeypatch):
    monkeypatch.setattr(gemm_rows, "MIN_ROWS", 4)
    small_gemm._cache.clear()
    assert small_gemm.max_rows(torch.float32) == 0
    want_bf16 = small_gemm.MAX_ROWS[torch.bfloat16] if cpu_kernels.load().small_gemm_supports("bfloat16") else 0
    assert small_gemm.max_rows(torch.bfloat16) == want_bf16
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    assert not lin.uses_small_gemm(x, w)


def _operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    x64, w64 = x.double(), w.double()
    b64 = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    exact = x64 @ w64.T + b64
    u = 2.0 ** -24
    n = x.shape[1] + 1
    bound = n * u / (1 - n * u) * (x64.abs() @ w64.abs().T + b64.abs())
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (exact.abs() + bound)
    err = (y.double() - exact).abs()
    assert y.dtype == x.dtype and y.shape == exact.shape
    assert bool((err <= bound).all()), f"max error {err.max().item()} over bound {bound.max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_float64_within_the_bound(dtype, bias):
    # K = 77: not a multiple of any vector width (8, 16, 32); N = 37: odd, a partial 4-row tile;
    # up to 9 rows at least: every activation tile height (4, 3, 2, 1 and two full tiles)
    for m in range(1, max(_rows(dtype), 9) + 1):
        x, w, b = _operands(m, 77, 37, dtype, seed=m, bias=bias)
        _assert_within_bound(small_gemm.run(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(576, 963), (1536, 61), (3, 5)])
def test_model_sized_and_tiny_shapes_match_float64(dtype, k, n):
    rows = _rows(dtype)
    for m in sorted({1, 5, rows}):
        x, w, b = _operands(m, k, n, dtype, seed=k + m, bias=True)
        _assert_within_bound(small_gemm.run(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_bitwise_the_same_alone_in_any_batch_and_on_any_thread_count(dtype):
    rows = max(_rows(dtype), 9)
    # 2 MB of weight: over the kernel's threshold for splitting over threads
    x, w, b = _operands(rows, 576, 1000 if dtype == torch.float32 else 1800, dtype, seed=7, bias=True)
    full = small_gemm.run(x, w, b)
    for r in range(rows):
        assert torch.equal(small_gemm.run(x[r:r + 1], w, b)[0], full[r])
    flipped = small_gemm.run(x.flip(0), w, b)
    assert torch.equal(flipped, full.flip(0))                   # another position in the batch
    for m in range(2, rows):
        assert torch.equal(small_gemm.run(x[:m], w, b), full[:m])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(small_gemm.run(x, w, b), full)
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_refuses_what_it_cannot_take():
    _rows(torch.float32)
    ext = cpu_kernels.load()
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="unit stride along K"):
        ext.small_gemm(torch.randn(16, 3).t(), w)
    with pytest.raises(RuntimeError, match="w must be contiguous"):
        ext.small_gemm(x, torch.randn(16, 8).t())
    with pytest.raises(RuntimeError, match="share one dtype"):
        ext.small_gemm(x, w.double())
    with pytest.raises(RuntimeError, match="not Double"):
        ext.small_gemm(x.double(), w.double())
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and w \[N, K\]"):
        ext.small_gemm(x, torch.randn(8, 15))
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        ext.small_gemm(torch.randn(65, 16), w)
    with pytest.raises(RuntimeError, match="bias must be a contiguous"):
        ext.small_gemm(x, w, torch.randn(9))
    with pytest.raises(RuntimeError, match="bias must be a contiguous"):
        ext.small_gemm(x, w, torch.randn(16)[::2])


def test_a_strided_input_is_copied_and_a_row_strided_one_read_in_place():
    rows = _rows(torch.float32)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 24, generator=g)
    wide = torch.randn(rows, 50, generator=g)
    x = wide[:, 3:27]                                           # rows 50 apart: read as it is
    assert torch.equal(cpu_kernels.load().small_gemm(x, w), small_gemm.run(x.contiguous(), w))
    xt = torch.randn(24, rows, generator=g).t()                 # columns strided: copied
    assert torch.equal(small_gemm.run(xt, w), small_gemm.run(xt.contiguous(), w))


def _spy(monkeypatch) -> list[int]:
    calls: list[int] = []
    run = small_gemm.run

    def spy(x, weight, bias=None):
        calls.append(x.shape[0])
        return run(x, weight, bias)
    monkeypatch.setattr(small_gemm, "run", spy)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_sends_up_to_the_crossover_here_and_more_rows_to_onednn(monkeypatch, dtype):
    rows = _rows(dtype)
    if lin.bf16_via_float32(torch.ones(1, 4, dtype=dtype), torch.ones(2, 4, dtype=dtype)):
        pytest.skip("bf16 runs as float32 on this CPU")
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(33, 40, generator=g).to(dtype)
    b = torch.randn(33, generator=g).to(dtype)
    for m in (1, rows, rows + 1):
        x = torch.randn(m, 40, generator=g).to(dtype)
        assert lin.uses_small_gemm(x, w) == (m <= rows)
        y = lin.linear(x, w, b)
        if m <= rows:
            assert torch.equal(y, small_gemm.run(x, w, b))
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()),
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=5e-2 if dtype == torch.bfloat16 else 1e-5)
    assert calls == [1, 1, rows, rows]                 # linear, then the test's own call, per m


def test_what_stays_off_the_small_kernel(monkeypatch):
    rows = _rows(torch.float32)
    calls = _spy(monkeypatch)
    w = torch.randn(8, 6)
    lin.linear(torch.randn(2, 6, dtype=torch.float64), w.double())         # no path for float64
    lin.linear(torch.randn(2, 3, 6), w)                                     # not 2-D
    lin.linear(torch.randn(2, 6), w, torch.randn(16)[::2])                  # strided bias
    wg = torch.randn(8, 6, requires_grad=True)
    lin.linear(torch.randn(2, 6), wg).sum().backward()                      # autograd wanted
    assert wg.grad is not None
    lin.linear(torch.randn(rows + 1, 6), w)                                 # over the crossover
    assert calls == []


def test_a_weight_over_the_size_limit_stays_on_onednn(monkeypatch):
    """The LM head's case (56 MB in bf16), with the limit lowered instead of a big weight."""
    _rows(torch.float32)
    calls = _spy(monkeypatch)
    x, small, big = torch.randn(1, 16), torch.randn(8, 16), torch.randn(9, 16)
    monkeypatch.setattr(small_gemm, "MAX_WEIGHT_BYTES", 8 * 16 * 4)
    assert lin.uses_small_gemm(x, small) and not lin.uses_small_gemm(x, big)
    lin.linear(x, small)
    torch.testing.assert_close(lin.linear(x, big), F.linear(x, big), rtol=1e-5, atol=1e-5)
    assert calls == [1]


def test_KVMESH_SMALL_GEMM_0_keeps_every_gemm_on_onednn(monkeypatch):
    _rows(torch.float32)
    monkeypatch.setenv("KVMESH_SMALL_GEMM", "0")
    small_gemm._cache.clear()
    calls = _spy(monkeypatch)
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    assert small_gemm.max_rows(torch.float32) == 0 and not lin.uses_small_gemm(x, w)
    torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert calls == []


def test_without_the_extension_nothing_runs_here(monkeypatch):
    """Fault injection: the C++ kernels could not be built (no compiler, KVMESH_CPU_KERNELS=0)."""
    monkeypatch.setattr(cpu_kernels, "load", lambda path=None: None)
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    assert small_gemm.max_rows(torch.float32) == 0 == small_gemm.max_rows(torch.bfloat16)
    torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_build_without_a_path_for_a_dtype_leaves_it_to_onednn(monkeypatch):
    """Fault injection: an AVX-512 build without AVX512-BF16 (or AVX2) has no bf16 path."""
    class NoBf16:
        def small_gemm_supports(self, dtype: str) -> bool:
            return dtype == "float32"
    monkeypatch.setattr(cpu_kernels, "load", lambda path=None: NoBf16())
    assert small_gemm.max_rows(torch.bfloat16) == 0
    assert small_gemm.max_rows(torch.float32) == small_gemm.MAX_ROWS[torch.float32]
    assert small_gemm.max_rows(torch.float16) == 0


# --- the engine: greedy output with the kernel on and off, with and without speculation -------

NGRAM5 = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
          "prompt_lookup_max": 3}     # k + 1 = 5 rows verified a step: float32's crossover


def _greedy(loaded, spec=None) -> dict[str, list[int]]:
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=spec), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    period = [5, 9, 14, 20, 7]
    out = {}
    # one request at a time: a decode step is one row, a verification k + 1 = 5 at most
    for i, prompt in enumerate([period * 3, [3, 30, 11], list(range(3, 40))]):
        engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
    return out


def test_a_tiny_model_decodes_the_same_tokens_on_and_off_the_kernel(monkeypatch, tmp_path):
    """float32 greedy decoding: the same tokens with the kernel as on oneDNN alone, and with
    speculation verifying 5 rows a step as decoding one row at a time (batch invariance)."""
    _rows(torch.float32)
    from tiny_models import save_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvmesh.engine.loader import load_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2))
    loaded = load_model(str(save_tiny_model(model.eval(), tmp_path / "tiny", seed=3)),
                        dtype="float32", device="cpu")
    calls = _spy(monkeypatch)
    on = _greedy(loaded)
    assert 1 in calls                                          # decode steps ran here
    calls.clear()
    spec = _greedy(loaded, NGRAM5)
    assert 5 in calls and max(calls) <= small_gemm.MAX_ROWS[torch.float32]
    monkeypatch.setenv("KVMESH_SMALL_GEMM", "0")
    small_gemm._cache.clear()
    calls.clear()
    off = _greedy(loaded)
    assert calls == []
    assert on == off == spec and len(on) == 3 and all(len(t) == 12 for t in on.values())
