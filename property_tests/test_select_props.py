"""Per-sample indexing ops equal the per-sample loop in values and gradients."""

from __future__ import annotations

import itertools

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests._pairs_helpers import check_against_loop, like
from property_tests.reference import assert_same, samples
from property_tests.strategies import raggeds
from raggedfn import Layout, Ragged

DTYPES = st.sampled_from([torch.float64, torch.float32])
FAST = settings(deadline=None, max_examples=40)
ANY = raggeds(
    num_ragged=st.sampled_from([1, 2]), feature_shape=st.sampled_from([(), (3,)]), dtype=DTYPES
)


def logical_dims(x: Ragged) -> st.SearchStrategy[int]:
    return st.sampled_from([*list(range(1, x.ndim)), -1])


@FAST
@given(ANY, st.data())
def test_narrow(x, data):
    dim = data.draw(logical_dims(x))
    start = data.draw(st.integers(-4, 4))
    length = data.draw(st.integers(0, 4))
    axis = x.layout.axes[dim % x.ndim - 1]
    if not axis.ragged:
        start = abs(start) % (x.shape[dim] + 1)

    def ref(s):
        size = s.shape[dim - 1 if dim > 0 else dim]
        begin = max(size + start, 0) if start < 0 else min(start, size)
        return s.narrow(dim - 1 if dim > 0 else dim, begin, max(0, min(length, size - begin)))

    check_against_loop(lambda a: raggedfn.narrow(a, dim, start, length), ref, x)


@FAST
@given(ANY, st.data())
def test_cat(x, data):
    dim = data.draw(st.sampled_from([*list(range(x.ndim)), -1]))
    sample_dim = dim - 1 if dim > 0 else dim
    axis = x.layout.axes[dim % x.ndim - 1] if dim % x.ndim else None
    if axis is not None and axis.ragged:
        # another value with the same sizes except along dim
        k = axis.index
        sizes = x.sizes.clone()
        sizes[:, k] = torch.tensor(
            data.draw(st.lists(st.integers(0, 3), min_size=x.batch_size, max_size=x.batch_size)),
            dtype=torch.int64,
        )
        counts = sizes.prod(dim=1)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        values = torch.randn(int(offsets[-1]), *x.values.shape[1:], dtype=torch.float64).to(x.dtype)
        y = Ragged(values, offsets, sizes, x.layout)
    else:
        y = like(x, seed=5)
    if dim % x.ndim == 0:
        got = raggedfn.cat([x, y, x], 0)
        assert_same(got, samples(x) + samples(y) + samples(x))
        return
    check_against_loop(
        lambda a, b: raggedfn.cat([a, b, a], dim),
        lambda a, b: torch.cat([a, b, a], sample_dim),
        x,
        y,
    )


def random_index(x: Ragged, dim: int, data, broadcast: bool) -> Ragged:
    """An int64 index with x's layout; along ragged ``dim`` new per-sample lengths."""
    axis = x.layout.axes[dim % x.ndim - 1]
    sizes = x.sizes.clone()
    if axis.ragged:
        new = [data.draw(st.integers(0, 4)) if int(n) else 0 for n in x.sizes[:, axis.index]]
        sizes[:, axis.index] = torch.tensor(new, dtype=torch.int64)
    counts = sizes.prod(dim=1) if sizes.shape[1] else sizes.new_ones(x.batch_size)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    dense = list(x.values.shape[1:])
    if not axis.ragged:
        dense[axis.index] = data.draw(st.integers(0, 4)) if dense[axis.index] else 0
    elif broadcast and dense:
        dense[0] = data.draw(st.sampled_from([1, dense[0]]))
    total = int(offsets[-1])
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    raw = torch.randint(0, 1 << 30, (total, *dense), generator=gen)
    segments = torch.repeat_interleave(torch.arange(x.batch_size), counts, output_size=total)
    if axis.ragged:
        limit = x.sizes[segments, axis.index].clamp(min=1).view(-1, *[1] * len(dense))
    else:
        limit = max(x.values.shape[1 + axis.index], 1)
    return Ragged(raw % limit, offsets, sizes, x.layout)


@FAST
@given(ANY, st.data())
def test_gather_and_take_along_dim(x, data):
    dim = data.draw(logical_dims(x))
    sample_dim = dim - 1 if dim > 0 else dim
    index = random_index(x, dim, data, broadcast=False)
    check_against_loop(
        lambda a, i: raggedfn.gather(a, dim, i),
        lambda a, i: torch.gather(a, sample_dim, i),
        x,
        index,
    )
    index = random_index(x, dim, data, broadcast=True)
    check_against_loop(
        lambda a, i: raggedfn.take_along_dim(a, i, dim),
        lambda a, i: torch.take_along_dim(a, i, sample_dim),
        x,
        index,
    )


@FAST
@given(
    raggeds(
        num_ragged=st.sampled_from([1, 2]),
        feature_shape=st.sampled_from([(), (3,), (2, 3)]),
        dtype=DTYPES,
        dim_order="ragged_first",
    ),
    st.integers(0, 1000),
)
def test_masked_select(x, seed):
    assume(all(a.index == k for k, a in enumerate(x.layout.axes[: x.num_ragged])))
    gen = torch.Generator().manual_seed(seed)
    full = Ragged(torch.rand(x.values.shape, generator=gen) < 0.5, x.offsets, x.sizes, x.layout)
    check_against_loop(raggedfn.masked_select, torch.masked_select, x, full)
    if x.layout.num_dense:
        rows = Ragged(
            torch.rand(x.values.shape[0], generator=gen) < 0.5,
            x.offsets,
            x.sizes,
            Layout.standard(x.num_ragged, 0),
        )
        check_against_loop(raggedfn.masked_select, lambda a, m: a[m], x, rows)


@FAST
@given(ANY, st.data())
def test_sort_argsort_topk(x, data):
    dim = data.draw(logical_dims(x))
    sample_dim = dim - 1 if dim > 0 else dim
    descending = data.draw(st.booleans())

    def ref_sort(a):
        out = torch.sort(a, dim=sample_dim, descending=descending, stable=True)
        return out.values, out.indices

    check_against_loop(lambda a: raggedfn.sort(a, dim, descending=descending), ref_sort, x)
    check_against_loop(
        lambda a: raggedfn.argsort(a, dim, descending=descending),
        lambda a: torch.argsort(a, dim=sample_dim, descending=descending, stable=True),
        x,
    )
    axis = x.layout.axes[dim % x.ndim - 1]
    k = data.draw(st.integers(0, 4 if axis.ragged else x.shape[dim]))

    def ref_topk(a):
        kk = min(k, a.shape[sample_dim])
        out = torch.sort(a, dim=sample_dim, descending=descending, stable=True)
        return out.values.narrow(sample_dim, 0, kk), out.indices.narrow(sample_dim, 0, kk)

    check_against_loop(lambda a: raggedfn.topk(a, k, dim, largest=descending), ref_topk, x)


@FAST
@given(
    raggeds(
        num_ragged=1,
        feature_shape=st.sampled_from([(), (2, 3)]),
        dtype=DTYPES,
        dim_order="ragged_first",
        max_size=7,
    )
)
def test_pairs(x):
    def square(a):
        n = a.shape[0]
        return a[:, None].expand(n, n, *a.shape[1:]), a[None, :].expand(n, n, *a.shape[1:])

    check_against_loop(raggedfn.pairs, square, x)
    forms = {
        (True, False): lambda n: [(i, j) for i in range(n) for j in range(n) if i != j],
        (False, False): lambda n: list(itertools.combinations(range(n), 2)),
        (False, True): lambda n: list(itertools.combinations_with_replacement(range(n), 2)),
    }
    for (ordered, diagonal), enumerate_pairs in forms.items():

        def ref(a, enumerate_pairs=enumerate_pairs):
            idx = torch.tensor(enumerate_pairs(a.shape[0]), dtype=torch.int64).reshape(-1, 2)
            return a[idx[:, 0]], a[idx[:, 1]]

        check_against_loop(
            lambda a, o=ordered, d=diagonal: raggedfn.pairs(a, diagonal=d, ordered=o), ref, x
        )
