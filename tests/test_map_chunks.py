"""raggedfn.map on pair states: groups of samples (chunk_elements), ragged contractions
through raggedfn.matmul, index_select gathers, values released after their last use.
Every result is compared with the per-sample loop, values and gradients, float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn import RaggedError
from raggedfn._map.caching import _warm
from raggedfn._map.running import _chunked, _interpret
from raggedfn._map.running._chunks import group_bounds

C = 4
LENGTHS = (3, 0, 5, 1, 7, 2, 6, 4)


def tokens(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, C, generator=gen, dtype=torch.float64) for n in lengths]
    )


def params(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(4 * C, C, generator=gen, dtype=torch.float64) / 2,
        torch.randn(4 * C, generator=gen, dtype=torch.float64),
        torch.randn(C, 4 * C, generator=gen, dtype=torch.float64) / 4,
        torch.randn(C, generator=gen, dtype=torch.float64),
    ]


def block(s, w1, b1, w2, b2):
    p = s[:, None] + s[None]
    p = p + F.linear(F.gelu(F.linear(p, w1, b1)), w2, b2)
    a = torch.softmax(p.sum(-1), -1)
    return a @ s


def two_outputs(s, w1, b1, w2, b2):
    """A ragged output, a fixed-shape one (via a contraction with a dense result) and
    a per-sample number, from non-canonical (transposed) operands."""
    p = s[:, None] * s[None]
    h = F.gelu(F.linear(p, w1, b1))
    a = torch.softmax(F.linear(h, w2, b2).sum(-1), 0)  # columns: a.T is rows
    out = a.T @ s
    gram = s.T @ a @ s  # [C, C]: no ragged axis remains
    return {"out": out, "gram": gram, "total": p.sum()}


IN_DIMS = (0, None, None, None, None)


def _grads(out, leaves):
    if isinstance(out, dict):
        parts = [v.values if isinstance(v, raggedfn.Ragged) else v for v in out.values()]
    else:
        parts = [out.values]
    loss = sum(
        (t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum() for t in parts
    )
    return torch.autograd.grad(loss, leaves)


def _loop_grads(fn, x, ps):
    values = x.values.detach().requires_grad_()
    leaves = [values, *(p.detach().requires_grad_() for p in ps)]
    per = [fn(s, *leaves[1:]) for s in values.split(x.lengths.tolist())]
    if isinstance(per[0], dict):
        out = {k: [o[k] for o in per] for k in per[0]}
        parts = [torch.cat([t.flatten() for t in out["out"]])]
        parts.append(torch.stack(out["gram"]))
        parts.append(torch.stack(out["total"]))
    else:
        parts = [torch.cat([t.flatten() for t in per])]
    loss = sum(
        (t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum() for t in parts
    )
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("chunk", [0, 1, 300, 5000, None])
def test_pair_block_equals_the_loop_in_values_and_gradients(chunk):
    x = tokens(LENGTHS)
    ps = params()
    kwargs = {} if chunk is None else {"chunk_elements": chunk}
    assert_same(raggedfn.map(block, x, *ps, in_dims=IN_DIMS, **kwargs), loop(block, x, *ps))
    values = x.values.detach().requires_grad_()
    leaves = [values, *(p.detach().requires_grad_() for p in ps)]
    xr = raggedfn.from_lengths(values, x.lengths)
    got = _grads(raggedfn.map(block, xr, *leaves[1:], in_dims=IN_DIMS, **kwargs), leaves)
    want = _loop_grads(block, x, ps)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("chunk", [0, 200])
def test_several_outputs_join_in_sample_order(chunk):
    x = tokens(LENGTHS, seed=3)
    ps = params(seed=4)
    got = raggedfn.map(two_outputs, x, *ps, in_dims=IN_DIMS, chunk_elements=chunk)
    want = loop(two_outputs, x, *ps)
    assert isinstance(got["out"], raggedfn.Ragged)
    assert_same(got["out"], [w["out"] for w in want])
    assert_same(got["gram"], [w["gram"] for w in want])
    assert_same(got["total"], [w["total"] for w in want])
    values = x.values.detach().requires_grad_()
    leaves = [values, *(p.detach().requires_grad_() for p in ps)]
    xr = raggedfn.from_lengths(values, x.lengths)
    out = raggedfn.map(two_outputs, xr, *leaves[1:], in_dims=IN_DIMS, chunk_elements=chunk)
    for g, w in zip(_grads(out, leaves), _loop_grads(two_outputs, x, ps), strict=True):
        torch.testing.assert_close(g, w)


def test_a_small_budget_runs_the_plan_once_per_group(monkeypatch):
    calls = []

    def counting(real):
        def run(plan, ctx, *rest):
            calls.append(ctx.batch_size)
            return real(plan, ctx, *rest)

        return run

    # every place that runs a plan: the general path and the warm call's groups (_chunked),
    # and the warm call's whole batch (_warm)
    for module, name in ((_chunked, "run"), (_warm, "run"), (_warm, "run_prepared")):
        monkeypatch.setattr(module, name, counting(getattr(module, name)))
    x = tokens((4, 4, 4, 4, 4, 4))
    ps = params()
    # the largest intermediate of a sample of 4: 4 * 4 * 4C = 256 elements
    raggedfn.map(block, x, *ps, in_dims=IN_DIMS, chunk_elements=600)
    assert calls == [2, 2, 2]
    calls.clear()
    raggedfn.map(block, x, *ps, in_dims=IN_DIMS, chunk_elements=0)
    assert calls == [6]
    calls.clear()
    raggedfn.map(block, x, *ps, in_dims=IN_DIMS)  # the default budget: one group here
    assert calls == [6]


def test_gradcheck_through_groups():
    x = tokens((3, 2, 4), seed=5)
    ps = [p.detach().requires_grad_() for p in params(seed=6)]
    values = x.values.detach().requires_grad_()

    def fn(v, w1, b1, w2, b2):
        xr = raggedfn.from_lengths(v, x.lengths)
        return raggedfn.map(block, xr, w1, b1, w2, b2, in_dims=IN_DIMS, chunk_elements=150).values

    assert torch.autograd.gradcheck(fn, (values, *ps))
    assert torch.autograd.gradgradcheck(fn, (values, *ps))


def test_group_bounds():
    assert group_bounds([], 10) == []
    assert group_bounds([3, 3, 3, 3], 6) == [(0, 2), (2, 4)]
    assert group_bounds([3, 3, 3, 3], 7) == [(0, 2), (2, 4)]
    assert group_bounds([20, 1, 1, 20, 0], 10) == [(0, 1), (1, 3), (3, 5)]
    assert group_bounds([0, 0, 0], 1) == [(0, 3)]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "many"])
def test_chunk_elements_is_checked(bad):
    x = tokens((2, 3))
    with pytest.raises(RaggedError, match="chunk_elements"):
        raggedfn.map(lambda t: t * 2, x, chunk_elements=bad)


def test_released_values_and_in_place_rebinds():
    """Values are released after their last reader; a value an in-place op rebinds
    stays (its later readers see the new value), outputs stay."""

    def fn(t):
        h = t * 2
        g = h.clone()
        g.add_(1)
        q = torch.exp(h)
        return g * q, h

    x = tokens((3, 5, 2), seed=7)
    got = raggedfn.map(fn, x, chunk_elements=10)
    want = loop(fn, x)
    assert_same(got[0], [w[0] for w in want])
    assert_same(got[1], [w[1] for w in want])


def test_last_uses():
    """Inputs 0-1, steps 2-5: each value is released after its last reader, except
    outputs and values an in-place op rebinds."""
    from types import SimpleNamespace as NS

    from raggedfn._map.base._steps import Ref

    steps = [
        NS(args=(Ref(0), Ref(1)), kwargs={}, rebind=None),  # 2 = f(0, 1)
        NS(args=(Ref(2),), kwargs={}, rebind=(2,)),  # 3: in place on 2
        NS(args=([Ref(2), Ref(0)],), kwargs={"x": Ref(3)}, rebind=None),  # 4
        NS(args=(Ref(4),), kwargs={}, rebind=None),  # 5
    ]
    plan = NS(steps=steps, outputs=[Ref(5), Ref(1)])
    assert _interpret.last_uses(plan, 2) == [(), (), (0, 3), (4,)]


# ----- row tiles ------------------------------------------------------------------------


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(9)
        self.up = torch.nn.Linear(C, 3 * C, dtype=torch.float64)
        self.down = torch.nn.Linear(3 * C, C, dtype=torch.float64)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64) / 3


MLP = Mlp()
SCALE = torch.linspace(0.5, 1.5, C, dtype=torch.float64)


def captured(s):
    """A chain with captured module weights (read between its ops), a fixed-size
    tensor broadcast along the rows, a value read after the chain, mean and sum over
    trailing axes (one with keepdim)."""
    p = s[:, None] - s[None]
    h = torch.tanh(MLP.up(p)) * 2.0
    q = MLP.down(h) * SCALE + p
    r = q.mean(-1, keepdim=True) + torch.relu(q).sum(2, keepdim=True)
    return torch.softmax(r.squeeze(-1), -1) @ s, h.sum((0, 1))


@pytest.mark.parametrize("fn", [block, captured], ids=["block", "captured"])
@pytest.mark.parametrize("tile", [16, 100])
def test_row_tiles_equal_the_loop_in_values_and_gradients(monkeypatch, fn, tile):
    from raggedfn._map.running import _blocks, _tiles

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", tile)
    monkeypatch.setattr(_blocks, "ENABLED", False)
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)  # tiles smaller than the weights
    x = tokens(LENGTHS, seed=11)
    ps = params(seed=12) if fn is block else []
    dims = IN_DIMS if fn is block else 0
    report = raggedfn.map_report(fn, x, *ps, in_dims=dims, chunk_elements=1 << 40)
    assert report.batched.get("row tiles", 0) >= 1, report.batched
    got = raggedfn.map(fn, x, *ps, in_dims=dims, chunk_elements=1 << 40)
    want = loop(fn, x, *ps)
    if fn is block:
        assert_same(got, want)
    else:
        assert_same(got[0], [w[0] for w in want])
        assert_same(got[1], [w[1] for w in want])
    values = x.values.detach().requires_grad_()
    mlp = list(MLP.parameters()) if fn is captured else []
    leaves = [values, *(p.detach().requires_grad_() for p in ps), *mlp]
    xr = raggedfn.from_lengths(values, x.lengths)
    out = raggedfn.map(fn, xr, *leaves[1 : 1 + len(ps)], in_dims=dims, chunk_elements=1 << 40)
    flat = [out.values] if fn is block else [out[0].values, out[1]]
    weights = [torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t) for t in flat]
    got_grads = torch.autograd.grad(
        sum((t * w).sum() for t, w in zip(flat, weights, strict=True)), leaves
    )
    per = [fn(s, *leaves[1 : 1 + len(ps)]) for s in values.split(x.lengths.tolist())]
    if fn is block:
        ref = [torch.cat([t.flatten() for t in per]).view_as(flat[0])]
    else:
        ref = [torch.cat([t[0] for t in per]), torch.stack([t[1] for t in per])]
    want_grads = torch.autograd.grad(
        sum((t * w).sum() for t, w in zip(ref, weights, strict=True)), leaves
    )
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_row_tiles_gradcheck(monkeypatch):
    from raggedfn._map.running import _blocks, _tiles

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 24)
    monkeypatch.setattr(_blocks, "ENABLED", False)
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)  # tiles smaller than the weights
    x = tokens((3, 2, 4), seed=13)
    ps = [p.detach().requires_grad_() for p in params(seed=14)]
    values = x.values.detach().requires_grad_()

    def fn(v, w1, b1, w2, b2):
        xr = raggedfn.from_lengths(v, x.lengths)
        return raggedfn.map(block, xr, w1, b1, w2, b2, in_dims=IN_DIMS).values

    assert torch.autograd.gradcheck(fn, (values, *ps))
    assert torch.autograd.gradgradcheck(fn, (values, *ps))


def test_small_calls_skip_the_per_sample_costs(monkeypatch):
    """sum N_i^2 <= (sum N_i)^2: a batch whose bound fits the budget is one group
    without evaluating per-sample sizes; one over it still groups by cost."""
    from raggedfn._map.running import _chunks

    calls = []
    real = _chunks.sample_costs

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_chunked, "sample_costs", spy)

    def fresh(*args):  # a code object never mapped before: the first call is cold
        return block(*args)

    x = tokens((4, 4, 4, 4, 4, 4))  # 24 rows: bound 24 * 24 * 4C = 9216 elements
    ps = params()
    want = loop(block, x, *ps)
    for _ in range(2):  # cold (the general path), then warm (the warm call's own check)
        assert_same(raggedfn.map(fresh, x, *ps, in_dims=IN_DIMS, chunk_elements=9216), want)
        assert calls == []
    assert_same(raggedfn.map(fresh, x, *ps, in_dims=IN_DIMS, chunk_elements=9215), want)
    assert calls == [1]


def broadcasts(s):
    """Pair states built inside the tiles: a broadcast product at the head of a chain,
    row and column vectors (``[N, 1, 1]``, ``[1, N, 1]``) added in its middle, and an
    operand with the chain's rows in another dense order (a transpose)."""
    p = s[:, None] * s[None]
    norm = s.pow(2).sum(-1)
    h = torch.tanh(MLP.up(p)) + norm[:, None, None] - 0.5 * norm[None, :, None]
    q = MLP.down(h).sum(-1)
    t = s[:, None, :, None] * s[None, :, None, :]  # [N, N, C, C]
    u = torch.exp(-torch.tanh(t) - t.transpose(-1, -2)).mean((-2, -1))
    return torch.softmax(q + u, -1) @ s


def _no_whole_pair_state(report, ops):
    """The broadcasts ran inside the tiles (no batched op of theirs outside)."""
    assert report.batched.get("row tiles", 0) >= 1, report.batched
    for op in ops:
        assert op not in report.batched, report.batched


@pytest.mark.parametrize("tile", [16, 100, 1 << 18])
def test_tiles_build_the_pair_state_from_its_rows(monkeypatch, tile):
    from raggedfn._map.running import _blocks, _tiles

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", tile)
    monkeypatch.setattr(_blocks, "ENABLED", False)
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)  # tiles smaller than the weights
    x = tokens(LENGTHS, seed=15)
    kwargs = {"chunk_elements": 1 << 40}
    if tile < 1 << 18:
        report = raggedfn.map_report(broadcasts, x, **kwargs)
        _no_whole_pair_state(report, ["aten.add.Tensor", "aten.sub.Tensor"])
        ps = params(seed=16)
        report = raggedfn.map_report(block, x, *ps, in_dims=IN_DIMS, **kwargs)
        _no_whole_pair_state(report, ["aten.add.Tensor"])
    assert_same(raggedfn.map(broadcasts, x, **kwargs), loop(broadcasts, x))
    values = x.values.detach().requires_grad_()
    leaves = [values, *MLP.parameters()]
    out = raggedfn.map(broadcasts, raggedfn.from_lengths(values, x.lengths), **kwargs).values
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    got = torch.autograd.grad((out * weights).sum(), leaves)
    per = torch.cat([broadcasts(s) for s in values.split(x.lengths.tolist())])
    want = torch.autograd.grad((per * weights).sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_pair_state_tiles_gradcheck(monkeypatch):
    from raggedfn._map.running import _blocks, _tiles

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 40)
    monkeypatch.setattr(_blocks, "ENABLED", False)
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)  # tiles smaller than the weights
    x = tokens((3, 2, 4), seed=17)
    values = x.values.detach().requires_grad_()

    def fn(v):
        return raggedfn.map(broadcasts, raggedfn.from_lengths(v, x.lengths)).values

    assert torch.autograd.gradcheck(fn, (values,))
    assert torch.autograd.gradgradcheck(fn, (values,))


def test_tiles_are_not_used_when_every_tile_would_read_large_weights(monkeypatch):
    """Weights read again by every tile: the chain runs op by op (and equals the loop)."""
    from raggedfn._map.running import _blocks, _tiles

    monkeypatch.setattr(_blocks, "ENABLED", False)
    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 100)  # < 8 x the 148 weight elements
    x = tokens(LENGTHS, seed=18)
    ps = params(seed=19)
    report = raggedfn.map_report(block, x, *ps, in_dims=IN_DIMS, chunk_elements=1 << 40)
    assert "row tiles" not in report.batched, report.batched
    assert "aten.linear.default" in report.batched, report.batched
    assert_same(
        raggedfn.map(block, x, *ps, in_dims=IN_DIMS, chunk_elements=1 << 40), loop(block, x, *ps)
    )
    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 8 * 148)
    report = raggedfn.map_report(block, x, *ps, in_dims=IN_DIMS, chunk_elements=1 << 40)
    assert report.batched.get("row tiles", 0) >= 1, report.batched
