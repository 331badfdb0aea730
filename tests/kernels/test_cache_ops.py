"""Triton cache write against the reference: slots out of order, -1 padding, strided K/V."""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import reference  # noqa: E402
from kvmesh.kernels.cache_ops import write_kv_cache  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 128), (3, 64), (4, 80)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_write_kv_cache_matches_reference(dtype, num_kv_heads, head_dim, block_size, slot_dtype):
    gen = torch.Generator().manual_seed(block_size * 7 + head_dim)
    num_blocks, num_tokens = 6, 13
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere: any slot the kernel writes wrongly or skips shows up as a mismatch.
    k_ref = torch.full(shape, float("nan"), dtype=dtype)
    v_ref = torch.full(shape, float("nan"), dtype=dtype)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    # K and V as strided views of one fused QKV-like buffer
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1                                         # padding tokens
    slots = slots.to(slot_dtype)

    reference.write_kv_cache(key, value, k_ref, v_ref, slots.long())
    write_kv_cache(key, value, k_tri, v_tri, slots, block_h=2)

    assert torch.equal(k_tri.isnan(), k_ref.isnan()) and torch.equal(v_tri.isnan(), v_ref.isnan())
    assert torch.equal(k_tri.nan_to_num(0), k_ref.nan_to_num(0))
    assert torch.equal(v_tri.nan_to_num(0), v_ref.nan_to_num(0))
    written = int((slots >= 0).sum()) * num_kv_heads * head_dim
    assert int((~k_tri.isnan()).sum()) == written


def test_write_kv_cache_all_padding_and_empty():
    k = torch.zeros(2, 8, 1, 64)
    v = torch.zeros(2, 8, 1, 64)
    key = torch.ones(3, 1, 64)
    write_kv_cache(key, key, k, v, torch.full((3,), -1, dtype=torch.int64))
    assert not k.any() and not v.any()
    write_kv_cache(key[:0], key[:0], k, v, torch.empty(0, dtype=torch.int64))


@pytest.mark.parametrize("case,match", [
    ("dtype", "key and value must share a float dtype"),
    ("slot_dtype", "int32 or int64"),
    ("heads", "do not match"),
    ("slot_len", "num_tokens"),
    ("cache_rank", "num_blocks, block_size"),
])
def test_write_kv_cache_rejects_bad_args(case, match):
    key = torch.randn(4, 2, 64)
    k_cache = torch.zeros(3, 8, 2, 64)
    slots = torch.arange(4)
    args = dict(key=key, value=key.clone(), k_cache=k_cache, v_cache=k_cache.clone(),
                slot_mapping=slots)
    if case == "dtype":
        args["value"] = key.half()
    elif case == "slot_dtype":
        args["slot_mapping"] = slots.float()
    elif case == "heads":
        args["key"] = args["value"] = torch.randn(4, 1, 64)
    elif case == "slot_len":
        args["slot_mapping"] = slots[:3]
    elif case == "cache_rank":
        args["k_cache"] = args["v_cache"] = k_cache.flatten(0, 1)
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**args)
