"""Layout / Axis: the static dim order of a sample."""

import pytest

from raggedfn import Axis, Layout, RaggedError


def test_standard_puts_ragged_axes_first():
    layout = Layout.standard(2, 1)
    assert layout.axes == (Axis(True, 0), Axis(True, 1), Axis(False, 0))
    assert (layout.rank, layout.num_ragged, layout.num_dense) == (3, 2, 1)
    assert layout.physical_to_logical() == (0, 1, 2)
    assert layout.logical_to_physical() == (0, 1, 2)


def test_from_ragged_positions_numbers_each_kind_in_position_order():
    # images [C, H*, W*]: channel dense, the two spatial axes ragged
    layout = Layout.from_ragged_positions(3, (1, 2))
    assert layout.axes == (Axis(False, 0), Axis(True, 0), Axis(True, 1))
    # physical sample is [H, W, C]; logical is [C, H, W]
    assert layout.physical_to_logical() == (2, 0, 1)
    assert layout.logical_to_physical() == (1, 2, 0)
    assert layout.position(Axis(True, 1)) == 2
    assert layout.position(Axis(False, 0)) == 0


def test_permutations_are_inverse():
    layout = Layout((Axis(False, 1), Axis(True, 1), Axis(False, 0), Axis(True, 0)))
    forward, backward = layout.physical_to_logical(), layout.logical_to_physical()
    assert forward == (3, 1, 2, 0)
    assert [forward[b] for b in backward] == [0, 1, 2, 3]
    assert [backward[f] for f in forward] == [0, 1, 2, 3]


def test_describe_marks_ragged_axes():
    assert Layout.standard(1, 1).describe((64,)) == "(N*, 64)"
    assert Layout.standard(1, 0).describe(()) == "(N*,)"
    assert Layout.from_ragged_positions(3, (1, 2)).describe((3,)) == "(3, N*, M*)"


def test_layout_is_hashable_and_compares_by_value():
    assert Layout.standard(1, 2) == Layout.standard(1, 2)
    assert hash(Layout.standard(1, 2)) == hash(Layout.standard(1, 2))
    assert Layout.standard(1, 2) != Layout.standard(2, 1)
    with pytest.raises(AttributeError):
        Layout.standard(1, 0).axes = ()  # type: ignore[misc]


@pytest.mark.parametrize(
    "axes",
    [
        (Axis(True, 1),),
        (Axis(True, 0), Axis(True, 0)),
        (Axis(False, 0), Axis(False, 2)),
    ],
)
def test_bad_numbering_is_refused(axes):
    with pytest.raises(
        RaggedError, match=r"Layout: expected ragged and dense axes numbered 0\.\.n-1 each, got '"
    ):
        Layout(axes)


@pytest.mark.parametrize("code", ["", "r0", "r0 d0", "d0 r0 d1", "r0 n1 d0", "d1 r1 d0 r0"])
def test_rank_counts_the_axes_of_the_code(code):
    assert Layout(code).rank == len(Layout(code).axes) == len(code.split())
