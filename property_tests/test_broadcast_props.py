"""Broadcasting that creates ragged axes equals the per-sample loop."""

from __future__ import annotations

import operator

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests._elementwise_helpers import (
    PerSample,
    check,
    pack,
    relayout,
    same_positions_layout,
)
from property_tests.reference import samples
from property_tests.strategies import raggeds
from raggedfn import Layout

SETTINGS = settings(deadline=None, max_examples=40)
FLOATS = st.sampled_from([torch.float64, torch.float32])
OPS = st.sampled_from([operator.add, operator.mul, operator.sub])
TOKENS = {
    "num_ragged": 1,
    "dim_order": "ragged_first",
    "feature_shape": st.sampled_from([(), (3,)]),
}


@st.composite
def same_batch(draw, x, dtype):
    """A token batch (B, M*, ...) with x's batch size and dense shape, own lengths."""
    lengths = draw(st.lists(st.integers(0, 4), min_size=x.batch_size, max_size=x.batch_size))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    dense = tuple(x.values.shape[1:])
    tensors = [
        torch.randn((n, *dense), generator=gen, dtype=torch.float64).to(dtype) for n in lengths
    ]
    if not tensors:
        return relayout(x, x.layout, seed=0)
    y = pack(tensors, x.layout, dense)
    y.values.requires_grad_(True)
    return y


@SETTINGS
@given(x=raggeds(dtype=FLOATS, requires_grad=True, **TOKENS), op=OPS)
def test_pair_state_from_one_token_batch(x, op) -> None:
    out = check(
        lambda a: op(raggedfn.unsqueeze(a, 2), raggedfn.unsqueeze(a, 1)),
        lambda a: op(a.unsqueeze(1), a.unsqueeze(0)),
        x,
    )
    assert out.shape[:3] == (x.batch_size, None, None)
    assert torch.equal(out.sizes, torch.cat([x.sizes, x.sizes], 1))
    assert out.values.shape[0] == int((x.sizes[:, 0] ** 2).sum())


@SETTINGS
@given(data=st.data(), dtype=FLOATS, op=OPS)
def test_cross_state_from_two_token_batches(data, dtype, op) -> None:
    x = data.draw(raggeds(dtype=dtype, requires_grad=True, **TOKENS))
    y = data.draw(same_batch(x, dtype))
    out = check(
        lambda a, b: op(raggedfn.unsqueeze(a, 2), raggedfn.unsqueeze(b, 1)),
        lambda a, b: op(a.unsqueeze(1), b.unsqueeze(0)),
        x,
        y,
    )
    expected_rows = int((x.sizes[:, 0] * y.sizes[:, 0]).sum())
    assert out.values.shape[0] == expected_rows  # only real elements, no padding
    # a (B, M*, N*) state transposed against a (B, N*, M*) one: sizes columns swap
    check(
        lambda a, b: op(
            raggedfn.unsqueeze(a, 2) * raggedfn.unsqueeze(b, 1),
            raggedfn.transpose(raggedfn.unsqueeze(b, 2) - raggedfn.unsqueeze(a, 1), 1, 2),
        ),
        lambda a, b: op(
            a.unsqueeze(1) * b.unsqueeze(0), (b.unsqueeze(1) - a.unsqueeze(0)).transpose(0, 1)
        ),
        x,
        y,
    )
    # broadcast the other way round: (B, 1, N*) against (B, M*, 1)
    check(
        lambda a, b: op(raggedfn.unsqueeze(a, 1), raggedfn.unsqueeze(b, 2)),
        lambda a, b: op(a.unsqueeze(0), b.unsqueeze(1)),
        x,
        y,
    )


@SETTINGS
@given(data=st.data(), dtype=FLOATS, op=OPS)
def test_pair_state_with_row_and_column_terms(data, dtype, op) -> None:
    """A pair state (any storage order) plus a token term along rows or columns."""
    x = data.draw(raggeds(dtype=dtype, requires_grad=True, **TOKENS))
    pair = raggedfn.unsqueeze(x, 2) * raggedfn.unsqueeze(x, 1)
    pair = relayout(pair.detach(), data.draw(same_positions_layout(pair.layout)), seed=3)
    pair.values.requires_grad_(True)
    axis = data.draw(st.sampled_from([1, 2]))
    check(
        lambda p, a: op(p, raggedfn.unsqueeze(a, axis)),
        lambda p, a: op(p, a.unsqueeze(axis - 1)),
        pair,
        x,
    )
    # the transposed pair against the pair: storage orders differ, rows are gathered
    check(
        lambda p: op(raggedfn.transpose(p, 1, 2), p),
        lambda p: op(p.transpose(0, 1), p),
        pair,
    )


@SETTINGS
@given(data=st.data(), dtype=FLOATS)
def test_per_sample_dense_against_created_axes(data, dtype) -> None:
    x = data.draw(raggeds(dtype=dtype, requires_grad=True, **TOKENS))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    dense = tuple(x.values.shape[1:])
    scale = torch.randn((x.batch_size, 1, 1, *dense), generator=gen, dtype=torch.float64)
    scale = scale.to(dtype)
    check(
        lambda a, s: raggedfn.unsqueeze(a, 2) * raggedfn.unsqueeze(a, 1) + s,
        lambda a, s: a.unsqueeze(1) * a.unsqueeze(0) + s,
        x,
        PerSample(scale),
    )


@SETTINGS
@given(data=st.data())
def test_broadcast_tensors(data) -> None:
    x = data.draw(raggeds(dtype=torch.float64, **TOKENS))
    a, b = raggedfn.broadcast_tensors(raggedfn.unsqueeze(x, 2), raggedfn.unsqueeze(x, 1))
    assert a.layout == b.layout == Layout.from_ragged_positions(a.layout.rank, (0, 1))
    for s, ea, eb in zip(samples(x), samples(a), samples(b), strict=True):
        ra, rb = torch.broadcast_tensors(s.unsqueeze(1), s.unsqueeze(0))
        torch.testing.assert_close(ea, ra)
        torch.testing.assert_close(eb, rb)


@settings(deadline=None, max_examples=15)
@given(x=raggeds(dtype=torch.float64, **TOKENS))
def test_torch_func_through_created_axes_and_shape_ops(x) -> None:
    """grad, jacrev and vmap (extra leading axis of values) through a pair state."""

    def pair_loss(values):
        t = x.with_values(values)
        pair = raggedfn.unsqueeze(t, 2) * raggedfn.unsqueeze(t, 1)
        pair = raggedfn.contiguous(raggedfn.transpose(pair, 1, 2))
        return pair.values.sin().sum()

    def reference(values):
        total = torch.zeros((), dtype=torch.float64)
        for s in samples(x.with_values(values)):
            total = total + (s.unsqueeze(1) * s.unsqueeze(0)).transpose(0, 1).sin().sum()
        return total

    expected = torch.func.grad(reference)(x.values)
    torch.testing.assert_close(torch.func.grad(pair_loss)(x.values), expected)
    torch.testing.assert_close(torch.func.jacrev(pair_loss)(x.values), expected)
    stack = torch.stack([x.values, 2 * x.values])
    per_copy = torch.func.vmap(torch.func.grad(pair_loss))(stack)
    for e in range(2):
        torch.testing.assert_close(per_copy[e], torch.func.grad(reference)(stack[e]))
