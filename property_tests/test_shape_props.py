"""Shape ops equal the per-sample loop, in values and gradients."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests._elementwise_helpers import check
from property_tests.strategies import raggeds
from raggedfn import Layout

SETTINGS = settings(deadline=None, max_examples=40)
FLOATS = st.sampled_from([torch.float64, torch.float32])
FEATURES = st.sampled_from([(), (3,), (2, 3), (2, 1, 3)])


def _dense_axes(x) -> list[int]:
    return [1 + p for p, a in enumerate(x.layout.axes) if not a.ragged]


@SETTINGS
@given(data=st.data(), dtype=FLOATS)
def test_transpose_and_permute_are_layout_only(data, dtype) -> None:
    x = data.draw(raggeds(dtype=dtype, requires_grad=True, feature_shape=FEATURES))
    a = data.draw(st.integers(1, x.ndim - 1))
    b = data.draw(st.integers(1, x.ndim - 1))
    negative = data.draw(st.booleans())
    out = check(
        lambda v: raggedfn.transpose(v, a - x.ndim if negative else a, b),
        lambda s: s.transpose(a - 1, b - 1),
        x,
    )
    assert out.values is x.values
    perm = data.draw(st.permutations(list(range(1, x.ndim))))
    out = check(
        lambda v: raggedfn.permute(v, (0, *perm)),
        lambda s: s.permute(*(p - 1 for p in perm)),
        x,
    )
    assert out.values is x.values


@SETTINGS
@given(data=st.data(), dtype=FLOATS)
def test_unsqueeze_and_squeeze(data, dtype) -> None:
    x = data.draw(raggeds(dtype=dtype, requires_grad=True, feature_shape=FEATURES))
    dim = data.draw(st.integers(1, x.ndim))
    up = check(lambda v: raggedfn.unsqueeze(v, dim), lambda s: s.unsqueeze(dim - 1), x)
    # squeeze() removes the size-1 dense axes only, never a ragged axis of size 1
    keep = up.ragged_dims
    check(
        raggedfn.squeeze,
        lambda s: s.squeeze(
            tuple(p for p, n in enumerate(s.shape) if p + 1 not in keep and n == 1)
        ),
        up,
    )
    check(lambda v: raggedfn.squeeze(v, dim), lambda s: s.squeeze(dim - 1), up)
    dense = _dense_axes(x)
    if dense:
        d = data.draw(st.sampled_from(dense))
        # a dense axis whose size is not 1 stays, like torch
        check(lambda v: raggedfn.squeeze(v, d), lambda s: s.squeeze(d - 1), x)


@SETTINGS
@given(data=st.data(), dtype=FLOATS)
def test_flatten_and_unflatten_dense_runs(data, dtype) -> None:
    x = data.draw(raggeds(dtype=dtype, requires_grad=True, feature_shape=FEATURES))
    shape = x.shape
    runs = [
        (s, e)
        for s in range(1, x.ndim)
        for e in range(s, x.ndim)
        if all(shape[p] is not None for p in range(s, e + 1))
    ]
    if not runs:
        return
    s, e = data.draw(st.sampled_from(runs))
    flat = check(lambda v: raggedfn.flatten(v, s, e), lambda t: t.flatten(s - 1, e - 1), x)
    sizes = [shape[p] for p in range(s, e + 1)]
    if len(sizes) > 1:
        unknown = data.draw(st.integers(-1, len(sizes) - 1))
        if unknown >= 0 and math.prod(sizes[:unknown] + sizes[unknown + 1 :]):
            sizes[unknown] = -1
        check(
            lambda v: raggedfn.unflatten(v, s, sizes),
            lambda t: t.unflatten(s - 1, sizes),
            flat.with_values(flat.values.detach().requires_grad_(True)),
        )


@SETTINGS
@given(data=st.data(), dtype=FLOATS)
def test_reshape_dense_groups(data, dtype) -> None:
    x = data.draw(raggeds(dtype=dtype, requires_grad=True, feature_shape=FEATURES))
    shape = list(x.shape)
    # merge each run of dense axes between ragged axes, then split it as (1, n)
    new = [-1]
    run = 1
    for size in [*shape[1:], None]:
        if size is None:
            new += [1, run]
            new.append(None)
            run = 1
        else:
            run *= size
    new = new[:-1]

    ragged_positions = [p - 1 for p in x.ragged_dims]

    def reference(t):
        ragged = iter(t.shape[p] for p in ragged_positions)
        return t.reshape([next(ragged) if s is None else s for s in new[1:]])

    out = check(lambda v: raggedfn.reshape(v, new), reference, x)
    assert out.shape[1:] == tuple(new[1:])


@SETTINGS
@given(x=raggeds(dtype=FLOATS, requires_grad=True, feature_shape=FEATURES))
def test_contiguous_is_standard_storage(x) -> None:
    out = check(raggedfn.contiguous, lambda s: s, x)
    positions = tuple(p for p, a in enumerate(x.layout.axes) if a.ragged)
    assert out.layout == Layout.from_ragged_positions(x.layout.rank, positions)
    assert out.values.is_contiguous()
