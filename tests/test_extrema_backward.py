"""The first-order backward of segment max/min (``_prims/_extrema.py``): two buffers written
in place where a graph is not recorded, bit-identical to the general rule and to the
per-sample ``torch.amax``/``torch.amin`` loop; the general rule wherever a graph is."""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import raggedfn
from property_tests import reference
from raggedfn import _prims
from raggedfn._prims import _extrema

# unsorted, with an empty segment (1) and a trailing empty one (4)
SEGMENTS = torch.tensor([0, 0, 2, 2, 2, 3, 0, 2])
NUM = 5


def _values(dtype: torch.dtype, nan: bool = False) -> torch.Tensor:
    """Rows with ties inside segments, +-inf (a NaN) and a trailing [2, 3] shape."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(-2, 3, (8, 2, 3), generator=gen).to(torch.float64)
    if nan:
        values[3, 0, 0] = math.nan
    values[6, 1, 2] = math.inf
    values[4, 1, 1] = -math.inf
    return values.to(dtype)


def _loop(values: torch.Tensor, cotangent: torch.Tensor, largest: bool) -> torch.Tensor:
    """The per-sample reference: torch's own rule on each segment's rows."""
    want = torch.zeros_like(values)
    reduce = torch.amax if largest else torch.amin
    for segment in range(NUM):
        rows = (SEGMENTS == segment).nonzero().squeeze(1)
        if len(rows) == 0:
            continue
        part = values.detach()[rows].requires_grad_()
        (g,) = torch.autograd.grad(reduce(part, 0), part, cotangent[segment])
        want[rows] = g
    return want


@pytest.fixture
def first_order(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = _extrema._first_order_share

    def spy(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_extrema, "_first_order_share", spy)
    return calls


@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_first_order_backward_equals_the_loop_and_the_general_rule(
    first_order: list[int], dtype: torch.dtype, largest: bool, nan: bool
) -> None:
    prim = _prims.segment_amax if largest else _prims.segment_amin
    values = _values(dtype, nan).requires_grad_()
    cotangent = torch.randn(NUM, 2, 3, generator=torch.Generator().manual_seed(1)).to(dtype)
    (fast,) = torch.autograd.grad(prim(values, SEGMENTS, NUM), values, cotangent)
    assert first_order == [1]
    # create_graph records the backward: the general rule, untouched
    (general,) = torch.autograd.grad(
        prim(values, SEGMENTS, NUM), values, cotangent, create_graph=True
    )
    assert first_order == [1]
    assert torch.equal(fast, general.detach())
    if nan:
        # a NaN extremum gets no gradient (torch.amax's rule gives NaN: 0 / 0 ties)
        assert fast[values.isnan()].eq(0).all() and fast.isfinite().all()
    else:
        torch.testing.assert_close(fast, _loop(values, cotangent, largest), rtol=0, atol=0)


def test_a_recorded_backward_keeps_the_general_rule_and_its_second_derivative(
    first_order: list[int],
) -> None:
    values = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(
        lambda v: _prims.segment_amax(v, SEGMENTS, NUM)[[0, 2, 3]], (values,)
    )
    (g,) = torch.autograd.grad(
        _prims.segment_amax(values, SEGMENTS, NUM)[[0, 2, 3]].pow(2).sum(),
        values,
        create_graph=True,
    )
    (gg,) = torch.autograd.grad(g.sum(), values)
    want = torch.zeros_like(values)
    for segment in (0, 2, 3):
        rows = (SEGMENTS == segment).nonzero().squeeze(1)
        part = values.detach()[rows].requires_grad_()
        (inner,) = torch.autograd.grad(part.amax(0).pow(2).sum(), part, create_graph=True)
        (outer,) = torch.autograd.grad(inner.sum(), part)
        want[rows] = outer
    torch.testing.assert_close(gg, want)


def test_transforms_take_the_general_rule(first_order: list[int]) -> None:
    values = torch.randn(8, 3, dtype=torch.float64)

    def loss(v: torch.Tensor) -> torch.Tensor:
        return _prims.segment_amax(v, SEGMENTS, NUM)[[0, 2, 3]].sum()

    got = torch.func.grad(loss)(values)
    assert first_order == []
    values.requires_grad_()
    (want,) = torch.autograd.grad(loss(values), values)
    assert first_order == [1]
    assert torch.equal(got, want)


def test_a_backward_under_forward_mode_takes_the_general_rule(first_order: list[int]) -> None:
    # a first-order backward while a dual level is active (its saved values are dual):
    # plain_eager() is False, no in-place writes into fresh buffers
    primal = torch.randint(0, 2, (8, 3)).double().requires_grad_()
    cotangent = torch.ones(NUM, 3, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(primal, torch.randn(8, 3, dtype=torch.float64))
        (got,) = torch.autograd.grad(_prims.segment_amax(dual, SEGMENTS, NUM), primal, cotangent)
        got = fwAD.unpack_dual(got).primal
    assert first_order == []
    (want,) = torch.autograd.grad(_prims.segment_amax(primal, SEGMENTS, NUM), primal, cotangent)
    assert first_order == [1]
    assert torch.equal(got, want)


def test_ragged_amax_over_the_ragged_axis_takes_it_and_equals_the_loop(
    first_order: list[int],
) -> None:
    lengths = [3, 0, 5, 1]
    gen = torch.Generator().manual_seed(2)
    values = torch.randint(0, 3, (sum(lengths), 4), generator=gen).float().requires_grad_()
    x = raggedfn.from_lengths(values, torch.tensor(lengths))
    cotangent = torch.randn(4, 4, generator=gen)
    (got,) = torch.autograd.grad(raggedfn.amax(x, 1), values, cotangent)
    assert first_order == [1]
    want = []
    for part, g in zip(reference.samples(x.with_values(values.detach())), cotangent, strict=True):
        leaf = part.clone().requires_grad_()
        want.append(torch.autograd.grad(leaf.amax(0), leaf, g)[0] if len(leaf) else leaf)
    torch.testing.assert_close(got, reference.pack_like(want, x), rtol=0, atol=0)
