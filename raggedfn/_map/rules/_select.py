"""Batching rules for data-dependent sizes: boolean masks, ``nonzero``, ``masked_select``.

A per-sample result whose size depends on the data (``t[t[:, 0] > 0]``) has an
unbacked size ``u0`` in the trace; its rule computes every sample's count on
device, defines ``u0`` in the symbol environment (so later sizes such as
``u0 + 1`` evaluate) and returns a new ragged axis. Packed rows are in sample
order, row-major, so a boolean index of the packed values keeps every sample's
selected elements together and in order: no sort, one host read for the total
(none while compiling).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ... import _prims
from ..base._registry import rule
from ..base._sizes import Sz, Unsupported, product_key
from ..base._values import Ctx, RaggedB, axes_of, canonical_layout, canonicalize, num_ragged_of
from ._index import index_positions

aten = torch.ops.aten


def _leading_ragged(x: RaggedB) -> bool:
    """One ragged axis, stored first and at logical position 0 (the token layout)."""
    axes = axes_of(x.layout)
    return num_ragged_of(x.layout) == 1 and axes[0].ragged


def _define(ctx: Ctx, step: Any, counts: Tensor, total: Any) -> tuple[Sz, Any]:
    """Per-sample ``counts`` are the value of the step's new size: record them."""
    if len(step.defines) != 1:
        raise Unsupported("a data-dependent result with several new sizes")
    name = step.defines[0]
    ctx.env[name] = counts
    spec_shape = step.out.shape if hasattr(step.out, "shape") else step.out[0].shape
    sz = next(s for s in spec_shape if isinstance(s, Sz) and s.key == name)
    ctx.totals[product_key((sz,))] = total
    return sz, ctx.struct((sz,))


def _mask_rows(x: RaggedB, mask: RaggedB) -> Tensor:
    """The mask as ``[T, *dense of the mask]`` over ``x``'s packed rows."""
    if mask.sz[0].key != x.sz[0].key:
        raise Unsupported("a mask over another ragged axis")
    return mask.values.bool()


def _select(ctx: Ctx, step: Any, x: RaggedB, mask: RaggedB) -> Any:
    x = canonicalize(ctx, x)
    mask = canonicalize(ctx, mask)
    if not (_leading_ragged(x) and _leading_ragged(mask)):
        raise Unsupported("a mask over a value with several or inner ragged axes")
    m = _mask_rows(x, mask)
    mask_rank = len(axes_of(mask.layout))
    x_rank = len(axes_of(x.layout))
    if mask_rank > x_rank or tuple(m.shape[1:]) != tuple(x.values.shape[1:mask_rank]):
        raise Unsupported("a mask that does not cover the leading axes")
    flat = m.reshape(m.shape[0], math.prod(m.shape[1:])).sum(1)
    counts = _prims.segment_sum(flat, x.struct.segments(), ctx.batch_size)
    values = x.values[m]
    sz, struct = _define(ctx, step, counts, values.shape[0])
    rank = len(step.out.shape)
    return RaggedB(values, canonical_layout(rank, (0,)), (sz,), struct)


@rule(aten.index.Tensor)
def index_rule(ctx: Ctx, step: Any, x: Any, indices: Any) -> Any:
    """``x[mask]`` with a boolean per-sample mask over the leading axes; integer tensor
    indices read per-sample positions (``index_positions``)."""
    if not step.defines:
        return index_positions(ctx, step, x, indices)
    if not isinstance(x, RaggedB):
        raise Unsupported("indexing with a tensor index")
    if len(indices) != 1 or not isinstance(indices[0], RaggedB):
        raise Unsupported("indexing with several tensor indices")
    mask = indices[0]
    if mask.values.dtype != torch.bool:
        raise Unsupported("indexing with an integer index")
    return _select(ctx, step, x, mask)


def _rows(t: Tensor) -> Tensor:
    """``t`` as ``[rows, everything else]`` (exact for empty tensors, unlike ``-1``)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


@rule(aten.masked_select)
def masked_select_rule(ctx: Ctx, step: Any, x: Any, mask: Any) -> Any:
    if not isinstance(x, RaggedB) or not isinstance(mask, RaggedB):
        raise Unsupported("masked_select with a shared operand")
    x = canonicalize(ctx, x)
    mask = canonicalize(ctx, mask)
    if len(axes_of(x.layout)) != len(axes_of(mask.layout)) or x.values.shape != mask.values.shape:
        raise Unsupported("masked_select with broadcasting")
    ragged = [p for p, a in enumerate(axes_of(x.layout)) if a.ragged]
    if ragged != list(range(len(ragged))):
        # packed rows follow the ragged axes first: a fixed-size axis before a ragged
        # one (t[:2] of a pair state) would put the selection out of row-major order
        raise Unsupported("masked_select where a fixed-size axis precedes a ragged one")
    x = RaggedB(_rows(x.values), canonical_layout(2, (0,)), x.sz, x.struct)
    mask = RaggedB(
        _rows(mask.values),
        canonical_layout(2, (0,)),
        mask.sz,
        mask.struct,
    )
    return _select(ctx, step, x, mask)


@rule(aten.nonzero)
def nonzero_rule(ctx: Ctx, step: Any, x: Any) -> Any:
    """Per-sample ``nonzero``: ``(u0, rank)`` int64 coordinates of the set elements."""
    if not isinstance(x, RaggedB):
        raise Unsupported("nonzero of a shared value")
    x = canonicalize(ctx, x)
    if not _leading_ragged(x):
        raise Unsupported("nonzero over several or inner ragged axes")
    m = x.values.bool()
    found = torch.nonzero(m)  # [K, 1 + dense]: packed row, then dense coordinates
    rows = found[:, 0]
    segments = x.struct.segments()
    local = rows - x.struct.offsets.index_select(0, segments.index_select(0, rows))
    coords = torch.cat([local[:, None], found[:, 1:]], 1)
    flat = m.reshape(m.shape[0], math.prod(m.shape[1:])).sum(1)
    counts = _prims.segment_sum(flat, segments, ctx.batch_size)
    sz, struct = _define(ctx, step, counts, coords.shape[0])
    return RaggedB(coords, canonical_layout(2, (0,)), (sz,), struct)


__all__: list[str] = []
