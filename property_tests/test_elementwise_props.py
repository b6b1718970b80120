"""Elementwise ops equal the per-sample loop, in values and gradients."""

from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests._elementwise_helpers import PerSample, check, relayout, same_positions_layout
from property_tests.reference import assert_same, loop, pack_like, samples
from property_tests.strategies import raggeds

SETTINGS = settings(deadline=None, max_examples=40)
FLOATS = st.sampled_from([torch.float64, torch.float32])

ARITHMETIC = [
    (raggedfn.add, torch.add),
    (raggedfn.sub, torch.sub),
    (raggedfn.mul, torch.mul),
    (raggedfn.div, torch.div),
]


@pytest.mark.parametrize(("ragged_op", "torch_op"), ARITHMETIC, ids=lambda f: f.__name__)
@SETTINGS
@given(data=st.data(), dtype=FLOATS)
def test_binary_same_partition_any_layouts(ragged_op, torch_op, data, dtype) -> None:
    x = data.draw(raggeds(dtype=dtype, requires_grad=True))
    layout = data.draw(same_positions_layout(x.layout))
    y = relayout(x, layout, seed=data.draw(st.integers(0, 2**31 - 1)))
    if ragged_op is raggedfn.div:
        y = relayout(raggedfn.abs(y) + 0.5, layout)
    check(ragged_op, torch_op, x, y)
    # the same partition objects: no data check at all
    z = x.with_values(x.values.detach() * 3)
    check(ragged_op, torch_op, z, x)


@SETTINGS
@given(x=raggeds(dtype=FLOATS, requires_grad=True), scalar=st.floats(-3, 3), data=st.data())
def test_scalars_and_reversed_operands(x, scalar, data) -> None:
    ops = [operator.add, operator.sub, operator.mul, operator.truediv]
    op = data.draw(st.sampled_from(ops))
    check(lambda a: op(a, scalar), lambda a: op(a, scalar), x)
    check(lambda a: op(scalar, abs(a) + 0.5), lambda a: op(scalar, abs(a) + 0.5), x)
    check(lambda a: a**2, lambda a: a**2, x)
    check(lambda a: 2.0**a, lambda a: 2.0**a, x)
    check(lambda a: (abs(a) + 0.5) ** a, lambda a: (abs(a) + 0.5) ** a, x)
    check(lambda a: -a, torch.neg, x)
    check(lambda a: abs(a), torch.abs, x)
    check(raggedfn.neg, torch.neg, x)
    zero_d = torch.tensor(scalar, dtype=x.dtype)
    check(lambda a: a * zero_d, lambda a: a * zero_d, x)


@st.composite
def _broadcastable(draw, x, per_sample):
    """A dense tensor shape that broadcasts against x's logical shape."""
    shape = []
    for size in x.shape[1:]:
        shape.append(1 if size is None else draw(st.sampled_from([1, size])))
    if per_sample:
        return [x.batch_size, *shape]
    keep = draw(st.integers(0, len(shape)))
    return shape[len(shape) - keep :]


@SETTINGS
@given(data=st.data(), dtype=FLOATS, per_sample=st.booleans())
def test_dense_operands_per_feature_and_per_sample(data, dtype, per_sample) -> None:
    x = data.draw(raggeds(dtype=dtype, requires_grad=True))
    shape = data.draw(_broadcastable(x, per_sample))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    arg = PerSample(t) if per_sample else t
    op = data.draw(st.sampled_from([operator.add, operator.mul, operator.sub]))
    check(op, op, x, arg)
    check(op, op, arg, x)


@SETTINGS
@given(data=st.data())
def test_integer_ops_and_comparisons(data) -> None:
    x = data.draw(raggeds(dtype=torch.int64))
    layout = data.draw(same_positions_layout(x.layout))
    y = relayout(x, layout)
    y = raggedfn.where(y == 0, 3, y)
    for op in [operator.floordiv, operator.eq, operator.ne, operator.lt, operator.le]:
        check(op, op, x, y, grad=False)
    for op in [operator.gt, operator.ge, operator.floordiv]:
        check(lambda a, op=op: op(a, 2), lambda a, op=op: op(a, 2), x, grad=False)
    out = check(raggedfn.lt, torch.lt, x, y, grad=False)
    assert out.dtype == torch.bool


@SETTINGS
@given(data=st.data(), dtype=FLOATS)
def test_where(data, dtype) -> None:
    x = data.draw(raggeds(dtype=dtype, requires_grad=True))
    layout = data.draw(same_positions_layout(x.layout))
    y = relayout(x, layout, seed=data.draw(st.integers(0, 1000)))
    cond = relayout(x, data.draw(same_positions_layout(x.layout))) > 0
    check(raggedfn.where, torch.where, cond, x, y)
    check(lambda c, a: raggedfn.where(c, a, 0.5), lambda c, a: torch.where(c, a, 0.5), cond, x)
    # a dense per-sample condition and a per-feature fallback tensor
    shape = [x.batch_size] + [1 if s is None else s for s in x.shape[1:]]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    mask = torch.rand(shape, generator=gen) > 0.5
    other_shape = shape[-1:] if x.shape[-1] is not None else []
    other = torch.randn(other_shape, generator=gen, dtype=torch.float64).to(dtype)
    other.requires_grad_(True)
    check(raggedfn.where, torch.where, PerSample(mask), x, other)


@SETTINGS
@given(x=raggeds(dtype=FLOATS, requires_grad=True))
def test_apply_pointwise_and_trailing(x) -> None:
    check(lambda a: raggedfn.apply(torch.tanh, a), torch.tanh, x)
    if x.shape[-1] is not None:
        check(
            lambda a: raggedfn.apply(torch.softmax, a, dim=-1),
            lambda a: torch.softmax(a, dim=-1),
            x,
        )
        ragged_first = all(a.ragged for a in x.layout.axes[: x.layout.num_ragged])
        if ragged_first:
            check(
                lambda a: raggedfn.apply(torch.sum, a, dim=-1),
                lambda a: torch.sum(a, dim=-1),
                x,
            )


# ----- torch.func --------------------------------------------------------------


@settings(deadline=None, max_examples=15)
@given(x=raggeds(dtype=torch.float64, feature_shape=(3,), min_batch=1, dim_order="ragged_first"))
def test_torch_func_grad_vjp_jacrev(x) -> None:
    bias = torch.randn(3, dtype=torch.float64)

    def f(values):
        y = x.with_values(values)
        return (raggedfn.mul(y, y) + bias).values.sin().sum()

    def ref(values):
        probe = x.with_values(values)
        return sum(((s * s + bias).sin().sum() for s in samples(probe)), torch.zeros(()))

    got = torch.func.grad(f)(x.values)
    expected = torch.func.grad(ref)(x.values)
    torch.testing.assert_close(got, expected)
    _, pullback = torch.func.vjp(f, x.values)
    torch.testing.assert_close(pullback(torch.ones((), dtype=torch.float64))[0], expected)
    torch.testing.assert_close(torch.func.jacrev(f)(x.values), expected)


@settings(deadline=None, max_examples=15)
@given(x=raggeds(dtype=torch.float64, feature_shape=(3,), dim_order="ragged_first"))
def test_vmap_over_extra_leading_axis(x) -> None:
    stack = torch.stack([x.values, 2 * x.values + 1, -x.values])
    weight = torch.randn(3, dtype=torch.float64)

    def f(values):
        y = x.with_values(values)
        return (raggedfn.mul(y, weight) - 1.0).values

    got = torch.func.vmap(f)(stack)
    for e, values in enumerate(stack):
        expected = loop(lambda s: s * weight - 1.0, x.with_values(values))
        assert_same(raggedfn.Ragged(got[e], x.offsets, x.sizes, x.layout), expected)

    # per-example gradients: vmap(grad) with the Ragged partition shared
    def loss(values):
        return (raggedfn.mul(x.with_values(values), weight).values ** 2).sum()

    per_example = torch.func.vmap(torch.func.grad(loss))(stack)
    for e, values in enumerate(stack):
        leaves = [s.detach().requires_grad_() for s in samples(x.with_values(values))]
        if not leaves:
            assert per_example[e].numel() == 0
            continue
        total = sum(((s * weight) ** 2).sum() for s in leaves)
        grads = torch.autograd.grad(total, leaves)
        torch.testing.assert_close(per_example[e], pack_like(grads, x))
