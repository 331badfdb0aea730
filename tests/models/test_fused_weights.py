"""fused_weights (engine/layers/linear.py): q/k/v (gate/up) in one buffer, built once, reused by
every forward, rebuilt when a projection's weight is replaced."""
from __future__ import annotations

import torch
from torch import nn

from kvmesh.engine.layers.linear import fused_weights


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 3, bias=False), nn.Linear(4, 2, bias=True)
        self._ab = None


def test_fused_once_then_reused_and_in_place_writes_land_in_the_buffer():
    m = _Holder()
    wa, wb, bb = m.a.weight.detach().clone(), m.b.weight.detach().clone(), m.b.bias.detach().clone()
    w, b = fused_weights(m, (m.a, m.b), "_ab")
    assert torch.equal(w, torch.cat([wa, wb])) and torch.equal(b, torch.cat([torch.zeros(3), bb]))
    again = fused_weights(m, (m.a, m.b), "_ab")
    assert again[0] is w and again[1] is b                       # nothing rebuilt
    with torch.no_grad():
        m.b.weight.mul_(2.0)                                     # e.g. load_state_dict's copy_
    assert torch.equal(fused_weights(m, (m.a, m.b), "_ab")[0], torch.cat([wa, 2 * wb]))


def test_a_replaced_weight_is_noticed_and_the_buffer_rebuilt():
    m = _Holder()
    w, _ = fused_weights(m, (m.a, m.b), "_ab")
    m.a.weight = nn.Parameter(torch.full((3, 4), 7.0))          # a new tensor (assign, .to)
    w2, _ = fused_weights(m, (m.a, m.b), "_ab")
    assert w2 is not w and torch.equal(w2[:3], torch.full((3, 4), 7.0))
    assert torch.equal(w2[3:], w[3:])
    assert m.a.weight.data_ptr() == w2.data_ptr()               # a view of the new buffer
