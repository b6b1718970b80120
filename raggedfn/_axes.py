"""Axis bookkeeping: the one place that maps logical axes to storage.

A ``Ragged`` value of rank ``1 + layout.rank`` has logical axis 0 (the batch)
and logical axes ``1..rank`` (one sample's axes). Each sample axis is either
ragged axis ``k`` (column ``k`` of ``sizes``) or dense axis ``j`` (axis ``1 + j``
of ``values``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._errors import fail
from ._layout import Axis, Layout

if TYPE_CHECKING:
    from ._ragged import Ragged


def logical_shape_text(x: Ragged) -> str:
    return x.layout.describe(tuple(x.values.shape[1:]))


def normalize_axis(x: Ragged, axis: int, fn: str, *, allow_batch: bool = True) -> int:
    """A logical axis (negative allowed) as an index in ``[0, ndim)``."""
    ndim = 1 + x.layout.rank
    if not isinstance(axis, (int, torch.SymInt)) or isinstance(axis, bool):
        raise fail(fn, f"axis must be an int, got {type(axis).__name__} {axis!r}")
    # Axes are static: an axis that arrives symbolic (an int argument under
    # torch.compile(dynamic=True), or make_fx tracing) is specialized to its value.
    axis = operator.index(axis)
    if not -ndim <= axis < ndim:
        raise fail(
            fn,
            f"axis {axis} is out of range for a sample of rank {x.layout.rank} "
            f"(logical shape {logical_shape_text(x)})",
        )
    axis = axis % ndim
    if axis == 0 and not allow_batch:
        raise fail(
            fn,
            f"axis 0 is the batch axis and cannot be used here "
            f"(logical shape (B, {logical_shape_text(x)[1:]})",
        )
    return axis


def normalize_axes(
    x: Ragged, axes: int | Sequence[int] | None, fn: str, *, allow_batch: bool = True
) -> tuple[int, ...]:
    """Logical axes as sorted unique indices; ``None`` means every axis."""
    if axes is None:
        return tuple(range(1 + x.layout.rank))
    if isinstance(axes, int):
        axes = (axes,)
    out = tuple(normalize_axis(x, a, fn, allow_batch=allow_batch) for a in axes)
    if len(set(out)) != len(out):
        raise fail(fn, f"axes {tuple(axes)} repeat an axis")
    return tuple(sorted(out))


def sample_axis(x: Ragged, axis: int, fn: str) -> Axis:
    """What logical axis ``axis`` (>= 1 after normalizing) is: ragged k or dense j."""
    axis = normalize_axis(x, axis, fn, allow_batch=False)
    return x.layout.axes[axis - 1]


def values_dim(axis: Axis) -> int:
    """The axis of ``values`` that stores dense axis ``axis``."""
    assert not axis.ragged
    return 1 + axis.index


def logical_axis(x: Ragged, axis: Axis) -> int:
    """The batched logical axis (>= 1) of a sample axis."""
    return 1 + x.layout.position(axis)


def refuse_nested(fn: str, x: Ragged, what: str = "values with nested ragged axes") -> None:
    """``RaggedError`` for an op that does not (yet) handle nested ragged axes."""
    if x.row_offsets:
        raise fail(
            fn,
            f"{what} are not supported (got logical shape (B, {logical_shape_text(x)[1:]} with "
            "nested ragged axes); join the nested levels first (raggedfn.flatten(x, 1, 2)) or "
            "work per sample (x[i], raggedfn.unbind)",
        )


def innermost_nested(fn: str, x: Ragged, axis: Axis, dim: int) -> None:
    """Refuse ``topk`` along an outer nested axis (its result would not be ragged)."""
    if x.row_offsets and axis.ragged and axis.index != x.layout.num_ragged - 1:
        raise fail(
            fn,
            f"axis {dim} is an outer nested ragged axis of logical shape (B, "
            f"{logical_shape_text(x)[1:]}; {fn} works along the innermost nested axis and dense "
            "axes (along an outer axis the k largest of every aligned line are not a prefix of "
            "each row); reduce or flatten the inner axes first, or sort along it",
        )


def leading_levels(x: Ragged) -> int:
    """How many nested ragged axes ``0, 1, ..`` lead the logical sample axes, in order."""
    count = 0
    for a in x.layout.axes:
        if not (a.ragged and a.index == count):
            break
        count += 1
    return count


def inner_layout(layout: Layout, outer: int) -> Layout:
    """The layout of one element of ragged axis ``outer - 1``: ``layout`` without its
    leading ragged axes ``0 .. outer - 1``, the ragged axes left renumbered from 0 as one
    rectangle."""
    axes = [a for a in layout.axes if not (a.ragged and a.index < outer)]
    return Layout(tuple(Axis(True, a.index - outer) if a.ragged else a for a in axes))


def outer_layout(layout: Layout, inner: Layout, outer: int) -> Layout:
    """``inner`` (the layout of one element of ragged axis ``outer - 1`` of ``layout``)
    under the leading ragged axes ``0 .. outer - 1`` of ``layout``: its first ragged axis
    nested in axis ``outer - 1``, the others a rectangle with it."""
    head = [a for a in layout.axes if a.ragged and a.index < outer]
    tail = [Axis(True, outer + a.index, a.index == 0) if a.ragged else a for a in inner.axes]
    return Layout((*head, *tail))


def one_level_deeper(dim: Any, rank: int) -> Any:
    """Axes ``dim`` of a nested value's sample (a one-level ``Ragged`` of logical rank
    ``rank``) as the axes of the nested batch: ``k >= 0`` is ``k + 1``, a negative axis
    counts from the end in both, ``None`` (every axis of the sample) is every axis but
    the batch's first; tuples axis by axis."""
    if dim is None:
        return tuple(range(1, rank + 1))
    if isinstance(dim, (tuple, list)):
        return tuple(one_level_deeper(d, rank) for d in dim)
    return dim + 1 if dim >= 0 else dim
