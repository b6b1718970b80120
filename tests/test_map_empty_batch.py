"""``raggedfn.map`` on a batch of no samples: the result has the structure ``f`` gives
(an empty ``Ragged`` where an output axis follows the sample sizes), or a ``RaggedError``
where that structure cannot be known; never the fixed shape of one trace's example.
Traces pinned by ``len(t)`` whose probe on small sizes stops are traced again on other
large sizes (``_plans._structure``).

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
    # len(t) fixes the size in the trace; t[4] stops the probe trace on small sizes, so
    # a trace on other large sizes tells that the output follows the length
    return t.new_zeros(len(t)) + t[4, 0]


def _five_zeros_past_four(t):
    return t.new_zeros(5) + t[4, 0] * len(t)


def _zeros_by_length_past_four_first_empty(t):
    return t.new_zeros(len(t)) + t[4, 0]


def _zeros_by_length_only_at_five(t):
    # both probes stop: at 2 on t[4], at 6 on the branch on the data
    z = t.new_zeros(len(t)) + t[4, 0]
    if len(t) == 5:
        return z
    return z if bool(t.sum() > 0) else -z


def _zeros_by_length(t):
    return t.new_zeros(len(t))


def _scaled_sum_past_four(t):
    return t.sum() * len(t) + t[4, 0]


def _assert_empty_ragged(out, dense=()):
    assert isinstance(out, raggedfn.Ragged) and out.batch_size == 0
    assert out.num_ragged == 1 and out.values.shape == (0, *dense)
    assert out.dtype == torch.float64


@pytest.mark.parametrize(
    "f", [_zeros_by_length, _zeros_by_length_past_four], ids=["probe", "probe_stops"]
)
def test_empty_batch_of_a_pinned_trace_is_ragged_where_f_follows_the_length(f):
    # reference for the kind: on samples (even of equal lengths) the output follows
    # the length; the empty batch has the same structure
    for lengths in ([6, 7], [5, 5]):
        assert isinstance(_loop_agrees(f, lengths), raggedfn.Ragged)
    _assert_empty_ragged(_map(f, _batch([])[0]))


def test_empty_batch_of_a_pinned_trace_of_fixed_size_is_dense():
    for lengths in ([6, 7], [5, 5]):
        assert _loop_agrees(_five_zeros_past_four, lengths).shape == (2, 5)
    out = _map(_five_zeros_past_four, _batch([])[0])
    assert isinstance(out, torch.Tensor) and out.shape == (0, 5)


def test_empty_batch_as_the_first_call_has_the_structure_too():
    # no earlier call: the traces are made on the empty batch itself
    _assert_empty_ragged(_map(_zeros_by_length_past_four_first_empty, _batch([])[0]))
    got = _loop_agrees(_zeros_by_length_past_four_first_empty, [6, 7, 5])
    assert isinstance(got, raggedfn.Ragged)


def test_empty_batch_is_refused_where_no_probe_completes():
    x, _ = _batch([])
    with pytest.raises(RaggedError, match="batch of no samples"):
        _map(_zeros_by_length_only_at_five, x)
    # with samples: ragged where sizes differ, the documented limit (docs/map.md)
    assert isinstance(_loop_agrees(_zeros_by_length_only_at_five, [6, 7, 5]), raggedfn.Ragged)
    same = _loop_agrees(_zeros_by_length_only_at_five, [5, 5])
    assert isinstance(same, torch.Tensor) and same.shape == (2, 5)


def test_empty_batch_of_a_per_sample_scalar_is_known_without_the_probe():
    # an output without axes cannot be ragged: a [0] tensor whatever the probes do
    assert _loop_agrees(_scaled_sum_past_four, [6, 7]).shape == (2,)
    x, _ = _batch([])
    out = _map(_scaled_sum_past_four, x)
    assert isinstance(out, torch.Tensor) and out.shape == (0,) and out.dtype == torch.float64
