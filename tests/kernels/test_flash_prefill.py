"""Prefill chunks with no cached prefix on torch's flash attention, the rest on the unified kernel.

The flash kernels are CUDA-only: here the "sdpa" route runs torch's math SDPA on the CPU (the
same call, another backend) and the unified kernel runs in the Triton interpreter, so what is
checked is the routing (which sequences go where) and the assembly of the output rows, exact
against the reference. The comparison of both flash routes and the unified kernel on the GPU
is the CUDA-only test at the end.
"""
import os

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import flash_prefill, reference, triton_ops  # noqa: E402
from kvmesh.kernels.flash_prefill import build_route, eligible, split_sequences  # noqa: E402
from kvmesh.kernels.prefill_attention import unified_attention  # noqa: E402

# these run the unified kernel on CPU tensors: in the interpreter only (a GPU run sets TRITON_INTERPRET=0)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the unified kernel on CPU tensors needs TRITON_INTERPRET=1")

# a decode, a fresh prompt, a chunk after a cached prefix, a 1-token prompt, a fresh prompt
MIXED = ([1, 5, 3, 1, 7], [9, 5, 10, 1, 7])


def test_split_sequences():
    assert split_sequences(*MIXED) == ([1, 3, 4], [0, 2])
    assert split_sequences([4, 4], [4, 4]) == ([0, 1], [])
    assert split_sequences([1, 2], [3, 8]) == ([], [0, 1])


def test_route_of_a_mixed_step(kx):
    case = kx.make_paged_case(*MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                              dtype=torch.float16)
    m = case.meta
    r = build_route(m)
    assert r.flash_seqs == [1, 3, 4] and r.flash_max_len == 7
    # token rows: seq 0 -> 0, seq 1 -> 1..5, seq 2 -> 6..8, seq 3 -> 9, seq 4 -> 10..16
    assert r.flash_tokens.tolist() == [1, 2, 3, 4, 5, 9, *range(10, 17)]
    assert r.flash_cu.tolist() == [0, 5, 6, 13]
    assert r.rest_tokens.tolist() == [0, 6, 7, 8]
    rm = r.rest_meta
    assert rm.query_start_loc.tolist() == [0, 1, 4] and rm.seq_lens.tolist() == [9, 10]
    assert rm.block_tables.tolist() == [m.block_tables[0].tolist(), m.block_tables[2].tolist()]
    assert (rm.query_lens_cpu, rm.seq_lens_cpu, rm.max_query_len, rm.max_seq_len) == ([1, 3], [9, 10], 3, 10)
    assert rm.slot_mapping.tolist() == [m.slot_mapping[i].item() for i in (0, 6, 7, 8)]


def test_route_of_fresh_prompts_only_and_of_none(kx):
    case = kx.make_paged_case([3, 6], [3, 6], num_heads=4, num_kv_heads=2, head_dim=16,
                              block_size=4, dtype=torch.float16)
    r = build_route(case.meta)
    assert r.flash_tokens is None and r.rest_meta is None and r.flash_cu.tolist() == [0, 3, 9]
    case = kx.make_paged_case([1, 2], [5, 8], num_heads=4, num_kv_heads=2, head_dim=16,
                              block_size=4, dtype=torch.float16)
    assert build_route(case.meta) is None


@pytest.mark.parametrize("dtype,softcap,window,impl,expected", [
    (torch.float16, 0.0, 0, "sdpa", True),
    (torch.bfloat16, 0.0, 0, "varlen", True),
    (torch.bfloat16, 0.0, 64, "varlen", True),       # varlen_attn takes the window
    (torch.bfloat16, 0.0, 64, "sdpa", False),        # SDPA's flash backend takes no window mask
    (torch.float32, 0.0, 0, "sdpa", False),          # flash kernels are 16-bit only
    (torch.float16, 30.0, 0, "varlen", False),       # no soft-cap in flash
    (torch.float16, 0.0, 0, None, False),            # no flash on this device
])
def test_eligibility(dtype, softcap, window, impl, expected):
    assert eligible(torch.empty(2, 4, 64, dtype=dtype), softcap, window, impl) is expected


def test_head_dim_limits():
    assert not eligible(torch.empty(2, 4, 512, dtype=torch.float16), 0.0, 0, "sdpa")
    assert not eligible(torch.empty(2, 4, 12, dtype=torch.float16), 0.0, 0, "sdpa")


def _expected(case, window=0):
    k, v = case.clean_caches()
    return reference.paged_attention(case.query, k, v, case.meta.with_window(window), case.scale)


@interpreted
@pytest.mark.parametrize("lens", [MIXED, ([6, 2, 9], [6, 2, 9])], ids=["mixed", "fresh-only"])
def test_output_assembled_in_step_order(kx, lens, monkeypatch):
    """Math SDPA on the CPU (flash is CUDA-only) for the fresh chunks, the unified kernel
    (interpreter) for the rest: every row lands where the reference puts it."""
    case = kx.make_paged_case(*lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                              dtype=torch.float16, strided_query=True)
    flashed = []
    real = flash_prefill._flash
    monkeypatch.setattr(flash_prefill, "_flash",
                        lambda impl, q, *a: flashed.append((impl, q.shape[0])) or real(impl, q, *a))
    with kx.poisoned():
        out = flash_prefill.prefill_attention(case.query, case.k_cache, case.v_cache, case.meta,
                                              case.scale, 0.0, unified_attention, "sdpa")
    kx.assert_close(out, _expected(case))
    assert flashed == [("sdpa", 13 if lens == MIXED else 17)]


@interpreted
def test_triton_ops_routes_through_flash_where_eligible(kx, monkeypatch):
    """The backend's entry point: with a flash impl (forced here: the CPU has none) a mixed
    step goes through the route; without one (fp32) the unified kernel alone, as before."""
    monkeypatch.setattr(triton_ops, "default_impl", lambda device: "sdpa")
    calls = []
    real = flash_prefill._flash
    monkeypatch.setattr(flash_prefill, "_flash", lambda *a: calls.append(a[0]) or real(*a))
    for dtype in (torch.float16, torch.float32):
        case = kx.make_paged_case(*MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                                  dtype=dtype, seed=3)
        with kx.poisoned():
            out = triton_ops.paged_attention(case.query, case.k_cache, case.v_cache, case.meta,
                                             case.scale)
        kx.assert_close(out, _expected(case))
    assert calls == ["sdpa"]


def _varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1)):
    """A stand-in with torch 2.11's `varlen_attn` keywords (window_size, no enable_gqa), per
    sequence on math SDPA: the real one is CUDA-only, and this machine's torch has the newer one."""
    assert key.shape[1] == query.shape[1], "torch 2.11's varlen_attn takes no GQA"
    left, right = window_size
    out = torch.empty_like(query)
    for lo, hi in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        i = torch.arange(hi - lo)
        d = i[:, None] - i[None, :]                     # query position - key position
        seen = ((d >= -right) if right >= 0 else torch.ones_like(d, dtype=torch.bool)) & (
            (d <= left) if left >= 0 else torch.ones_like(d, dtype=torch.bool))
        out[lo:hi] = torch.nn.functional.scaled_dot_product_attention(
            query[lo:hi].transpose(0, 1), key[lo:hi].transpose(0, 1), value[lo:hi].transpose(0, 1),
            attn_mask=seen, scale=scale).transpose(0, 1)
    return out


def _varlen_without_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
    raise AssertionError("not causal: never called")


@interpreted
@pytest.mark.parametrize("window", [0, 3])
def test_varlen_of_a_torch_without_gqa(kx, monkeypatch, window):
    """torch 2.11's varlen_attn (the GPU image's) has no enable_gqa: the K/V heads are repeated
    for it, and the causal mask (window_size (-1, 0), or a sliding window) still goes along."""
    import torch.nn.attention.varlen as varlen_mod
    monkeypatch.setattr(varlen_mod, "varlen_attn", _varlen_2_11)
    flash_prefill.varlen_keywords.cache_clear()
    try:
        case = kx.make_paged_case(*MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                                  dtype=torch.float16, seed=5)
        meta = case.meta.with_window(window)
        with kx.poisoned():
            out = flash_prefill.prefill_attention(case.query, case.k_cache, case.v_cache, meta,
                                                  case.scale, 0.0, unified_attention, "varlen")
        kx.assert_close(out, _expected(case, window))
    finally:
        flash_prefill.varlen_keywords.cache_clear()


def test_a_varlen_without_window_size_is_not_used(monkeypatch):
    """Its causal mask is window_size: a varlen_attn without it cannot run a prefill."""
    import torch.nn.attention.varlen as varlen_mod
    monkeypatch.setattr(varlen_mod, "varlen_attn", _varlen_without_window)
    flash_prefill.varlen_keywords.cache_clear()
    try:
        for window in (0, 64):
            assert not eligible(torch.empty(2, 4, 64, dtype=torch.bfloat16), 0.0, window, "varlen")
        assert eligible(torch.empty(2, 4, 64, dtype=torch.bfloat16), 0.0, 0, "sdpa")
    finally:
        flash_prefill.varlen_keywords.cache_clear()


def test_impl_override(monkeypatch):
    monkeypatch.setenv("KVMESH_FLASH_PREFILL", "off")
    flash_prefill.default_impl.cache_clear()
    try:
        assert flash_prefill.default_impl(torch.device("cpu")) is None
    finally:
        flash_prefill.default_impl.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: torch's flash kernels (varlen_attn, SDPA flash) run only on a GPU")
@pytest.mark.parametrize("window", [0, 24])
def test_flash_routes_match_unified_on_the_gpu(kx, window):
    lens = ([1, 40, 17, 1, 70, 33], [50, 40, 90, 1, 70, 33])
    case = kx.make_paged_case(*lens, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                              dtype=torch.bfloat16, seed=window)
    # the model's layout: q a strided view of the fused QKV output
    t = case.query.shape[0]
    q = torch.zeros(t, (8 + 2 * 2) * 128, dtype=torch.bfloat16, device="cuda")[:, :8 * 128].view(t, 8, 128)
    q.copy_(case.query)
    kc, vc = (t.nan_to_num(0.0).cuda() for t in (case.k_cache, case.v_cache))
    meta = case.meta
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).cuda())
    meta = meta.with_window(window)
    unified = unified_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                case.scale, sliding_window=window)
    expected = reference.paged_attention(q, kc, vc, meta, case.scale)
    for impl in ("varlen", "sdpa"):
        out = flash_prefill.prefill_attention(q, kc, vc, meta, case.scale, 0.0, unified_attention, impl)
        if window and impl == "sdpa":
            assert out is None
            continue
        kx.assert_close(out, expected)
        kx.assert_close(out, unified)
