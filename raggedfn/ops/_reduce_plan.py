"""How a reduction over logical axes maps onto ``values``: the shared plan.

A reduction over a set of logical axes (batch axis excluded) runs in two steps:
the dense axes among them are reduced on ``values`` with ``keepdim=True``, then
the ragged axes among them are reduced by a segment primitive whose segment is
the output row (the sample, or the sample and the kept ragged coordinates).
:func:`finish` then drops or keeps the reduced axes and rebuilds the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._axes import normalize_axes
from .._errors import describe, fail
from .._index import reduced_rows
from .._layout import Axis, Layout
from .._nested import partition_from_lengths, reduced_levels
from .._prims import segment_counts
from .._ragged import Ragged, as_rectangular, like


class Plan(NamedTuple):
    """Where the reduced axes of ``x`` live.

    ``axes``: the reduced logical axes (>= 1, sorted); ``dense_dims``: their
    ``values`` axes; ``segments``/``num_segments``/``counts``: output row of each
    packed row, number of output rows and packed rows per output row (``None``
    when no ragged axis is reduced); ``offsets``/``sizes``/``row_offsets``: the
    output partition when ragged axes are left (else ``None``).
    """

    axes: tuple[int, ...]
    dense_dims: tuple[int, ...]
    segments: Tensor | None
    num_segments: int
    counts: Tensor | None
    offsets: Tensor | None
    sizes: Tensor | None
    row_offsets: tuple[Tensor, ...] = ()


def require_ragged(x: Any, fn: str) -> Ragged:
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    return x


def reduced_axes(x: Ragged, dim: int | Sequence[int] | None, fn: str) -> tuple[int, ...] | None:
    """Normalized sample axes to reduce, or ``None`` for a full reduction.

    Eagerly the answer for a plain int ``dim`` is remembered per layout code: it
    depends on nothing else (a bad ``dim`` raises before anything is stored).
    """
    if type(dim) is int and not torch.compiler.is_compiling():
        key = (x.layout.code, dim)
        found = _REDUCED_AXES.get(key, _MISSING)
        if found is _MISSING:
            found = _REDUCED_AXES[key] = _reduced_axes(x, dim, fn)
        return found  # type: ignore[return-value]
    return _reduced_axes(x, dim, fn)


def whole_samples(x: Ragged, dim: Any, keepdim: bool) -> bool:
    """``dim`` is the one ragged axis of ``x`` (no nested levels) and the result is the
    dense ``[B, *dense]`` of one value per sample, in order (eagerly, for a plain int
    ``dim``; remembered per layout code): then a reduction is one segment reduction
    over the samples, with nothing to plan or rearrange."""
    if type(dim) is not int or keepdim or x.row_offsets or torch.compiler.is_compiling():
        return False
    key = (x.layout.code, dim)
    found = _WHOLE_SAMPLES.get(key)
    if found is None:
        layout = x.layout
        rank = layout.rank
        found = layout == Layout.standard(1, rank - 1) and dim in (1, -rank)
        _WHOLE_SAMPLES[key] = found
    return found


# eager answers of whole_samples, by (layout code, dim)
_WHOLE_SAMPLES: dict[tuple[str, int], bool] = {}

_MISSING = object()
# eager answers of reduced_axes for an int dim, by (layout code, dim)
_REDUCED_AXES: dict[tuple[str, int], tuple[int, ...] | None] = {}


def _reduced_axes(x: Ragged, dim: int | Sequence[int] | None, fn: str) -> tuple[int, ...] | None:
    chosen: Sequence[int] | None = None
    if dim is not None:
        # A lone non-int reaches normalize_axes as one axis, to be named in its message.
        chosen = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)  # type: ignore[assignment]
    axes = normalize_axes(x, chosen or None, fn)  # torch reduces everything for dim=()
    if 0 not in axes:
        return axes
    if len(axes) == x.ndim:
        return None
    raise fail(
        fn,
        f"dim={dim!r} includes axis 0, the batch axis, which can only be reduced together "
        f"with every other axis (dim=None); logical shape (B, {x.layout.describe(tuple(x.values.shape[1:]))[1:]}",
    )


def static_axes(layout: Layout) -> tuple[tuple[bool, int], ...]:
    """``(ragged, index)`` of every sample axis as plain Python values.

    Under ``torch.compile(dynamic=True)`` dynamo may treat the layout's ints as
    symbolic (``sorted`` then breaks the graph, and ``Axis(...) in axes``
    silently answers False, torch 2.13); ints found by equality against
    ``range`` are plain, and keep the bookkeeping exact. Eagerly the answer for
    a layout code is remembered (a handful of codes per program).
    """
    if torch.compiler.is_compiling():
        return _static_axes(layout)
    found = _STATIC_AXES.get(layout.code)
    if found is None:
        found = _STATIC_AXES[layout.code] = _static_axes(layout)
    return found


_STATIC_AXES: dict[str, tuple[tuple[bool, int], ...]] = {}


def _static_axes(layout: Layout) -> tuple[tuple[bool, int], ...]:
    counts = {True: layout.num_ragged, False: layout.num_dense}
    return tuple(
        (bool(a.ragged), next(k for k in range(counts[bool(a.ragged)]) if a.index == k))
        for a in layout.axes
    )


def plan(x: Ragged, axes: tuple[int, ...]) -> Plan:
    dense_dims, ragged = _split_axes(x.layout, axes)
    if not ragged:
        return Plan(axes, dense_dims, None, 0, None, None, None, x.row_offsets)
    if x.row_offsets:
        return _nested_plan(x, axes, dense_dims, ragged)
    segments, num_segments, counts, offsets, sizes = reduced_rows(
        x.offsets, x.sizes, x.values.shape[0], ragged
    )
    return Plan(axes, dense_dims, segments, num_segments, counts, offsets, sizes)


def _split_axes(layout: Layout, axes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(values axes of the reduced dense axes, sorted reduced ragged axes)``; static, so
    remembered eagerly per (layout code, axes)."""
    if torch.compiler.is_compiling():
        return _compute_split(layout, axes)
    key = (layout.code, axes)
    found = _SPLITS.get(key)
    if found is None:
        found = _SPLITS[key] = _compute_split(layout, axes)
    return found


_SPLITS: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def _compute_split(
    layout: Layout, axes: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    chosen = [static_axes(layout)[a - 1] for a in axes]
    dense_dims = tuple(1 + index for ragged, index in chosen if not ragged)
    ragged = tuple(sorted(index for is_ragged, index in chosen if is_ragged))
    return dense_dims, ragged


def _nested_plan(
    x: Ragged, axes: tuple[int, ...], dense_dims: tuple[int, ...], ragged: tuple[int, ...]
) -> Plan:
    """Reducing nested axes: inner levels only (no sync) or aligned outer levels."""
    segments, num, kept = reduced_levels(x.sizes, x.row_offsets, x.values.shape[0], ragged)
    counts = segment_counts(segments, num)
    if not kept:
        return Plan(axes, dense_dims, segments, num, counts, None, None)
    offsets, sizes, row_offsets = partition_from_lengths(kept)
    return Plan(axes, dense_dims, segments, num, counts, offsets, sizes, row_offsets)


def apply(
    p: Plan,
    values: Tensor,
    dense_op: Callable[[Tensor, tuple[int, ...]], Tensor],
    segment_op: Callable[[Tensor, Tensor, int, Tensor], Tensor],
) -> Tensor:
    """Reduce ``values`` along the plan: ``[S, *dense]`` with reduced dense axes of size 1."""
    if p.dense_dims:
        values = dense_op(values, p.dense_dims)
    if p.segments is not None:
        assert p.counts is not None
        values = segment_op(values, p.segments, p.num_segments, p.counts)
    return values


def finish(x: Ragged, p: Plan, values: Tensor, keepdim: bool) -> Ragged | Tensor:
    """Build the result from reduced ``values`` (``[S, *dense]``, reduced dense axes size 1).

    Without ``keepdim`` the reduced axes vanish; with it, reduced dense axes stay
    (size 1) and each reduced ragged axis becomes a new dense axis of size 1 at
    its logical position. No ragged axis left: a dense ``[B, *logical]`` tensor.
    """
    shape = _result_shape(x.layout, p.axes, keepdim)
    if keepdim:
        values = values.reshape(*values.shape, *([1] * shape.added))
    elif shape.dropped:
        values = values.squeeze(shape.dropped)
    if shape.layout is None:
        # () when the axes are in order already (a fresh result: no view needed)
        return values.permute(shape.permutation) if shape.permutation else values
    if p.offsets is None:
        return Ragged(values, x.offsets, x.sizes, shape.layout, x.row_offsets)
    assert p.sizes is not None
    if p.row_offsets and not shape.layout.num_nested:  # the rectangles above the reduced axes
        return as_rectangular(values, p.offsets, p.sizes, shape.layout)
    return Ragged(values, p.offsets, p.sizes, shape.layout, p.row_offsets)


class _Shape(NamedTuple):
    """What a reduction does to the axes: see :func:`_result_shape`."""

    layout: Layout | None  # the result's, or None when no ragged axis is left
    permutation: tuple[int, ...]  # of the dense result's axes (batch first); () if in order
    added: int  # reduced ragged axes kept as dense axes of size 1 (keepdim)
    dropped: tuple[int, ...]  # values axes squeezed away (reduced dense axes, no keepdim)


# eager answers of _result_shape, by (layout code, reduced axes, keepdim)
_SHAPES: dict[tuple[str, tuple[int, ...], bool], _Shape] = {}


def _result_shape(layout: Layout, reduced_axes: tuple[int, ...], keepdim: bool) -> _Shape:
    """The result's axes after reducing logical ``reduced_axes`` (static: remembered eagerly)."""
    if torch.compiler.is_compiling():
        return _compute_shape(layout, reduced_axes, keepdim)
    key = (layout.code, reduced_axes, keepdim)
    found = _SHAPES.get(key)
    if found is None:
        found = _SHAPES[key] = _compute_shape(layout, reduced_axes, keepdim)
    return found


def _compute_shape(layout: Layout, reduced_axes: tuple[int, ...], keepdim: bool) -> _Shape:
    num_dense = layout.num_dense
    sample = static_axes(layout)
    reduced = [sample[q - 1] for q in reduced_axes]
    dropped = sorted(index for ragged, index in reduced if not ragged)
    reduced_ragged = [index for ragged, index in reduced if ragged]
    axes: list[Axis] = []
    next_ragged = 0
    added = 0
    nested = layout.num_nested > 0
    letters = [part[0] for part in layout.code.split()]  # strings stay constants under compile
    first_reduced = min(reduced_ragged, default=len(sample))
    for position, (ragged, index) in enumerate(sample):
        removed = position + 1 in reduced_axes
        if ragged and not removed:
            # Kept ragged axes keep their storage (k) order (a nested chain stays one).
            new = index - sum(1 for k in reduced_ragged if k < index)
            # above every reduced axis the partition is unchanged, and so are the
            # rectangles; below one the elements are aligned: nested
            letter = letters[position] == "n" if index < first_reduced else True
            axes.append(Axis(True, new, nested and new > 0 and letter))
            next_ragged += 1
        elif ragged and keepdim:
            axes.append(Axis(False, num_dense + added))
            added += 1
        elif not ragged and (keepdim or not removed):
            shift = 0 if keepdim else sum(1 for j in dropped if j < index)
            axes.append(Axis(False, index - shift))
    squeezed = () if keepdim else tuple(1 + j for j in dropped)
    if next_ragged == 0:
        permutation = (0, *(1 + a.index for a in axes))
        if permutation == tuple(range(len(permutation))):
            permutation = ()
        return _Shape(None, permutation, added, squeezed)
    return _Shape(Layout(tuple(axes)), (), added, squeezed)


def full_result(x: Ragged, value: Tensor, keepdim: bool) -> Tensor:
    """A full reduction's 0-d ``value``, shaped ``(1,) * ndim`` for ``keepdim``."""
    return value.reshape((1,) * x.ndim) if keepdim else value


def map_result(result: Ragged | Tensor, fn: Callable[[Tensor], Tensor]) -> Ragged | Tensor:
    """Apply an elementwise ``fn`` to a reduction result (its values if Ragged)."""
    if isinstance(result, Ragged):
        return like(result, fn(result.values))
    return fn(result)


def integer_sum_dtype(values: Tensor, dtype: torch.dtype | None) -> Tensor:
    """Values cast as ``torch.sum`` would: to ``dtype``, or integers/bool to int64."""
    if dtype is not None:
        return values.to(dtype)
    if values.dtype == torch.bool or not (values.is_floating_point() or values.is_complex()):
        return values.to(torch.int64)
    return values
