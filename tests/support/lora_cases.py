"""LoRA kernel cases for the C++ kernel's tests (tests/kernels/test_lora_cpu.py, every ISA path in
test_cpu_paths.py): random x, A, Bt (block-diagonal over the parts), the mapping's arrays, and
the float64 definition with its derived error bound."""
from __future__ import annotations

import torch

from kvmesh.kernels import lora_cpu

U32 = 2.0 ** -24     # unit roundoff of float32
U_BF16 = 2.0 ** -8   # of bfloat16


def case(token_slots, k, n, rank, parts=1, slots=4, dtype=torch.float32, seed=0, ranks=None):
    """x, A, Bt (block-diagonal over `parts`), base out, the mapping's arrays, the part columns and
    the slots' ranks (`ranks`: per slot, default all `rank`; a slot of rank r < R has zeros past
    its first r ranks of each part, as LoRASite.set_slot leaves them)."""
    g = torch.Generator().manual_seed(seed)
    rt = parts * rank
    x = torch.randn(len(token_slots), k, generator=g).to(dtype)
    a = (torch.randn(slots, rt, k, generator=g) / k ** 0.5).to(dtype)
    bt = (torch.randn(slots, rt, n, generator=g) / rank ** 0.5)
    cols = [n * p // parts for p in range(parts + 1)]
    for p in range(parts):          # part p's columns see only its own ranks
        bt[:, :p * rank, cols[p]:cols[p + 1]] = 0
        bt[:, (p + 1) * rank:, cols[p]:cols[p + 1]] = 0
    ranks = [rank] * slots if ranks is None else ranks
    for slot, r in enumerate(ranks):
        for p in range(parts):
            a[slot, p * rank + r:(p + 1) * rank] = 0
            bt[slot, p * rank + r:(p + 1) * rank] = 0
    bt = bt.to(dtype)
    base = torch.randn(len(token_slots), n, generator=g).to(dtype)
    ts = torch.tensor(token_slots, dtype=torch.int64)
    lora_rows = torch.nonzero(ts >= 0).flatten()
    rows = lora_rows[torch.argsort(ts[lora_rows], stable=True)]
    sorted_slots = ts[rows].tolist()
    starts = [0] + [i for i in range(1, len(sorted_slots)) if sorted_slots[i] != sorted_slots[i - 1]]
    starts.append(len(sorted_slots))
    seg_slots = [sorted_slots[s] for s in starts[:-1]]
    return (x, a, bt, base, rows, starts, seg_slots, torch.tensor(cols, dtype=torch.int64),
            torch.tensor(ranks, dtype=torch.int64))


def fused(x, a, bt, base, rows, starts, seg_slots, cols, ranks):
    out = base.clone()
    assert lora_cpu.applies(x, a, bt, out)
    lora_cpu.sgmv_add(x, a, bt, out, rows, torch.tensor(starts, dtype=torch.int64),
                      torch.tensor(seg_slots, dtype=torch.int64), cols, ranks)
    return out


def definition_and_bound(x, a, bt, base, token_slots, dtype):
    """(float64 result, elementwise error bound). Float32 sums over K then R (+ the add to out) err
    by at most gamma_{K+R+1} = (K+R+1)u / (1 - (K+R+1)u) times the sum of the terms' magnitudes
    (Higham, Accuracy and Stability, 3.1); bfloat16 adds its one rounding of the result."""
    want, mag = base.double().clone(), base.double().abs()
    for t, s in enumerate(token_slots):
        if s >= 0:
            xa = x[t].double() @ a[s].double().t()
            want[t] += xa @ bt[s].double()
            mag[t] += ((x[t].double().abs() @ a[s].double().abs().t()) @ bt[s].double().abs())
    n = x.shape[1] + a.shape[1] + 1
    bound = n * U32 / (1 - n * U32) * mag
    if dtype == torch.bfloat16:
        bound = bound + U_BF16 * (want.abs() + bound)
    return want, bound
