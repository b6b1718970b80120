"""``raggedfn.map`` on a batch of no samples: the result has the structure ``f`` gives
(an empty ``Ragged`` where an output axis follows the sample sizes), or a ``RaggedError``
where that structure cannot be known; never the fixed shape of one trace's example.

The reference for the kind of each output is ``map`` (and the loop) on batches with
samples of different sizes."""

from __future__ import annotations

import warnings

import pytest
import torch

import raggedfn
from property_tests.map_oracle import assert_restacked
from raggedfn import RaggedError

C = 5


def _batch(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = [torch.randn(n, C, generator=gen, dtype=torch.float64) for n in lengths]
    if samples:
        return raggedfn.from_list(samples), samples
    empty = torch.empty(0, C, dtype=torch.float64)
    return raggedfn.from_lengths(empty, torch.zeros(0, dtype=torch.int64)), samples


def _map(f, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
        return raggedfn.map(f, x)


def _loop_agrees(f, lengths):
    x, samples = _batch(lengths)
    got = _map(f, x)
    assert_restacked(got, [f(s.clone()) for s in samples])
    return got


def _zeros_by_length_past_four(t):
    # len(t) fixes the size in the trace; t[4] stops the probe trace on small sizes
    return t.new_zeros(len(t)) + t[4, 0]


def _zeros_by_length(t):
    return t.new_zeros(len(t))


def _scaled_sum_past_four(t):
    return t.sum() * len(t) + t[4, 0]


def test_empty_batch_of_a_pinned_trace_whose_probe_stops_is_refused():
    # on samples the output axis follows the length: Ragged (lengths 6, 7)
    assert isinstance(_loop_agrees(_zeros_by_length_past_four, [6, 7]), raggedfn.Ragged)
    x, _ = _batch([])
    with pytest.raises(RaggedError, match="batch of no samples"):
        _map(_zeros_by_length_past_four, x)


def test_empty_batch_of_a_pinned_trace_whose_probe_completes_is_ragged():
    assert isinstance(_loop_agrees(_zeros_by_length, [6, 7]), raggedfn.Ragged)
    x, _ = _batch([])
    out = _map(_zeros_by_length, x)
    assert isinstance(out, raggedfn.Ragged) and out.batch_size == 0
    assert out.num_ragged == 1 and out.values.shape == (0,) and out.dtype == torch.float64


def test_empty_batch_of_a_per_sample_scalar_is_known_without_the_probe():
    # an output without axes cannot be ragged: a [0] tensor whatever the probe does
    assert _loop_agrees(_scaled_sum_past_four, [6, 7]).shape == (2,)
    x, _ = _batch([])
    out = _map(_scaled_sum_past_four, x)
    assert isinstance(out, torch.Tensor) and out.shape == (0,) and out.dtype == torch.float64


def _zeros_by_length_past_four_first_empty(t):
    return t.new_zeros(len(t)) + t[4, 0]


def test_empty_batch_as_the_first_call_is_refused_too():
    # no earlier call: the trace is made on the empty batch itself
    x, _ = _batch([])
    with pytest.raises(RaggedError, match="batch of no samples"):
        _map(_zeros_by_length_past_four_first_empty, x)
    got = _loop_agrees(_zeros_by_length_past_four_first_empty, [6, 7, 5])
    assert isinstance(got, raggedfn.Ragged)


def test_with_samples_the_kind_of_such_a_trace_follows_the_sizes():
    # the documented limit (docs/map.md): with the probe stopped, an output axis of a
    # pinned trace is ragged when its size differs between samples; values are the loop's
    assert isinstance(_loop_agrees(_zeros_by_length_past_four, [6, 7, 5]), raggedfn.Ragged)
    same = _loop_agrees(_zeros_by_length_past_four, [5, 5])
    assert isinstance(same, torch.Tensor) and same.shape == (2, 5)
