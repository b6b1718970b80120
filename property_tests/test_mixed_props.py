"""Nested and rectangular ragged axes in one value, against per-sample loops.

Two shapes of mixed value: a rectangle per sample whose elements are lists (an
``N x N`` grid of edge lists, layout ``r0 r1 n2``) and lists of rectangles (the
sentences of a document, each an ``L x M`` pair state, ``r0 n1 r2``), plus
deeper mixes. References read the raw partitions by hand (``nested_reference``);
every Ragged result also passes ``raggedfn.check``, which verifies that the
axes it marks rectangular are.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.nested_reference import (
    assert_canonical,
    canonical,
    dense_shape,
    lines,
    reduce,
    stack,
    weighted_sum,
)
from property_tests.nested_strategies import build, level_lengths, nested_raggeds

SETTINGS = settings(deadline=None, max_examples=40)

# (levels, rectangular levels): grid of lists, lists of rectangles, deeper mixes
MIXED = st.sampled_from([(3, (1,)), (3, (2,)), (4, (1, 3)), (4, (2, 3)), (4, (1, 2)), (4, (2,))])


def mixed(**kwargs: Any) -> Any:
    return nested_raggeds(levels=MIXED, max_size=2, **kwargs)


def _grad(result: Any, x: raggedfn.Ragged) -> torch.Tensor:
    total = weighted_sum(result)
    if not total.requires_grad:
        return torch.zeros_like(x.values)
    (g,) = torch.autograd.grad(total, x.values, allow_unused=True)
    return torch.zeros_like(x.values) if g is None else g


def _letters(x: raggedfn.Ragged) -> list[str]:
    return [part[0] for part in x.layout.code.split() if part[0] != "d"]


# ----- construction ---------------------------------------------------------------------


@st.composite
def documents_of_rectangles(draw: Any) -> tuple[list[list[torch.Tensor]], bool]:
    """Per sample a list of ``[L, M, 2]`` tensors (``L = M`` for pair states); a
    rectangle with ``L = 0`` has ``M = 0`` (a nested value keeps no side after it)."""
    square = draw(st.booleans())
    batch = draw(st.integers(1, 3))
    docs = []
    for _ in range(batch):
        doc = []
        for _ in range(draw(st.integers(0, 3))):
            rows = draw(st.integers(0, 3))
            cols = rows if square else (draw(st.integers(0, 3)) if rows else 0)
            doc.append(torch.randn(rows, cols, 2, dtype=torch.float64))
        docs.append(doc)
    if not any(docs):
        docs[0].append(torch.randn(1, 1, 2, dtype=torch.float64))
    return docs, square


@SETTINGS
@given(documents_of_rectangles(), st.booleans())
def test_lists_of_rectangles_round_trip(data: Any, channels_between: bool) -> None:
    docs, _ = data
    if channels_between:  # a dense axis between the rectangle's sides: [L, 2, M]
        docs = [[t.transpose(1, 2) for t in doc] for doc in docs]
        x = raggedfn.from_list(docs, ragged_dims=(1, 2, 4))
        assert x.layout.code == "r0 n1 d0 r2" and x.shape == (len(docs), None, None, 2, None)
    else:
        x = raggedfn.from_list(docs, ragged_dims=(1, 2, 3))
        assert x.layout.code == "r0 n1 r2 d0" and x.shape == (len(docs), None, None, None, 2)
    raggedfn.check(x)
    for i, doc in enumerate(docs):
        sample = x[i]  # one level less: a batch of rectangles (ordinary multi-axis Ragged)
        assert not sample.row_offsets and sample.batch_size == len(doc)
        assert sample.sizes.tolist() == [
            [t.shape[0], t.shape[-1 if channels_between else 1]] for t in doc
        ]
        for j, t in enumerate(doc):
            assert torch.equal(sample[j], t)
    # every level padded: the rectangle's sides to the largest of each
    padded = raggedfn.to_padded(x, fill=-1.0)
    for i, doc in enumerate(docs):
        for j, t in enumerate(doc):
            if channels_between:
                block = padded[i, j, : t.shape[0], :, : t.shape[2]]
            else:
                block = padded[i, j, : t.shape[0], : t.shape[1]]
            assert torch.equal(block, t)
    assert int((padded != -1.0).sum()) == sum(t.numel() for doc in docs for t in doc)
    again = raggedfn.from_list(list(raggedfn.unbind(x)))  # Ragged samples stack back
    assert again.layout == x.layout
    assert torch.equal(again.values, x.values) and torch.equal(again.sizes, x.sizes)
    assert all(torch.equal(a, b) for a, b in zip(again.row_offsets, x.row_offsets, strict=True))


def test_an_empty_side_before_a_longer_one_is_refused() -> None:
    with pytest.raises(raggedfn.RaggedError, match=r"ragged sizes \[0, 5\]"):
        raggedfn.from_list([[torch.zeros(0, 5, 2)]], ragged_dims=(1, 2, 3))
    pairs = raggedfn.from_list([torch.zeros(0, 5), torch.zeros(2, 2)], ragged_dims=(1, 2))
    with pytest.raises(raggedfn.RaggedError, match=r"ragged sizes \[0, 5\]"):
        raggedfn.from_list([pairs])
    x = raggedfn.from_list([[torch.zeros(3, 0, 2)]], ragged_dims=(1, 2, 3))  # 3 x 0 is kept
    assert x[0].sizes.tolist() == [[3, 0]]


@SETTINGS
@given(st.data(), st.sampled_from([(1,), (2,), (1, 2)]))
def test_from_nested_lengths_marks_rectangles(data: Any, rectangular: tuple[int, ...]) -> None:
    lengths = data.draw(level_lengths(3, rectangular=rectangular))
    values = torch.randn(sum(lengths[-1]), 2, dtype=torch.float64)
    x = raggedfn.from_nested_lengths(values, lengths, rectangular_dims=[1 + k for k in rectangular])
    every = rectangular == (1, 2)  # no nested axis: an ordinary rectangular value
    want = build(lengths, values, () if every else rectangular)
    assert_canonical(x, canonical(want))
    assert x.values is values and torch.equal(x.offsets, want.offsets)
    if every:
        assert x.layout.code == "r0 r1 r2 d0" and not x.row_offsets
        return
    assert x.layout == want.layout
    for a, b in zip((x.sizes, *x.row_offsets), (want.sizes, *want.row_offsets), strict=True):
        assert torch.equal(a, b)
    # lists of lists: the same value
    lists = [_node(want, sample, (), 0) for sample in canonical(want)]
    if lists and any(_has_tensor(s) for s in lists):
        y = raggedfn.from_list(lists, rectangular_dims=[1 + k for k in rectangular if k < 2])
        assert_canonical(y, canonical(want))


def _node(x: raggedfn.Ragged, sample: Any, prefix: tuple[int, ...], depth: int) -> Any:
    keys, rows = sample
    if depth == len(keys) - 1:
        here = [rows[n] for n, k in enumerate(keys[-1]) if k[:-1] == prefix]
        return stack(here, dense_shape(x), x.values)
    return [_node(x, sample, k, depth + 1) for k in keys[depth] if k[:-1] == prefix]


def _has_tensor(item: Any) -> bool:
    return isinstance(item, torch.Tensor) or (
        isinstance(item, list) and any(map(_has_tensor, item))
    )


def test_lengths_that_break_a_rectangle_are_refused() -> None:
    values = torch.randn(4, 2)
    with pytest.raises(raggedfn.RaggedError, match="rectangular with axis 0"):
        raggedfn.from_nested_lengths(values, [[2], [2, 1], [1, 1, 2]], rectangular_dims=(2,))
    with pytest.raises(raggedfn.RaggedError, match="rectangular_dims entry 1"):
        raggedfn.from_nested_lengths(values, [[2], [2, 2], [1, 1, 1, 1]], rectangular_dims=(1,))
    bad = build([[2], [2, 1], [1, 1, 2]], values, (1,))  # a hand-built value breaking it
    with pytest.raises(raggedfn.RaggedError, match="differ between elements of one rectangle"):
        raggedfn.check(bad)


# ----- samples ----------------------------------------------------------------------------


@SETTINGS
@given(mixed(min_batch=1), st.data())
def test_samples_keep_the_rectangles(x: raggedfn.Ragged, data: Any) -> None:
    i = data.draw(st.integers(0, x.batch_size - 1))
    keys, rows = canonical(x)[i]
    sample = x[i]
    raggedfn.check(sample)
    expected = []
    for s in range(len(keys[0])):
        sub_keys = [[k[1:] for k in level if k[0] == s] for level in keys[1:]]
        sub_rows = [r for r, k in zip(rows, keys[-1], strict=True) if k[0] == s]
        expected.append((sub_keys, sub_rows))
    assert_canonical(sample, expected)
    letters = _letters(x)[1:]  # the outermost axis becomes the batch
    letters[0] = "r"
    if "n" in letters:
        assert _letters(sample) == letters and sample.row_offsets
    else:  # one rectangle per element: an ordinary multi-axis Ragged
        assert _letters(sample) == ["r"] * len(letters) and not sample.row_offsets


# ----- ops ----------------------------------------------------------------------------------


@SETTINGS
@given(mixed(requires_grad=True, feature_shape=(2,)), st.data())
def test_sums_keep_the_rectangles_above_the_reduced_axes(x: raggedfn.Ragged, data: Any) -> None:
    subsets = [
        c
        for n in range(1, x.num_ragged + 1)
        for c in itertools.combinations(range(x.num_ragged), n)
    ]
    levels = data.draw(st.sampled_from(subsets))
    got = raggedfn.sum(x, tuple(1 + k for k in levels))
    expected = reduce(x, levels, lambda t: t.sum(0))
    assert_canonical(got, expected)
    torch.testing.assert_close(_grad(got, x), _grad(expected, x))
    kept = [k for k in range(x.num_ragged) if k not in levels]
    if not kept:
        assert isinstance(got, torch.Tensor)
        return
    letters = _letters(x)
    want = [
        "r" if m == 0 or (letters[k] == "r" and k < levels[0]) else "n" for m, k in enumerate(kept)
    ]
    if "n" not in want:
        want = ["r"] * len(want)
    assert _letters(got) == want
    assert bool(got.row_offsets) == ("n" in want)


@SETTINGS
@given(mixed(requires_grad=True, feature_shape=(2,)), st.data())
def test_softmax_and_cumsum_along_every_axis(x: raggedfn.Ragged, data: Any) -> None:
    level = data.draw(st.integers(0, x.num_ragged - 1))
    for op, ref in (
        (raggedfn.softmax, lambda t: torch.softmax(t, 0)),
        (raggedfn.cumsum, lambda t: torch.cumsum(t, 0)),
    ):
        got = op(x, 1 + level)
        assert got.layout == x.layout
        expected = lines(x, level, ref)
        assert_canonical(got, expected)
        torch.testing.assert_close(_grad(got, x), _grad(expected, x))


@SETTINGS
@given(mixed(requires_grad=True, feature_shape=(2,)))
def test_broadcasting_a_reduced_rectangle_back(x: raggedfn.Ragged) -> None:
    inner = x.num_ragged
    mean = raggedfn.mean(x, inner, keepdim=True)  # one value per element above the last axis
    got = x - mean
    assert got.layout == x.layout
    expected = []
    for keys, rows in canonical(x):
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, key in enumerate(keys[-1]):
            groups.setdefault(key[:-1], []).append(r)
        out = list(rows)
        for members in groups.values():
            centre = torch.stack([rows[r] for r in members]).mean(0)
            for r in members:
                out[r] = rows[r] - centre
        expected.append((keys, out))
    assert_canonical(got, expected)
    torch.testing.assert_close(_grad(got, x), _grad(expected, x))
