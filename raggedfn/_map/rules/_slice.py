"""Batching rules that take part of an axis: ``select``, ``slice`` and ``narrow`` on ragged
and dense axes, with Python's slice semantics evaluated per sample (negative bounds,
clamping to ``[0, n]``, steps by ceil division), and the gathers they become."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..._layout import Axis
from ..base._registry import rule
from ..base._sizes import SampleRaises, Sz, Unsupported
from ..base._values import (
    Ctx,
    DenseB,
    RaggedB,
    SymB,
    align,
    axes_of,
    canonical_layout,
    canonicalize,
    dense_shape,
    is_batched,
    make_layout,
    num_ragged_of,
    ragged_positions,
    rank_of,
    struct_rows,
    sz_in_storage_order,
    take_rows,
)
from ._index import slice_shared

aten = torch.ops.aten


def _take(ctx: Ctx, x: RaggedB, dim: int, out_shape: tuple[Any, ...], index_of: Any) -> Any:
    """Result of indexing canonical ``x`` along ragged logical axis ``dim``.

    ``index_of(out_coord, segments, size)`` gives the input coordinate along
    ``dim`` (``out_coord`` is None when the axis is removed, as by ``select``).
    """
    x = canonicalize(ctx, x)
    k_dim = axes_of(x.layout)[dim].index
    keeps_axis = len(out_shape) == len(axes_of(x.layout))
    positions = ragged_positions(out_shape)
    others = len(positions) - (1 if keeps_axis and isinstance(out_shape[dim], Sz) else 0)
    if others != num_ragged_of(x.layout) - 1:
        # another ragged axis has a fixed size in this trace (a guard fixed it)
        raise Unsupported("indexing where another ragged axis has a size fixed by a guard")
    if keeps_axis and not isinstance(out_shape[dim], Sz):
        return _take_fixed(ctx, x, dim, out_shape, index_of)
    if positions:
        layout = canonical_layout(len(out_shape), positions)
        sz = sz_in_storage_order(out_shape, layout)
        struct = ctx.struct(sz)
        segments = struct.segments()
        out_coords = list(struct.coords())
    else:
        segments = torch.arange(ctx.batch_size, device=ctx.device)
        out_coords = []
        layout, sz, struct = canonical_layout(len(out_shape), ()), (), None
    size = x.struct.sizes[segments, k_dim]
    coords: list[Any] = []
    it = iter(out_coords)
    for k in range(num_ragged_of(x.layout)):
        if k == k_dim:
            coords.append(index_of(next(it) if keeps_axis else None, segments, size))
        else:
            coords.append(next(it))
    values = take_rows(x.values, struct_rows(x.struct, segments, coords))
    if struct is None:
        return DenseB(values.reshape(ctx.batch_size, *out_shape))
    return RaggedB(
        values.reshape(values.shape[0], *dense_shape(out_shape, layout)), layout, sz, struct
    )


def _take_fixed(ctx: Ctx, x: RaggedB, dim: int, out_shape: tuple[Any, ...], index_of: Any) -> Any:
    """A ragged axis sliced to a fixed size ``m`` (e.g. ``x[:3]`` under the guard
    ``s0 >= 3``): it becomes a dense axis; every kept row gathers ``m`` rows."""
    k_dim = axes_of(x.layout)[dim].index
    m = int(out_shape[dim])
    positions = ragged_positions(out_shape)
    if positions:
        layout = canonical_layout(len(out_shape), positions)
        sz = sz_in_storage_order(out_shape, layout)
        struct = ctx.struct(sz)
        segments = struct.segments()
        out_coords = list(struct.coords())
    else:
        segments = torch.arange(ctx.batch_size, device=ctx.device)
        out_coords = []
        layout, sz, struct = canonical_layout(len(out_shape), ()), (), None
    segments = segments[:, None]
    size = x.struct.sizes[segments, k_dim]
    steps = torch.arange(m, device=ctx.device)[None, :]
    coords: list[Any] = []
    it = iter(out_coords)
    for k in range(num_ragged_of(x.layout)):
        coords.append(index_of(steps, segments, size) if k == k_dim else next(it)[:, None])
    values = x.values[struct_rows(x.struct, segments, coords)]  # [n, m, *dense]
    before = sum(1 for q, a in enumerate(axes_of(x.layout)) if not a.ragged and q < dim)
    values = values.movedim(1, 1 + before)
    if struct is None:
        return DenseB(values.reshape(ctx.batch_size, *out_shape))
    return RaggedB(values, layout, sz, struct)


def dense_axis_op(x: RaggedB, dim: int, fn: Any, removes: bool) -> RaggedB:
    axis = axes_of(x.layout)[dim]
    values = fn(x.values, 1 + axis.index)
    axes = list(axes_of(x.layout))
    if removes:
        del axes[dim]
        axes = [
            Axis(False, a.index - 1) if not a.ragged and a.index > axis.index else a for a in axes
        ]
    return RaggedB(values, make_layout(tuple(axes)), x.sz, x.struct)


def per_sample_scalar(ctx: Ctx, v: Any, segments: Tensor) -> Any:
    if isinstance(v, SymB):
        return ctx.eval(v.sz)[segments]
    if is_batched(v):
        raise Unsupported("a tensor index")
    return v


@rule(aten.select)
def select_rule(ctx: Ctx, step: Any, x: Any, dim: int, index: Any) -> Any:
    if isinstance(x, DenseB) and not is_batched(index):
        return DenseB(x.data.select(1 + dim % rank_of(x), index))
    if not isinstance(x, RaggedB):
        raise Unsupported("select of a per-sample size")
    dim = dim % len(axes_of(x.layout))
    if not axes_of(x.layout)[dim].ragged and not is_batched(index):
        return dense_axis_op(x, dim, lambda v, d: v.select(d, index), removes=True)

    def index_of(_: Any, segments: Tensor, size: Tensor) -> Tensor:
        i = torch.as_tensor(per_sample_scalar(ctx, index, segments), device=size.device) + 0 * size
        i = torch.where(i < 0, i + size, i)
        if not torch.compiler.is_compiling() and bool(((i < 0) | (i >= size)).any()):
            # the per-sample call raises IndexError here; never read another sample's rows
            raise SampleRaises(
                "map: "
                f"index {index} is out of range along ragged axis {dim} for a sample with "
                f"sizes {x.struct.sizes[segments[(i < 0) | (i >= size)][0]].tolist()}",
            )
        return i

    return _take(ctx, x, dim, step.out.shape, index_of)


def _normalize(value: Any, size: Tensor, default: int) -> Tensor:
    if value is None:
        return torch.full_like(size, default)
    value = torch.as_tensor(value, device=size.device) + 0 * size
    value = torch.where(value < 0, value + size, value)
    return value.clamp(min=0).minimum(size)


@rule(aten.slice)
def slice_rule(
    ctx: Ctx, step: Any, x: Any, dim: int = 0, start: Any = None, end: Any = None, stride: int = 1
) -> Any:
    if isinstance(x, DenseB) and not any(is_batched(v) for v in (start, end)):
        return DenseB(aten.slice(x.data, 1 + dim % rank_of(x), start, end, stride))
    if isinstance(x, Tensor) and not isinstance(end, RaggedB) and not isinstance(start, RaggedB):
        return slice_shared(ctx, step, x, dim, start, end, stride)
    if not isinstance(x, RaggedB):
        raise Unsupported("slice of a per-sample size")
    dim = dim % len(axes_of(x.layout))
    if not axes_of(x.layout)[dim].ragged and not any(is_batched(v) for v in (start, end)):
        return dense_axis_op(x, dim, lambda v, d: aten.slice(v, d, start, end, stride), False)
    xs = x.shape()[dim]
    if (
        isinstance(step.out.shape[dim], Sz)
        and step.out.shape[dim].key == xs.key
        and start in (None, 0)
        and stride == 1
    ):
        return x

    def index_of(out_coord: Tensor, segments: Tensor, size: Tensor) -> Tensor:
        begin = _normalize(per_sample_scalar(ctx, start, segments), size, 0)
        return begin + out_coord * stride

    return _take(ctx, x, dim, step.out.shape, index_of)


@rule(aten.narrow)
def narrow_rule(ctx: Ctx, step: Any, x: Any, dim: int, start: Any, length: Any) -> Any:
    if isinstance(x, DenseB) and not any(is_batched(v) for v in (start, length)):
        return DenseB(x.data.narrow(1 + dim % rank_of(x), start, length))
    if not isinstance(x, RaggedB):
        raise Unsupported("narrow of a per-sample size")
    dim = dim % len(axes_of(x.layout))
    if not axes_of(x.layout)[dim].ragged and not any(is_batched(v) for v in (start, length)):
        return dense_axis_op(x, dim, lambda v, d: v.narrow(d, start, length), False)

    def index_of(out_coord: Tensor, segments: Tensor, size: Tensor) -> Tensor:
        begin = _normalize(per_sample_scalar(ctx, start, segments), size, 0)
        return begin + out_coord

    return _take(ctx, x, dim, step.out.shape, index_of)


# ----- diff ---------------------------------------------------------------------------


@rule(aten.diff)
def diff_rule(
    ctx: Ctx, step: Any, x: Any, n: int = 1, dim: int = -1, prepend: Any = None, append: Any = None
) -> Any:
    """``torch.diff`` per sample. Along a dense axis: the packed values' own diff. Along
    a ragged axis: each output element is the ``n``-th difference of its window of
    ``n + 1`` consecutive elements of the sample's ``cat([prepend, x, append])``
    (``torch.diff`` on the gathered windows: the loop's arithmetic, bool as xor), so no
    difference crosses a sample boundary; a sample's output has ``max(0, L - n)`` rows."""
    if not isinstance(x, RaggedB):
        raise Unsupported("diff of a fixed-size or per-sample value")
    x = canonicalize(ctx, x)
    dim = dim % len(axes_of(x.layout))
    axis = axes_of(x.layout)[dim]
    if not axis.ragged:
        sides = [None if t is None else _dense_side(ctx, x, t) for t in (prepend, append)]
        values = torch.diff(x.values, n, 1 + axis.index, prepend=sides[0], append=sides[1])
        return RaggedB(values.to(step.out.dtype), x.layout, x.sz, x.struct)
    out_size = step.out.shape[dim]
    k = axis.index
    if isinstance(out_size, Sz):
        sz = tuple(out_size if j == k else s for j, s in enumerate(x.sz))
        struct = ctx.struct(sz)
        segments = struct.segments()
        coords = list(struct.coords())
    elif num_ragged_of(x.layout) == 1:
        # a size fixed by a guard (a plan for empty samples): every sample has the
        # same number of rows, a dense axis of the result
        segments = torch.arange(ctx.batch_size, device=ctx.device).repeat_interleave(out_size)
        coords = [torch.arange(out_size, device=ctx.device).repeat(ctx.batch_size)]
    else:
        raise Unsupported("diff along a ragged axis to a size fixed by a guard")
    pieces = [_piece(ctx, x, dim, t) for t in (prepend, x, append) if t is not None]
    base = 0
    for piece in pieces:
        piece["base"] = base
        base = base + piece["values"].shape[0]
    windows = []
    for j in range(n + 1):
        at = coords[k] + j
        # the piece holding position ``at``: the last one starting at or before it
        # (``at`` < the sample's total length, so a piece of length 0 is never chosen)
        rows: Any = None
        start = torch.zeros_like(at)
        for piece in pieces:
            local = piece["rows"](segments, coords, k, at - start) + piece["base"]
            rows = local if rows is None else torch.where(at >= start, local, rows)
            start = start + piece["length"](segments)
        windows.append(rows)
    source = torch.cat([p["values"] for p in pieces])
    gathered = source[torch.stack(windows, 1)]  # [T_out, n + 1, *dense]
    values = torch.diff(gathered, n, 1).squeeze(1).to(step.out.dtype)
    if not isinstance(out_size, Sz):
        values = values.reshape(ctx.batch_size, out_size, *values.shape[1:])
        return DenseB(values.movedim(1, 1 + dim))
    return RaggedB(values, x.layout, sz, struct)


def _dense_side(ctx: Ctx, x: RaggedB, side: Any) -> Tensor:
    """``prepend``/``append`` of a diff along a dense axis, laid out like ``x.values``."""
    if not isinstance(side, RaggedB):
        raise Unsupported("diff with a fixed-size prepend or append along a dense axis")
    return align(ctx, side, side.shape(), x.layout, x.struct)


def _piece(ctx: Ctx, x: RaggedB, dim: int, t: Any) -> dict[str, Any]:
    """One of ``prepend, x, append`` along ragged axis ``dim`` of canonical ``x``: its
    packed rows (``values``), its length per sample, and the row of the element at
    output coordinates ``coords`` with coordinate ``at`` along that axis."""
    k = axes_of(x.layout)[dim].index
    if isinstance(t, RaggedB):
        t = canonicalize(ctx, t)
        along = axes_of(t.layout)[dim]
        if along.ragged:
            same = axes_of(t.layout) == axes_of(x.layout) and all(
                j == k or a.key == b.key for j, (a, b) in enumerate(zip(t.sz, x.sz, strict=True))
            )
        else:  # a fixed number of rows along the axis (t[:1] where a guard says n >= 1)
            others = [s for j, s in enumerate(x.sz) if j != k]
            same = len(others) == len(t.sz) and all(
                a.key == b.key for a, b in zip(t.sz, others, strict=True)
            )
        if not same:
            raise Unsupported("diff with a prepend or append of other ragged sizes")
        struct = t.struct
        if along.ragged:

            def rows(segments: Tensor, coords: list[Tensor], k: int, at: Tensor) -> Tensor:
                coords = [at if j == k else c for j, c in enumerate(coords)]
                return struct_rows(struct, segments, coords)

            return {"values": t.values, "length": lambda s: struct.sizes[:, k][s], "rows": rows}
        count = t.values.shape[1 + along.index]
        values = t.values.movedim(1 + along.index, 1)

        def fixed_along(segments: Tensor, coords: list[Tensor], k: int, at: Tensor) -> Tensor:
            rest = [c for j, c in enumerate(coords) if j != k]
            return struct_rows(struct, segments, rest) * count + at

        return {
            "values": values.reshape(values.shape[0] * count, *values.shape[2:]),
            "length": lambda s: torch.full_like(s, count),
            "rows": fixed_along,
        }
    if num_ragged_of(x.layout) != 1:
        raise Unsupported("diff with a fixed-size prepend or append and several ragged axes")
    if isinstance(t, DenseB):
        data, shared = t.data.movedim(1 + dim, 1), False
    elif isinstance(t, Tensor):
        data, shared = t.movedim(dim, 0)[None], True
    else:
        raise Unsupported("diff with a per-sample size")
    count = data.shape[1]

    def fixed_rows(segments: Tensor, coords: list[Tensor], k: int, at: Tensor) -> Tensor:
        return at if shared else segments * count + at

    return {
        "values": data.reshape(data.shape[0] * count, *data.shape[2:]),
        "length": lambda s: torch.full_like(s, count),
        "rows": fixed_rows,
    }


# ----- cat / stack -------------------------------------------------------------------
