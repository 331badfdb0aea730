"""The decode split rule, its fixed count per CUDA-graph size, and the preallocated workspace.

The rule and the planner are host arithmetic (exact values, no GPU). The kernel checks run in the
Triton interpreter: a split count fixed as a graph fixes it, at contexts from 1 token to many
splits, through `triton_ops.paged_attention` with the step's `decode_launch`, reading partials
from a reused NaN-filled workspace (stale partials must never be read).
"""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.kernels import paged_attention, reference, triton_ops  # noqa: E402
from kvmesh.kernels.decode_plan import (DecodeLaunch, DecodePlanner, DecodeWorkspace,  # noqa: E402
                                        decode_splits, split_counts)

H100_SMS = 132


@pytest.mark.parametrize("num_seqs,ctx,expected", [
    (1, 512, 1),        # short context: one split, one launch
    (1, 1023, 1),       # still under two splits of 512
    (1, 1024, 2),
    (1, 8192, 16),      # capped by the context (16 x 512)
    (1, 32768, 64),     # 2 waves / 8 KV heads = 33 programs a sequence, rounded up
    (16, 2048, 4),      # cdiv(264, 128) = 3 -> 4
    (64, 8192, 1),      # 512 programs already fill the GPU
])
def test_decode_splits_rule(num_seqs, ctx, expected):
    assert decode_splits(num_seqs, 8, ctx, H100_SMS) == expected


def test_decode_splits_rejects_zero():
    with pytest.raises(ValueError, match="num_sms"):
        decode_splits(1, 8, 512, 0)


def test_graph_split_count_is_fixed_per_size_and_covers_every_context():
    """A graph of size b always launches graph_splits[b] splits whatever the context, that is
    the most any eager step of b sequences would use, and the workspace holds it."""
    planner = DecodePlanner(max_num_seqs=32, num_heads=32, num_kv_heads=8, head_dim=128,
                            max_model_len=8192, num_sms=H100_SMS, device="cpu")
    assert planner.graph_splits == split_counts(32, 8, 8192, H100_SMS)
    assert [planner.graph_splits[b] for b in (1, 2, 4, 8, 16, 32)] == [16, 16, 16, 8, 4, 2]
    for b in range(1, 33):
        fixed = planner.splits(b, 8192)
        for ctx in (1, 100, 511, 512, 2048, 4097, 8192):
            assert planner.splits(b, ctx, graph=True) == fixed
            eager = planner.splits(b, ctx)
            assert eager <= fixed and eager in planner.variants()
    assert planner.splits(1, 600) == 1                 # eager, short context: one launch
    assert planner.variants() == [1, 2, 4, 8, 16]
    # the workspace: the most (seq, split) rows any size asks for, x heads x head_dim floats
    assert planner.rows == max(b * s for b, s in planner.graph_splits.items())
    assert planner.workspace.part.numel() == planner.rows * 32 * 128
    assert planner.workspace.lse.numel() == planner.rows * 32


def test_planner_never_outgrows_its_workspace():
    planner = DecodePlanner(max_num_seqs=4, num_heads=8, num_kv_heads=2, head_dim=64,
                            max_model_len=4096, num_sms=H100_SMS, device="cpu")
    assert planner.rows == 32                           # b = 4: 8 splits, capped by the context
    # a batch past max_num_seqs (a tensor-parallel worker): fewer splits, within the rows
    assert planner.splits(9, 4096) == 2
    # a context past max_model_len: no more splits than start-up warmed
    assert planner.variants() == [1, 2, 4, 8]
    assert planner.splits(1, 1 << 20) == 8 and decode_splits(1, 2, 1 << 20, H100_SMS) == 64
    launch = planner.launch(9, 4096)
    assert (launch.num_splits, launch.min_split_tokens) == (2, 512)
    assert launch.workspace is planner.workspace


def test_planner_without_splits_has_no_workspace():
    planner = DecodePlanner(max_num_seqs=8, num_heads=8, num_kv_heads=8, head_dim=64,
                            max_model_len=1000, num_sms=H100_SMS, device="cpu")
    assert planner.workspace is None and planner.variants() == [1]


def test_workspace_too_small_is_a_clear_error():
    ws = DecodeWorkspace.allocate(rows=4, num_heads=2, head_dim=16, device="cpu")
    part, lse = ws.views(2, 2, 2, 16)
    assert part.shape == (2, 2, 2, 16) and lse.shape == (2, 2, 2)
    assert part.data_ptr() == ws.part.data_ptr()
    with pytest.raises(ValueError, match="this decode needs 16"):
        ws.views(2, 2, 4, 16)


def _decode_case(kx, lens, seed):
    return kx.make_paged_case([1] * len(lens), lens, num_heads=4, num_kv_heads=2, head_dim=32,
                              block_size=8, dtype=torch.float32, seed=seed)


def test_fixed_splits_reused_workspace_exact_at_every_context(kx):
    """NUM_SPLITS fixed at 4 (as a graph fixes it), min 32 tokens a split: a 1-token padding
    row and short contexts use one split (written directly), longer ones 2-4; the workspace is
    allocated once, NaN-filled, and two steps reuse it; a call allocates only its output."""
    ws = DecodeWorkspace.allocate(rows=6 * 4, num_heads=4, head_dim=32, device="cpu")
    ws.part.fill_(float("nan"))
    ws.lse.fill_(float("nan"))
    launch = DecodeLaunch(num_splits=4, min_split_tokens=32, workspace=ws)
    empties = []
    for step, lens in enumerate(([1, 20, 33, 64, 130, 1], [200, 1, 31, 97])):
        case = _decode_case(kx, lens, seed=step)
        case.meta.decode_launch = launch
        k_ref, v_ref = case.clean_caches()
        expected = reference.paged_attention(case.query, k_ref, v_ref, case.meta, case.scale)
        with kx.poisoned():
            poison = torch.empty
            torch.empty = lambda *a, **k: empties.append(a) or poison(*a, **k)
            try:
                out = triton_ops.paged_attention(case.query, case.k_cache, case.v_cache, case.meta,
                                                 case.scale)
            finally:
                torch.empty = poison
        kx.assert_close(out, expected)
    assert [tuple(a[0]) for a in empties] == [(6, 4, 32), (4, 4, 32)]   # the outputs only


def test_one_split_is_one_launch(kx, monkeypatch):
    """num_splits 1: the split kernel writes the output; the merge kernel is never launched."""
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel was launched for a one-split decode")

    monkeypatch.setattr(paged_attention, "_decode_reduce_kernel", NoLaunch())
    case = _decode_case(kx, [3, 50], seed=7)
    case.meta.decode_launch = DecodeLaunch(num_splits=1, min_split_tokens=512)
    k_ref, v_ref = case.clean_caches()
    with kx.poisoned():
        out = triton_ops.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    kx.assert_close(out, reference.paged_attention(case.query, k_ref, v_ref, case.meta, case.scale))
