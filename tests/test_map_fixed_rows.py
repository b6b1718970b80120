"""A plan whose guards fix the samples' rows (``Eq(s, 0)``, ``Eq(s, 1)``: the plans for
empty and one-row samples that ``torch.diff(..., n)`` asks for) gives fixed-size
results; pointwise ops on the ragged input there batch as fixed-size values (their
rows are equally many) instead of running per sample. Compared with the loop in
values and float64 gradients, and nothing runs per sample."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same, loop
from tests.test_map import pairs, tokens

FUNCTIONS = [
    lambda t: torch.diff(t * 2, dim=0),
    lambda t: torch.diff((t > 0).long(), n=2, dim=0),
    lambda t: torch.diff(t.exp() + 1, n=3, dim=0) * 2,
    lambda t: torch.diff(t.T.sin(), n=2, dim=1),  # the ragged axis logically last
]


@pytest.mark.parametrize("lengths", [(0,), (1,), (1, 1), (0, 1, 3, 1, 0, 2), (2, 2, 5)])
@pytest.mark.parametrize("which", range(len(FUNCTIONS)))
def test_pointwise_ops_on_rows_fixed_by_a_guard_batch_like_the_loop(lengths, which):
    f = FUNCTIONS[which]
    x = tokens(lengths)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.whole_loop is None and report.partial_loop is None, str(report)
    assert not report.fallback, str(report)


@pytest.mark.parametrize("lengths", [(1, 1), (0, 1, 3, 1, 0, 2)])
def test_gradients_through_rows_fixed_by_a_guard_equal_the_loop(lengths):
    f = FUNCTIONS[2]
    x = tokens(lengths)
    values = x.values.detach().requires_grad_()
    y = raggedfn.map(f, x.with_values(values))
    ref = values.detach().requires_grad_()
    pieces = [f(t) for t in ref.split(x.lengths.tolist())]
    (g,) = torch.autograd.grad(y.values.square().sum(), values)
    (g_ref,) = torch.autograd.grad(sum(p.square().sum() for p in pieces), ref)
    torch.testing.assert_close(g, g_ref)


def _three_rows_apart(t):
    if t.shape[0] == 3:  # a guard Eq(s, 3): that plan's results have fixed sizes
        return (t.T.exp() * 2).cumsum(1)
    return t.T.cumsum(1)


@pytest.mark.parametrize("lengths", [(3, 5, 3), (3,), (5, 3, 3, 2)])
def test_pointwise_ops_on_rows_fixed_by_a_python_branch_batch_like_the_loop(lengths):
    x = tokens(lengths)
    report = raggedfn.map_report(_three_rows_apart, x)
    assert_same(report.output, loop(_three_rows_apart, x))
    assert report.whole_loop is None and report.partial_loop is None, str(report)
    assert not report.fallback, str(report)


def test_pointwise_ops_on_empty_pair_states_batch():
    # a pair state's empty samples: a plan whose result has no elements (its sizes fixed
    # to 0); the product runs batched there, the diff of nothing per sample
    f = lambda p: torch.diff(p * 2, dim=0)  # noqa: E731
    x = pairs((3, 0, 1, 0))
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert set(report.fallback) <= {"aten.diff.default"}, str(report)


@pytest.mark.parametrize("lengths", [(0,), (0, 2), (0, 0)])
def test_results_without_elements_keep_the_autograd_history_of_the_loop(lengths):
    # a plan for empty samples: the loop's empty results require grad, so must map's
    f = lambda t: (t * 2 + 1 if t.shape[0] < 1 else t - 1)[0:]  # noqa: E731
    x = tokens(lengths)
    values = x.values.detach().requires_grad_()
    y = raggedfn.map(f, x.with_values(values))
    pieces = [f(t) for t in values.split(x.lengths.tolist())]
    assert y.values.requires_grad == any(p.requires_grad for p in pieces)
    assert_same(y, loop(f, x))
    (g,) = torch.autograd.grad(y.values.sum(), values, allow_unused=True)
    (g_ref,) = torch.autograd.grad(sum(p.sum() for p in pieces), values, allow_unused=True)
    assert (g is None) == (g_ref is None)
    if g is not None:
        torch.testing.assert_close(g, g_ref)


def _diff_of_four_rows_apart(t):
    if t.shape[0] == 4:  # a guard Eq(s, 4): diff's rows are a fixed number there
        return torch.diff(t, dim=0) * 2
    return torch.diff(t, dim=0)


def _diff_of_four_rows_apart_last(t):  # the ragged axis logically last, a prepend
    if t.shape[0] == 4:
        return torch.diff(t.T, n=2, dim=1, prepend=t[:1].T) * 2
    return torch.diff(t.T, n=2, dim=1, prepend=t[:1].T)


@pytest.mark.parametrize("f", [_diff_of_four_rows_apart, _diff_of_four_rows_apart_last])
@pytest.mark.parametrize("lengths", [(4, 2, 4, 5, 4), (4, 4)])
def test_diff_on_several_samples_whose_rows_a_python_branch_fixed_equals_the_loop(f, lengths):
    # diff of the ragged input in the plan for 4 rows: its result has 3 or 4 rows per
    # sample fixed by the guard (a dense axis), several samples there; each sample's rows
    # stay together, as in the loop; values and float64 gradients
    x = tokens(lengths)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.whole_loop is None and report.partial_loop is None, str(report)
    assert not report.fallback, str(report)
    values = x.values.detach().requires_grad_()
    y = raggedfn.map(f, x.with_values(values))
    ref = values.detach().requires_grad_()
    pieces = [f(t) for t in ref.split(x.lengths.tolist())]
    (g,) = torch.autograd.grad(y.values.square().sum(), values)
    (g_ref,) = torch.autograd.grad(sum(p.square().sum() for p in pieces), ref)
    torch.testing.assert_close(g, g_ref)
