"""The fused C++ LoRA kernel (kernels/lora_cpu.py, csrc/lora.cpp) against a token-by-token float64
definition and the torch path (lora_ops.sgmv_add): float32 and bfloat16, ranks 8/16/64, mixed
slots with base-model tokens, one-token and many-token segments, odd K / N, fused sites of
several parts, both thread layouts; and the checks that refuse bad arguments."""
from __future__ import annotations

import pytest
import torch

from lora_cases import case, definition_and_bound, fused

from kvmesh.kernels import cpu_kernels, lora_cpu, lora_ops

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ CPU kernels here")

LAYOUTS = {
    "one-token-segments": [1, -1, 0, 2, 3, -1],
    "decode-mixed": [1, -1, 0, 2, 1, -1, 0, 2, 2, 3, 3, 0],
    "prefill-runs": [2] * 21 + [-1] * 5 + [0] * 37 + [1] * 3,    # blocks of 8 and remainders
    "one-adapter": [3] * 9,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fused_kernel_matches_the_float64_definition_to_rounding(layout, rank, dtype):
    token_slots = LAYOUTS[layout]
    args = case(token_slots, 77, 45, rank, dtype=dtype)           # odd K and N: every tail
    x, a, bt, base = args[:4]
    got = fused(*args)
    want, bound = definition_and_bound(x, a, bt, base, token_slots, dtype)
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    untouched = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[untouched], base[untouched])
    if dtype == torch.float32:
        # the torch path is held to the same bound, so the two differ by at most twice it
        x, a, bt, base, rows, starts, seg_slots = args[:7]
        torch_out = base.clone()
        lora_ops.sgmv_add(x, a, bt.transpose(1, 2), torch_out, rows, starts, seg_slots)
        assert bool(((got.double() - torch_out.double()).abs() <= 2 * bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("token_slots", [[0] * 8, [i % 3 for i in range(64)]], ids=["one-block", "many-blocks"])
def test_fused_sites_of_three_parts_on_both_thread_layouts(token_slots, threads, dtype):
    """q/k/v-like: 3 parts of rank 64 over 1000 columns. On 4 threads, one block of 8 tokens
    takes the split-columns layout (fewer blocks than threads), 64 tokens of 3 slots the
    per-block one; on 1 thread both run on the calling thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        args = case(token_slots, 576, 1000, 64, parts=3, dtype=dtype, seed=1)
        got = fused(*args)
    finally:
        torch.set_num_threads(before)
    want, bound = definition_and_bound(*args[:4], token_slots, dtype)
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_of_lower_rank_and_untouched_slots_skip_their_zero_ranks(dtype):
    """R = 16 slots holding adapters of rank 16, 8, 3 and 0 (an adapter that leaves this site
    alone): each computes only its own ranks, to the same result as the whole R."""
    token_slots = [0, 1, 2, 3, -1, 1, 1, 2, 3, 0] + [1] * 11 + [3] * 9
    args = case(token_slots, 77, 45, 16, parts=3, dtype=dtype, ranks=[16, 8, 3, 0])
    got = fused(*args)
    want, bound = definition_and_bound(*args[:4], token_slots, dtype)
    assert bool(((got.double() - want).abs() <= bound).all())
    untouched = [t for t, s in enumerate(token_slots) if s in (-1, 3)]    # rank 0: skipped
    assert torch.equal(got[untouched], args[3][untouched])
    full = fused(*args[:8], torch.full((4,), 16, dtype=torch.int64))      # every rank, zeros too
    assert bool(((full.double() - want).abs() <= bound).all())


def test_strided_x_and_out_rows_are_read_and_written_in_place():
    """A site's x and out can be column slices of wider tensors (unit stride along the row)."""
    args = list(case([0, 1, -1, 1], 40, 24, 8))
    wide_x = torch.zeros(4, 50)
    wide_x[:, 5:45] = args[0]
    wide_out = torch.zeros(4, 30)
    wide_out[:, 3:27] = args[3]
    x, out = wide_x[:, 5:45], wide_out[:, 3:27]
    lora_cpu.sgmv_add(x, args[1], args[2], out, args[4], torch.tensor(args[5]), torch.tensor(args[6]),
                      args[7], args[8])
    assert torch.equal(out, fused(*args))
    assert torch.equal(wide_out[:, :3], torch.zeros(4, 3)) and torch.equal(wide_out[:, 27:], torch.zeros(4, 3))


def test_applies_only_to_what_the_kernel_takes():
    x, a, bt, base = case([0], 16, 16, 8)[:4]
    assert lora_cpu.applies(x, a, bt, base)
    assert not lora_cpu.applies(x.half(), a.half(), bt.half(), base.half())       # float16: torch
    assert not lora_cpu.applies(x, a, bt.transpose(1, 2).contiguous().transpose(1, 2), base)  # strided B
    assert not lora_cpu.applies(x, a.double(), bt, base)                           # mixed dtypes
    big = torch.zeros(2, 257, 16)
    assert not lora_cpu.applies(x, big, torch.zeros(2, 257, 16), base)             # over 256 rank rows


@pytest.mark.parametrize("bad, message", [
    ({"slots": [4]}, "slot out of range"),
    ({"rows": [0, 9]}, "row out of range"),
    ({"cols": [0, 10]}, "part_cols must run from 0 to N"),
    ({"cols": [0, 12, 8, 16]}, "part_cols must ascend"),
    ({"starts": [0, 1]}, "seg_starts must run from 0 to len"),
    ({"rows_dtype": torch.int32}, "contiguous int64"),
    ({"ranks": [8, 9, 8, 8]}, "slot_ranks must be in"),
    ({"ranks": [8, 8]}, "one rank per slot"),
])
def test_bad_arguments_are_refused_and_out_is_untouched(bad, message):
    x, a, bt, base, rows, starts, seg_slots, cols, ranks = case([0, 0, -1], 16, 16, 8, parts=1)
    rows = torch.tensor(bad.get("rows", rows.tolist()), dtype=bad.get("rows_dtype", torch.int64))
    if "cols" in bad:
        a, bt = torch.zeros(4, 3 * 8, 16), torch.zeros(4, 3 * 8, 16)
        if len(bad["cols"]) == 2:
            a, bt = torch.zeros(4, 8, 16), torch.zeros(4, 8, 16)
    out = base.clone()
    with pytest.raises(RuntimeError, match=message):
        lora_cpu.sgmv_add(x, a, bt, out, rows, torch.tensor(bad.get("starts", starts)),
                          torch.tensor(bad.get("slots", seg_slots)), torch.tensor(bad.get("cols", cols.tolist())),
                          torch.tensor(bad.get("ranks", ranks.tolist())))
    assert torch.equal(out, base)
