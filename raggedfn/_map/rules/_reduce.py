"""Batching rules for reductions, softmax and cumsum (over dense and ragged axes).

Reductions over ragged axes are segment reductions on the packed rows: every
row is sent to the row of the result that keeps its other coordinates
(``reduce_index``), and the segment primitives of ``raggedfn._prims`` combine
them (dense axes reduced in the same call are reduced row by row first).
Empty samples follow DESIGN §4: sum 0, prod 1, mean NaN, amax/amin the
identity, argmax/argmin -1, logsumexp -inf.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ... import _prims
from ..._prims._forward import plain_eager
from ..base._registry import rule, schema_args
from ..base._sizes import SampleRaises, Sz, Unsupported
from ..base._values import (
    Ctx,
    DenseB,
    RaggedB,
    axes_of,
    canonical_layout,
    canonicalize,
    dense_shape,
    num_ragged_of,
    reduce_index,
)

aten = torch.ops.aten


def bind(step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, (name, kwarg_only, has_default, default) in enumerate(schema_args(step.target)):
        if i < len(args) and not kwarg_only:
            out[name] = args[i]
        elif name in kwargs:
            out[name] = kwargs[name]
        elif has_default:
            out[name] = default
        else:
            out[name] = None
    return out


def _dims(value: Any, rank: int) -> list[int]:
    if value is None:
        return list(range(rank))
    if isinstance(value, int):
        value = [value]
    value = list(value)
    if not value:
        return list(range(rank))
    return sorted({d % rank for d in value}) if rank else []


def _finish(
    ctx: Ctx, values: Tensor, shape: tuple[Any, ...], sz: tuple[Sz, ...], struct: Any
) -> Any:
    positions = tuple(p for p, s in enumerate(shape) if isinstance(s, Sz))
    if not positions:
        return DenseB(values.reshape(ctx.batch_size, *shape))
    layout = canonical_layout(len(shape), positions)
    values = values.reshape(values.shape[0], *dense_shape(shape, layout))
    return RaggedB(values, layout, sz, struct)


def segment(values: Tensor, index: Tensor, count: Any, how: str) -> Tensor:
    """Combine rows of ``values`` that share ``index`` into ``count`` rows (``_prims``).

    ``how`` is ``"sum"``, ``"amax"``, ``"amin"`` or ``"prod"``; the rules of
    ``_linalg`` call this name.
    """
    if how == "sum":
        return _prims.segment_sum(values, index, count)
    if how == "amax":
        return _prims.segment_amax(values, index, count)
    if how == "amin":
        return _prims.segment_amin(values, index, count)
    if how == "prod":
        return _prims.segment_prod(values, index, count)
    raise AssertionError(how)


_KIND = {
    aten.sum: "sum",
    aten.mean: "mean",
    aten.amax: "amax",
    aten.amin: "amin",
    aten.prod: "prod",
    aten.any: "any",
    aten.all: "all",
    aten.var: "var",
    aten.std: "std",
    aten.logsumexp: "logsumexp",
    aten.linalg_vector_norm: "norm",
    aten.norm: "norm",
    aten.argmax: "argmax",
    aten.argmin: "argmin",
}


@rule(*_KIND)
def reduce_rule(ctx: Ctx, step: Any, *args: Any, **kwargs: Any) -> Any:
    kind = _KIND[step.target.overloadpacket]
    bound = bind(step, args, kwargs)
    x = bound["self"]
    if not isinstance(x, RaggedB):
        raise Unsupported("a reduction of a per-sample size")
    x = canonicalize(ctx, x)
    rank = len(axes_of(x.layout))
    dims = _dims(bound.get("dim"), rank)
    ragged = [p for p in dims if axes_of(x.layout)[p].ragged]
    dense = [p for p in dims if not axes_of(x.layout)[p].ragged]
    if not ragged:
        return _dense_only(step, x, args, kwargs, dims)
    if kind in ("argmax", "argmin", "amax", "amin"):
        refuse_empty(ctx, step, x, {axes_of(x.layout)[p].index for p in ragged})
    if kind in ("argmax", "argmin"):
        if bound.get("dim") is None:
            raise Unsupported("argmax/argmin of a flattened ragged value")
        k = axes_of(x.layout)[dims[0]].index
        largest = kind == "argmax"
        _, _, position, sz, out_struct = _extremum(ctx, x, k, largest, x.values.detach())
        return _finish(ctx, position, step.out.shape, sz, out_struct)
    values = x.values
    dtype = bound.get("dtype")
    if dtype is not None:
        values = values.to(dtype)
    elif kind in ("sum", "prod") and values.dtype != step.out.dtype:
        values = values.to(step.out.dtype)  # torch's promotion: a sum of bools counts (int64)
    value_dims = [1 + axes_of(x.layout)[p].index for p in dense]
    reduced = {axes_of(x.layout)[p].index for p in ragged}
    index, count, sz = reduce_index(ctx, x, reduced)
    out_struct = ctx.struct(sz) if sz else None
    segments = out_struct.segments() if out_struct is not None else None
    per_sample = torch.ones(ctx.batch_size, dtype=torch.int64, device=ctx.device)
    for k in reduced:
        per_sample = per_sample * x.struct.sizes[:, k]
    # rows that reach each output row, known from the sizes (no counting pass)
    n = per_sample if segments is None else per_sample[segments]
    dense_count = 1
    for d in value_dims:
        dense_count *= values.shape[d]

    def over_dense(v: Tensor, fn: Any) -> Tensor:
        return fn(v, value_dims) if value_dims else v

    if kind == "sum":
        out = _prims.segment_sum(over_dense(values, torch.sum), index, count)
    elif kind == "mean":
        total = over_dense(values, torch.sum)
        out = _prims.segment_mean(total, index, count, counts=n * dense_count)
    elif kind in ("amax", "amin"):
        if kind == "amax":
            out = _prims.segment_amax(over_dense(values, torch.amax), index, count)
        else:
            out = _prims.segment_amin(over_dense(values, torch.amin), index, count)
    elif kind == "prod":
        v = values
        for d in sorted(value_dims, reverse=True):
            v = v.prod(d)
        out = _prims.segment_prod(v, index, count)
    elif kind in ("any", "all"):
        flag = values.bool() if kind == "any" else ~values.bool()
        hits = _prims.segment_sum(over_dense(flag.long(), torch.sum), index, count)
        out = hits > 0 if kind == "any" else hits == 0
    elif kind in ("var", "std"):
        if value_dims:
            raise Unsupported("var/std over ragged and dense axes together")
        correction = bound.get("correction")
        if correction is None:
            unbiased = bound.get("unbiased")
            correction = 0 if unbiased is False else 1
        mean = _prims.segment_mean(values, index, count, counts=n)
        centred = values - _prims.broadcast(mean, index)
        squares = _prims.segment_sum(centred * centred, index, count)
        rows = n.reshape(-1, *([1] * (squares.ndim - 1))).to(values.dtype)
        out = squares / (rows - correction).clamp(min=0)
        if kind == "std":
            out = out.sqrt()
    elif kind == "logsumexp":
        # the dense axes and the rows in one pass (one shift, one sum): as torch's own
        # logsumexp over all of them, in values and in slopes
        out = _prims.segment_logsumexp(values, index, count, tuple(value_dims))
        if value_dims:
            out = out.squeeze(tuple(value_dims))
    elif kind == "norm":
        order = bound.get("ord", bound.get("p", 2))
        order = 2 if order is None else order
        if order not in (1, 2, 1.0, 2.0):
            raise Unsupported(f"norm of order {order}")
        if order in (1, 1.0):
            out = _prims.segment_sum(over_dense(values.abs(), torch.sum), index, count)
        else:
            squares = _prims.segment_sum(over_dense(values * values, torch.sum), index, count)
            # the square root's derivative is infinite at 0: a zero vector takes the
            # other branch (squares itself, 0), whose gradient 2 v is 0 there, as
            # torch.linalg.vector_norm gives it
            present = squares > 0
            out = torch.where(present, torch.where(present, squares, 1.0).sqrt(), squares)
    else:
        raise Unsupported(kind)
    return _finish(ctx, out.to(step.out.dtype), step.out.shape, sz, out_struct)


def refuse_empty(ctx: Ctx, step: Any, x: RaggedB, reduced: set[int]) -> None:
    """torch refuses max/min/argmax/argmin over an empty axis: so does every sample
    (the per-sample loop would raise there; an identity value would be invented)."""
    if not reduced:
        return
    empty = torch.zeros_like(x.struct.sizes[:, 0], dtype=torch.bool)
    for k in reduced:
        empty = empty | (x.struct.sizes[:, k] == 0)
    message = (
        f"map: {step.op} of an empty axis: torch raises IndexError there (Expected reduction "
        "dim to have non-zero size)"
    )
    if torch.compiler.is_compiling():
        torch._assert_async(~empty.any(), message)
        return
    if bool(empty.any()):
        sample = int(empty.nonzero()[0])
        raise SampleRaises(f"{message}, for sample {sample}")


def _dense_only(
    step: Any, x: RaggedB, args: tuple[Any, ...], kwargs: dict[str, Any], dims: list[int]
) -> Any:
    value_dims = [1 + axes_of(x.layout)[p].index for p in dims]
    bound = bind(step, args, kwargs)
    names = [name for name, _, _, _ in schema_args(step.target)]
    new_args = list(args)
    new_kwargs = dict(kwargs)
    new_dim: Any = value_dims if not isinstance(bound.get("dim"), int) else value_dims[0]
    slot = names.index("dim")
    if slot < len(args):
        new_args[slot] = new_dim
    else:
        new_kwargs["dim"] = new_dim
    new_args[0] = x.values
    values = step.target(*new_args, **new_kwargs)
    # x's ragged axes stay ragged (a trace in which a guard fixed one of their sizes
    # has an int in step.out.shape there, but the values keep it as a ragged axis)
    kept = [p for p in range(len(axes_of(x.layout))) if bool(bound.get("keepdim")) or p not in dims]
    positions = tuple(kept.index(p) for p in x.positions())
    layout = canonical_layout(len(kept), positions)
    return RaggedB(values, layout, x.sz, x.struct)


def _extremum(
    ctx: Ctx, x: RaggedB, k: int, largest: bool, values: Tensor
) -> tuple[Tensor, Tensor, Tensor, tuple[Sz, ...], Any]:
    """Max (or min) of ``values`` along ragged storage axis ``k`` of ``x`` and where it is.

    Returns ``(extremum, rows, position, sz, struct)``: ``rows`` is the packed
    row and ``position`` the coordinate along the axis of the first element
    that attains the extremum (as ``torch.argmax``; NaN is the largest and the
    smallest); both are -1 for an empty segment.
    """
    index, count, sz = reduce_index(ctx, x, {k})
    reduce = _prims.segment_max if largest else _prims.segment_min
    extremum, rows = reduce(values, index, count)
    # rows of a segment follow axis k in packed order; -1 (no row) picks the -1
    # appended to the coordinates
    coords = x.struct.coords()[k]
    coords = torch.cat([coords, coords.new_full((1,), -1)])
    position = coords[torch.where(rows < 0, rows + coords.shape[0], rows)]
    return extremum, rows, position, sz, ctx.struct(sz) if sz else None


# ----- softmax and cumsum ------------------------------------------------------------

_SOFTMAX = {
    aten.softmax: "softmax",
    aten._softmax: "softmax",
    aten._safe_softmax: "safe",
    aten.log_softmax: "log",
    aten._log_softmax: "log",
}


# From this many elements per sample on average (CPU, eager), a softmax over the last
# stored ragged axis runs torch's kernel once per sample on its block of rows
# (_prims.block_softmax): the segment form's scatter reductions take about seven passes
BLOCK_SOFTMAX_MIN = 4096


def _last_axis_blocks(x: RaggedB, k: int) -> tuple[tuple[int, int, int], ...] | None:
    """Per sample ``(start, stop, rows)`` when the softmax axis (storage ``k``) is the
    last stored ragged axis, so that each sample's rows are ``[rows, N_k, *dense]``
    row-major; None where the segment form runs (compiled, under a transform or forward
    mode, off the CPU, light samples). One host read of the sizes per partition."""
    sizes, offsets = x.struct.sizes, x.struct.offsets
    if (
        k != sizes.shape[1] - 1
        or not plain_eager()
        or x.values.device.type != "cpu"
        or x.values.numel() < BLOCK_SOFTMAX_MIN * max(sizes.shape[0], 1)
    ):
        return None
    found = getattr(x.struct, "host_blocks", None)
    if found is None:
        rows = sizes[:, :-1].prod(dim=1).clamp(min=1)  # no earlier ragged axis: one row
        found = tuple(zip(*(t.tolist() for t in (offsets[:-1], offsets[1:], rows)), strict=True))
        x.struct.host_blocks = found  # type: ignore[attr-defined]
    return found


@rule(*_SOFTMAX)
def softmax_rule(ctx: Ctx, step: Any, x: Any, dim: int, *rest: Any, **kwargs: Any) -> Any:
    if not isinstance(x, RaggedB):
        raise Unsupported("softmax of a per-sample size")
    kind = _SOFTMAX[step.target.overloadpacket]
    dim = dim % len(axes_of(x.layout))
    axis = axes_of(x.layout)[dim]
    if not axis.ragged:
        values = step.target(x.values, 1 + axis.index, *rest, **kwargs)
        return RaggedB(values, x.layout, x.sz, x.struct)
    values = x.values.to(step.out.dtype)
    index, count, _ = reduce_index(ctx, x, {axis.index})
    if kind == "log":
        values = _prims.segment_log_softmax(values, index, count)
    elif kind == "softmax" and (blocks := _last_axis_blocks(x, axis.index)) is not None:
        values = _prims.block_softmax(values, blocks)
    elif kind == "softmax":
        values = _prims.segment_softmax(values, index, count)
    else:
        # _safe_softmax: 0 where every element is -inf (softmax would give NaN);
        # those rows go through the softmax as zeros, so their gradient is 0
        with torch.no_grad():
            peak = _prims.segment_amax(values.detach(), index, count)
        masked = _prims.broadcast(peak == float("-inf"), index)
        zeros = torch.zeros_like(values)
        values = _prims.segment_softmax(torch.where(masked, zeros, values), index, count)
        values = torch.where(masked, zeros, values)
    return RaggedB(values, x.layout, x.sz, x.struct)


@rule(aten.cumsum)
def cumsum_rule(ctx: Ctx, step: Any, x: Any, dim: int, dtype: Any = None) -> Any:
    if not isinstance(x, RaggedB):
        raise Unsupported("cumsum of a per-sample size")
    dim = dim % len(axes_of(x.layout))
    axis = axes_of(x.layout)[dim]
    values = x.values if dtype is None else x.values.to(dtype)
    if not axis.ragged:
        return RaggedB(values.cumsum(1 + axis.index).to(step.out.dtype), x.layout, x.sz, x.struct)
    k = axis.index
    if k == num_ragged_of(x.layout) - 1:
        # the last storage axis varies fastest: each group is a run of consecutive
        # rows starting at the row with coordinate 0
        rows = torch.arange(values.shape[0], device=values.device)
        out = _prims.segment_cumsum(values, rows - x.struct.coords()[k])
    else:
        group, count, _ = reduce_index(ctx, x, {k})
        # rows of one group are in increasing order along the axis: a stable sort by
        # group makes each group a run of consecutive rows
        order = torch.sort(group, stable=True).indices
        counts = _prims.segment_counts(group, count)
        starts = torch.cumsum(counts, 0) - counts
        running = _prims.segment_cumsum(values[order], starts[group[order]])
        out = torch.zeros_like(running).index_copy(0, order, running)
    return RaggedB(out.to(step.out.dtype), x.layout, x.sz, x.struct)


@rule(aten.max.dim, aten.min.dim)
def max_dim_rule(ctx: Ctx, step: Any, x: Any, dim: int, keepdim: bool = False) -> Any:
    """``(values, indices)`` of ``torch.max(x, dim)`` / ``torch.min(x, dim)``."""
    if not isinstance(x, RaggedB):
        raise Unsupported("max of a per-sample size")
    x = canonicalize(ctx, x)
    dim = dim % len(axes_of(x.layout))
    axis = axes_of(x.layout)[dim]
    values_spec, index_spec = step.out
    if not axis.ragged:
        values, indices = step.target(x.values, 1 + axis.index, keepdim)
        shape = values_spec.shape
        positions = tuple(p for p, s in enumerate(shape) if isinstance(s, Sz))
        layout = canonical_layout(len(shape), positions)
        return (
            RaggedB(values, layout, x.sz, x.struct),
            RaggedB(indices, layout, x.sz, x.struct),
        )
    refuse_empty(ctx, step, x, {axis.index})
    largest = step.target.overloadpacket is aten.max
    values = x.values
    with torch.no_grad():
        best, rows, position, sz, out_struct = _extremum(ctx, x, axis.index, largest, values)
    if values.shape[0] > 0:
        # the value is read at the returned index, so that a tie sends the whole
        # gradient to that element, as torch.max(x, dim) does (amax shares it)
        picked = torch.gather(values, 0, rows.clamp(min=0))
        best = torch.where(rows >= 0, picked, best)
    return (
        _finish(ctx, best, values_spec.shape, sz, out_struct),
        _finish(ctx, position, index_spec.shape, sz, out_struct),
    )
