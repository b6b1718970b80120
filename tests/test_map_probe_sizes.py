"""The documented limit of ``map``'s output structure below the probe sizes
(docs/map.md, "Known limits"): the probe trace runs size class ``k`` at ``2 + k``, so an
output whose shape differs from the first trace's only below that size is dense on a
batch whose samples all reach it, and ragged once a sample falls below. Values always
equal the per-sample loop's; these tests pin which kind each batch gets."""

from __future__ import annotations

import warnings

import pytest
import torch

import raggedfn
from property_tests.map_oracle import assert_restacked
from property_tests.reference import loop


def _batch(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, 2, generator=gen, dtype=torch.float64) for n in lengths]
    )


def _kind(f, t_lengths, u_lengths):
    t, u = _batch(t_lengths, 0), _batch(u_lengths, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
        got = raggedfn.map(f, t, u)
    assert_restacked(got, loop(f, t, u))
    return "ragged" if isinstance(got, raggedfn.Ragged) else "dense"


# t is the first size class (probed at 2), u the second (probed at 3)
def _t_head_2(t, u):
    return t[: min(2, t.shape[0])]


def _t_head_3(t, u):
    return t[: min(3, t.shape[0])]


def _u_head_3(t, u):
    return u[: min(3, u.shape[0])]


def _u_head_4(t, u):
    return u[: min(4, u.shape[0])]


@pytest.mark.parametrize(
    ("f", "t_lengths", "u_lengths", "kind"),
    [
        # at or below the class's probe size: the kind follows the batch
        (_t_head_2, [5, 6], [7, 8], "dense"),
        (_t_head_2, [2, 6], [7, 8], "dense"),
        (_t_head_2, [1, 6], [7, 8], "ragged"),
        (_u_head_3, [5, 6], [3, 8], "dense"),
        (_u_head_3, [5, 6], [2, 8], "ragged"),
        # above it: the probe sees the difference, ragged on every batch
        (_t_head_3, [5, 6], [7, 8], "ragged"),
        (_t_head_3, [2, 6], [7, 8], "ragged"),
        (_u_head_4, [5, 6], [7, 8], "ragged"),
        (_u_head_4, [5, 6], [3, 8], "ragged"),
    ],
)
def test_output_kind_below_each_size_class_probe(f, t_lengths, u_lengths, kind):
    assert _kind(f, t_lengths, u_lengths) == kind


def test_an_empty_batch_gets_the_kind_the_probe_sees():
    empty = raggedfn.from_lengths(
        torch.empty(0, 2, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    )
    dense = raggedfn.map(_t_head_2, empty, empty)
    assert isinstance(dense, torch.Tensor) and dense.shape == (0, 2, 2)
    ragged = raggedfn.map(_t_head_3, empty, empty)
    assert isinstance(ragged, raggedfn.Ragged) and ragged.batch_size == 0
