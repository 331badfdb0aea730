"""LoRA's grouped shrink / expand (SGMV): the torch path and the Triton pair (in the interpreter
here) against a token-by-token float64 definition, over segment layouts, ranks and dtypes."""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvmesh.engine.lora.mapping import _pad  # noqa: E402
from kvmesh.kernels import lora_ops, lora_triton  # noqa: E402


def untouched_rows(token_slots):
    return [t for t, s in enumerate(token_slots) if s < 0]

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _case(tokens, in_dim, out_dim, rank, slots, token_slots, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_dim, generator=g).to(dtype)
    a = (torch.randn(slots, rank, in_dim, generator=g) / in_dim ** 0.5).to(dtype)
    b = (torch.randn(slots, out_dim, rank, generator=g) / rank ** 0.5).to(dtype)
    base = torch.randn(tokens, out_dim, generator=g).to(dtype)
    ts = torch.tensor(token_slots)
    lora_rows = torch.nonzero(ts >= 0).flatten()
    order = torch.argsort(ts[lora_rows], stable=True)
    rows = lora_rows[order]
    sorted_slots = ts[rows].tolist()
    starts = [0] + [i for i in range(1, len(sorted_slots)) if sorted_slots[i] != sorted_slots[i - 1]]
    starts.append(len(sorted_slots))
    seg_slots = [sorted_slots[s] for s in starts[:-1]]
    return x, a, b, base, rows, starts, seg_slots


def _definition(x, a, b, base, token_slots):
    """Token by token in float64: base + (x A_s^T) B_s^T for tokens with a slot, base otherwise."""
    out = base.double().clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            out[t] += (x[t].double() @ a[s].double().t()) @ b[s].double().t()
    return out


LAYOUTS = {
    # token slots per batch row (-1: base model)
    "one-adapter": [0] * 7,
    "decode-mixed": [1, -1, 0, 2, 1, -1, 0, 2, 2],
    "prefill-runs": [2] * 20 + [-1] * 5 + [0] * 37 + [1] * 3,
    "base-gaps": [-1, -1, 3, -1, 3, 3, -1],
    "sparse-slots": [3, 1, 3, 1, -1, 3],          # slots 1 and 3: the weights gathered
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rank", [8, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_and_triton_sgmv_match_the_definition(layout, rank, dtype):
    token_slots = LAYOUTS[layout]
    x, a, b, base, rows, starts, seg_slots = _case(len(token_slots), 64, 96, rank, 4, token_slots, dtype)
    want = _definition(x, a, b, base, token_slots)
    tol = TOL[dtype] * want.abs().max().item()

    got_torch = base.clone()
    lora_ops.sgmv_add(x, a, b, got_torch, rows, starts, seg_slots)       # gathered rows
    assert (got_torch.double() - want).abs().max().item() <= tol
    runs = [(int(rows[s]), int(rows[e - 1]) + 1) for s, e in zip(starts, starts[1:])]
    if all(hi - lo == e - s for (lo, hi), s, e in zip(runs, starts, starts[1:])):
        got_runs = base.clone()                                          # views of x and out
        lora_ops.sgmv_add(x, a, b, got_runs, rows, starts, seg_slots, runs)
        assert (got_runs.double() - want).abs().max().item() <= tol
        assert torch.equal(got_runs, got_torch)
    if len(seg_slots) > 1:                                               # two bmm over [S, L]
        import numpy as np
        padded = _pad(rows.numpy(), np.asarray(starts), seg_slots, max(e - s for s, e in zip(starts, starts[1:])))
        got_bmm = base.clone()
        lora_ops.sgmv_add(x, a, b, got_bmm, rows, starts, seg_slots, padded=padded)
        assert (got_bmm.double() - want).abs().max().item() <= tol
        assert torch.equal(got_bmm[untouched_rows(token_slots)], base[untouched_rows(token_slots)])

    got_triton = base.clone()
    seg_starts = torch.tensor(starts, dtype=torch.int32)
    seg_slot_t = torch.tensor(seg_slots, dtype=torch.int32)
    max_len = max(e - s for s, e in zip(starts, starts[1:]))
    y2 = lora_triton.sgmv_shrink(x, a, rows, seg_starts, seg_slot_t, max_len)
    assert y2.dtype == torch.float32 and y2.shape == (rows.shape[0], rank)
    lora_triton.sgmv_expand(y2, b, got_triton, rows, seg_starts, seg_slot_t, max_len)
    assert (got_triton.double() - want).abs().max().item() <= tol
    # rows without an adapter are left exactly as they were
    untouched = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got_triton[untouched], base[untouched])
    assert torch.equal(got_torch[untouched], base[untouched])


def test_the_triton_launcher_checks_its_arguments():
    x = torch.zeros(4, 64)
    a = torch.zeros(2, 8, 32)                      # in 32 != 64
    rows = torch.arange(4)
    with pytest.raises(ValueError, match="shape mismatch"):
        lora_triton.sgmv_shrink(x, a, rows, torch.tensor([0, 4], dtype=torch.int32),
                                torch.tensor([0], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="int32"):
        lora_triton.sgmv_shrink(x, torch.zeros(2, 8, 64), rows, torch.tensor([0, 4]),
                                torch.tensor([0], dtype=torch.int32), 4)
