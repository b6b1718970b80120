"""``raggedfn.map`` over nested values: ``f`` gets a one-level ``Ragged`` per sample.

``f`` built from raggedfn ops and torch code on their dense results runs batched
(tests/test_map_nested_batched.py has the details); what the batched run cannot
stand for (a ``map`` inside ``f``, reading a sample's sizes) runs per sample with a
``RaggedPerformanceWarning``. Tensor results restack as usual, ``Ragged`` results as
a value with one nested level more, each checked against the loop either way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import raggedfn


def _documents() -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(0)

    def t(n: int) -> torch.Tensor:
        return torch.randn(n, 3, generator=gen, dtype=torch.float64)

    return raggedfn.from_list([[t(2), t(3)], [], [t(1)], [t(0), t(4)]])


def _map(f: Callable[[raggedfn.Ragged], Any], x: raggedfn.Ragged, batched: bool) -> Any:
    """``raggedfn.map`` over a nested value: batched (no warning, the report says so),
    or per sample with a warning."""
    if batched:
        assert raggedfn.map_report(f, x).fully_batched
        with warnings.catch_warnings():
            warnings.simplefilter("error", raggedfn.RaggedPerformanceWarning)
            return raggedfn.map(f, x)
    with pytest.warns(raggedfn.RaggedPerformanceWarning, match="nested value"):
        return raggedfn.map(f, x)


def _loop(f: Callable[[raggedfn.Ragged], Any], x: raggedfn.Ragged) -> list[Any]:
    return [f(x[i]) for i in range(x.batch_size)]


def test_samples_are_one_level_ragged_values() -> None:
    x = _documents()
    seen: list[raggedfn.Ragged] = []

    def f(sample: raggedfn.Ragged) -> torch.Tensor:
        if isinstance(sample, raggedfn.Ragged):
            seen.append(sample)
        return raggedfn.sum(sample, 1)

    _map(f, x, batched=True)
    assert seen and all(s.layout == raggedfn.Layout("r0 d0") for s in seen)


@pytest.mark.parametrize(
    ("f", "batched"),
    [
        (lambda s: raggedfn.sum(s, 1), True),  # (S_i, D): one vector per sentence
        (lambda s: raggedfn.map(lambda t: t.softmax(0).sum(0), s), False),  # map inside f
    ],
    ids=["raggedfn-op", "inner-map"],
)
def test_dense_results_equal_the_loop(f: Callable[[raggedfn.Ragged], Any], batched: bool) -> None:
    x = _documents()
    got = _map(f, x, batched)
    expected = _loop(f, x)
    assert isinstance(got, raggedfn.Ragged)
    assert got.lengths.tolist() == [e.shape[0] for e in expected]
    torch.testing.assert_close(got.values, torch.cat(expected))


@pytest.mark.parametrize(
    ("f", "batched"),
    [
        (lambda s: raggedfn.softmax(s, 1), True),  # a Ragged per sample -> a nested result
        (lambda s: s * 2.0, True),  # Ragged operators on the sample
        (lambda s: raggedfn.map(lambda t: t.softmax(0), s), False),
    ],
    ids=["softmax", "operator", "inner-map-ragged"],
)
def test_ragged_results_restack_as_nested_values(
    f: Callable[[raggedfn.Ragged], Any], batched: bool
) -> None:
    x = _documents()
    got = _map(f, x, batched)
    expected = raggedfn.from_list(_loop(f, x))
    assert isinstance(got, raggedfn.Ragged) and isinstance(got.values, torch.Tensor)
    assert got.layout == expected.layout
    assert got.sizes.tolist() == expected.sizes.tolist()
    for mine, theirs in zip(got.row_offsets, expected.row_offsets, strict=True):
        assert torch.equal(mine, theirs)
    torch.testing.assert_close(got.values, expected.values)


def test_map_over_nested_values_runs_per_sample_and_says_so() -> None:
    x = _documents()

    def f(s: raggedfn.Ragged) -> torch.Tensor:
        return raggedfn.sum(s, 1) * len(s)  # the sample's size: the loop's

    report = raggedfn.map_report(f, x)  # (records, no warning)
    assert not report.fully_batched and "nested" in report.whole_loop
    assert "length" in report.whole_loop
    expected = _loop(f, x)
    torch.testing.assert_close(report.output.values, torch.cat(expected))
    with pytest.raises(raggedfn.RaggedError, match="strict=True refuses"):
        raggedfn.map(f, x, strict=True)
