"""Every instruction-set path of the C++ CPU kernels this CPU can run, in float32 and bfloat16,
against the torch reference: paged attention (decodes and prefill chunks, GQA ratios, head dims,
block sizes, mixed lengths), the KV-cache write, RMSNorm (+ residual), RoPE, SiLU·up, argmax.

Each path is its own build of the same sources (`cpu_kernels.PATHS`: -march=native narrowed with
-mno-... flags; the path that narrows nothing is the native build); a path this CPU lacks is
skipped with the flags it misses. The first run builds
each path once (about a minute each); later runs load the cached libraries.
"""
from __future__ import annotations

import pytest
import torch
from paged_batch import paged_batch

from kvmesh.kernels import cpu_kernels, cpu_ops, reference
from kvmesh.kernels.kv_cache_dtype import to_cache_codes

DTYPES = (torch.float32, torch.bfloat16)
# (atol, rtol) of attention and the norm: float32 within a few ulp; bf16 within ~2 ulp of bf16
# (the kernel rounds its float32 sums once, the reference rounds the same sums taken in another order)
ATTENTION_TOL = {torch.float32: (2e-6, 2e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.fixture(scope="module", params=list(cpu_kernels.PATHS))
def path_ext(request):
    """(path, its extension); cpu_ops runs on it for the test (see `on_path`)."""
    path = request.param
    missing = cpu_kernels.missing_flags(path)
    if missing:
        pytest.skip(f"the {path} path needs CPU flags {', '.join(missing)}, which this CPU lacks")
    # NOTE: a path that narrows nothing (no -mno-... flags: amx) is compiled with exactly
    # the native build's flags, so on a CPU that has it the native build is that path: one
    # build (about a minute) fewer; the isa() check below still holds it to the path
    ext = cpu_kernels.load(path) if cpu_kernels.PATHS[path][0] else cpu_kernels.load()
    if ext is None:
        pytest.fail(f"the {path} path did not build: {cpu_kernels.unavailable_reason(path)}")
    assert ext.isa() == path, f"built with {cpu_kernels.PATHS[path][0]} the kernels took the {ext.isa()} path"
    return path, ext


@pytest.fixture
def on_path(path_ext, monkeypatch):
    path, ext = path_ext
    monkeypatch.setattr(cpu_ops, "load", lambda: ext)
    return ext


def test_the_native_build_is_the_widest_path_this_cpu_has():
    ext = cpu_kernels.load()
    assert ext is not None, cpu_kernels.unavailable_reason()
    widest = next(p for p in cpu_kernels.PATHS if not cpu_kernels.missing_flags(p))
    assert ext.isa() == widest


def _batch(query_lens, seq_lens, *, heads, kv_heads, dim, block, dtype, seed=0):
    return paged_batch(query_lens, seq_lens, heads=heads, kv_heads=kv_heads, dim=dim, block=block,
                       dtype=dtype, seed=seed)


def _attention_case(on_path, dtype, query_lens, seq_lens, window=0, softcap=0.0, **shape):
    query, k, v, meta = _batch(query_lens, seq_lens, dtype=dtype, **shape)
    meta = meta.with_window(window)
    scale = shape["dim"] ** -0.5
    assert cpu_ops.kernel_applies(query, k, v)
    got = cpu_ops.paged_attention(query, k, v, meta, scale, softcap)
    want = reference.paged_attention(query, k, v, meta, scale, softcap)
    assert got.dtype == dtype
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [64, 12])
def test_attention_over_an_8_bit_cache_matches_the_reference(on_path, cache_dtype, dtype, dim):
    """--kv-cache-dtype fp8 / fp8_e5m2: each path widens the codes (vectors through float16 bits,
    or one by one) to the values the reference reads."""
    query, k, v, meta = _batch([1, 37, 1, 5], [70, 37, 3, 100], heads=9, kv_heads=3, dim=dim, block=16,
                               dtype=torch.float32, seed=dim)
    query, k, v = query.to(dtype), to_cache_codes(k * 3, cache_dtype), to_cache_codes(v * 3, cache_dtype)
    assert cpu_ops.kernel_applies(query, k, v)
    got = cpu_ops.paged_attention(query, k, v, meta, dim ** -0.5)
    want = reference.paged_attention(query, k, v, meta, dim ** -0.5)
    atol, rtol = (1e-5, 2e-5) if dtype == torch.float32 else ATTENTION_TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 1)])      # GQA 1, 3, 8
@pytest.mark.parametrize("block", [1, 16, 32])
def test_attention_matches_the_reference(on_path, dtype, dim, heads, kv_heads, block):
    # decodes of uneven contexts beside a whole prompt and a chunk after a cached prefix
    _attention_case(on_path, dtype, [1, 37, 1, 5], [70, 37, 3, 100], heads=heads, kv_heads=kv_heads,
                    dim=dim, block=block, seed=dim + block)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window, softcap", [(21, 0.0), (0, 5.0)])
def test_attention_window_and_softcap(on_path, dtype, window, softcap):
    _attention_case(on_path, dtype, [1, 30, 1], [64, 30, 9], window, softcap, heads=6, kv_heads=2, dim=64,
                    block=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_head_dim_off_the_vector_width(on_path, dtype):
    # 80 is a multiple of 8 and 16 but not of 32 (no vdpbf16ps); 12 of none: the portable loops
    for dim in (80, 12):
        _attention_case(on_path, dtype, [1, 7], [20, 7], heads=4, kv_heads=2, dim=dim, block=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_cache_write_is_exact_and_skips_padding(on_path, dtype):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, (4 + 2 + 2) * 64, generator=g).to(dtype)
    k = qkv[:, 256:384].view(6, 2, 64)                  # strided views of a fused projection
    v = qkv[:, 384:].view(6, 2, 64)
    slots = torch.tensor([5, -1, 0, 63, 17, -1])
    got_k, got_v = torch.zeros(4, 16, 2, 64, dtype=dtype), torch.zeros(4, 16, 2, 64, dtype=dtype)
    want_k, want_v = got_k.clone(), got_v.clone()
    cpu_ops.write_kv_cache(k, v, got_k, got_v, slots)
    reference.write_kv_cache(k, v, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert got_k.view(-1, 2, 64)[[1, 2, 3, 4]].abs().sum() == 0      # slots nobody wrote


def test_kv_cache_write_refuses_a_slot_outside_the_cache(on_path):
    k = torch.ones(2, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 outside the cache"):
        on_path.write_kv_cache(k, k, k_cache, v_cache, torch.tensor([0, 8]))
    assert not k_cache.any()                              # checked before anything is written
    with pytest.raises(RuntimeError, match="the caches in their dtype or both float8_e4m3fn / float8_e5m2"):
        on_path.write_kv_cache(k.bfloat16(), k.bfloat16(), k_cache, v_cache, torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, hidden", [(3, 576), (130, 100)])   # inline / threads; a scalar tail
def test_rms_norm_with_and_without_the_residual(on_path, dtype, tokens, hidden):
    g = torch.Generator().manual_seed(tokens)
    x, r = (torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype)
    out, summed = cpu_ops.rms_norm(x, w, 1e-5, r)
    want, want_sum = reference.rms_norm(x, w, 1e-5, r)
    assert torch.equal(summed, want_sum)                  # the residual sum rounds as torch's add
    tol = 1e-6 if dtype == torch.float32 else 8e-3        # one bf16 ulp: the sum of squares' order
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    out, none = cpu_ops.rms_norm(x, w, 1e-5)
    assert none is None
    torch.testing.assert_close(out.float(), reference.rms_norm(x, w, 1e-5)[0].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_rope_is_bit_exact_on_strided_views(on_path, dtype, dim):
    g = torch.Generator().manual_seed(dim)
    qkv = torch.randn(50, (6 + 2 + 2) * dim, generator=g).to(dtype)
    q = qkv[:, : 6 * dim].view(50, 6, dim)
    k = qkv[:, 6 * dim: 8 * dim].view(50, 2, dim)
    table = torch.randn(512, dim, generator=g)
    pos = torch.randint(0, 512, (50,), generator=g)
    got_q, got_k = cpu_ops.rotary_embedding(pos, q, k, table)
    want_q, want_k = reference.rotary_embedding(pos, q, k, table)
    assert got_q.dtype == dtype
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, inter", [(1, 5), (70, 1536)])
def test_silu_and_mul(on_path, dtype, tokens, inter):
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(tokens, 2 * inter, generator=g) * 6.0).to(dtype)
    x[0, 0], x[-1, inter - 1] = -100.0, 100.0             # saturated sigmoid both ways
    gate, up = x.chunk(2, dim=-1)
    got = cpu_ops.silu_and_mul(x)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3        # float32: a few ulp; bf16: one ulp
    torch.testing.assert_close(got.float(), (torch.nn.functional.silu(gate) * up).float(), atol=tol, rtol=tol)


def test_argmax_of_float32_logits(on_path):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 49157, generator=g)
    x[1, 7] = x[1, 49000] = 9.0                           # a tie: the first
    x[2, 100] = float("nan")                              # NaN counts as the maximum
    assert cpu_ops.argmax(x).tolist() == x.argmax(dim=-1).tolist()


def test_kvmesh_cpu_kernels_names_a_narrower_path_for_the_engine(monkeypatch):
    """`KVMESH_CPU_KERNELS=avx2` makes plain `load()` (what the engine's ops call) return the avx2
    build: a benchmark stands in for an AVX2-only CPU on a wider one."""
    if cpu_kernels.missing_flags("avx2"):
        pytest.skip(f"the avx2 path needs {', '.join(cpu_kernels.missing_flags('avx2'))}, which this CPU lacks")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("KVMESH_CPU_KERNELS", "avx2")
    ext = cpu_kernels.load()
    assert ext is not None, cpu_kernels.unavailable_reason()
    assert ext.isa() == "avx2"


def test_kvmesh_cpu_kernels_path_the_cpu_lacks_is_refused_with_the_missing_flags(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setenv("KVMESH_CPU_KERNELS", "avx512_bf16")
    assert cpu_kernels.load() is None
    assert cpu_kernels.unavailable_reason() == (
        "the avx512_bf16 path needs avx512f, avx512bw, avx512vl, avx512_bf16, which this CPU lacks")


def test_kvmesh_cpu_kernels_unknown_value_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("KVMESH_CPU_KERNELS", "sse4")
    with pytest.raises(ValueError, match="KVMESH_CPU_KERNELS='sse4': expected 0, 1 or one of "
                                         "amx, avx512_bf16, avx512, avx2, portable"):
        cpu_kernels.load()


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_sgmv_add(path_ext, monkeypatch, dtype):
    """The fused LoRA kernel on this path: a mixed decode batch and a 13-token segment (blocks of
    8 and a remainder), odd K and N (every vector tail), three parts, within the float64
    definition's derived bound (tests/support/lora_cases.py)."""
    from lora_cases import case, definition_and_bound, fused

    from kvmesh.kernels import lora_cpu

    monkeypatch.setattr(lora_cpu, "load", lambda: path_ext[1])
    token_slots = [1, -1, 0, 2, 1, -1, 0, 2] + [3] * 13
    args = case(token_slots, 77, 45, 16, parts=3, dtype=dtype)
    got = fused(*args)
    want, bound = definition_and_bound(*args[:4], token_slots, dtype)
    assert bool(((got.double() - want).abs() <= bound).all())
    assert torch.equal(got[[1, 5]], args[3][[1, 5]])          # base-model rows untouched


def test_plain_load_reads_kvmesh_cpu_kernels_once(monkeypatch):
    """Every kernel call asks load(): the engine's answer is remembered (no environment read
    per call); a fresh `_state` (what the tests above use) reads the variable again."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    first = cpu_kernels.load()
    monkeypatch.setenv("KVMESH_CPU_KERNELS", "sse4")        # an error, were it read again
    assert cpu_kernels.load() is first
    monkeypatch.setattr(cpu_kernels, "_state", {})
    with pytest.raises(ValueError, match="KVMESH_CPU_KERNELS='sse4'"):
        cpu_kernels.load()


# the dtypes each path's small-row GEMM runs (the rest stay on oneDNN)
SMALL_GEMM_DTYPES = {"amx": DTYPES, "avx512_bf16": DTYPES, "avx512": (torch.float32,), "avx2": (torch.float32,),
                     "portable": ()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_gemm(path_ext, dtype):
    """The small-row GEMM on this path: 1-9 rows (every activation tile height of AVX-512's 4 and
    AVX2's 2), odd K and N, within the float64 product's bound gamma(K + 1) * (|x| @ |w|^T + |b|)
    (+ half a bf16 ulp), each row bitwise the same alone; a dtype without a path is refused."""
    path, ext = path_ext
    name = str(dtype).removeprefix("torch.")
    g = torch.Generator().manual_seed(11)
    w = torch.randn(37, 77, generator=g).to(dtype)
    b = torch.randn(37, generator=g).to(dtype)
    if dtype not in SMALL_GEMM_DTYPES[path]:
        assert not ext.small_gemm_supports(name)
        with pytest.raises(RuntimeError, match="small_gemm: this build takes"):
            ext.small_gemm(torch.randn(2, 77).to(dtype), w, b)
        return
    assert ext.small_gemm_supports(name)
    u, n = 2.0 ** -24, 78
    for m in range(1, 10):
        x = torch.randn(m, 77, generator=g).to(dtype)
        y = ext.small_gemm(x, w, b)
        exact = x.double() @ w.double().T + b.double()
        bound = n * u / (1 - n * u) * (x.double().abs() @ w.double().abs().T + b.double().abs())
        if dtype == torch.bfloat16:
            bound = bound + 2.0 ** -8 * (exact.abs() + bound)
        assert bool(((y.double() - exact).abs() <= bound).all())
        for r in range(m):
            assert torch.equal(ext.small_gemm(x[r:r + 1], w, b)[0], y[r])
