"""Per-sample indexing: examples, errors, immutability, gradcheck."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same, samples
from raggedfn import Layout, Ragged, RaggedError


def tokens(lengths, dim=None, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (sum(lengths),) if dim is None else (sum(lengths), dim)
    values = torch.randn(shape, generator=gen, dtype=dtype)
    return raggedfn.from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


def test_narrow_clamps_per_sample_and_counts_from_the_end():
    x = raggedfn.from_list([torch.arange(5.0), torch.arange(2.0), torch.arange(0.0)])
    assert raggedfn.narrow(x, 1, 1, 3).lengths.tolist() == [3, 1, 0]
    tail = raggedfn.narrow(x, 1, -2, 2)
    assert tail.values.tolist() == [3.0, 4.0, 0.0, 1.0]


def test_cat_along_a_ragged_axis_of_a_pair_state():
    a = raggedfn.from_list([torch.ones(2, 3), torch.ones(1, 2)], ragged_dims=(1, 2))
    b = raggedfn.from_list([torch.zeros(2, 1), torch.zeros(1, 0)], ragged_dims=(1, 2))
    got = raggedfn.cat([a, b], dim=2)
    assert got.sizes.tolist() == [[2, 4], [1, 2]]
    assert_same(got, [torch.cat([s, t], 1) for s, t in zip(samples(a), samples(b), strict=True)])


def test_topk_is_ragged_and_sorted():
    x = raggedfn.from_list([torch.tensor([1.0, 5.0, 3.0]), torch.tensor([2.0]), torch.zeros(0)])
    values, indices = raggedfn.topk(x, 2, dim=1)
    assert values.lengths.tolist() == [2, 1, 0]
    assert values.values.tolist() == [5.0, 3.0, 2.0]
    assert indices.values.tolist() == [1, 2, 0]
    smallest, _ = raggedfn.topk(x, 2, dim=1, largest=False)
    assert smallest.values.tolist() == [1.0, 3.0, 2.0]


def test_pairs_square_and_combinations():
    x = raggedfn.from_list([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])])
    left, right = raggedfn.pairs(x)
    assert left.shape == (2, None, None) and left.sizes.tolist() == [[3, 3], [1, 1]]
    assert samples(right)[0].tolist() == [[1.0, 2.0, 3.0]] * 3
    a, b = raggedfn.pairs(x, ordered=False, diagonal=True)
    assert a.lengths.tolist() == [6, 1]
    assert list(zip(a.values.tolist(), b.values.tolist(), strict=True)) == [
        (1.0, 1.0),
        (1.0, 2.0),
        (1.0, 3.0),
        (2.0, 2.0),
        (2.0, 3.0),
        (3.0, 3.0),
        (4.0, 4.0),
    ]


def test_pairs_of_long_samples_enumerate_exactly():
    n = 300
    x = raggedfn.from_list([torch.arange(float(n))])
    a, b = raggedfn.pairs(x, ordered=False, diagonal=False)
    expected = torch.combinations(torch.arange(float(n)), 2)
    assert torch.equal(a.values, expected[:, 0]) and torch.equal(b.values, expected[:, 1])


def test_masked_select_rows_and_elements():
    x = tokens([2, 3], dim=2)
    rows = Ragged(
        torch.tensor([True, False, False, True, True]), x.offsets, x.sizes, Layout.standard(1, 0)
    )
    got = raggedfn.masked_select(x, rows)
    assert got.shape == (2, None, 2) and got.lengths.tolist() == [1, 2]
    full = x.with_values(x.values > 0)
    flat = raggedfn.masked_select(x, full)
    assert flat.shape == (2, None)
    assert_same(
        flat, [torch.masked_select(s, m) for s, m in zip(samples(x), samples(full), strict=True)]
    )


def test_gradcheck_and_gradgradcheck_float64():
    x = tokens([3, 0, 4], dim=2)
    index = raggedfn.from_lengths(torch.tensor([[2, 0], [1, 1], [3, 0], [0, 2]]), [2, 0, 2])
    with pytest.raises(RaggedError):  # 2 is out of range along the dense axis of size 2
        raggedfn.gather(x, 2, index)
    index = raggedfn.from_lengths(torch.tensor([[2, 0], [1, 1], [3, 0], [0, 1]]), [2, 0, 2])

    def f(values):
        y = x.with_values(values)
        parts = [
            raggedfn.gather(y, 1, index).values,
            raggedfn.sort(y, 1)[0].values,
            raggedfn.topk(y, 2, 1)[0].values,
            raggedfn.narrow(y, 1, 1, 2).values,
            raggedfn.cat([y, y], 1).values,
            raggedfn.pairs(y, ordered=False)[1].values,
        ]
        return torch.cat([p.reshape(-1) for p in parts])

    values = x.values.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (values,))
    assert torch.autograd.gradgradcheck(f, (values,))


def test_inputs_are_not_mutated():
    x = tokens([3, 2], dim=2)
    before = x.values._version
    raggedfn.sort(x, 1)
    raggedfn.topk(x, 1, 1)
    raggedfn.narrow(x, 1, 0, 1)
    raggedfn.cat([x, x], 1)
    raggedfn.pairs(x)
    raggedfn.masked_select(x, x.with_values(x.values > 0))
    assert x.values._version == before


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x: raggedfn.narrow(x, 0, 0, 1), "axis 0 is the batch axis"),
        (lambda x: raggedfn.narrow(x, 1, 0, -1), "length must be >= 0, got -1"),
        (lambda x: raggedfn.narrow(x, 1, 0.5, 1), "start must be an int, got float 0.5"),
        (
            lambda x: raggedfn.narrow(x, 2, 3, 1),
            "start 3 is out of range for dense axis 2 of size 2",
        ),
        (lambda x: raggedfn.cat([]), "xs must be a non-empty list of Ragged values"),
        (lambda x: raggedfn.cat([x, tokens([1], dim=2)], 1), "xs\\[1\\] has 1 samples, expected 2"),
        (
            lambda x: raggedfn.cat([x, tokens([2, 3], dim=3)], 0),
            r"xs\[1\] has logical shape \(2, None, 3\)",
        ),
        (lambda x: raggedfn.cat([x, tokens([2, 2], dim=2)], 2), "another partition than xs\\[0\\]"),
        (lambda x: raggedfn.gather(x, 1, x), "index must be an int64 Ragged value"),
        (
            lambda x: raggedfn.gather(x, 1, raggedfn.from_lengths(torch.full((2, 2), 5), [1, 1])),
            "index values must lie in \\[0, size of axis 1\\)",
        ),
        (lambda x: raggedfn.masked_select(x, x), "mask must be a boolean Ragged value"),
        (
            lambda x: raggedfn.masked_select(
                x, tokens([1, 1], dim=2).with_values(torch.ones(2, 2, dtype=torch.bool))
            ),
            "mask must have the partition of x",
        ),
        (lambda x: raggedfn.topk(x, -1, 1), "k must be an int >= 0"),
        (lambda x: raggedfn.topk(x, 3, 2), "k = 3 exceeds dense axis 2 of size 2"),
        (
            lambda x: raggedfn.pairs(raggedfn.transpose(x, 1, 2)),
            "x must have one ragged axis at logical axis 1",
        ),
        (lambda x: raggedfn.sort("x", 1), "x must be a Ragged value, got str"),
    ],
)
def test_errors(call, message):
    x = tokens([2, 3], dim=2)
    with pytest.raises(RaggedError, match=message):
        call(x)
