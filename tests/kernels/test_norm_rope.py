"""Fused RMSNorm (+ residual) and NeoX RoPE against the reference."""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import reference  # noqa: E402
from kvmesh.kernels.norm import rms_norm  # noqa: E402
from kvmesh.kernels.rope import rotary_embedding  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# NOTE: interpreter bf16 stores truncate where torch rounds, and these ops round twice
# (x + r, then norm * weight), so bf16 may differ by 2 ulp: widen its rtol a little.
NORM_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 3e-2)}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (2, 3, 96)], ids=["1x64", "7x576", "2x3x96"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(kx, dtype, shape, with_residual):
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    x_before = x.clone()
    expected, expected_res = reference.rms_norm(x, weight, 1e-6, residual)
    with kx.poisoned():
        out, res = rms_norm(x, weight, 1e-6, residual)
    atol, rtol = NORM_TOL[dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    if with_residual:
        assert not res.isnan().any()
        torch.testing.assert_close(res.float(), expected_res.float(), atol=atol, rtol=rtol)
    else:
        assert res is None
    assert torch.equal(x, x_before), "inputs must not be modified"


def test_rms_norm_strided_rows(kx):
    wide = torch.randn(5, 256)
    x = wide[:, :128]                        # row stride 256, unit column stride
    weight = torch.randn(128)
    with kx.poisoned():
        out, _ = rms_norm(x, weight, 1e-5)
    kx.assert_close(out, reference.rms_norm(x, weight, 1e-5)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(4, 4, 64), (8, 2, 128), (9, 3, 64), (2, 1, 80)])
@pytest.mark.parametrize("block_h", [None, 2])
def test_rope_matches_reference(kx, dtype, num_heads, num_kv_heads, head_dim, block_h):
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    num_tokens, max_pos = 11, 64
    # query and key as strided views of one fused QKV projection output
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim]
    key = key.view(num_tokens, num_kv_heads, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    exp_q, exp_k = reference.rotary_embedding(positions, query, key, cos_sin)
    with kx.poisoned():
        q, k = rotary_embedding(positions.int(), query, key, cos_sin, block_h=block_h)
    atol, rtol = NORM_TOL[dtype]
    for actual, expected in ((q, exp_q), (k, exp_k)):
        assert not actual.isnan().any()
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("op,match", [
    ("norm_weight", "weight must be"),
    ("norm_dtype", "must match x dtype"),
    ("norm_residual", "residual must match"),
    ("rope_cache", "cos_sin_cache"),
    ("rope_positions", "positions"),
    ("rope_odd", "even"),
])
def test_norm_rope_reject_bad_args(op, match):
    x = torch.randn(3, 64)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    pos, cs = torch.arange(3), torch.randn(8, 64)
    with pytest.raises(ValueError, match=match):
        if op == "norm_weight":
            rms_norm(x, torch.ones(32), 1e-6)
        elif op == "norm_dtype":
            rms_norm(x, torch.ones(64, dtype=torch.float16), 1e-6)
        elif op == "norm_residual":
            rms_norm(x, torch.ones(64), 1e-6, torch.randn(3, 32))
        elif op == "rope_cache":
            rotary_embedding(pos, q, k, cs.half())
        elif op == "rope_positions":
            rotary_embedding(pos.float(), q, k, cs)
        elif op == "rope_odd":
            rotary_embedding(pos, torch.randn(3, 4, 63), torch.randn(3, 2, 63), torch.randn(8, 63))
