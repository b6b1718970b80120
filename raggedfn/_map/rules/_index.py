"""Batching rules for indexing with per-sample positions: ``gather`` and slices of a
shared tensor by per-sample bounds (Hugging Face models slice their position-id
buffer by the sequence length and gather token-type ids by position).

Both are written with coordinates: every packed element of the result knows its
sample and its coordinate along each logical axis; the source element is found by
replacing one coordinate (the gathered axis) and reading the source at those
coordinates, as a packed row when the source is per-sample, directly when it is
shared. An out-of-range position sends the call to the per-sample loop, which
raises torch's own error for that sample (checked on device while compiling).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

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
    is_batched,
    struct_rows,
    sz_in_storage_order,
    take_rows,
)

aten = torch.ops.aten


def _coordinates(x: RaggedB) -> tuple[Tensor, list[Tensor]]:
    """Sample of every packed element of canonical ``x`` and its coordinate along each
    logical axis, broadcastable to ``x.values.shape``."""
    dense = x.values.shape[1:]
    rank = len(axes_of(x.layout))
    extra = [1] * len(dense)
    segments = x.struct.segments().reshape(-1, *extra)
    coords: list[Tensor] = []
    ragged = x.struct.coords()
    for a in axes_of(x.layout)[:rank]:
        if a.ragged:
            coords.append(ragged[a.index].reshape(-1, *extra))
        else:
            shape = [1] * (1 + len(dense))
            shape[1 + a.index] = dense[a.index]
            coords.append(torch.arange(dense[a.index], device=x.values.device).reshape(shape))
    return segments, coords


def _check_range(ctx: Ctx, op: str, positions: Tensor, size: Any, segments: Tensor) -> None:
    bad = (positions < 0) | (positions >= size)
    message = f"map: {op}: a position is out of range for its sample (torch raises there)"
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), message)
        return
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0])
        sample = int(segments.expand_as(bad)[where])
        limit = size if isinstance(size, int) else int(size.expand_as(bad)[where])
        raise SampleRaises(
            f"{message}: sample {sample} asks for position "
            f"{int(positions.expand_as(bad)[where])} of {limit}"
        )


@rule(aten.gather)
def gather_rule(
    ctx: Ctx, step: Any, x: Any, dim: int, index: Any, *, sparse_grad: bool = False
) -> Any:
    """``torch.gather(x, dim, index)`` with a per-sample ``index`` (ragged or not) and a
    per-sample or shared source: the result has ``index``'s shape."""
    if not isinstance(index, RaggedB) or isinstance(x, SymB):
        raise Unsupported("gather with a shared index")
    index = canonicalize(ctx, index)
    rank = len(axes_of(index.layout))
    dim = dim % rank
    segments, coords = _coordinates(index)
    full = index.values.shape
    # an index expanded over an axis (DeBERTa's relative positions over heads) is
    # checked and offset once per distinct element; broadcasting gives it back
    positions = _unexpanded(index.values)
    if isinstance(x, RaggedB):
        x = canonicalize(ctx, x)
        x_axes = axes_of(x.layout)
        if len(x_axes) != rank:
            raise Unsupported("gather between values of different ranks")
        along = x_axes[dim]
        if along.ragged:
            size = take_rows(x.struct.sizes[:, along.index], segments)
        else:
            size = x.values.shape[1 + along.index]
        _check_range(ctx, "gather", positions, size, segments)
        coords[dim] = positions
        order = sorted((a.index, p) for p, a in enumerate(x_axes) if a.ragged)
        ragged_coords = [coords[p] for _, p in order]
        # segments and coordinates broadcast: no per-element index lookups
        rows = struct_rows(x.struct, segments, ragged_coords)
        dense_order = sorted((a.index, p) for p, a in enumerate(x_axes) if not a.ragged)
        values = _read_flat(x.values, rows, [(i, coords[p]) for i, p in dense_order], full)
    elif isinstance(x, Tensor) and not is_batched(x):
        if x.ndim != rank:
            raise Unsupported("gather between values of different ranks")
        _check_range(ctx, "gather", positions, x.shape[dim], segments)
        coords[dim] = positions
        values = x[tuple(c.expand(full) for c in coords)]
    else:
        raise Unsupported("gather from a fixed-size per-sample source")
    return RaggedB(values.to(step.out.dtype), index.layout, index.sz, index.struct)


def _unexpanded(t: Tensor) -> Tensor:
    """``t`` with length 1 along its broadcast (stride-0) dense axes: the same elements
    (the packed row axis stays whole, as the sample ids it is checked with)."""
    for d in range(1, t.ndim):
        if t.stride(d) == 0 and t.shape[d] > 1:
            t = t.narrow(d, 0, 1)
    return t


def _read_flat(
    source: Tensor, rows: Tensor, dense: list[tuple[int, Tensor]], shape: torch.Size
) -> Tensor:
    """``source[rows, *dense coordinates]`` (broadcast together, to ``shape``) as one 1-D
    ``gather`` of the flattened source: its backward is one ``scatter_add``, where
    advanced indexing's is an accumulating ``index_put`` (several times slower on pair
    states, DeBERTa's relative-position gathers). The offsets are summed smallest
    first, so that only the last sum has the full shape."""
    source = source.contiguous()
    strides = source.stride()
    terms = [rows * strides[0]]
    terms += [c if strides[1 + axis] == 1 else c * strides[1 + axis] for axis, c in dense]
    if not torch.compiler.is_compiling():  # symbolic sizes have no order to sort by
        terms.sort(key=lambda t: t.numel())
    flat = terms[0]
    for t in terms[1:]:
        flat = flat + t
    return source.reshape(-1).gather(0, flat.expand(shape).reshape(-1)).reshape(shape)


def slice_shared(
    ctx: Ctx, step: Any, x: Tensor, dim: int, start: Any, end: Any, stride: int
) -> RaggedB:
    """``buffer[..., start:end]`` of a shared tensor with per-sample bounds: a ragged
    axis whose size is the traced per-sample expression (Python slice semantics)."""
    shape = step.out.shape
    dim = dim % x.ndim
    positions = tuple(p for p, s in enumerate(shape) if isinstance(s, Sz))
    if positions != (dim,):
        raise Unsupported("a slice of a shared tensor with other per-sample sizes")
    layout = canonical_layout(len(shape), positions)
    sz = sz_in_storage_order(shape, layout)
    struct = ctx.struct(sz)
    segments = struct.segments()
    size = torch.full_like(segments, x.shape[dim])
    if start is None:
        begin = torch.zeros_like(segments)
    else:
        begin = ctx.eval(start.sz)[segments] if isinstance(start, SymB) else start + 0 * size
        begin = torch.where(begin < 0, begin + size, begin).clamp(min=0).minimum(size)
    rows = begin + struct.coords()[0] * stride
    values = x.movedim(dim, 0).index_select(0, rows)
    return RaggedB(values, layout, sz, struct)


@rule(aten.sort, aten.argsort)
def sort_rule(ctx: Ctx, step: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """Sort along any axis of each sample: raggedfn's own (stable) ``sort``."""
    from ..._ragged import Ragged
    from ...ops import sort

    if not isinstance(x, RaggedB):
        raise Unsupported("sort of a fixed-size or shared value")
    overload = step.target._overloadname
    if overload == "stable":
        dim, descending = kwargs.get("dim", -1), kwargs.get("descending", False)
    else:
        dim = args[0] if args else kwargs.get("dim", -1)
        descending = args[1] if len(args) > 1 else kwargs.get("descending", False)
    value = Ragged._make(x.values, x.struct.offsets, x.struct.sizes, x.layout)
    # the per-sample axis d is axis d + 1 of the batched value
    values, indices = sort(value, dim % len(axes_of(x.layout)) + 1, descending)
    if step.target.overloadpacket is aten.argsort:
        return RaggedB(indices.values, x.layout, x.sz, x.struct)
    return (
        RaggedB(values.values, x.layout, x.sz, x.struct),
        RaggedB(indices.values, x.layout, x.sz, x.struct),
    )


def index_positions(ctx: Ctx, step: Any, x: Any, indices: Any) -> Any:
    """``x[i0, i1, ...]`` with integer tensor indices (per-sample, shared, or both) over
    the leading axes of a per-sample ``x``: every element of the broadcast index shape
    reads ``x`` at those coordinates; ragged axes of ``x`` are indexed by each sample's
    own positions (negative ones count from that sample's end). Hugging Face's mask
    builders read ``ids[batch_idx, q_idx]`` this way."""
    if not isinstance(x, RaggedB):
        raise Unsupported("indexing a fixed-size or shared value with a per-sample index")
    if any(i is None for i in indices):
        raise Unsupported("indexing with slices between tensor indices")
    if any(not isinstance(i, (Tensor, RaggedB, DenseB)) for i in indices):
        raise Unsupported("indexing with a per-sample size")
    if any(_dtype(i) in (torch.bool, torch.uint8) for i in indices):
        raise Unsupported("indexing with a mask among several indices")
    x = canonicalize(ctx, x)
    x_axes = axes_of(x.layout)
    m = len(indices)
    if any(a.ragged for a in x_axes[m:]):
        raise Unsupported("a ragged axis after the indexed axes")
    shape = step.out.shape
    nb = len(shape) - (len(x_axes) - m)
    positions = tuple(p for p, s in enumerate(shape) if isinstance(s, Sz))
    if any(p >= nb for p in positions):
        raise Unsupported("a ragged result axis after the indexed axes")
    layout_b = canonical_layout(nb, positions)
    if positions:
        sz = sz_in_storage_order(shape[:nb], layout_b)
        struct = ctx.struct(sz)
        segments = struct.segments()
    else:
        sz, struct = (), None
        segments = torch.arange(ctx.batch_size, device=x.values.device)
    aligned = [align(ctx, i, tuple(shape[:nb]), layout_b, struct) for i in indices]
    extra = nb - len(positions)
    segments = segments.reshape(-1, *([1] * extra))
    segments, *aligned = torch.broadcast_tensors(segments, *aligned)
    ragged: list[Any] = [None] * len(x.sz)
    dense: list[Tensor] = []
    for q, (a, i) in enumerate(zip(x_axes, aligned, strict=False)):
        size = x.struct.sizes[:, a.index][segments] if a.ragged else x.values.shape[1 + a.index]
        i = torch.where(i < 0, i + size, i)
        _check_range(ctx, f"index along axis {q}", i, size, segments)
        if a.ragged:
            ragged[a.index] = i
        else:
            dense.append(i)
    rows = struct_rows(x.struct, segments, ragged)
    values = x.values[(rows, *dense)].to(step.out.dtype)
    if struct is None:
        return DenseB(values.reshape(ctx.batch_size, *shape))
    layout = canonical_layout(len(shape), positions)
    return RaggedB(values, layout, sz_in_storage_order(shape, layout), struct)


def _dtype(i: Any) -> Any:
    return (
        i.values.dtype
        if isinstance(i, RaggedB)
        else i.data.dtype
        if isinstance(i, DenseB)
        else i.dtype
    )


__all__ = ["gather_rule", "index_positions", "slice_shared", "sort_rule"]


def _triangle(ctx: Ctx, x: Any, diagonal: Any, lower: bool) -> Any:
    """``tril``/``triu`` of a value whose last two logical axes hold per-sample sizes:
    elements are kept by their coordinates (``j - i <= diagonal`` for the lower
    triangle), as each sample's own call keeps them."""
    if not isinstance(x, RaggedB):
        raise Unsupported("tril/triu of a fixed-size value")  # torch.vmap batches those
    if not isinstance(diagonal, int) or isinstance(diagonal, bool):
        raise Unsupported("tril/triu with a per-sample diagonal")
    x = canonicalize(ctx, x)
    _, coords = _coordinates(x)
    offset = coords[-1] - coords[-2]
    keep = offset <= diagonal if lower else offset >= diagonal
    zero = torch.zeros((), dtype=x.values.dtype, device=x.values.device)
    return RaggedB(torch.where(keep, x.values, zero), x.layout, x.sz, x.struct)


@rule(aten.tril)
def tril_rule(ctx: Ctx, step: Any, x: Any, diagonal: Any = 0) -> Any:
    return _triangle(ctx, x, diagonal, lower=True)


@rule(aten.triu)
def triu_rule(ctx: Ctx, step: Any, x: Any, diagonal: Any = 0) -> Any:
    return _triangle(ctx, x, diagonal, lower=False)
