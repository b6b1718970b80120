"""``from_sizes`` under symbolic tracing: the number of ragged axes ``R`` arrives as a
SymInt (make_fx's ``tracing_mode="symbolic"``, ``torch.compile(dynamic=True)``) and is
specialized (the layout is static); every other size stays symbolic. Each traced graph
is compared with eager on batches of other sizes."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

import raggedfn

D = 7  # (unlike every B, R and T below: duck sizing would tie their symbols)


def _batch(sizes, seed=0):
    sizes = torch.tensor(sizes, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    total = int(sizes.prod(dim=1).sum())
    return torch.randn(total, D, generator=gen, dtype=torch.float64), sizes


# (first batch, later batches of the same R with other B and T, ragged_dims, the dense
# logical axis)
CASES = {
    "R2": ([[2, 2], [3, 3]], [[[1, 2], [3, 4], [2, 3]], [[4, 1]]], None, 3),
    "R3": (
        [[2, 3, 2], [3, 2, 4]],
        [[[1, 2, 3]], [[2, 2, 2], [0, 3, 1], [1, 1, 5]]],
        (1, 2, 4),
        3,
    ),
}


def _build(ragged_dims, dense_axis):
    def build(values, sizes):
        x = raggedfn.from_sizes(values, sizes, ragged_dims)
        return (x * 3).values, x.offsets, x.sizes, raggedfn.sum(x, dense_axis).values

    return build


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_sizes_under_make_fx_symbolic_equals_eager(case):
    first, later, ragged_dims, dense_axis = CASES[case]
    build = _build(ragged_dims, dense_axis)
    graph = make_fx(build, tracing_mode="symbolic")(*_batch(first))
    for n, sizes in enumerate([first, *later]):
        args = _batch(sizes, seed=n)
        _same(graph(*args), build(*args))
    # the data checks are asserts in the graph (sizes that do not add up to T)
    values, sizes = _batch(later[0])
    with pytest.raises(RuntimeError, match="from_sizes: sizes must account"):
        graph(values[1:], sizes)


def test_from_sizes_compiles_with_dynamic_sizes_in_one_graph():
    _, _, ragged_dims, dense_axis = CASES["R2"]
    build = _build(ragged_dims, dense_axis)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(build, fullgraph=True, dynamic=True, backend="aot_eager")
    # batches of 2 or more samples (a batch of one specializes B = 1 in torch), the first
    # with B != R: duck sizing gives equal sizes one symbol, and R is specialized
    batches = [[[1, 2], [3, 4], [2, 3]], [[4, 1], [0, 2], [5, 5], [1, 1]], [[2, 3]] * 5]
    for n, sizes in enumerate(batches):
        args = _batch(sizes, seed=n)
        _same(compiled(*args), build(*args))
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
