"""Per-sample indexing: narrow, cat, masked_select and pairs.

``gather``/``take_along_dim`` live in ``_gather``, ``sort``/``argsort``/``topk`` in
``_sort``; they share this module's helpers. Every op here moves whole elements: it computes, for each element of the
result, which packed element of the input it comes from, and gathers. The
gathers are differentiable (their backward is an ``index_put``), so gradients
of any order come from autograd. Results whose size depends on the data
(``narrow``, ``topk``, ``masked_select``, ``pairs``) read the new total size on
the host once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .._axes import leading_levels, normalize_axis, sample_axis, values_dim
from .._errors import describe, fail, shape_text
from .._index import coordinates, gather_ranges, lengths_of, offsets_of, segment_ids
from .._layout import Axis, Layout
from .._nested import level_offsets, level_partitions
from .._ragged import Ragged, like
from ._broadcast import check_equal
from ._nested_select import cat_nested, cat_nested_batches
from ._nested_shape import flatten_levels
from ._pairs import pairs

__all__ = [
    "cat",
    "masked_select",
    "narrow",
    "pairs",
]


def _require(fn: str, name: str, x: object) -> Ragged:
    if not isinstance(x, Ragged):
        raise fail(fn, f"{name} must be a Ragged value, got {describe(x)}")
    return x


def _rows(x: Ragged, segments: Tensor, coords: Sequence[Tensor]) -> Tensor:
    """Packed row of ``x`` at ragged coordinates ``coords`` of sample ``segments``."""
    row = x.offsets[segments]
    stride = torch.ones_like(segments)
    for k in reversed(range(x.num_ragged)):
        row = row + coords[k] * stride
        stride = stride * x.sizes[segments, k]
    return row


def _resized(x: Ragged, sizes: Tensor) -> tuple[Tensor, Tensor, list[Tensor], int]:
    """Offsets, segments and coordinates of a value with ``x``'s layout and new ``sizes``."""
    offsets = offsets_of(sizes.prod(dim=1))
    total = int(offsets[-1])  # the result's size depends on the data: one host read
    segments, coords = coordinates(offsets, sizes, total)
    return offsets, segments, coords, total


def narrow(x: Ragged, dim: int, start: int, length: int) -> Ragged:
    """``torch.narrow`` of each sample, with the length clamped to each sample.

    Along a ragged axis, sample ``i`` keeps elements ``s_i .. s_i + length`` where
    ``s_i = start`` (or ``N_i + start`` for a negative ``start``, floored at 0); a
    sample shorter than that keeps what it has (possibly nothing). Along a nested
    axis the same holds within every element of the axis above it, and a kept
    element keeps everything below it (``narrow(docs, 1, 0, 2)``: the first two
    sentences of every document). Along a dense axis it is ``torch.narrow`` on
    every sample.

    Args:
        x: ``Ragged`` value.
        dim: logical axis (batch = 0 is not allowed).
        start: first element (negative counts from each sample's end).
        length: at most this many elements per sample (``>= 0``).

    Returns:
        ``Ragged`` with the layout of ``x``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is not an int or is out of
            range for the logical shape of ``x``, or is the batch axis; ``start`` or
            ``length`` is not an int; ``length`` is negative; along a dense axis, ``start``
            is out of range.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.arange(4.0), torch.arange(2.0)])
        >>> raggedfn.narrow(x, 1, 1, 2).values.tolist()
        [1.0, 2.0, 1.0]
    """
    fn = "narrow"
    x = _require(fn, "x", x)
    axis = sample_axis(x, dim, fn)
    for name, value in (("start", start), ("length", length)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise fail(fn, f"{name} must be an int, got {describe(value)}")
    if length < 0:
        raise fail(fn, f"length must be >= 0, got {length}")
    if not axis.ragged:
        size = x.values.shape[values_dim(axis)]
        if not -size <= start <= size:
            raise fail(fn, f"start {start} is out of range for dense axis {dim} of size {size}")
        begin = start % size if start < 0 else start
        values = x.values.narrow(values_dim(axis), begin, min(length, size - begin))
        return like(x, values)
    if x.row_offsets:
        return _narrow_nested(x, axis.index, start, length)
    k = axis.index
    extent = x.sizes[:, k]
    begins = (extent + start).clamp(min=0) if start < 0 else torch.full_like(extent, start)
    kept = (extent - begins).clamp(min=0, max=length)
    sizes = x.sizes.clone()
    sizes[:, k] = kept
    offsets, segments, coords, _ = _resized(x, sizes)
    coords = list(coords)
    coords[k] = coords[k] + begins[segments]
    return Ragged(x.values[_rows(x, segments, coords)], offsets, sizes, x.layout)


def _narrow_nested(x: Ragged, level: int, start: int, length: int) -> Ragged:
    """:func:`narrow` along nested axis ``level``: within every element above it (every
    sample for level 0), with everything below the kept elements (whole sentences)."""
    partitions = level_partitions(x.sizes, x.row_offsets)
    parts = partitions[level]
    extent = lengths_of(parts)
    begins = (extent + start).clamp(min=0) if start < 0 else torch.full_like(extent, start)
    kept = (extent - begins).clamp(min=0, max=length)
    source, joined = gather_ranges(parts[:-1] + begins, kept)
    new_parts = [*partitions[:level], joined]
    for below in partitions[level + 1 :]:  # the children of the kept elements, level by level
        counts = lengths_of(below).index_select(0, source)
        source, joined = gather_ranges(below[:-1].index_select(0, source), counts)
        new_parts.append(joined)
    row_offsets = tuple(new_parts[1:])
    levels = level_offsets(lengths_of(new_parts[0]).unsqueeze(1), row_offsets)
    sizes = torch.stack([lengths_of(offsets) for offsets in levels], 1)
    return Ragged(x.values[source], levels[-1], sizes, x.layout, row_offsets)


def cat(xs: Sequence[Ragged], dim: int = 0) -> Ragged:
    """Concatenate ``Ragged`` values of one layout.

    ``dim = 0`` joins the batches (sample lists concatenate). Along a ragged axis
    each sample is concatenated with the same sample of the others (its size
    there is the sum; every other ragged size must agree per sample). Along a
    dense axis it is ``torch.cat`` of each sample (partitions must be equal).

    With nested ragged axes (documents -> sentences -> tokens), along nested
    axis ``dim`` the axes above it must agree and, within every element of the
    axis above (every sample for the first), the elements along ``dim`` of
    ``xs[0]`` come first, then those of ``xs[1]``, ... each with everything
    below it (``tf.concat`` of ``RaggedTensor``): ``cat([x, y], 2)`` joins the
    tokens of sentence ``s`` of ``x`` and of ``y``. The axes below ``dim`` may
    differ; where the axis below ``dim`` is rectangular with it, the rectangles'
    sides must agree.

    Args:
        xs: one or more ``Ragged`` values with the same layout.
        dim: logical axis.

    Returns:
        ``Ragged`` with the common layout.

    Raises:
        RaggedError: ``xs`` is not a non-empty list of ``Ragged`` values; values that differ
            in layout, batch size or dense sizes, or in the sizes of ragged axes other than
            ``dim`` (nested: of the axes above ``dim``); ``dim`` out of range.

    Examples:
        >>> import torch, raggedfn
        >>> a = raggedfn.from_list([torch.ones(1), torch.ones(2)])
        >>> raggedfn.cat([a, a], dim=1).lengths.tolist()
        [2, 4]
    """
    fn = "cat"
    if isinstance(xs, Ragged) or not isinstance(xs, Sequence) or not xs:
        raise fail(fn, f"xs must be a non-empty list of Ragged values, got {describe(xs)}")
    xs = [_require(fn, f"xs[{n}]", x) for n, x in enumerate(xs)]
    first = xs[0]
    for n, x in enumerate(xs[1:], 1):
        if x.layout != first.layout:
            raise fail(
                fn,
                f"xs[{n}] has layout Layout({x.layout.code!r}), expected "
                f"Layout({first.layout.code!r}) like xs[0]",
            )
    dim = normalize_axis(first, dim, fn)
    if first.row_offsets:
        if dim == 0:
            return cat_nested_batches(xs)
        return cat_nested(xs, first.layout.axes[dim - 1], dim)
    if dim == 0:
        for n, x in enumerate(xs[1:], 1):
            if x.values.shape[1:] != first.values.shape[1:]:
                raise fail(
                    fn,
                    f"xs[{n}] has logical shape {shape_text(x.shape)}, expected the dense sizes of {shape_text(first.shape)}",
                )
        lengths = torch.cat([lengths_of(x.offsets) for x in xs])
        values = torch.cat([x.values for x in xs])
        sizes = torch.cat([x.sizes for x in xs])
        return Ragged(values, offsets_of(lengths), sizes, first.layout)
    axis = first.layout.axes[dim - 1]
    for n, x in enumerate(xs[1:], 1):
        if x.batch_size != first.batch_size:
            raise fail(fn, f"xs[{n}] has {x.batch_size} samples, expected {first.batch_size}")
    if not axis.ragged:
        for n, x in enumerate(xs[1:], 1):
            check_equal(
                fn, "sizes", x.sizes, first.sizes, f"xs[{n}] has another partition than xs[0]"
            )
        values = torch.cat([x.values for x in xs], dim=values_dim(axis))
        return Ragged(values, first.offsets, first.sizes, first.layout)
    k = axis.index
    others = [j for j in range(first.num_ragged) if j != k]
    for n, x in enumerate(xs[1:], 1):
        if x.values.shape[1:] != first.values.shape[1:]:
            raise fail(
                fn,
                f"xs[{n}] has logical shape {shape_text(x.shape)}, expected dense sizes of {shape_text(first.shape)}",
            )
        if others:
            check_equal(
                fn,
                "sizes",
                x.sizes[:, others],
                first.sizes[:, others],
                f"xs[{n}] differs from xs[0] in the sizes of ragged axes other than {dim}",
            )
    along = torch.stack([x.sizes[:, k] for x in xs])  # [J, B]
    ends = torch.cumsum(along, 0)
    sizes = first.sizes.clone()
    sizes[:, k] = ends[-1]
    offsets, segments, coords, _ = _resized(first, sizes)
    coords = list(coords)
    source = (coords[k].unsqueeze(0) >= ends[:, segments]).sum(0)  # which operand
    coords[k] = coords[k] - (ends - along)[source, segments]
    bases = offsets_of(torch.stack([torch.tensor(x.values.shape[0]) for x in xs]))[:-1]
    row = torch.stack([x.offsets for x in xs])[source, segments]
    stride = torch.ones_like(segments)
    all_sizes = torch.stack([x.sizes for x in xs])  # [J, B, R]
    for j in reversed(range(first.num_ragged)):
        row = row + coords[j] * stride
        stride = stride * all_sizes[source, segments, j]
    values = torch.cat([x.values for x in xs])
    return Ragged(values[bases.to(row.device)[source] + row], offsets, sizes, first.layout)


def _ragged_first(layout: Layout) -> bool:
    return all(a == Axis(True, k) for k, a in enumerate(layout.axes[: layout.num_ragged]))


def _joined_levels(fn: str, x: Ragged, mask: Ragged) -> tuple[Ragged, Ragged]:
    """Nested ``x`` and ``mask`` with their (equal) nested levels joined into one: the
    selection reads every sample's rows in packed (row-major) order either way."""
    if mask.num_ragged != x.num_ragged or mask.batch_size != x.batch_size:
        raise fail(
            fn,
            f"mask must have the partition of x {shape_text(x.shape)}, got {shape_text(mask.shape)}",
        )
    for k, (a, b) in enumerate(zip(mask.row_offsets, x.row_offsets, strict=False)):
        check_equal(fn, f"row_offsets[{k}]", a, b, "mask must have the partition of x")
    if len(mask.row_offsets) != len(x.row_offsets):
        raise fail(fn, "mask must have the partition of x: one is nested, the other is not")
    for name, value in (("x", x), ("mask", mask)):
        if leading_levels(value) != value.num_ragged:
            raise fail(
                fn,
                f"needs the ragged axes first in storage order, got {name} "
                f"{shape_text(value.shape)} with layout Layout({value.layout.code!r})",
            )
    last = x.num_ragged - 1
    return flatten_levels(fn, x, 0, last), flatten_levels(fn, mask, 0, last)


def masked_select(x: Ragged, mask: Ragged) -> Ragged:
    """Select elements (or rows) of each sample where a boolean ``Ragged`` is True.

    Two forms, both with the ragged axes of ``x`` first in storage order:

    - ``mask`` of the same logical shape as ``x``: like ``torch.masked_select``,
      sample ``i`` gives the 1-D ``x_i[mask_i]`` in row-major order, so the
      result is ``(B, K*)``.
    - ``mask`` covering only the ragged axes (no dense axes): like
      ``x_i[mask_i]``, whole rows are kept, so ``(B, N*, *dense)`` becomes
      ``(B, K*, *dense)``.

    With nested ragged axes (documents -> sentences -> tokens) each sample's
    elements (or rows) are read in packed, row-major order, as for one ragged
    axis: the result is one flat list per sample, ``(B, K*)`` or
    ``(B, K*, *dense)``; ``mask`` must have every partition of ``x``.

    Args:
        x: ``Ragged`` value.
        mask: boolean ``Ragged`` with the partition of ``x``.

    Returns:
        ``Ragged`` with one ragged axis, ``K_i`` = number of True in sample ``i``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``mask`` is not a bool ``Ragged`` with
            the partition of ``x`` and its logical shape (or its ragged axes only); ``x``
            does not store its ragged axes first.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
        >>> m = raggedfn.from_list([torch.tensor([False, True]), torch.tensor([True])])
        >>> y = raggedfn.masked_select(x, m)
        >>> y.values.tolist(), y.lengths.tolist()
        ([2.0, 3.0], [1, 1])
    """
    fn = "masked_select"
    x = _require(fn, "x", x)
    mask = _require(fn, "mask", mask)
    if x.row_offsets or mask.row_offsets:
        x, mask = _joined_levels(fn, x, mask)
    if mask.dtype != torch.bool:
        raise fail(fn, f"mask must be a boolean Ragged value, got dtype {mask.dtype}")
    if mask.batch_size != x.batch_size:
        raise fail(fn, f"mask must have the partition of x, got {mask.batch_size} samples")
    check_equal(fn, "sizes", mask.sizes, x.sizes, "mask must have the partition of x")
    if not _ragged_first(x.layout) or not _ragged_first(mask.layout):
        raise fail(
            fn,
            f"needs the ragged axes first in storage order, got x {shape_text(x.shape)} with layout "
            f"Layout({x.layout.code!r}); permute x (and mask) first",
        )
    total = x.values.shape[0]
    segments = segment_ids(x.offsets, total)
    if mask.layout.num_dense == 0 and x.layout.num_dense > 0:
        counts = torch.zeros(x.batch_size, dtype=torch.int64, device=x.device)
        counts = counts.index_add(0, segments, mask.values.to(torch.int64))
        values = x.values[mask.values]
        layout = Layout((Axis(True, 0), *x.layout.axes[x.num_ragged :]))
        return Ragged(values, offsets_of(counts), counts.unsqueeze(1), layout)
    if mask.shape != x.shape:
        raise fail(
            fn,
            f"mask must have the logical shape of x {shape_text(x.shape)} or cover only its ragged axes, "
            f"got {shape_text(mask.shape)}",
        )
    order = [a.index for a in x.layout.axes[x.num_ragged :]]
    width = math.prod(x.values.shape[1:])
    values = x.values.permute(0, *(1 + j for j in order)).reshape(total, width)
    bits = mask.values.permute(0, *(1 + j for j in order)).reshape(total, width)
    counts = torch.zeros(x.batch_size, dtype=torch.int64, device=x.device)
    counts = counts.index_add(0, segments, bits.sum(1))
    return Ragged(values[bits], offsets_of(counts), counts.unsqueeze(1), Layout.standard(1, 0))
