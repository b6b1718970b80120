"""Constructor behaviour that ``make mutate`` found untested (docs/testing.md).

``from_list`` of ``Ragged`` samples and of nested lists (``raggedfn._construct_lists``):
each test reads the result back sample by sample and compares it with the tensors the
lists hold, or asserts the exact refusal; each was seen failing with the surviving
mutant it names applied.
"""

from __future__ import annotations

import pytest
import torch

import raggedfn
from raggedfn import RaggedError

D = 3


def _pair(*sides, seed=0):
    """A value with two ragged axes (rectangles, no row offsets): one ``L x M`` per sample."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(a, b, D, generator=gen) for a, b in sides]
    return raggedfn.from_list(tensors, ragged_dims=(1, 2)), tensors


def _refusal(sample, element, sides):
    return (
        f"Ragged sample {sample}, element {element}, has ragged sizes \\{list(sides)}: "
        "inside a nested value a rectangle that is empty along one ragged axis"
    )


# x_stack_samples__mutmut_31 (`&` -> `|`: the first element with any nonzero later side
# or an empty count is checked, a fine rectangle before the bad one hides it) and
# x_stack_samples__mutmut_40 (`bad = None`: sizes[None] is one nested row, nothing is
# checked).
def test_stacking_refuses_a_later_element_empty_along_one_axis_only():
    ok, _ = _pair((1, 1))
    bad, _ = _pair((2, 3), (0, 5), seed=1)
    assert bad.sizes.tolist() == [[2, 3], [0, 5]]  # a flat value keeps both sides
    with pytest.raises(RaggedError, match=_refusal(1, 1, [0, 5])):
        raggedfn.from_list([ok, bad])


# x_stack_samples__mutmut_35 (`.ne(0)` -> `.ne(1)`: a later side of exactly 1 after an
# empty one is not seen; nested, the 0 x 1 rectangle would read back 0 x 0).
def test_stacking_refuses_an_empty_rectangle_with_a_later_side_of_one():
    ok, _ = _pair((1, 1))
    bad, _ = _pair((0, 1), seed=2)
    with pytest.raises(RaggedError, match=_refusal(1, 0, [0, 1])):
        raggedfn.from_list([ok, bad])


def test_stacking_keeps_rectangles_empty_along_every_axis():
    # the accepted counterpart of the two refusals above, read back per sample
    a, ta = _pair((1, 2))
    b, tb = _pair((0, 0), (2, 2), seed=3)
    x = raggedfn.from_list([a, b])
    assert x.shape == (2, None, None, None, D)
    for i, want in enumerate([ta, tb]):
        got = list(raggedfn.unbind(x[i]))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and torch.equal(g, w)


# x_from_nested_list__mutmut_144 (`device = None`: the lengths land on torch's default
# device instead of the tensors' one). A default device other than the tensors' (here
# `meta`, standing in for `torch.set_default_device("cuda")` with CPU tensors) shows it.
def test_nested_list_lengths_follow_the_tensors_device_not_the_default():
    gen = torch.Generator().manual_seed(4)
    a0, a1, b0 = (torch.randn(n, D, generator=gen) for n in (2, 1, 4))
    with torch.device("meta"):
        x = raggedfn.from_list([[a0, a1], [b0]])
    assert x.values.device == x.sizes.device == torch.device("cpu")
    assert all(p.device == torch.device("cpu") for p in x.row_offsets)
    for i, want in enumerate([[a0, a1], [b0]]):
        got = list(raggedfn.unbind(x[i]))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


# x__first_ragged__mutmut_2 (`_first_ragged(None)`: no Ragged is ever found inside a
# list, so a value of only empty lists and an empty Ragged has no template for its
# dtype and dense shape).
def test_empty_lists_beside_an_empty_ragged_take_its_dtype_and_shape():
    empty = raggedfn.from_lengths(
        torch.empty(0, D, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    )
    x = raggedfn.from_list([[], empty])
    assert x.shape == (2, None, None, D)
    assert x.values.dtype == torch.float64 and x.values.shape == (0, D)
    assert [x[i].batch_size for i in range(2)] == [0, 0]
