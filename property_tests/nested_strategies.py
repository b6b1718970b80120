"""Hypothesis strategies for nested ragged values (documents -> sentences -> tokens).

``nested_raggeds()`` reaches B = 0, B = 1, empty samples, empty rows (elements
of an outer level without elements below) and equal sizes by construction,
each an explicit branch of the draw. The value is built from hand-computed
partitions (no raggedfn constructor), so constructor bugs cannot hide.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from property_tests.strategies import _random_values
from raggedfn import Layout, Ragged
from raggedfn._layout import Axis


@st.composite
def level_lengths(
    draw: Any,
    levels: int,
    max_batch: int = 4,
    max_size: int = 3,
    min_batch: int = 0,
    rectangular: tuple[int, ...] = (),
) -> list[list[int]]:
    """Per-level lengths: ``[per sample, per element of level 0, ...]``.

    Levels in ``rectangular`` (>= 1) form a rectangle with the level before: one
    length per element above the rectangle, repeated for each of its elements.
    """
    kind = draw(st.sampled_from(["random", "random", "empty_batch", "single", "equal", "holes"]))
    if kind == "empty_batch" and min_batch == 0:
        return [[] for _ in range(levels)]
    batch = 1 if kind == "single" else draw(st.integers(max(min_batch, 1), max(max_batch, 1)))
    fixed: list[int] = []
    if kind == "equal":
        fixed = [draw(st.integers(1, max_size)) for _ in range(levels)]
    return _draw_levels(draw, [], levels, batch, max_size, rectangular, kind, fixed)


@st.composite
def relengthed(
    draw: Any,
    lengths: list[list[int]],
    keep: int,
    max_size: int = 3,
    rectangular: tuple[int, ...] = (),
) -> list[list[int]]:
    """Lengths that share the first ``keep`` levels of ``lengths`` and draw the rest anew
    (random, or with holes)."""
    kind = draw(st.sampled_from(["random", "holes"]))
    levels, batch = len(lengths), len(lengths[0])
    return _draw_levels(draw, lengths[:keep], levels, batch, max_size, rectangular, kind, [])


def _draw_levels(
    draw: Any,
    prefix: list[list[int]],
    levels: int,
    batch: int,
    max_size: int,
    rectangular: tuple[int, ...],
    kind: str,
    fixed: list[int],
) -> list[list[int]]:
    size = st.integers(0, max_size)
    lengths: list[list[int]] = []
    owners = list(range(batch))  # the element above the rectangle of every element
    count = batch
    for k in range(levels):
        if k < len(prefix):
            row = list(prefix[k])
        elif kind == "equal":
            row = [fixed[k]] * count
        elif k in rectangular:
            side = [draw(size) for _ in range(max(owners, default=-1) + 1)]
            if kind == "holes" and side:  # an empty rectangle side
                side[draw(st.integers(0, len(side) - 1))] = 0
            row = [side[o] for o in owners]
        else:
            row = [draw(size) for _ in range(count)]
            if kind == "holes" and row:  # an empty sample or an empty row at this level
                row[draw(st.integers(0, len(row) - 1))] = 0
        if k + 1 in rectangular:  # the next level's rectangles sit under these owners
            owners = [o for o, n in zip(owners, row, strict=True) for _ in range(n)]
        else:  # a new level: every element of this one owns its children
            owners = [e for e, n in enumerate(row) for _ in range(n)]
        lengths.append(row)
        count = sum(row)
    return lengths


def build(
    lengths: list[list[int]], values: torch.Tensor, rectangular: tuple[int, ...] = ()
) -> Ragged:
    """A nested ``Ragged`` from per-level lengths, partitions computed with Python lists;
    the levels in ``rectangular`` are marked rectangular with the level before."""

    def running(counts: list[int]) -> list[int]:
        out = [0]
        for c in counts:
            out.append(out[-1] + c)
        return out

    partitions = [running(level) for level in lengths]
    per_sample = [partitions[0]]
    for parts in partitions[1:]:
        per_sample.append([parts[e] for e in per_sample[-1]])
    batch = len(lengths[0])
    sizes = [[lv[i + 1] - lv[i] for lv in per_sample] for i in range(batch)]
    levels = len(lengths)
    layout = Layout(
        tuple(Axis(True, k, k > 0 and k not in rectangular) for k in range(levels))
        + tuple(Axis(False, j) for j in range(values.ndim - 1))
    )
    return Ragged(
        values,
        torch.tensor(per_sample[-1], dtype=torch.int64),
        torch.tensor(sizes, dtype=torch.int64).reshape(batch, levels),
        layout,
        tuple(torch.tensor(p, dtype=torch.int64) for p in partitions[1:]),
    )


# chains of 2 or 3 levels, and mixed values (a rectangle per sample of lists, or lists
# of rectangles): (levels, rectangular levels)
ANY_LEVELS = st.sampled_from([(2, ()), (2, ()), (3, ()), (3, (1,)), (3, (2,))])
ANY_FEATURES = st.sampled_from([(), (3,), (2, 3)])


@st.composite
def nested_raggeds(
    draw: Any,
    levels: int | Any = ANY_LEVELS,
    feature_shape: tuple[int, ...] | Any = ANY_FEATURES,
    dtype: torch.dtype = torch.float64,
    requires_grad: bool = False,
    max_batch: int = 4,
    max_size: int = 3,
    min_batch: int = 0,
) -> Ragged:
    """A nested ``Ragged`` with ``levels`` ragged axes (each nested in the one before, or
    a ``(levels, rectangular levels)`` pair)."""
    rectangular: tuple[int, ...] = ()
    if not isinstance(levels, int):
        levels = draw(levels)
    if isinstance(levels, tuple):
        levels, rectangular = levels
    if not isinstance(feature_shape, tuple):
        feature_shape = draw(feature_shape)
    lengths = draw(level_lengths(levels, max_batch, max_size, min_batch, rectangular))
    total = sum(lengths[-1])
    seed = draw(st.integers(0, 2**31 - 1))
    values = _random_values((total, *feature_shape), dtype, seed)
    if requires_grad and dtype.is_floating_point:
        values.requires_grad_(True)
    return build(lengths, values, rectangular)
