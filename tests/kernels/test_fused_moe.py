"""Fused MoE: expert selection, the block alignment and the Triton grouped GEMM against the reference."""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import fused_moe as fm  # noqa: E402
from kvmesh.kernels import reference  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(num_tokens, num_experts, top_k, dtype, hidden=64, inter=32, idle=(), seed=0):
    """x, w13, w2 and a routing in which the experts in `idle` get no token."""
    gen = torch.Generator().manual_seed(seed * 1000 + num_tokens * 31 + num_experts)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, list(idle)] = -1e4
    weights, ids = reference.select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def _hf_routing(logits, top_k, renormalize):
    """HF Qwen3-MoE / Mixtral router arithmetic, spelled out independently."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top, idx = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top /= top.sum(dim=-1, keepdim=True)
    return top, idx


def _loop_moe(x, w13, w2, weights, ids):
    """Token-by-token, expert-by-expert float64 MoE: the definition, no grouping."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, k]) * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts_matches_hf(renormalize):
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(3))
    w, ids = reference.select_experts(logits, 2, renormalize)
    hw, hids = _hf_routing(logits, 2, renormalize)
    assert torch.equal(ids, hids) and torch.equal(w, hw) and w.dtype == torch.float32
    assert torch.allclose(w.sum(-1), torch.ones(9)) == renormalize


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (37, 8, 2), (20, 6, 3), (5, 8, 1)])
def test_reference_is_the_definition(num_tokens, num_experts, top_k):
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, torch.float64, idle=(1,))
    out = reference.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, _loop_moe(x, w13, w2, weights, ids))


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (37, 8, 2), (100, 4, 1), (9, 64, 8)])
def test_align_block_size_invariants(num_tokens, num_experts, top_k, block_m):
    _, _, _, _, ids = _case(num_tokens, num_experts, top_k, torch.float32, idle=(0,))
    sorted_ids, block_expert = fm.moe_align_block_size(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    assert sorted_ids.numel() == block_expert.numel() * block_m
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < num_pairs].long()
    assert sorted(real.tolist()) == list(range(num_pairs))   # every pair exactly once
    seen_experts = []
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block_m:(b + 1) * block_m].long()
        if e < 0:
            assert (rows == num_pairs).all()                  # tiles past the end are padding
            continue
        valid = rows[rows < num_pairs]
        assert valid.numel() > 0 and (flat[valid] == e).all()  # a tile holds one expert's pairs
        assert (rows[:valid.numel()] < num_pairs).all()       # padding only at a run's end
        seen_experts.append(e)
    assert seen_experts == sorted(seen_experts) and 0 not in seen_experts  # idle expert: no tile
    assert set(seen_experts) == set(flat.tolist())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 2), (6, 3)], ids=["e4k1", "e8k2", "e6k3"])
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_fused_moe_matches_reference(kx, dtype, num_experts, top_k, num_tokens):
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, dtype, idle=(0, num_experts - 1))
    assert not torch.isin(ids, torch.tensor([0, num_experts - 1])).any()  # two experts with no token
    expected = reference.fused_moe(x, w13, w2, weights, ids)
    with kx.poisoned():
        out = fm.fused_moe(x, w13, w2, weights, ids)
    kx.assert_close(out, expected)


@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 16, 16), (32, 64, 64), (64, 32, 16)])
def test_fused_moe_tiles_and_masked_edges(kx, block_m, block_n, block_k):
    """hidden 80 and inter 40: neither a multiple of the tiles (masked N and K edges)."""
    x, w13, w2, weights, ids = _case(23, 8, 2, torch.float32, hidden=80, inter=40)
    with kx.poisoned():
        out = fm.fused_moe(x, w13, w2, weights, ids, block_m=block_m, block_n=block_n, block_k=block_k)
    kx.assert_close(out, reference.fused_moe(x, w13, w2, weights, ids))


def test_fused_moe_strided_input_and_int32_ids(kx):
    x, w13, w2, weights, ids = _case(11, 8, 2, torch.float32)
    wide = torch.randn(11, 2 * x.shape[1])
    wide[:, ::2] = x
    xs = wide[:, ::2]
    assert not xs.is_contiguous()
    out = fm.fused_moe(xs, w13, w2, weights, ids.int())
    kx.assert_close(out, reference.fused_moe(x, w13, w2, weights, ids))


def test_native_16bit_dot_operands(kx, monkeypatch):
    """The GPU path (fp16 tiles straight into tl.dot), run in the interpreter."""
    monkeypatch.setattr(fm, "upcast_operands", lambda t: False)
    x, w13, w2, weights, ids = _case(19, 8, 2, torch.float16, idle=(2,))
    kx.assert_close(fm.fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids))


def test_no_tokens():
    x, w13, w2, weights, ids = _case(0, 4, 2, torch.float32)
    assert fm.fused_moe(x, w13, w2, weights, ids).shape == (0, 64)


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "w2": a["w2"][:, :, :16]}, "inconsistent"),
    (lambda a: {**a, "w13": a["w13"].half()}, "share a dtype"),
    (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "int32 or int64"),
    (lambda a: {**a, "topk_weights": a["topk_weights"].half()}, "float32"),
    (lambda a: {**a, "topk_ids": a["topk_ids"][:3]}, "num_tokens"),
    (lambda a: {**a, "block_n": 8}, "power of two >= 16"),
    (lambda a: {**a, "block_m": 48}, "power of two >= 16"),
])
def test_launcher_rejects_bad_arguments(change, match):
    x, w13, w2, weights, ids = _case(5, 4, 2, torch.float32)
    args = dict(x=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    with pytest.raises(ValueError, match=match):
        fm.fused_moe(**change(args))
