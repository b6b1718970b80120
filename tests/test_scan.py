"""cumsum: each of its four paths with values written out, and non-finite entries."""

from __future__ import annotations

import pytest
import torch

import raggedfn

INF = float("inf")


def pairs() -> raggedfn.Ragged:
    """Two samples of logical shape (N*, M*): [[1, 2, 3], [4, 5, 6]] and [[7], [8]]."""
    values = torch.arange(1.0, 9.0, dtype=torch.float64)
    return raggedfn.from_sizes(values, torch.tensor([[2, 3], [2, 1]]))


@pytest.mark.parametrize("dim", [1, -2])
def test_first_of_two_ragged_axes_moves_the_lines_and_is_inclusive(dim):
    """Along N (not the innermost ragged axis): the lines are gathered innermost first."""
    out = raggedfn.cumsum(pairs(), dim)
    assert out.values.tolist() == [1, 2, 3, 5, 7, 9, 7, 15]
    assert out.offsets is pairs().offsets or torch.equal(out.offsets, pairs().offsets)


def test_last_of_two_ragged_axes_is_inclusive_per_line():
    assert raggedfn.cumsum(pairs(), 2).values.tolist() == [1, 3, 6, 4, 9, 15, 7, 8]


def test_one_ragged_axis_restarts_per_sample_and_dense_axis_runs_on_values():
    x = raggedfn.from_list([torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6]])])
    assert raggedfn.cumsum(x, 1).values.tolist() == [[1, 2], [4, 6], [5, 6]]
    assert raggedfn.cumsum(x, 2).values.tolist() == [[1, 3], [3, 7], [5, 11]]
    assert raggedfn.cumsum(x, 1).dtype == torch.int64  # torch's promotion of integers


@pytest.mark.parametrize("dim", [1, 2])
def test_dtype_casts_first_on_every_path(dim):
    x = raggedfn.from_sizes(torch.arange(1, 9, dtype=torch.int32), torch.tensor([[2, 3], [2, 1]]))
    out = raggedfn.cumsum(x, dim, dtype=torch.float32)
    assert out.dtype == torch.float32
    want = raggedfn.cumsum(pairs(), dim).values.float()
    assert torch.equal(out.values, want)
    tokens = raggedfn.from_lengths(torch.tensor([1, 2, 3]), [2, 1])
    assert raggedfn.cumsum(tokens, 1, dtype=torch.float64).values.tolist() == [1.0, 3.0, 3.0]


@pytest.mark.parametrize("dim", [1, 2])
def test_infinities_stay_inside_their_line(dim):
    """-inf in one line must not turn later lines or samples into NaN (inf - inf)."""
    values = torch.tensor([-INF, 2.0, 3.0, 4.0, INF, -INF, 7.0, 8.0], dtype=torch.float64)
    x = raggedfn.from_sizes(values, torch.tensor([[2, 3], [2, 1]]))
    out = raggedfn.cumsum(x, dim)
    dims = {1: 0, 2: 1}
    want = [
        torch.cumsum(s, dims[dim]).reshape(-1)
        for s in (values[:6].reshape(2, 3), values[6:].reshape(2, 1))
    ]
    torch.testing.assert_close(out.values, torch.cat(want), equal_nan=True)
    tokens = raggedfn.from_lengths(torch.tensor([-INF, 1.0, 2.0, 3.0]), [2, 2])
    assert raggedfn.cumsum(tokens, 1).values.tolist() == [-INF, -INF, 2.0, 5.0]


def test_gradient_of_finite_entries_is_the_reverse_running_sum():
    values = torch.tensor([-INF, 1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    out = raggedfn.cumsum(raggedfn.from_lengths(values, [2, 2]), 1)
    loss = torch.where(torch.isfinite(out.values), out.values, 0.0).sum()
    (grad,) = torch.autograd.grad(loss, values)
    assert grad.tolist() == [0.0, 0.0, 2.0, 1.0]


@pytest.mark.parametrize("order", ["small-first", "large-first"])
def test_a_sample_is_as_exact_as_its_own_cumsum_whatever_its_neighbours(order):
    """Issue #19 (20,000-program run): one running sum over all packed rows gave a
    float64 sample of magnitude 1e4 an error of eps times its neighbour's 1e15 (five
    digits lost against the loop), in the forward after that neighbour and in the
    backward (a reverse running sum) before it."""
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(5, 3, generator=gen, dtype=torch.float64) * 1e4
    large = torch.randn(9, 3, generator=gen, dtype=torch.float64) * 1e15
    samples = [small, large] if order == "small-first" else [large, small]
    leaves = [s.clone().requires_grad_() for s in samples]
    out = raggedfn.cumsum(raggedfn.from_list(leaves), 1)
    want = [torch.cumsum(s, 0) for s in leaves]
    weights = [torch.randn(s.shape, generator=gen, dtype=torch.float64) for s in samples]
    cotangent = torch.cat(
        [w * 10.0 ** (4 if s is small else 15) for w, s in zip(weights, samples, strict=True)]
    )
    got_grads = torch.autograd.grad(out.values, leaves, cotangent)
    want_grads = torch.autograd.grad(want, leaves, list(cotangent.split([len(s) for s in samples])))
    for got, expected in zip(raggedfn.unbind(out), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)
    for got, expected in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)
