"""The mean of an empty sample (raggedfn._prims._mean) and a NaN extremum, against the loop.

torch's per-sample loop: ``torch.mean`` of an empty tensor is NaN, and so is its
forward-mode tangent (a zero-length sum divided by 0); its gradient is an empty
tensor. raggedfn's mean equals that in every mode. ``amax``/``amin`` of a sample
holding a NaN: the value is NaN as in torch, but the NaN extremum gets no
derivative, where ``torch.amax``'s rule gives every row of the sample NaN (the
documented deviation, pinned here).
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.autograd import gradcheck, gradgradcheck
from torch.func import jacfwd, jacrev, jvp

import raggedfn
from property_tests.reference import assert_same, samples
from raggedfn import _prims

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)

F64 = torch.float64
# unsorted segment ids; segments 1 and 4 have no rows
SEGMENTS = torch.tensor([0, 0, 2, 2, 2, 3, 0])
NUM = 5
EMPTY = [1, 4]
PRESENT = torch.tensor([True, False, True, True, False])


def _values(seed: int = 0) -> Tensor:
    return torch.randn(7, 3, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _mean(v: Tensor) -> Tensor:
    return _prims.segment_mean(v, SEGMENTS, NUM)


def _loop_mean(v: Tensor) -> Tensor:
    """torch.mean of each segment's rows, one segment at a time."""
    return torch.stack([v[SEGMENTS == s].mean(0) for s in range(NUM)])


# ----- the primitive -------------------------------------------------------------------------


def test_the_tangent_of_an_empty_segment_is_nan_as_torch_mean() -> None:
    values, tangent = _values(), _values(1)
    want = jvp(_loop_mean, (values,), (tangent,))
    assert want[1][EMPTY].isnan().all()  # torch's own answer
    got = jvp(_mean, (values,), (tangent,))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, equal_nan=True)
    assert got[1][PRESENT].isfinite().all()
    with fwAD.dual_level():
        dual = fwAD.unpack_dual(_mean(fwAD.make_dual(values, tangent)))
    torch.testing.assert_close(dual.tangent, want[1], equal_nan=True)


def test_jacfwd_equals_the_loops_and_jacrev_where_the_mean_is_finite() -> None:
    """jacfwd batches the forward rule (vmap): NaN rows for empty segments, as the loop's."""
    values = _values()
    got = jacfwd(_mean)(values)
    torch.testing.assert_close(got, jacfwd(_loop_mean)(values), equal_nan=True)
    assert got[EMPTY].isnan().all()
    torch.testing.assert_close(got[PRESENT], jacrev(_mean)(values)[PRESENT])


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled:UserWarning")
def test_gradients_equal_the_loop_and_no_nan_enters_the_backward() -> None:
    """The loop's gradient reaches only rows (an empty sample has none); a NaN cotangent
    on an empty segment's NaN mean stops at the rule (anomaly mode sees no NaN)."""
    values = _values().requires_grad_()
    cotangent = _values(2)[:NUM]
    (want,) = torch.autograd.grad(_loop_mean(values)[PRESENT], values, cotangent[PRESENT])
    cotangent[EMPTY] = float("nan")
    with torch.autograd.detect_anomaly():
        (got,) = torch.autograd.grad(_mean(values), values, cotangent)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


def test_gradcheck_and_gradgradcheck_in_both_modes() -> None:
    """The rule's derivatives of every order, forward and reverse, against finite
    differences; the empty segments' outputs are masked after the rule (a NaN value has
    no finite difference), so their zero gradient and masked tangent are checked too."""
    values = _values().requires_grad_()

    def masked(v: Tensor) -> Tensor:
        out = _mean(v)
        return torch.where(PRESENT[:, None], out, torch.zeros_like(out))

    for f in (masked, lambda v: _mean(v)[PRESENT]):
        assert gradcheck(f, (values,), check_forward_ad=True, check_batched_forward_grad=True)
        assert gradgradcheck(f, (values,), check_fwd_over_rev=True)


# ----- the public op and map -------------------------------------------------------------------


def _tokens() -> raggedfn.Ragged:
    return raggedfn.from_lengths(_values()[:6], [3, 0, 2, 0, 1])


def _pairs() -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(5)
    return raggedfn.from_list(
        [torch.randn(n, m, 2, generator=gen, dtype=F64) for n, m in [(2, 3), (0, 0), (3, 0)]],
        ragged_dims=(1, 2),
    )


@pytest.mark.parametrize(
    ("x", "dim", "sample_dim"),
    [(_tokens(), 1, 0), (_pairs(), 2, 1), (_pairs(), (1, 2), (0, 1))],
    ids=["tokens", "pairs-one-axis", "pairs-both-axes"],
)
def test_mean_under_jvp_equals_the_loop(x: raggedfn.Ragged, dim, sample_dim) -> None:
    tangent = torch.randn(x.values.shape, generator=torch.Generator().manual_seed(7), dtype=F64)

    def f(v: Tensor) -> Tensor | raggedfn.Ragged:
        out = raggedfn.mean(x.with_values(v), dim)
        return out.values if isinstance(out, raggedfn.Ragged) else out

    structure = raggedfn.mean(x, dim)
    wrap = structure.with_values if isinstance(structure, raggedfn.Ragged) else (lambda v: v)
    value, got = jvp(f, (x.values,), (tangent,))
    per_sample = [
        jvp(lambda s: s.mean(sample_dim), (s,), (t,))
        for s, t in zip(samples(x), samples(x.with_values(tangent)), strict=True)
    ]
    assert_same(wrap(value), [v for v, _ in per_sample])
    assert_same(wrap(got), [t for _, t in per_sample])
    assert any(t.isnan().any() for _, t in per_sample)  # an empty extent is there


def test_mean_inside_map_under_jvp_equals_the_loop() -> None:
    x = _tokens()
    tangent = _values(3)[:6]

    def per_sample(t: Tensor) -> Tensor:
        return t.mean(0) * 2

    got = jvp(lambda v: raggedfn.map(per_sample, x.with_values(v)), (x.values,), (tangent,))
    want = [
        jvp(per_sample, (s,), (t,))
        for s, t in zip(samples(x), samples(x.with_values(tangent)), strict=True)
    ]
    assert_same(got[0], [v for v, _ in want])
    assert_same(got[1], [t for _, t in want])
    assert got[1][1].isnan().all()


def test_compiled_mean_and_its_gradient_equal_eager() -> None:
    """Compiled without a transform, the rule's jvp-less class: one graph, eager's answer."""
    x = _tokens()

    def loss(v: Tensor) -> Tensor:
        out = raggedfn.mean(x.with_values(v), 1)
        return torch.where(out.isfinite(), out, torch.zeros_like(out)).pow(2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    v = x.values.clone().requires_grad_()
    (got,) = torch.autograd.grad(compiled(v), v)
    (want,) = torch.autograd.grad(loss(v), v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inside_compiled_forward_mode_the_tangent_of_an_empty_mean_is_zero() -> None:
    """The documented limit (docs/transforms.md): dynamo refuses a custom jvp, and the
    plain body gives 0 where the eager rule gives NaN; equal to eager elsewhere."""
    x = _tokens()
    tangent = _values(3)[:6]

    def f(v: Tensor) -> Tensor:
        return raggedfn.mean(x.with_values(v), 1)

    torch._dynamo.reset()
    compiled = torch.compile(
        lambda v: jvp(f, (v,), (tangent,)), fullgraph=True, backend="aot_eager"
    )
    value, got = compiled(x.values)
    eager_value, eager = jvp(f, (x.values,), (tangent,))
    torch.testing.assert_close(value, eager_value, equal_nan=True)
    empty = torch.tensor([False, True, False, True, False])
    torch.testing.assert_close(got[~empty], eager[~empty])
    assert got[empty].eq(0).all() and eager[empty].isnan().all()


# ----- a NaN extremum: the documented deviation ------------------------------------------------


@pytest.mark.parametrize("name", ["amax", "amin"])
def test_a_nan_extremum_gets_no_derivative_where_torch_gives_nan(name: str) -> None:
    """Value NaN as torch's. torch's rule divides each row's share by the number of rows
    equal to the extremum, and NaN equals nothing: 0/0 for every row of that sample.
    raggedfn gives that sample zero gradient and zero tangent; other samples equal the loop."""
    values = _values()[:6].clone()
    values[1, 0] = float("nan")  # sample 0, feature 0
    x = raggedfn.from_lengths(values, [3, 0, 3])
    op, torch_op = getattr(raggedfn, name), getattr(torch, name)
    v = values.clone().requires_grad_()
    out = op(x.with_values(v), 1)[[0, 2]]
    rows = [s.clone().requires_grad_() for s in (values[:3], values[3:])]  # the loop
    want_values = [torch_op(s, 0) for s in rows]
    torch.testing.assert_close(out, torch.stack(want_values), equal_nan=True)
    (got,) = torch.autograd.grad(out.sum(), v)
    want = torch.autograd.grad([w.sum() for w in want_values], rows)
    assert want[0][:, 0].isnan().all()  # torch: NaN for every row of the NaN's column
    assert got[:3, 0].eq(0).all() and got.isfinite().all()
    torch.testing.assert_close(got[:3, 1:], want[0][:, 1:])
    torch.testing.assert_close(got[3:], want[1])
    ones = torch.ones_like(values)
    _, tangent = jvp(lambda v: op(x.with_values(v), 1), (values,), (ones,))
    assert tangent[0, 0] == 0 and tangent.isfinite().all()
    _, torch_tangent = jvp(lambda s: torch_op(s, 0), (values[:3],), (ones[:3],))
    assert torch_tangent[0].isnan()
