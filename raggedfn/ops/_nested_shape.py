"""Joining nested ragged levels (``flatten``) and splitting one (``unflatten``).

Both change only the partitions: the packed ``values`` are shared, never moved.
"""

from __future__ import annotations

from torch import Tensor

from .._axes import logical_shape_text
from .._errors import describe, fail
from .._index import offsets_of
from .._layout import Axis, Layout
from .._ragged import Ragged
from ._broadcast import check_equal


def _level_partition(x: Ragged, level: int) -> Tensor:
    """The partition of ragged axis ``level``: per sample (0) or ``row_offsets``."""
    return offsets_of(x.sizes[:, 0]) if level == 0 else x.row_offsets[level - 1]


def _chain_layout(x: Ragged, replace: dict[int, list[Axis]]) -> Layout:
    """``x``'s layout with ragged axis ``k`` replaced by ``replace[k]`` (others renumbered)."""
    axes: list[Axis] = []
    count = 0
    for a in x.layout.axes:
        if not a.ragged:
            axes.append(a)
            continue
        for _ in replace.get(a.index, [a]):
            axes.append(Axis(True, count, False))
            count += 1
    nested = count > 1
    return Layout(
        tuple(Axis(True, a.index, nested and a.index > 0) if a.ragged else a for a in axes)
    )


def flatten_levels(fn: str, x: Ragged, start: int, end: int) -> Ragged:
    """Join the nested ragged axes at sample positions ``start..end`` into one: every
    element of the outer one holds the elements of the inner ones, in order."""
    group = x.layout.axes[start : end + 1]
    if not x.row_offsets or not all(a.ragged for a in group):
        raise fail(
            fn,
            f"axes {start + 1}..{end + 1} of logical shape {logical_shape_text(x)} mix ragged and "
            "dense axes; flatten joins dense axes, or consecutive nested ragged axes",
        )
    first, last = group[0].index, group[-1].index
    parts = list(x.row_offsets)
    # the elements of ``last`` under every element of the axis above ``first``
    composed = parts[first - 1] if first > 0 else None
    for k in range(first + 1, last + 1):
        composed = parts[k - 1] if composed is None else parts[k - 1].index_select(0, composed)
    row_offsets = parts[: max(first - 1, 0)]
    if first > 0:
        assert composed is not None
        row_offsets.append(composed)
    row_offsets += parts[last:]
    keep = [k for k in range(x.num_ragged) if not first <= k < last]
    layout = _chain_layout(x, {k: [] for k in range(first + 1, last + 1)})
    return Ragged(x.values, x.offsets, x.sizes[:, keep], layout, tuple(row_offsets))


def unflatten_level(fn: str, x: Ragged, position: int, lengths: Ragged) -> Ragged:
    """Split ragged axis ``k`` (at sample position ``position``) into two nested ones.

    ``lengths`` is an integer ``Ragged`` holding the new outer level: its ragged
    axes are ``x``'s axes ``0 .. k - 1`` plus one more, whose elements give how
    many elements of axis ``k`` each holds.
    """
    axis = x.layout.axes[position]
    k = axis.index
    if not isinstance(lengths, Ragged) or lengths.dtype.is_floating_point:
        raise fail(fn, f"lengths must be an integer Ragged value, got {describe(lengths)}")
    if (
        lengths.num_ragged != k + 1
        or lengths.layout.num_dense
        or lengths.batch_size != x.batch_size
    ):
        raise fail(
            fn,
            f"lengths must have the {k} ragged axes of x above axis {position + 1} plus one "
            f"(logical shape (B, {', '.join(['None'] * (k + 1))})) and B = {x.batch_size}, got "
            f"logical shape {lengths.shape}",
        )
    check_equal(fn, "sizes", lengths.sizes[:, :k], x.sizes[:, :k])
    for j in range(k - 1):
        check_equal(fn, f"row_offsets[{j}]", lengths.row_offsets[j], x.row_offsets[j])
    counts = lengths.values.to(x.offsets.dtype)
    inner = offsets_of(counts)  # new level -> elements of axis k
    outer = _level_partition(lengths, k)  # axis k - 1 (or the sample) -> new level
    check_equal(
        fn,
        "lengths",
        inner.index_select(0, outer.clamp(0, inner.shape[0] - 1)),
        _level_partition(x, k),
        "the lengths under every element must add up to its elements along the split axis",
    )
    if k == 0:
        row_offsets = (inner, *x.row_offsets)
    else:
        row_offsets = (*x.row_offsets[: k - 1], outer, inner, *x.row_offsets[k:])
    sizes = x.sizes.new_empty(x.batch_size, x.num_ragged + 1)
    sizes[:, :k] = x.sizes[:, :k]
    sizes[:, k] = lengths.sizes[:, k]
    sizes[:, k + 1 :] = x.sizes[:, k:]
    layout = _chain_layout(x, {k: [axis, axis]})
    return Ragged(x.values, x.offsets, sizes, layout, row_offsets)
