"""The Triton backend module: same API as the reference, and dispatch through it."""
import inspect

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import reference  # noqa: E402
from kvmesh.kernels.ops import get_ops  # noqa: E402

OPS = ["write_kv_cache", "paged_attention", "rms_norm", "rotary_embedding", "fused_moe"]


@pytest.mark.parametrize("name", OPS)
def test_triton_ops_exposes_reference_signatures(name):
    triton_ops = get_ops("triton")
    assert triton_ops.__name__ == "kvmesh.kernels.triton_ops"
    ours = inspect.signature(getattr(triton_ops, name))
    theirs = inspect.signature(getattr(reference, name))
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.parameters.values()]
    assert str(ours) == str(theirs)


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [5, 17, 33]),        # all decode: the split-K decode kernel
    ([1, 6, 1], [5, 17, 33]),        # mixed: the unified kernel
], ids=["decode", "mixed"])
def test_write_then_attend_through_get_ops(kx, query_lens, seq_lens):
    """The model's per-layer sequence: write this step's K/V, then attend; default tiles."""
    triton_ops = get_ops("triton")
    num_kv_heads, head_dim, block_size = 2, 64, 16
    case = kx.make_paged_case(query_lens, seq_lens, num_heads=4, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, block_size=block_size, dtype=torch.float16)
    meta = case.meta
    num_tokens = sum(query_lens)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).half()
    value = torch.randn(num_tokens, num_kv_heads, head_dim).half()
    k_ref, v_ref = case.clean_caches()
    reference.write_kv_cache(key, value, k_ref, v_ref, meta.slot_mapping)
    expected = reference.paged_attention(case.query, k_ref, v_ref, meta, case.scale)
    with kx.poisoned():
        triton_ops.write_kv_cache(key, value, case.k_cache, case.v_cache, meta.slot_mapping)
        out = triton_ops.paged_attention(case.query, case.k_cache, case.v_cache, meta, case.scale)
    kx.assert_close(out, expected)


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [5, 17, 70]),
    ([1, 6, 1], [5, 17, 33]),
], ids=["decode", "mixed"])
def test_native_16bit_dot_operands(kx, monkeypatch, query_lens, seq_lens):
    """The GPU path (fp16 tl.dot operands, P cast to fp16) run in the interpreter.

    The interpreter cannot do bf16 arithmetic, so the suite otherwise runs the fp32-operand path;
    fp16 numpy arithmetic works, so this covers the operand casts the GPU compiles.
    """
    from kvmesh.kernels import paged_attention, prefill_attention
    monkeypatch.setattr(paged_attention, "upcast_operands", lambda query: False)
    monkeypatch.setattr(prefill_attention, "upcast_operands", lambda query: False)
    case = kx.make_paged_case(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                              block_size=16, dtype=torch.float16)
    k_ref, v_ref = case.clean_caches()
    expected = reference.paged_attention(case.query, k_ref, v_ref, case.meta, case.scale)
    with kx.poisoned():
        if query_lens == [1, 1, 1]:
            out = paged_attention.paged_decode_attention(
                case.query, case.k_cache, case.v_cache, case.meta.block_tables,
                case.meta.seq_lens, case.meta.max_seq_len, case.scale, num_splits=2, block_n=32)
        else:
            out = get_ops("triton").paged_attention(case.query, case.k_cache, case.v_cache,
                                                    case.meta, case.scale)
    # P is rounded to fp16 before P @ V, as on the GPU: allow a few fp16 ulps more
    torch.testing.assert_close(out.float(), expected.float(), atol=5e-3, rtol=5e-3)
