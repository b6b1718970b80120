"""Nested and rectangular ragged axes in one value.

A value with nested ragged axes stores its ragged axes ``0 .. R-1`` as one chain
(``raggedfn._nested``): every axis ``k >= 1`` has ``row_offsets[k - 1]``, one
size per element of axis ``k - 1``. In its layout an axis ``k >= 1`` is either
``n`` (nested: the size varies per element of axis ``k - 1``) or ``r``
(rectangular with axis ``k - 1``: every element of axis ``k - 1`` under one
element of the axis above their group, the sample for the first group, has the
same size). Consecutive axes joined by ``r`` form a *group*, a rectangle:

- ``r0 r1 n2``: per sample an ``N x N`` grid (node pairs), each pair a list (edges);
- ``r0 n1 r2``: per sample a list of sentences, each an ``L x L`` pair state.

Storage and ``sizes`` are the chain's (``sizes[i, k]`` counts sample ``i``'s
elements of axis ``k``), so every op of nested values reads a mixed value as it
is; the ``r`` letters are a promise (checked by ``raggedfn.check``) that keeps
the rectangles visible: a sample whose remaining ragged axes are all one group
is an ordinary rectangular ``Ragged`` (``sizes`` the rectangle's sides).

A rectangle empty along one axis has no elements to carry the sizes of the axes
after it: it reads back with size 0 there (a ``0 x 5`` rectangle as ``0 x 0``).
Constructors refuse such input rather than change it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._index import lengths_of
from ._layout import Layout
from ._nested import parents


def uniform_axes(layout: Layout) -> tuple[int, ...]:
    """The ragged axes ``k >= 1`` that are rectangular with ``k - 1`` (all of them when
    no axis is nested)."""
    return tuple(a.index for a in layout.axes if a.ragged and a.index > 0 and not a.nested)


def group_start(layout: Layout, k: int) -> int:
    """The first ragged axis of the group (rectangle) that holds ragged axis ``k``."""
    uniform = uniform_axes(layout)
    while k in uniform:
        k -= 1
    return k


def uniform_checks(
    sizes: Tensor, row_offsets: tuple[Tensor, ...], total: Any, layout: Layout
) -> list[tuple[Tensor, str]]:
    """``(condition, message)`` for every rectangular axis of a mixed layout: the sizes
    along it agree across the elements of the axis before it, within each element
    above their group (each sample for the first group)."""
    uniform = uniform_axes(layout)
    if not uniform or not row_offsets:
        return []
    owners = parents(sizes, row_offsets, total)
    checks: list[tuple[Tensor, str]] = []
    for k in uniform:
        counts = lengths_of(row_offsets[k - 1])  # per element of axis k - 1
        start = group_start(layout, k)
        owner = torch.arange(counts.shape[0], device=counts.device)
        for level in range(k - 1, start - 1, -1):
            owner = owners[level].index_select(0, owner)
        groups = sizes.shape[0] if start == 0 else row_offsets[start - 1].shape[0] - 1
        high = counts.new_zeros(groups).scatter_reduce(0, owner, counts, "amax", include_self=False)
        low = counts.new_zeros(groups).scatter_reduce(0, owner, counts, "amin", include_self=False)
        checks.append(
            (
                (high == low).all(),
                f"ragged axis {k} is rectangular with axis {k - 1} (layout {layout.code!r}) "
                "but its sizes differ between elements of one rectangle",
            )
        )
    return checks


def rectangle_sides(counts: Tensor) -> Tensor:
    """``[B, g]`` sides of each sample's rectangle from its element counts per axis
    (``counts[:, k]`` = the product of the first ``k + 1`` sides); 0 after an empty side."""
    sides = [counts[:, 0]]
    for k in range(1, counts.shape[1]):
        before = counts[:, k - 1]
        sides.append(torch.where(before > 0, counts[:, k] // before.clamp(min=1), 0))
    return torch.stack(sides, 1)


def chain_lengths(sides: list[list[int]]) -> list[list[int]]:
    """Per-level lengths of rectangles given by their sides (one list per rectangle):
    level 0 the first side of each, level ``k`` side ``k`` once per element of level
    ``k - 1`` (Python ints: for constructors)."""
    if not sides:
        return []
    rank = len(sides[0])
    levels: list[list[int]] = [[] for _ in range(rank)]
    for rect in sides:
        count = 1
        for k, side in enumerate(rect):
            levels[k].extend([side] * count)
            count *= side
    return levels
