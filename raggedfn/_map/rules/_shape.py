"""Batching rules for shape ops: views, permutations, cat/stack, splits, factories (taking
part of an axis: `_slice.py`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..._errors import fail
from ..._index import local_positions
from ..._layout import Layout
from ..base._registry import rule
from ..base._sizes import Sz, Unsupported
from ..base._values import (
    Ctx,
    DenseB,
    RaggedB,
    align,
    axes_of,
    canonical_layout,
    canonicalize,
    dense_shape,
    is_batched,
    make_layout,
    make_ragged,
    ragged_positions,
    rank_of,
    struct_rows,
    sz_in_storage_order,
)
from ._slice import dense_axis_op, per_sample_scalar

aten = torch.ops.aten


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
    positions = ragged_positions(shape)
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


@rule(aten.permute)
def permute_rule(ctx: Ctx, step: Any, x: Any, dims: Any) -> Any:
    n = rank_of(x)
    return _permuted(ctx, x, [d % n for d in dims])


@rule(aten.transpose, aten.swapaxes, aten.swapdims)
def transpose_rule(ctx: Ctx, step: Any, x: Any, d0: int, d1: int) -> Any:
    n = rank_of(x)
    perm = list(range(n))
    if n:
        perm[d0 % n], perm[d1 % n] = perm[d1 % n], perm[d0 % n]
    return _permuted(ctx, x, perm)


@rule(aten.t, aten.numpy_T, aten.mT, aten.adjoint)
def t_rule(ctx: Ctx, step: Any, x: Any) -> Any:
    n = rank_of(x)
    if step.target.overloadpacket is aten.numpy_T:
        return _permuted(ctx, x, list(range(n))[::-1])
    perm = list(range(n))
    if n >= 2:
        perm[-1], perm[-2] = perm[-2], perm[-1]
    return _permuted(ctx, x, perm)


@rule(aten.movedim)
def movedim_rule(ctx: Ctx, step: Any, x: Any, source: Any, destination: Any) -> Any:
    n = rank_of(x)
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
    positions = ragged_positions(shape)
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
    positions = ragged_positions(shape)
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
    positions = ragged_positions(shape)
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
    begin = per_sample_scalar(ctx, start, segments)
    delta = per_sample_scalar(ctx, end_step, segments)
    values = (begin + position * delta).to(step.out.dtype)
    return RaggedB(values, layout, sz, struct)


@rule(aten.eye)
def eye_rule(ctx: Ctx, step: Any, *args: Any, **kwargs: Any) -> Any:
    """``eye(n[, m])`` with per-sample sizes: ones where the two coordinates agree."""
    shape, layout, sz, struct, _ = _factory_values(ctx, step)
    if len(shape) != 2 or len(sz) != 2:
        raise Unsupported("eye with a fixed size")
    rows, cols = struct.coords()
    if layout.axes[0].index != 0:  # storage order (m, n): coordinates come swapped
        rows, cols = cols, rows
    return RaggedB((rows == cols).to(step.out.dtype), layout, sz, struct)


@rule(aten.zeros, aten.ones, aten.empty, aten.full, aten.rand, aten.randn)
def factory_rule(ctx: Ctx, step: Any, size: Any, *rest: Any, **kwargs: Any) -> Any:
    _, layout, sz, struct, dense = _factory_values(ctx, step)
    if any(is_batched(v) for v in rest):
        raise Unsupported("a per-sample fill value")
    values = step.target([struct.total, *dense], *rest, **kwargs)
    return RaggedB(values, layout, sz, struct)


@rule(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full)
def new_factory_rule(ctx: Ctx, step: Any, x: Any, size: Any, *rest: Any, **kwargs: Any) -> Any:
    if any(is_batched(v) for v in rest):
        raise Unsupported("a per-sample fill value")
    like = x.values if isinstance(x, RaggedB) else x.data if isinstance(x, DenseB) else x
    if not isinstance(like, Tensor):
        raise Unsupported("a factory from a per-sample size")
    if not ragged_positions(step.out.shape) and not any(is_batched(s) for s in size):
        # a fixed shape read only from x's dtype and device: the same tensor for every
        # sample (Hugging Face's mask builders start from ``x.new_ones(())``)
        return step.target(like, size, *rest, **kwargs)
    _, layout, sz, struct, dense = _factory_values(ctx, step)
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
        # one unbind of the packed values, as torch per sample: its backward stacks the
        # gradients (one copy), where one select per piece zero-fills a full-size gradient each
        pieces = x.values.unbind(1 + axis.index)
        return tuple(dense_axis_op(x, dim, lambda v, d, p=p: p, removes=True) for p in pieces)
    pieces = packet(x.values, rest[0], 1 + axis.index)
    return tuple(RaggedB(p, x.layout, x.sz, x.struct) for p in pieces)
