"""Property tests of from_padded(mask=), positions and segment_ids against per-sample loops."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.reference import assert_same, samples
from property_tests.strategies import raggeds
from raggedfn import Ragged

SETTINGS = settings(deadline=None, max_examples=60)


def ragged_positions(x: Ragged) -> list[int]:
    """Logical sample positions of the ragged axes, ascending."""
    return [p for p, a in enumerate(x.layout.axes) if a.ragged]


@SETTINGS
@given(x=raggeds(), data=st.data())
def test_positions_equal_the_index_along_the_axis(x, data):
    ragged = ragged_positions(x)
    position = data.draw(st.sampled_from(ragged))
    got = raggedfn.positions(x, dim=1 + position)
    expected = []
    for s in samples(x):
        # the sample without its dense axes: index every dense axis at 0
        shape = [s.shape[p] for p in ragged]
        index = torch.arange(s.shape[position]).reshape(
            [-1 if p == position else 1 for p in ragged]
        )
        expected.append(index.expand(shape))
    assert got.dtype == torch.int64
    assert_same(got, expected)


@SETTINGS
@given(x=raggeds())
def test_segment_ids_name_each_rows_sample(x):
    expected: list[int] = []
    for i, s in enumerate(samples(x)):
        rows = 1
        for p in ragged_positions(x):
            rows *= s.shape[p]
        expected.extend([i] * rows)
    got = raggedfn.segment_ids(x)
    assert got.dtype == torch.int64 and got.tolist() == expected


@SETTINGS
@given(x=raggeds(num_ragged=1, dim_order="standard"), data=st.data())
def test_from_padded_mask_takes_the_marked_rows_on_any_side(x, data):
    length = data.draw(st.integers(0, 3)) + max([s.shape[0] for s in samples(x)], default=0)
    rows, masks = [], []
    for s in samples(x):
        # each sample padded on its own side, with a sentinel that must never come back
        left = data.draw(st.integers(0, length - s.shape[0]))
        right = length - s.shape[0] - left
        fill = torch.full((1, *s.shape[1:]), 99, dtype=s.dtype)
        rows.append(
            torch.cat([fill.expand(left, *s.shape[1:]), s, fill.expand(right, *s.shape[1:])])
        )
        masks.append(torch.tensor([0] * left + [1] * s.shape[0] + [0] * right, dtype=torch.int64))
    if not rows:
        return
    got = raggedfn.from_padded(torch.stack(rows), mask=torch.stack(masks))
    assert_same(got, samples(x))
    assert torch.equal(got.offsets, x.offsets)
