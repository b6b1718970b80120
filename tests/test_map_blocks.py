"""raggedfn.map on pair states run per sample on row blocks (raggedfn/_map/running/_blocks.py).

Every function is compared with the per-sample loop, values and gradients, float64,
with blocks small enough that every sample of more than a row or two is cut."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn._map.running import _blocks
from tests.test_map_chunks import LENGTHS, C, block, params, tokens

BIG = 1 << 40  # chunk_elements: one group of samples


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(9)
        self.up = torch.nn.Linear(C, 3 * C, dtype=torch.float64)
        self.down = torch.nn.Linear(3 * C, C, dtype=torch.float64)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64) / 3


MLP = Mlp()


def mixed(s, d):
    """A per-sample fixed-size operand (``d``) and captured weights in the chain, means
    and sums with keepdim, a value read after the chain (``p``, reduced over its first
    axis: not a block op; a ragged ``[N, C]`` output), a log-softmax chain ending in
    ``@ s``."""
    p = s[:, None] * s[None] + d - s  # s: [N, C] broadcast along the first axis
    h = torch.tanh(MLP.up(p))
    q = MLP.down(h).mean(-1, keepdim=True) + p.sum(-1, keepdim=True)
    a = torch.log_softmax(q.squeeze(-1), -1)
    r = torch.exp(a) * 2.0 - a
    return r @ s, p.sum(0)


def cross(x, y):
    """Pairs of two ragged inputs of different lengths: ``[N, M, C]``, softmax over M."""
    p = torch.tanh(x[:, None] - 0.5 * y[None])
    w = torch.softmax(MLP.down(F.gelu(MLP.up(p))).sum(-1), -1)
    return w @ y


def _check(fn, args, in_dims, n_out=1):
    report = raggedfn.map_report(fn, *args, in_dims=in_dims, chunk_elements=BIG)
    assert report.batched.get("row blocks", 0) >= 1, report.batched
    got = raggedfn.map(fn, *args, in_dims=in_dims, chunk_elements=BIG)
    want = loop(fn, *args)
    if n_out == 1:
        assert_same(got, want)
    else:
        for k in range(n_out):
            assert_same(got[k], [w[k] for w in want])


def _flat(out):
    parts = out if isinstance(out, tuple) else (out,)
    return [p.values if isinstance(p, raggedfn.Ragged) else p for p in parts]


@pytest.fixture(params=[16, 100, 1 << 18], ids=["16", "100", "default"])
def tile(request, monkeypatch):
    from raggedfn._map.running import _tiles

    monkeypatch.setattr(_blocks, "TILE_ELEMENTS", request.param)
    monkeypatch.setattr(_blocks, "MIN_FILL", BIG)  # blocks for samples of any size
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)  # blocks smaller than the weights
    return request.param


def test_pair_block_on_row_blocks_equals_the_loop(tile):
    x = tokens(LENGTHS, seed=21)
    ps = params(seed=22)
    dims = (0, None, None, None, None)
    _check(block, (x, *ps), dims)
    values = x.values.detach().requires_grad_()
    leaves = [values, *(p.detach().requires_grad_() for p in ps)]
    out = raggedfn.map(
        block,
        raggedfn.from_lengths(values, x.lengths),
        *leaves[1:],
        in_dims=dims,
        chunk_elements=BIG,
    ).values
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    got = torch.autograd.grad((out * weights).sum(), leaves)
    per = torch.cat([block(s, *leaves[1:]) for s in values.split(x.lengths.tolist())])
    want = torch.autograd.grad((per * weights).sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_mixed_operands_on_row_blocks_equal_the_loop(tile):
    x = tokens(LENGTHS, seed=23)
    gen = torch.Generator().manual_seed(24)
    d = torch.randn(len(LENGTHS), C, generator=gen, dtype=torch.float64)
    report = raggedfn.map_report(mixed, x, d, chunk_elements=BIG)
    assert report.batched.get("row blocks", 0) >= 1, report.batched
    got = raggedfn.map(mixed, x, d, chunk_elements=BIG)
    want = [mixed(s, d[i]) for i, s in enumerate(x.values.split(x.lengths.tolist()))]
    assert_same(got[0], [w[0] for w in want])
    assert_same(got[1], [w[1] for w in want])
    values = x.values.detach().requires_grad_()
    dd = d.detach().requires_grad_()
    leaves = [values, dd, *MLP.parameters()]
    outs = _flat(
        raggedfn.map(mixed, raggedfn.from_lengths(values, x.lengths), dd, chunk_elements=BIG)
    )
    weights = [torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t) for t in outs]
    got_g = torch.autograd.grad(
        sum((t * w).sum() for t, w in zip(outs, weights, strict=True)), leaves
    )
    per = [mixed(s, dd[i]) for i, s in enumerate(values.split(x.lengths.tolist()))]
    ref = [torch.cat([t[0] for t in per]), torch.cat([t[1] for t in per])]
    want_g = torch.autograd.grad(
        sum((t * w).sum() for t, w in zip(ref, weights, strict=True)), leaves
    )
    for g, w in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(g, w)


def test_cross_pairs_on_row_blocks_equal_the_loop(tile):
    x = tokens(LENGTHS, seed=25)
    y = tokens((2, 4, 0, 3, 6, 1, 5, 2), seed=26)
    _check(cross, (x, y), 0)
    xv = x.values.detach().requires_grad_()
    yv = y.values.detach().requires_grad_()
    leaves = [xv, yv, *MLP.parameters()]
    out = raggedfn.map(
        cross,
        raggedfn.from_lengths(xv, x.lengths),
        raggedfn.from_lengths(yv, y.lengths),
        chunk_elements=BIG,
    ).values
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    got = torch.autograd.grad((out * weights).sum(), leaves)
    per = torch.cat(
        [
            cross(a, b)
            for a, b in zip(xv.split(x.lengths.tolist()), yv.split(y.lengths.tolist()), strict=True)
        ]
    )
    want = torch.autograd.grad((per * weights).sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_row_blocks_gradcheck(monkeypatch):
    from raggedfn._map.running import _tiles

    monkeypatch.setattr(_blocks, "TILE_ELEMENTS", 30)
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)
    x = tokens((3, 2, 0, 4), seed=27)
    ps = [p.detach().requires_grad_() for p in params(seed=28)]
    values = x.values.detach().requires_grad_()

    def fn(v, w1, b1, w2, b2):
        xr = raggedfn.from_lengths(v, x.lengths)
        return raggedfn.map(block, xr, w1, b1, w2, b2, in_dims=(0, None, None, None, None)).values

    assert torch.autograd.gradcheck(fn, (values, *ps))
    assert torch.autograd.gradgradcheck(fn, (values, *ps))


def test_chains_that_blocks_cannot_hold_run_the_ordinary_way():
    """A reduction over the first axis, a value broadcast from inside the chain along
    the first axis: no block op (the results still equal the loop's)."""

    def first_axis(s):
        p = torch.tanh(s[:, None] + s[None])
        q = p * 2.0 + p.sum(0)  # sum over the rows: needs every block
        return torch.softmax(q.sum(-1), -1) @ s

    x = tokens(LENGTHS, seed=29)
    plan_report = raggedfn.map_report(first_axis, x, chunk_elements=BIG)
    assert_same(raggedfn.map(first_axis, x, chunk_elements=BIG), loop(first_axis, x))
    assert "aten.sum.dim_IntList" in plan_report.batched


def _weights_times_themselves(s):
    p = torch.tanh(s[:, None] * s[None])
    a = torch.softmax(p.sum(-1), -1)  # [N, N], a value of the chain
    return (a * 2.0) @ a  # a read whole as matmul's right operand: not one block's rows


def test_a_chain_value_read_whole_ends_the_chain(tile):
    """A value the chain makes exists only block by block: a step reading it whole (the
    right operand of ``matmul``) is not a member; the chain before it still runs on
    blocks."""
    x = tokens(LENGTHS, seed=30)
    _check(_weights_times_themselves, (x,), 0)


def test_blocks_are_not_used_when_every_block_would_read_large_weights(monkeypatch):
    monkeypatch.setattr(_blocks, "TILE_ELEMENTS", 100)  # < 8 x the 148 weight elements
    x = tokens(LENGTHS, seed=30)
    ps = params(seed=31)
    dims = (0, None, None, None, None)
    report = raggedfn.map_report(block, x, *ps, in_dims=dims, chunk_elements=BIG)
    assert "row blocks" not in report.batched, report.batched
    assert_same(raggedfn.map(block, x, *ps, in_dims=dims, chunk_elements=BIG), loop(block, x, *ps))
    monkeypatch.setattr(_blocks, "TILE_ELEMENTS", 8 * 148)
    report = raggedfn.map_report(block, x, *ps, in_dims=dims, chunk_elements=BIG)
    assert report.batched.get("row blocks", 0) >= 1, report.batched


def test_only_samples_large_enough_take_blocks():
    """By default blocks need samples whose widest value averages TILE_ELEMENTS / MIN_FILL
    elements (below, the loop over samples costs more than the caches save); smaller
    ones run as flat row tiles or op by op. Both equal the loop."""
    ps = [p.float() for p in params(seed=3)]
    gen = torch.Generator().manual_seed(4)
    for n, blocks in ((6, 0), (70, 1)):  # widest value 70 * 70 * 4C = 78K elements
        x = raggedfn.from_list([torch.randn(m, C, generator=gen) for m in (n, n + 1)])
        report = raggedfn.map_report(block, x, *ps, in_dims=(0, None, None, None, None))
        assert report.batched.get("row blocks", 0) == blocks, (n, report.batched)
        got = raggedfn.map(block, x, *ps, in_dims=(0, None, None, None, None))
        assert_same(got, loop(block, x, *ps), rtol=1e-5, atol=1e-5)


def test_blocks_over_samples_without_rows_keep_the_autograd_link(monkeypatch):
    """Program 278 of the oracle's seed 7: every sample empty after a mask, the pair
    chain's output was a fresh empty tensor that did not require grad (the loop's does,
    with zero gradients)."""
    monkeypatch.setattr(_blocks, "MIN_FILL", BIG)  # blocks whatever the samples' size

    def masked_pairs(t):
        h = t[t[:, 0] > 0]
        h = h[:, None, :] * h[None, :, :]
        h = F.log_softmax(h, -1)
        return (h * 2 + 1).sum((0, 1))

    values = -torch.rand(3, C, dtype=torch.float64) - 1  # every row masked out
    values.requires_grad_()
    x = raggedfn.from_lengths(values * 1, torch.tensor([2, 1, 0]))
    out = raggedfn.map(masked_pairs, x)
    assert out.requires_grad
    want = torch.stack([masked_pairs(s) for s in raggedfn.unbind(x)])
    torch.testing.assert_close(out, want)
    weights = torch.arange(1.0, out.numel() + 1, dtype=out.dtype).view_as(out)
    (got,) = torch.autograd.grad((out * weights).sum(), values, retain_graph=True)
    (expected,) = torch.autograd.grad((want * weights).sum(), values)
    torch.testing.assert_close(got, expected)


def test_blocks_refused_for_small_samples_leave_the_chain_to_the_flat_tiles(monkeypatch):
    """Samples below MIN_FILL: the block refuses before running anything and the same
    chain runs on flat row tiles (``_interpret``'s fallthrough), equal to the loop."""
    from raggedfn._map.running import _tiles

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 100)  # flat tiles of a few rows
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)
    ps = params(seed=5)
    x = tokens([6, 7, 5], seed=6)
    dims = (0, None, None, None, None)
    report = raggedfn.map_report(block, x, *ps, in_dims=dims, chunk_elements=BIG)
    assert report.batched.get("row blocks", 0) == 0, report.batched
    assert report.batched.get("row tiles", 0) >= 1, report.batched
    assert_same(raggedfn.map(block, x, *ps, in_dims=dims, chunk_elements=BIG), loop(block, x, *ps))
