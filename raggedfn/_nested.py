"""Index tensors of nested ragged axes (documents -> sentences -> tokens).

A nested value has a chain of ragged axes ``0 .. R-1``: axis 0 has one size per
sample (``sizes[:, 0]``), axis ``k >= 1`` one size per element of axis ``k - 1``,
given by ``row_offsets[k - 1]`` (``[N_{k-1} + 1]``, numbered across the batch,
like TensorFlow's ``row_splits``). The elements of the innermost axis are the
packed rows of ``values``. Everything here has output sizes taken from tensor
shapes (``N_k``), so it needs no host sync and compiles without data-dependent
shapes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._index import local_positions, offsets_of, segment_ids


def level_counts(row_offsets: tuple[Tensor, ...], total: Any) -> list[Any]:
    """``N_k``, the number of elements of every level across the batch."""
    return [p.shape[0] - 1 for p in row_offsets] + [total]


def level_offsets(sizes: Tensor, row_offsets: tuple[Tensor, ...]) -> list[Tensor]:
    """``[B + 1]`` offsets of every sample's elements at each level (``R`` tensors).

    The last one equals the value's ``offsets`` (the packed rows).
    """
    levels = [offsets_of(sizes[:, 0])]
    for parts in row_offsets:
        levels.append(parts.index_select(0, levels[-1]))
    return levels


def level_partitions(sizes: Tensor, row_offsets: tuple[Tensor, ...]) -> list[Tensor]:
    """The partition of every level: ``[B + 1]`` for level 0 (samples -> elements),
    then ``row_offsets`` (element of level ``k - 1`` -> elements of level ``k``)."""
    return [offsets_of(sizes[:, 0]), *row_offsets]


def parents(sizes: Tensor, row_offsets: tuple[Tensor, ...], total: Any) -> list[Tensor]:
    """For every level ``k``, ``[N_k]`` the element of level ``k - 1`` (the sample for
    ``k = 0``) that owns each element."""
    counts = level_counts(row_offsets, total)
    return [
        segment_ids(parts, count)
        for parts, count in zip(level_partitions(sizes, row_offsets), counts, strict=True)
    ]


def coordinates(
    sizes: Tensor, row_offsets: tuple[Tensor, ...], total: Any
) -> tuple[list[Tensor], list[Tensor]]:
    """``(parents, positions)``: per level, the owner of each element (see :func:`parents`)
    and its position inside that owner."""
    counts = level_counts(row_offsets, total)
    partitions = level_partitions(sizes, row_offsets)
    owners = parents(sizes, row_offsets, total)
    positions = [
        local_positions(parts, owner, count)
        for parts, owner, count in zip(partitions, owners, counts, strict=True)
    ]
    return owners, positions


def ancestors(owners: list[Tensor], level: int) -> Tensor:
    """``[T]`` the element of ``level`` (``-1``: the sample) holding every packed row."""
    found: Tensor | None = None
    for k in range(len(owners) - 1, level, -1):
        found = owners[k] if found is None else owners[k].index_select(0, found)
    if found is None:  # level is the innermost: the rows themselves
        return torch.arange(owners[-1].shape[0], device=owners[-1].device)
    return found


def partition_from_lengths(
    lengths: list[Tensor],
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """``(offsets [B + 1], sizes [B, R], row_offsets)`` from per-level lengths.

    ``lengths[0]`` counts each sample's elements of level 0, ``lengths[k]`` each
    element of level ``k - 1``'s elements of level ``k``; the last level's
    elements are the packed rows.
    """
    partitions = [offsets_of(level) for level in lengths]
    levels = [partitions[0]]
    for parts in partitions[1:]:
        levels.append(parts.index_select(0, levels[-1]))
    sizes = torch.stack([level[1:] - level[:-1] for level in levels], 1)
    return levels[-1], sizes, tuple(partitions[1:])


def reduced_levels(
    sizes: Tensor,
    row_offsets: tuple[Tensor, ...],
    total: Any,
    reduce: tuple[int, ...],
    exact: bool = True,
) -> tuple[Tensor, Any, list[Tensor]]:
    """Where every packed row goes when the nested ragged axes ``reduce`` are reduced.

    The kept axes keep their order. Reducing an axis aligns its elements: the
    elements of a kept axis below it are matched by position, as if every level
    were padded (TensorFlow's ragged reductions): summing the sentences of a
    document gives, at token position ``j``, the sum over the sentences that
    have a token ``j``, and as many positions as the longest sentence.

    Args:
        sizes, row_offsets, total: the value's partition and packed row count.
        reduce: the nested ragged axes (levels) to reduce, at least one.
        exact: count the output elements of aligned levels exactly (a host sync
            each); else give an upper bound (``N_k``) and no sync.

    Returns:
        ``(segments [T], num_segments, kept)``: the output row of every packed row
        (the sample when every level is reduced), the number of output rows (or
        its bound), and for every kept level the number of its output elements
        per output element of the kept level before it (per sample for the
        first): the output's lengths, for :func:`partition_from_lengths`.
    """
    counts = level_counts(row_offsets, total)
    partitions = level_partitions(sizes, row_offsets)
    owners, positions = coordinates(sizes, row_offsets, total)
    out: Tensor | None = None  # output element of each element of the previous level
    num: Any = sizes.shape[0]
    aligned = False
    kept: list[Tensor] = []
    for k in range(len(partitions)):
        base = owners[k] if out is None else out.index_select(0, owners[k])
        if k in reduce:
            out, aligned = base, True
        elif not aligned:  # nothing reduced above: the elements stay as they are
            kept.append(partitions[k][1:] - partitions[k][:-1])
            out, num = None, counts[k]
        else:
            coord = positions[k]
            widths = torch.zeros(num, dtype=torch.int64, device=coord.device)
            widths = widths.scatter_reduce(0, base, coord + 1, "amax", include_self=True)
            starts = offsets_of(widths)
            num = int(starts[-1]) if exact else counts[k]
            out = starts.index_select(0, base) + coord
            kept.append(widths)
    assert out is not None, "reduce names no axis"
    return out, num, kept


def row_positions(sizes: Tensor, row_offsets: tuple[Tensor, ...], total: Any, level: int) -> Tensor:
    """``[T]`` every packed row's position along nested ragged axis ``level``."""
    owners, positions = coordinates(sizes, row_offsets, total)
    return positions[level].index_select(0, ancestors(owners, level))


def row_coordinates(
    sizes: Tensor, row_offsets: tuple[Tensor, ...], total: Any
) -> tuple[Tensor, list[Tensor]]:
    """``(sample [T], [c_0 [T], ..., c_{R-1} [T]])``: every packed row's sample and its
    coordinate along each nested ragged axis."""
    owners, positions = coordinates(sizes, row_offsets, total)
    coords = [positions[k].index_select(0, ancestors(owners, k)) for k in range(len(owners))]
    return ancestors(owners, -1), coords


def find_rows(
    sizes: Tensor, row_offsets: tuple[Tensor, ...], segments: Tensor, coords: list[Tensor]
) -> tuple[Tensor, Tensor]:
    """``(row, found)``: the packed row at nested coordinates ``coords`` (any broadcastable
    shapes) of sample ``segments``, and whether that element exists (where it does not,
    ``row`` is meaningless: clamp it before reading)."""
    partitions = level_partitions(sizes, row_offsets)
    elem = segments
    found = torch.ones((), dtype=torch.bool, device=segments.device)
    for parts, c in zip(partitions, coords, strict=True):
        last = parts.shape[0] - 1
        start = parts.index_select(0, elem.clamp(0, last).reshape(-1)).view(elem.shape)
        end = parts.index_select(0, (elem + 1).clamp(0, last).reshape(-1)).view(elem.shape)
        found = found & (c >= 0) & (c < end - start)
        elem = start + c
    return elem, found
