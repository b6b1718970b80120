"""Segment ids derived from offsets: values, safety on malformed offsets, the eager reuse."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import raggedfn
from raggedfn import _index
from raggedfn._index import offsets_of, segment_ids


def _reference(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Row t belongs to the sample i with offsets[i] <= t < offsets[i + 1]; B past the end."""
    bounds = offsets.tolist()
    out = []
    for t in range(total):
        owner = next((i for i in range(len(bounds) - 1) if bounds[i] <= t < bounds[i + 1]), None)
        out.append(len(bounds) - 1 if owner is None else owner)
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("lengths", [[], [0], [3], [2, 0, 3], [0, 0, 4, 0], [1] * 7])
def test_segment_ids_and_offsets_match_the_definition(lengths):
    offsets = offsets_of(torch.tensor(lengths, dtype=torch.int64))
    assert offsets.tolist() == [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()]
    total = sum(lengths)
    torch.testing.assert_close(segment_ids(offsets, total), _reference(offsets, total))


@pytest.mark.parametrize(
    "offsets, total",
    [([0, 5, 3, 8], 8), ([0, 2, 9], 5), ([0, -4, 2], 2), ([3, 4, 6], 6), ([0, 1], 4)],
)
def test_malformed_offsets_give_in_range_ids_without_crashing(offsets, total):
    ids = segment_ids(torch.tensor(offsets), total)
    assert ids.shape == (total,)
    assert bool(((ids >= 0) & (ids <= len(offsets) - 1)).all())


def test_eager_ids_are_reused_for_the_same_offsets():
    x = raggedfn.from_lengths(torch.zeros(9, 2), torch.tensor([4, 0, 5]))
    first = segment_ids(x.offsets, 9)
    assert segment_ids(x.offsets, 9) is first
    assert segment_ids(x.with_values(torch.ones(9)).offsets, 9) is first  # shared partition
    assert segment_ids(x.offsets, 8) is not first  # another T is another question


def test_an_in_place_edit_of_the_offsets_or_the_ids_is_noticed():
    offsets = offsets_of(torch.tensor([2, 3]))
    ids = segment_ids(offsets, 5)
    assert ids.tolist() == [0, 0, 1, 1, 1]
    offsets[1] = 4  # modified in place: the remembered ids are stale
    assert segment_ids(offsets, 5).tolist() == [0, 0, 0, 0, 1]
    again = segment_ids(offsets, 5)
    again[0] = 7  # someone wrote into the ids: recompute, do not hand them out
    assert segment_ids(offsets, 5).tolist() == [0, 0, 0, 0, 1]


def test_public_segment_ids_is_a_copy():
    x = raggedfn.from_lengths(torch.arange(5.0), torch.tensor([2, 3]))
    mine, yours = raggedfn.segment_ids(x), raggedfn.segment_ids(x)
    mine.fill_(0)  # the caller's tensor: another caller's and raggedfn's own must not change
    assert yours.tolist() == [0, 0, 1, 1, 1]
    assert raggedfn.segment_ids(x).tolist() == [0, 0, 1, 1, 1]
    assert raggedfn.sum(x, 1).tolist() == [1.0, 9.0]


def test_the_remembered_ids_die_with_the_offsets():
    offsets = offsets_of(torch.tensor([1, 2]))
    segment_ids(offsets, 3)
    key = id(offsets)
    assert key in _index._SEGMENT_IDS
    del offsets
    gc.collect()
    assert key not in _index._SEGMENT_IDS


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("where", ["inference_mode", "dispatch_mode", "vmap", "pre_dispatch"])
def test_nothing_is_remembered_inside_modes_and_transforms(where):
    offsets = offsets_of(torch.tensor([2, 1]))
    before = dict(_index._SEGMENT_IDS)
    if where == "inference_mode":
        with torch.inference_mode():
            segment_ids(offsets, 3)
    elif where == "dispatch_mode":
        with _Passthrough():
            segment_ids(offsets, 3)
    elif where == "pre_dispatch":  # make_fx(pre_dispatch=True), as map traces
        from torch.fx.experimental.proxy_tensor import make_fx

        make_fx(lambda v: v + segment_ids(offsets, 3), pre_dispatch=True)(torch.zeros(3))
    else:
        torch.func.vmap(lambda v: v + segment_ids(offsets, 3))(torch.zeros(2, 3))
    assert id(offsets) not in _index._SEGMENT_IDS
    assert set(_index._SEGMENT_IDS) <= set(before) | {id(offsets)}


def test_ids_remembered_eagerly_serve_a_later_backward():
    x = raggedfn.from_lengths(torch.randn(5, 3), torch.tensor([2, 3]))
    raggedfn.sum(x, 1)  # remembers the ids
    weight = torch.arange(15.0).view(5, 3)
    values = x.values.clone().requires_grad_(True)
    out = raggedfn.softmax(x.with_values(values), 1).values
    (grad,) = torch.autograd.grad((out * weight).sum(), values)
    want = []
    for v, w in zip(x.values.split([2, 3]), weight.split([2, 3]), strict=True):
        v = v.clone().requires_grad_(True)
        want.append(torch.autograd.grad((torch.softmax(v, 0) * w).sum(), v)[0])
    torch.testing.assert_close(grad, torch.cat(want))


def test_bounds_are_remembered_with_the_ids_and_an_edit_is_noticed():
    offsets = offsets_of(torch.tensor([2, 0, 3]))
    ids, bounds = _index.segment_bounds(offsets, 5)
    assert bounds.tolist() == [0, 2, 2, 5] and ids.tolist() == _reference(offsets, 5).tolist()
    assert _index.segment_bounds(offsets, 5)[1] is bounds
    bounds[1] = 4  # someone wrote into the bounds: recompute, do not hand them out
    assert _index.segment_bounds(offsets, 5)[1].tolist() == [0, 2, 2, 5]
    offsets[1] = 1  # the offsets changed in place: new ids and bounds
    ids, bounds = _index.segment_bounds(offsets, 5)
    assert bounds.tolist() == [0, 1, 2, 5] and ids.tolist() == [0, 1, 2, 2, 2]
