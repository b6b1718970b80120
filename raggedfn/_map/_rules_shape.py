"""Batching rules for shape ops: views, permutations, indexing, cat/stack, factories."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._errors import fail
from .._index import local_positions
from .._layout import Axis, Layout
from ._registry import rule
from ._rules_index import slice_shared
from ._sizes import Sz, Unsupported
from ._values import (
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
    make_ragged,
    num_ragged_of,
    struct_rows,
    sz_in_storage_order,
    take_rows,
)

aten = torch.ops.aten
_BIG = 2**62


def _ragged_positions(shape: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(p for p, s in enumerate(shape) if isinstance(s, Sz))


def _groups(shape: tuple[Any, ...]) -> tuple[list[str], list[int]]:
    keys: list[str] = []
    products = [1]
    for s in shape:
        if isinstance(s, Sz):
            keys.append(s.key)
            products.append(1)
        else:
            products[-1] *= int(s)
    return keys, products


def reshape_to(ctx: Ctx, x: Any, shape: tuple[Any, ...]) -> Any:
    """``x`` viewed as logical ``shape``: ragged axes stay whole, dense runs between them regroup."""
    if isinstance(x, DenseB):
        if any(isinstance(s, Sz) for s in shape):
            raise Unsupported("a fixed-size value reshaped to a ragged shape")
        return DenseB(x.data.reshape(x.data.shape[0], *shape))
    if not isinstance(x, RaggedB):
        raise Unsupported("reshape of a per-sample size")
    x = canonicalize(ctx, x)
    if _groups(x.shape()) != _groups(shape):
        raise Unsupported("a reshape that merges or splits a ragged axis")
    positions = _ragged_positions(shape)
    dense = [int(s) for s in shape if not isinstance(s, Sz)]
    if not positions:
        raise Unsupported("a reshape that removes every ragged axis")
    values = x.values.reshape(x.values.shape[0], *dense)
    return RaggedB(values, canonical_layout(len(shape), positions), x.sz, x.struct)


@rule(
    aten.view,
    aten.reshape,
    aten._unsafe_view,
    aten.unsqueeze,
    aten.squeeze,
    aten.flatten,
    aten.unflatten,
    aten.view_as,
    aten.reshape_as,
)
def reshape_rule(ctx: Ctx, step: Any, x: Any, *rest: Any, **kwargs: Any) -> Any:
    if step.target.overloadpacket in (aten.view, aten.reshape) and not isinstance(
        rest[0], (list, tuple)
    ):
        raise Unsupported("view as a dtype")
    if step.target.overloadpacket is aten.squeeze and isinstance(x, RaggedB):
        _check_squeeze(ctx, x, rest)
    return reshape_to(ctx, x, step.out.shape)


def _check_squeeze(ctx: Ctx, x: RaggedB, rest: tuple[Any, ...]) -> None:
    """torch's symbolic squeeze assumes a symbolic size is never 1 (and records no guard)."""
    rank = len(axes_of(x.layout))
    dims = list(range(rank)) if not rest else rest[0]
    dims = [dims] if isinstance(dims, int) else list(dims)
    for d in dims:
        axis = axes_of(x.layout)[d % rank]
        if axis.ragged and not torch.compiler.is_compiling():
            if bool((x.struct.sizes[:, axis.index] == 1).any()):
                raise fail(
                    "map",
                    f"squeeze of ragged axis {d % rank} while some sample has size 1 there: the "
                    "per-sample rank would differ between samples; squeeze dense axes by index",
                )


def _permuted(ctx: Ctx, x: Any, perm: list[int]) -> Any:
    if isinstance(x, DenseB):
        return DenseB(x.data.permute(0, *(1 + p for p in perm)))
    if isinstance(x, RaggedB):
        layout = make_layout(tuple(axes_of(x.layout)[p] for p in perm))
        return RaggedB(x.values, layout, x.sz, x.struct)
    raise Unsupported("permute of a per-sample size")


def _rank(x: Any) -> int:
    if isinstance(x, DenseB):
        return x.data.ndim - 1
    if isinstance(x, RaggedB):
        return len(axes_of(x.layout))
    raise Unsupported("not a tensor")


@rule(aten.permute)
def permute_rule(ctx: Ctx, step: Any, x: Any, dims: Any) -> Any:
    n = _rank(x)
    return _permuted(ctx, x, [d % n for d in dims])


@rule(aten.transpose, aten.swapaxes, aten.swapdims)
def transpose_rule(ctx: Ctx, step: Any, x: Any, d0: int, d1: int) -> Any:
    n = _rank(x)
    perm = list(range(n))
    if n:
        perm[d0 % n], perm[d1 % n] = perm[d1 % n], perm[d0 % n]
    return _permuted(ctx, x, perm)


@rule(aten.t, aten.numpy_T, aten.mT, aten.adjoint)
def t_rule(ctx: Ctx, step: Any, x: Any) -> Any:
    n = _rank(x)
    if step.target.overloadpacket is aten.numpy_T:
        return _permuted(ctx, x, list(range(n))[::-1])
    perm = list(range(n))
    if n >= 2:
        perm[-1], perm[-2] = perm[-2], perm[-1]
    return _permuted(ctx, x, perm)


@rule(aten.movedim)
def movedim_rule(ctx: Ctx, step: Any, x: Any, source: Any, destination: Any) -> Any:
    n = _rank(x)
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    src = [s % n for s in src]
    dst = [d % n for d in dst]
    rest = [a for a in range(n) if a not in src]
    perm: list[int] = [-1] * n
    for s, d in zip(src, dst, strict=True):
        perm[d] = s
    it = iter(rest)
    perm = [p if p >= 0 else next(it) for p in perm]
    return _permuted(ctx, x, perm)


def broadcast_to(ctx: Ctx, x: Any, shape: tuple[Any, ...]) -> Any:
    """``x`` broadcast to logical ``shape`` and materialised as a batched value."""
    positions = _ragged_positions(shape)
    layout = canonical_layout(len(shape), positions)
    if not positions:
        data = align(ctx, x, shape, layout, None)
        return DenseB(data.expand(ctx.batch_size, *shape))
    sz = sz_in_storage_order(shape, layout)
    struct = ctx.struct(sz)
    values = align(ctx, x, shape, layout, struct)
    dense = dense_shape(shape, layout)
    if not isinstance(values, Tensor) or values.ndim == 0:
        values = torch.as_tensor(values, device=ctx.device)
    values = values.expand(struct.total, *dense)
    return RaggedB(values, layout, sz, struct)


@rule(aten.expand, aten.expand_as, aten.broadcast_to)
def expand_rule(ctx: Ctx, step: Any, x: Any, *rest: Any, **kwargs: Any) -> Any:
    return broadcast_to(ctx, x, step.out.shape)


# ----- indexing along one axis -------------------------------------------------------


def _take(ctx: Ctx, x: RaggedB, dim: int, out_shape: tuple[Any, ...], index_of: Any) -> Any:
    """Result of indexing canonical ``x`` along ragged logical axis ``dim``.

    ``index_of(out_coord, segments, size)`` gives the input coordinate along
    ``dim`` (``out_coord`` is None when the axis is removed, as by ``select``).
    """
    x = canonicalize(ctx, x)
    k_dim = axes_of(x.layout)[dim].index
    keeps_axis = len(out_shape) == len(axes_of(x.layout))
    positions = _ragged_positions(out_shape)
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
    positions = _ragged_positions(out_shape)
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


def _dense_axis_op(x: RaggedB, dim: int, fn: Any, removes: bool) -> RaggedB:
    axis = axes_of(x.layout)[dim]
    values = fn(x.values, 1 + axis.index)
    axes = list(axes_of(x.layout))
    if removes:
        del axes[dim]
        axes = [
            Axis(False, a.index - 1) if not a.ragged and a.index > axis.index else a for a in axes
        ]
    return RaggedB(values, make_layout(tuple(axes)), x.sz, x.struct)


def _scalar(ctx: Ctx, v: Any, segments: Tensor) -> Any:
    if isinstance(v, SymB):
        return ctx.eval(v.sz)[segments]
    if is_batched(v):
        raise Unsupported("a tensor index")
    return v


@rule(aten.select)
def select_rule(ctx: Ctx, step: Any, x: Any, dim: int, index: Any) -> Any:
    if isinstance(x, DenseB) and not is_batched(index):
        return DenseB(x.data.select(1 + dim % _rank(x), index))
    if not isinstance(x, RaggedB):
        raise Unsupported("select of a per-sample size")
    dim = dim % len(axes_of(x.layout))
    if not axes_of(x.layout)[dim].ragged and not is_batched(index):
        return _dense_axis_op(x, dim, lambda v, d: v.select(d, index), removes=True)

    def index_of(_: Any, segments: Tensor, size: Tensor) -> Tensor:
        i = torch.as_tensor(_scalar(ctx, index, segments), device=size.device) + 0 * size
        i = torch.where(i < 0, i + size, i)
        if not torch.compiler.is_compiling() and bool(((i < 0) | (i >= size)).any()):
            # the per-sample call raises IndexError here; never read another sample's rows
            raise fail(
                "map",
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
        return DenseB(aten.slice(x.data, 1 + dim % _rank(x), start, end, stride))
    if isinstance(x, Tensor) and not isinstance(end, RaggedB) and not isinstance(start, RaggedB):
        return slice_shared(ctx, step, x, dim, start, end, stride)
    if not isinstance(x, RaggedB):
        raise Unsupported("slice of a per-sample size")
    dim = dim % len(axes_of(x.layout))
    if not axes_of(x.layout)[dim].ragged and not any(is_batched(v) for v in (start, end)):
        return _dense_axis_op(x, dim, lambda v, d: aten.slice(v, d, start, end, stride), False)
    xs = x.shape()[dim]
    if (
        isinstance(step.out.shape[dim], Sz)
        and step.out.shape[dim].key == xs.key
        and start in (None, 0)
        and stride == 1
    ):
        return x

    def index_of(out_coord: Tensor, segments: Tensor, size: Tensor) -> Tensor:
        begin = _normalize(_scalar(ctx, start, segments), size, 0)
        return begin + out_coord * stride

    return _take(ctx, x, dim, step.out.shape, index_of)


@rule(aten.narrow)
def narrow_rule(ctx: Ctx, step: Any, x: Any, dim: int, start: Any, length: Any) -> Any:
    if isinstance(x, DenseB) and not any(is_batched(v) for v in (start, length)):
        return DenseB(x.data.narrow(1 + dim % _rank(x), start, length))
    if not isinstance(x, RaggedB):
        raise Unsupported("narrow of a per-sample size")
    dim = dim % len(axes_of(x.layout))
    if not axes_of(x.layout)[dim].ragged and not any(is_batched(v) for v in (start, length)):
        return _dense_axis_op(x, dim, lambda v, d: v.narrow(d, start, length), False)

    def index_of(out_coord: Tensor, segments: Tensor, size: Tensor) -> Tensor:
        begin = _normalize(_scalar(ctx, start, segments), size, 0)
        return begin + out_coord

    return _take(ctx, x, dim, step.out.shape, index_of)


# ----- cat / stack -------------------------------------------------------------------


def _size_at(x: Any, dim: int) -> Any:
    if isinstance(x, RaggedB):
        return x.shape()[dim]
    if isinstance(x, DenseB):
        return x.data.shape[1 + dim]
    return x.shape[dim]


@rule(aten.cat, aten.concat, aten.concatenate)
def cat_rule(ctx: Ctx, step: Any, tensors: Any, dim: int = 0) -> Any:
    shape = step.out.shape
    n = len(shape)
    dim = dim % n
    parts = [t for t in tensors if not (isinstance(t, Tensor) and t.ndim == 1 and t.numel() == 0)]
    positions = _ragged_positions(shape)
    layout = canonical_layout(n, positions)
    if not isinstance(shape[dim], Sz):
        pieces = []
        for t in parts:
            piece_shape = tuple(_size_at(t, dim) if p == dim else s for p, s in enumerate(shape))
            pieces.append(broadcast_to(ctx, t, piece_shape))
        if not positions:
            return DenseB(torch.cat([p.data for p in pieces], 1 + dim))
        sz = sz_in_storage_order(shape, layout)
        struct = ctx.struct(sz)
        j = axes_of(layout)[dim].index
        values = torch.cat([canonicalize(ctx, p).values for p in pieces], 1 + j)
        return RaggedB(values, layout, sz, struct)
    # concatenation along a ragged axis: place every piece's rows, then permute once
    out_sz = sz_in_storage_order(shape, layout)
    out = ctx.struct(out_sz)
    k_cat = axes_of(layout)[dim].index
    all_values, all_rows = [], []
    before = None
    for t in parts:
        size = _size_at(t, dim)
        size_sz = size if isinstance(size, Sz) else Sz.constant(int(size))
        piece_shape = tuple(size_sz if p == dim else s for p, s in enumerate(shape))
        piece = canonicalize(ctx, broadcast_to(ctx, t, piece_shape))
        segments = piece.struct.segments()
        coords = list(piece.struct.coords())
        if before is not None:
            coords[k_cat] = coords[k_cat] + before[segments]
        all_rows.append(struct_rows(out, segments, coords))
        all_values.append(piece.values)
        before = ctx.eval(size_sz) if before is None else before + ctx.eval(size_sz)
    rows = torch.cat(all_rows)
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(rows.shape[0], device=rows.device)
    values = torch.cat(all_values)[inverse]
    return RaggedB(values, layout, out_sz, out)


@rule(aten.stack)
def stack_rule(ctx: Ctx, step: Any, tensors: Any, dim: int = 0) -> Any:
    shape = step.out.shape
    dim = dim % len(shape)
    piece_shape = tuple(1 if p == dim else s for p, s in enumerate(shape))
    pieces = []
    for t in tensors:
        if isinstance(t, Tensor):
            pieces.append(t.unsqueeze(dim))
        else:
            part_shape = tuple(s for p, s in enumerate(piece_shape) if p != dim)
            pieces.append(reshape_to(ctx, broadcast_to(ctx, t, part_shape), piece_shape))
    fake = type(step)(step.index, step.name, aten.cat.default, (), {}, step.out, True)
    return cat_rule(ctx, fake, pieces, dim)


# ----- factories -----------------------------------------------------------------------


def _factory_values(ctx: Ctx, step: Any) -> tuple[Any, Layout, tuple[Sz, ...], Any, list[int]]:
    shape = step.out.shape
    positions = _ragged_positions(shape)
    if not positions:
        raise Unsupported("a factory whose per-sample shape is fixed")
    layout = canonical_layout(len(shape), positions)
    sz = sz_in_storage_order(shape, layout)
    struct = ctx.struct(sz)
    return shape, layout, sz, struct, dense_shape(shape, layout)


@rule(aten.arange)
def arange_rule(ctx: Ctx, step: Any, *args: Any, **kwargs: Any) -> Any:
    if len(step.out.shape) != 1:
        raise Unsupported("arange")
    _, layout, sz, struct, _ = _factory_values(ctx, step)
    start, end_step = (0, 1)
    if len(args) >= 2:
        start = args[0]
    if len(args) >= 3:
        end_step = args[2]
    segments = struct.segments()
    position = local_positions(struct.offsets, segments, struct.total)
    begin = _scalar(ctx, start, segments)
    delta = _scalar(ctx, end_step, segments)
    values = (begin + position * delta).to(step.out.dtype)
    return RaggedB(values, layout, sz, struct)


@rule(aten.zeros, aten.ones, aten.empty, aten.full, aten.rand, aten.randn)
def factory_rule(ctx: Ctx, step: Any, size: Any, *rest: Any, **kwargs: Any) -> Any:
    _, layout, sz, struct, dense = _factory_values(ctx, step)
    if any(is_batched(v) for v in rest):
        raise Unsupported("a per-sample fill value")
    values = step.target([struct.total, *dense], *rest, **kwargs)
    return RaggedB(values, layout, sz, struct)


@rule(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full)
def new_factory_rule(ctx: Ctx, step: Any, x: Any, size: Any, *rest: Any, **kwargs: Any) -> Any:
    _, layout, sz, struct, dense = _factory_values(ctx, step)
    if any(is_batched(v) for v in rest):
        raise Unsupported("a per-sample fill value")
    like = x.values if isinstance(x, RaggedB) else x.data if isinstance(x, DenseB) else x
    values = step.target(like, [struct.total, *dense], *rest, **kwargs)
    return RaggedB(values, layout, sz, struct)


__all__ = ["broadcast_to", "make_ragged", "reshape_to"]


@rule(aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.tensor_split)
def split_rule(ctx: Ctx, step: Any, x: Any, *rest: Any, **kwargs: Any) -> Any:
    """Splits along a dense axis: split the packed values along that axis."""
    if not isinstance(x, RaggedB):
        raise Unsupported("split of a fixed-size or per-sample value")
    packet = step.target.overloadpacket
    if packet is aten.unbind:
        dim = rest[0] if rest else kwargs.get("dim", 0)
    else:
        dim = rest[1] if len(rest) > 1 else kwargs.get("dim", 0)
    dim = dim % len(axes_of(x.layout))
    axis = axes_of(x.layout)[dim]
    if axis.ragged:
        raise Unsupported("a split along a ragged axis")
    if packet is aten.unbind:
        count = x.values.shape[1 + axis.index]
        return tuple(
            _dense_axis_op(x, dim, lambda v, d, i=i: v.select(d, i), removes=True)
            for i in range(count)
        )
    pieces = packet(x.values, rest[0], 1 + axis.index)
    return tuple(RaggedB(p, x.layout, x.sz, x.struct) for p in pieces)
