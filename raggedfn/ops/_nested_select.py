"""``cat`` of values with nested ragged axes (documents -> sentences -> tokens).

Every operand's elements are numbered in one joint numbering per level (operand
``j``'s elements of level ``l`` after those of operands ``0 .. j - 1``, as
``cat(xs, 0)`` numbers them); a result element of the concatenated level is a
range of one operand's elements, and every level below follows by ranges of the
joint partitions. Output sizes come from tensor shapes: no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._axes import values_dim
from .._construct_nested import check_rectangles
from .._errors import fail, shape_text
from .._index import gather_ranges, lengths_of, offsets_of
from .._layout import Axis
from .._mixed import uniform_axes
from .._nested import level_counts, level_offsets, level_partitions
from .._ragged import Ragged, like
from ._broadcast import check_equal


def _joined(partitions: Sequence[Tensor]) -> Tensor:
    """One partition from the operands' partitions of a level, each shifted by the
    elements of the operands before it (the joint numbering)."""
    shifts = offsets_of(torch.stack([p[-1] for p in partitions]))[:-1]
    parts = [p[:-1] + shift for p, shift in zip(partitions, shifts, strict=True)]
    return torch.cat([*parts, (partitions[-1][-1] + shifts[-1]).reshape(1)])


def _check_dense(xs: Sequence[Ragged]) -> None:
    first = xs[0]
    for n, x in enumerate(xs[1:], 1):
        if x.values.shape[1:] != first.values.shape[1:]:
            raise fail(
                "cat",
                f"xs[{n}] has logical shape {shape_text(x.shape)}, expected the dense sizes of "
                f"{shape_text(first.shape)}",
            )


def cat_nested_batches(xs: Sequence[Ragged]) -> Ragged:
    """``cat(xs, 0)`` of nested values: the samples of all, every level's partition joined."""
    first = xs[0]
    _check_dense(xs)
    row_offsets = tuple(
        _joined([x.row_offsets[k] for x in xs]) for k in range(first.layout.num_nested)
    )
    return Ragged(
        torch.cat([x.values for x in xs]),
        _joined([x.offsets for x in xs]),
        torch.cat([x.sizes for x in xs]),
        first.layout,
        row_offsets,
    )


def cat_nested(xs: Sequence[Ragged], axis: Axis, dim: int) -> Ragged:
    """``cat(xs, dim)`` (``dim >= 1``) of nested values, as the per-sample, per-row loop.

    Along nested ragged axis ``m``: the levels above ``m`` must be equal; within
    every element of level ``m - 1`` (every sample for ``m = 0``) the elements of
    level ``m`` are those of ``xs[0]``, then those of ``xs[1]``, ..., each with
    everything below it. Along a dense axis the partitions must be equal.
    """
    fn = "cat"
    first = xs[0]
    for n, x in enumerate(xs[1:], 1):
        if x.batch_size != first.batch_size:
            raise fail(fn, f"xs[{n}] has {x.batch_size} samples, expected {first.batch_size}")
    if not axis.ragged:
        for n, x in enumerate(xs[1:], 1):
            explain = f"xs[{n}] has another partition than xs[0]"
            check_equal(fn, "sizes", x.sizes, first.sizes, explain)
            for k, (a, b) in enumerate(zip(x.row_offsets, first.row_offsets, strict=True)):
                check_equal(fn, f"row_offsets[{k}]", a, b, explain)
        return like(first, torch.cat([x.values for x in xs], dim=values_dim(axis)))
    _check_dense(xs)
    m = axis.index
    for n, x in enumerate(xs[1:], 1):
        explain = (
            f"xs[{n}] differs from xs[0] in the nested ragged axes above axis {dim} (the "
            "elements that are concatenated along it)"
        )
        check_equal(fn, "sizes", x.sizes[:, :m], first.sizes[:, :m], explain)
        for k in range(m - 1):
            check_equal(fn, f"row_offsets[{k}]", x.row_offsets[k], first.row_offsets[k], explain)
    partitions = [level_partitions(x.sizes, x.row_offsets) for x in xs]
    counts = [level_counts(x.row_offsets, x.values.shape[0]) for x in xs]
    levels = len(partitions[0])
    # level m: for every element p above it, a range of every operand's elements in turn
    bases = [sum(c[m] for c in counts[:j]) for j in range(len(xs))]
    starts = torch.stack([p[m][:-1] + base for p, base in zip(partitions, bases, strict=True)], 1)
    along = torch.stack([lengths_of(p[m]) for p in partitions], 1)  # [N_{m-1}, J]
    source, joined = gather_ranges(starts.reshape(-1), along.reshape(-1), sum(c[m] for c in counts))
    new_parts = [*partitions[0][:m], joined[:: len(xs)]]
    for level in range(m + 1, levels):  # the subtrees of the moved elements, level by level
        below = _joined([p[level] for p in partitions])
        total = sum(c[level] for c in counts)
        source, joined = gather_ranges(
            below[:-1].index_select(0, source), lengths_of(below).index_select(0, source), total
        )
        new_parts.append(joined)
    row_offsets = tuple(new_parts[1:])
    offsets = level_offsets(lengths_of(new_parts[0]).unsqueeze(1), row_offsets)
    sizes = torch.stack([lengths_of(o) for o in offsets], 1)
    values = torch.cat([x.values for x in xs]).index_select(0, source)
    out = Ragged(values, offsets[-1], sizes, first.layout, row_offsets)
    if m + 1 in uniform_axes(first.layout):
        # the rectangles below axis m now hold elements of several operands: their
        # sides must agree
        check_rectangles(fn, first.layout, out)
    return out
