"""raggedfn.map's softmax over the last stored ragged axis of a pair state: torch's
kernel once per sample block (``_prims.block_softmax``), forward, backward and double
backward against the per-sample loop (float64); other axes keep the segment form."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same
from raggedfn import _prims
from raggedfn._map.rules import _reduce

LENGTHS = (3, 0, 5, 1, 4)
H = 2


def scores(t):
    return (t[:, None, :] * t[None, :, :]).sum(-1, keepdim=True) * torch.arange(1.0, H + 1)


FUNCTIONS = {
    "keys": lambda t: torch.softmax(scores(t), 1),  # [n, n, H] over keys: blocks
    "keys_last": lambda t: torch.softmax(scores(t).sum(-1), -1),  # [n, n]: blocks
    "queries": lambda t: torch.softmax(scores(t), 0),  # the first ragged axis: segments
    "rectangular": lambda t: torch.softmax(t @ t[1:].T, -1),  # [n, n - 1]: blocks
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_pair_softmax_equals_the_loop_to_second_order(name, monkeypatch):
    f = FUNCTIONS[name]
    monkeypatch.setattr(_reduce, "BLOCK_SOFTMAX_MIN", 0)
    calls = []
    real = _prims.block_softmax
    monkeypatch.setattr(_prims, "block_softmax", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(sum(LENGTHS), 3, generator=gen, dtype=torch.float64)
    values.requires_grad_()
    x = raggedfn.from_lengths(values, torch.tensor(LENGTHS))
    report = raggedfn.map_report(f, x)
    assert report.fully_batched, report
    assert bool(calls) == (name != "queries"), calls
    want = [f(s) for s in values.split(list(LENGTHS))]
    assert_same(report.output, want)

    weights = torch.linspace(-1, 1, report.output.values.numel(), dtype=torch.float64)
    flat_want = torch.cat([w.flatten() for w in want])
    got_g = torch.autograd.grad(
        (report.output.values.flatten() * weights).sum(), values, create_graph=True
    )[0]
    want_g = torch.autograd.grad((flat_want * weights).sum(), values, create_graph=True)[0]
    torch.testing.assert_close(got_g, want_g)
    got_gg = torch.autograd.grad(got_g.pow(2).sum(), values)[0]
    want_gg = torch.autograd.grad(want_g.pow(2).sum(), values)[0]
    torch.testing.assert_close(got_gg, want_gg)


def test_block_softmax_first_order_backward_equals_torch():
    """The fused backward (no graph recorded) against torch's softmax per block."""
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(4 + 9 + 6, H, generator=gen, dtype=torch.float64, requires_grad=True)
    blocks = ((0, 4, 2), (4, 4, 0), (4, 13, 3), (13, 19, 1))
    out = _prims.block_softmax(values, blocks)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, values, grad)
    pieces = [values[a:b].view(r, -1, H).softmax(1).reshape(-1, H) for a, b, r in blocks if b > a]
    want_out = torch.cat(pieces)
    (want,) = torch.autograd.grad(want_out, values, grad)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(got, want)
