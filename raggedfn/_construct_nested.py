"""Nested ragged values: constructors, padded conversions and flat index vectors.

A nested value holds a chain of ragged axes, each nested in the one before
(documents -> sentences -> tokens, graphs -> nodes -> incoming edges); see
``raggedfn._nested`` for the partitions. Constructors from user data validate
every level (a host sync eagerly, device-side assertions under compile).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._errors import describe, fail
from ._index import lengths_of, offsets_of
from ._layout import Layout
from ._mixed import uniform_checks
from ._nested import ancestors, coordinates, partition_from_lengths
from ._ragged import Ragged, as_rectangular
from ._validate import check_partition, check_structure, is_tracing


def _index_tensor(fn: str, name: str, value: Any, device: torch.device) -> Tensor:
    """A 1-D int64 copy of user lengths/ids (floats and bools refused)."""
    if not isinstance(value, Tensor):
        try:
            value = torch.as_tensor(value, device=device)
        except Exception as error:
            raise fail(fn, f"{name} must be an integer tensor, got {describe(value)}") from error
        if value.numel() == 0:
            value = value.to(torch.int64)
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise fail(fn, f"{name} must have an integer dtype, got {describe(value)}")
    if value.device != device:
        raise fail(fn, f"{name} must be on {device} like values, got {describe(value)}")
    if value.ndim != 1:
        raise fail(fn, f"{name} must be 1-D, got {describe(value)}")
    return value.to(torch.int64, copy=True)


def build_nested(values: Tensor, lengths: Sequence[Tensor], layout: Layout | None = None) -> Ragged:
    """A value from per-level lengths (level 0 per sample, level ``k`` per element of
    level ``k - 1``), trusted: callers validate. ``layout`` (default: ragged axes
    first, each nested in the one before) may mark axes rectangular; without a
    nested axis left the result holds rectangles only."""
    offsets, sizes, row_offsets = partition_from_lengths(list(lengths))
    if layout is None:
        layout = Layout.standard(len(lengths), values.ndim - 1, nested=len(lengths) > 1)
    if len(lengths) > 1 and not layout.num_nested:
        return as_rectangular(values, offsets, sizes, layout)
    return Ragged(values, offsets, sizes, layout, row_offsets)


def check_rectangles(fn: str, layout: Layout, nested: Ragged) -> None:
    """``RaggedError`` unless the axes ``layout`` marks rectangular are: checked on
    ``nested``, the partition in chain form."""
    total = nested.values.shape[0]
    for ok, message in uniform_checks(nested.sizes, nested.row_offsets, total, layout):
        if is_tracing(nested.sizes):
            torch._assert_async(ok, f"{fn}: {message}")
        elif not bool(ok):
            raise fail(fn, message)


def mixed_layout(
    fn: str, num_levels: int, num_dense: int, rectangular_dims: Sequence[int]
) -> Layout:
    """Ragged axes first, nested except the logical axes ``rectangular_dims`` (>= 2)."""
    dims = tuple(rectangular_dims)
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or not 2 <= d <= num_levels:
            raise fail(
                fn,
                f"rectangular_dims entry {d!r} must be a ragged logical axis after the first, "
                f"in 2..{num_levels}",
            )
    letters = tuple(1 + k not in dims for k in range(num_levels))
    return Layout.from_ragged_positions(num_levels + num_dense, tuple(range(num_levels)), letters)


def _check_lengths(fn: str, values: Tensor, lengths: list[Tensor]) -> None:
    """Non-negative lengths; each level has one entry per element of the level before,
    and the innermost level accounts for every packed row."""
    total = values.shape[0]
    if any(is_tracing(level) for level in lengths):
        for k, level in enumerate(lengths):
            torch._assert_async((level >= 0).all(), f"{fn}: lengths[{k}] must be non-negative")
            count = lengths[k + 1].shape[0] if k + 1 < len(lengths) else total
            torch._assert_async(
                level.sum() == count,
                f"{fn}: lengths[{k}] must add up to the entries of the next level",
            )
        return
    for k, level in enumerate(lengths):
        if bool((level < 0).any()):
            raise fail(fn, f"lengths[{k}] must be non-negative, got {level.tolist()[:16]}")
        counted = int(level.sum())
        if k + 1 < len(lengths):
            expected = lengths[k + 1].shape[0]
            if counted != expected:
                raise fail(
                    fn,
                    f"lengths[{k}] adds up to {counted} elements but lengths[{k + 1}] has "
                    f"{expected} entries (one per element of level {k})",
                )
        elif counted != total:
            raise fail(
                fn,
                f"lengths[{k}] (the innermost level) adds up to {counted} rows but "
                f"values.shape[0] = {total}",
            )


def from_nested_lengths(
    values: Tensor, lengths: Sequence[Any], rectangular_dims: Sequence[int] = ()
) -> Ragged:
    """Nested ragged axes from packed ``values`` and one lengths vector per level.

    Args:
        values: ``[T, *dense]`` packed rows, innermost level first-to-last.
        lengths: ``[rows_per_sample [B], lengths_per_row [N_0], ...]``: level 0 gives
            each sample's number of elements, level ``k`` each element's number of
            elements of level ``k + 1`` (the last level counts packed rows). One
            entry gives a one-level value (as ``from_lengths``).
        rectangular_dims: logical axes (``>= 2``) that form a rectangle with the axis
            before them instead of nesting in it: their lengths are equal for every
            element of that axis under one element above the rectangle (one sample
            for the first). ``[N, N per node, edges per node pair]`` with
            ``rectangular_dims=(2,)`` is a per-sample ``N x N`` grid of edge lists.

    Returns:
        ``Ragged`` of logical shape ``(B, None, ..., None, *dense)`` with
        ``len(lengths)`` ragged axes, each nested in the one before or rectangular
        with it. ``sizes[i, k]`` counts sample ``i``'s elements of axis ``k``; when
        every axis is rectangular the value is an ordinary rectangular one
        (``sizes`` the sides).

    Raises:
        RaggedError: lengths that are negative, not integers, not 1-D, or that do
            not add up (each level must have one entry per element of the level
            before, the last must account for ``T`` rows); ``rectangular_dims``
            out of range or whose lengths differ within a rectangle.

    Examples:
        >>> import torch, raggedfn
        >>> tokens = torch.randn(6, 4)                 # 2 documents, 3 sentences, 6 tokens
        >>> x = raggedfn.from_nested_lengths(tokens, [[2, 1], [1, 3, 2]])
        >>> x.shape, x.sizes.tolist(), x.offsets.tolist()
        ((2, None, None, 4), [[2, 4], [1, 2]], [0, 4, 6])
        >>> [t.shape for t in x[0]]
        [torch.Size([1, 4]), torch.Size([3, 4])]
        >>> edges = torch.randn(5, 4)                  # 1 graph, 2 x 2 node pairs, 5 edges
        >>> g = raggedfn.from_nested_lengths(edges, [[2], [2, 2], [1, 0, 3, 1]], rectangular_dims=(2,))
        >>> g.layout, raggedfn.sum(g, 3).sizes.tolist()   # summing the edges: a 2 x 2 pair state
        (Layout('r0 r1 n2 d0'), [[2, 2]])
    """
    fn = "from_nested_lengths"
    if not isinstance(values, Tensor) or values.ndim < 1:
        raise fail(fn, f"values must be a [T, ...] tensor, got {describe(values)}")
    if isinstance(lengths, Tensor) or not isinstance(lengths, Sequence) or not lengths:
        raise fail(
            fn,
            f"lengths must be a non-empty list of 1-D lengths (one per level), got {describe(lengths)}",
        )
    levels = [
        _index_tensor(fn, f"lengths[{k}]", level, values.device) for k, level in enumerate(lengths)
    ]
    _check_lengths(fn, values, levels)
    layout = mixed_layout(fn, len(levels), values.ndim - 1, rectangular_dims)
    if rectangular_dims:
        check_rectangles(fn, layout, build_nested(values, levels))
    return build_nested(values, levels, layout)


def nested_rows(x: Ragged) -> tuple[Tensor, list[Tensor]]:
    """``(sample [T], [coordinate along ragged axis k of every packed row, per k])``."""
    total = x.values.shape[0]
    owners, positions = coordinates(x.sizes, x.row_offsets, total)
    coords = [positions[k].index_select(0, ancestors(owners, k)) for k in range(x.num_ragged)]
    return ancestors(owners, -1), coords


def nested_extents(x: Ragged) -> list[int]:
    """The largest size of every ragged axis (one host sync)."""
    if x.batch_size == 0:
        return [0] * x.num_ragged
    widths = [x.sizes[:, 0].amax()]
    for parts in x.row_offsets:
        counts = lengths_of(parts)
        widths.append(counts.amax() if counts.numel() else counts.new_zeros(()))
    return [int(w) for w in torch.stack(widths).tolist()]


def nested_to_padded(x: Ragged, fill: float, extents: list[int]) -> Tensor:
    """``to_padded`` of a nested value with the given ragged extents."""
    segments, coords = nested_rows(x)
    dense = tuple(x.values.shape[1:])
    physical = x.values.new_full((x.batch_size, *extents, *dense), fill)
    physical = physical.index_put((segments, *coords), x.values)
    return physical.permute(0, *(1 + p for p in x.layout.physical_to_logical()))


def nested_mask(x: Ragged) -> Tensor:
    """``mask`` of a nested value: True where a packed row sits."""
    segments, coords = nested_rows(x)
    out = torch.zeros(x.batch_size, *nested_extents(x), dtype=torch.bool, device=x.device)
    return out.index_put((segments, *coords), torch.ones_like(segments, dtype=torch.bool))


def check_nested(fn: str, x: Ragged) -> None:
    check_structure(fn, x.values, x.offsets, x.sizes, x.layout, x.row_offsets)
    check_partition(fn, x.values, x.offsets, x.sizes, x.row_offsets, x.layout)


def from_segment_ids(values: Tensor, segment_ids: Any, num_segments: int) -> Ragged:
    """One ragged axis from packed ``values`` and the sorted segment of every row.

    This reads PyG's ``batch`` vector (graph of every node) or any sorted id
    vector: segment ``s`` holds the rows whose id is ``s``, in order; segments
    without rows are empty samples.

    Args:
        values: ``[T, *dense]`` packed rows, sorted by segment.
        segment_ids: int ``[T]``, non-decreasing, in ``[0, num_segments)``.
        num_segments: ``B``, the number of samples (a Python int).

    Returns:
        ``Ragged`` of logical shape ``(B, N*, *dense)`` sharing ``values``.

    Raises:
        RaggedError: ids that are not integers, not ``[T]``, decrease (unsorted
            ids: use :func:`group_by`), or fall outside ``[0, num_segments)``.

    Examples:
        >>> import torch, raggedfn
        >>> batch = torch.tensor([0, 0, 2, 2, 2])        # PyG: graph of every node
        >>> x = raggedfn.from_segment_ids(torch.randn(5, 8), batch, 3)
        >>> x.lengths.tolist(), raggedfn.segment_ids(x).tolist()
        ([2, 0, 3], [0, 0, 2, 2, 2])
    """
    fn = "from_segment_ids"
    if not isinstance(values, Tensor) or values.ndim < 1:
        raise fail(fn, f"values must be a [T, ...] tensor, got {describe(values)}")
    ids = _index_tensor(fn, "segment_ids", segment_ids, values.device)
    if not isinstance(num_segments, (int, torch.SymInt)) or isinstance(num_segments, bool):
        raise fail(fn, f"num_segments must be an int, got {describe(num_segments)}")
    if num_segments < 0:
        raise fail(fn, f"num_segments must be >= 0, got {num_segments}")
    if ids.shape[0] != values.shape[0]:
        raise fail(
            fn,
            f"segment_ids must have one entry per row of values ({values.shape[0]}), got "
            f"{describe(ids)}",
        )
    steps = ids[1:] - ids[:-1]
    if is_tracing(ids):
        torch._assert_async((steps >= 0).all(), f"{fn}: segment_ids must be sorted")
        torch._assert_async(
            ((ids >= 0) & (ids < num_segments)).all(),
            f"{fn}: segment_ids must lie in [0, num_segments)",
        )
    else:
        if bool((steps < 0).any()):
            bad = int((steps < 0).nonzero()[0, 0])
            raise fail(
                fn,
                f"segment_ids must be sorted (non-decreasing), got segment_ids[{bad}] = "
                f"{int(ids[bad])} > segment_ids[{bad + 1}] = {int(ids[bad + 1])}; group rows "
                "with raggedfn.group_by(values, ids, num_segments) first",
            )
        outside = (ids < 0) | (ids >= num_segments)
        if bool(outside.any()):
            bad = int(outside.nonzero()[0, 0])
            raise fail(
                fn,
                f"segment_ids must lie in [0, num_segments) = [0, {num_segments}), got "
                f"segment_ids[{bad}] = {int(ids[bad])}",
            )
    counts = torch.zeros(num_segments, dtype=torch.int64, device=values.device)
    counts = counts.index_add(0, ids.clamp(0, max(num_segments - 1, 0)), torch.ones_like(ids))
    layout = Layout.standard(1, values.ndim - 1)
    return Ragged(values, offsets_of(counts), counts.unsqueeze(1), layout)
