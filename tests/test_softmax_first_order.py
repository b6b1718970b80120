"""The first-order backwards of segment softmax and log-softmax (``_prims/_softmax.py``):
their own fresh buffers written in place where no graph is recorded, bit-identical to the
general rules and equal to the per-sample ``torch.softmax``/``log_softmax`` loop; the
general rules wherever a graph is (``create_graph``, ``torch.func``, forward mode)."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import raggedfn
from property_tests import reference
from raggedfn import _prims
from raggedfn._prims import _softmax

# unsorted, with an empty segment (1) and a trailing empty one (4): the segment form
SEGMENTS = torch.tensor([0, 0, 2, 2, 2, 3, 0, 2])
NUM = 5
PRIMS = {
    "softmax": (_prims.segment_softmax, "_first_order_softmax", torch.softmax),
    "log_softmax": (_prims.segment_log_softmax, "_first_order_log_softmax", torch.log_softmax),
}


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    calls: dict[str, list[int]] = {}
    for _, name, _ in PRIMS.values():
        calls[name] = []
        real = getattr(_softmax, name)

        def spy(*args: torch.Tensor, _real=real, _calls=calls[name]) -> torch.Tensor:
            _calls.append(1)
            return _real(*args)

        monkeypatch.setattr(_softmax, name, spy)
    return calls


def _loop(values: torch.Tensor, cotangent: torch.Tensor, reference) -> torch.Tensor:
    want = torch.zeros_like(values)
    for segment in range(NUM):
        rows = (SEGMENTS == segment).nonzero().squeeze(1)
        if len(rows):
            part = values.detach()[rows].requires_grad_()
            (g,) = torch.autograd.grad(reference(part, 0), part, cotangent[rows])
            want[rows] = g
    return want


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(PRIMS))
def test_first_order_backward_equals_the_general_rule_and_the_loop(
    spies: dict[str, list[int]], name: str, dtype: torch.dtype
) -> None:
    prim, spied, reference = PRIMS[name]
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(8, 2, 3, generator=gen, dtype=torch.float64).to(dtype)
    values[6, 1, 2] = -torch.inf  # a masked-out row
    values.requires_grad_()
    cotangent = torch.randn(8, 2, 3, generator=gen, dtype=torch.float64).to(dtype)
    (fast,) = torch.autograd.grad(prim(values, SEGMENTS, NUM), values, cotangent)
    assert spies[spied] == [1]
    (general,) = torch.autograd.grad(
        prim(values, SEGMENTS, NUM), values, cotangent, create_graph=True
    )
    assert spies[spied] == [1]  # a recorded backward keeps the general rule
    assert torch.equal(fast, general.detach())
    torch.testing.assert_close(fast, _loop(values, cotangent, reference))
    # an expanded cotangent (the gradient of a sum) is read, never written
    ones = torch.ones(1, 1, 1, dtype=dtype).expand(8, 2, 3)
    (fast,) = torch.autograd.grad(prim(values, SEGMENTS, NUM), values, ones)
    (general,) = torch.autograd.grad(prim(values, SEGMENTS, NUM), values, ones, create_graph=True)
    assert torch.equal(fast, general.detach()) and ones.eq(1).all()


@pytest.mark.parametrize("name", sorted(PRIMS))
def test_transforms_and_forward_mode_take_the_general_rule(
    spies: dict[str, list[int]], name: str
) -> None:
    prim, spied, _ = PRIMS[name]
    values = torch.randn(8, 3, dtype=torch.float64)
    weights = torch.randn(8, 3, dtype=torch.float64)

    def loss(v: torch.Tensor) -> torch.Tensor:
        return (prim(v, SEGMENTS, NUM) * weights).sum()

    got = torch.func.grad(loss)(values)
    assert spies[spied] == []
    primal = values.clone().requires_grad_()
    with fwAD.dual_level():
        dual = fwAD.make_dual(primal, torch.randn(8, 3, dtype=torch.float64))
        (in_dual,) = torch.autograd.grad(loss(dual), primal)
        in_dual = fwAD.unpack_dual(in_dual).primal
    assert spies[spied] == []
    (want,) = torch.autograd.grad(loss(primal), primal)
    assert spies[spied] == [1]
    assert torch.equal(got, want) and torch.equal(in_dual, want)


def test_gradgradcheck_still_passes_through_the_general_rules() -> None:
    values = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    for prim, _, _ in PRIMS.values():
        assert torch.autograd.gradcheck(lambda v, p=prim: p(v, SEGMENTS, NUM), (values,))
        assert torch.autograd.gradgradcheck(lambda v, p=prim: p(v, SEGMENTS, NUM), (values,))


def test_ragged_softmax_of_small_samples_takes_it_and_equals_the_loop(
    spies: dict[str, list[int]],
) -> None:
    lengths = [3, 0, 5, 1]
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(sum(lengths), 4, generator=gen, requires_grad=True)
    x = raggedfn.from_lengths(values, torch.tensor(lengths))
    cotangent = torch.randn(sum(lengths), 4, generator=gen)
    (got,) = torch.autograd.grad(raggedfn.softmax(x, 1).values, values, cotangent)
    assert spies["_first_order_softmax"] == [1]
    parts = reference.samples(x.with_values(values.detach()))
    grads = reference.samples(x.with_values(cotangent))
    want = []
    for part, g in zip(parts, grads, strict=True):
        leaf = part.clone().requires_grad_()
        want.append(torch.autograd.grad(torch.softmax(leaf, 0), leaf, g)[0] if len(leaf) else leaf)
    torch.testing.assert_close(got, reference.pack_like(want, x))
