"""Batching rules for reductions, softmax and cumsum (over dense and ragged axes).

Reductions over ragged axes are segment reductions on the packed rows: every
row is sent to the row of the result that keeps its other coordinates
(``reduce_index``), and ``index_add`` / ``scatter_reduce`` combine them. All
are plain differentiable torch ops (no custom backward). Empty samples follow
DESIGN §4: sum 0, mean NaN, amax/amin the identity, argmax/argmin -1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._registry import rule
from ._sizes import Sz, Unsupported
from ._values import (
    Ctx,
    DenseB,
    RaggedB,
    axes_of,
    canonical_layout,
    canonicalize,
    dense_shape,
    reduce_index,
)

aten = torch.ops.aten


# target -> ((name, kwarg_only, has_default, default), ...): plain Python, filled on the
# eager first call, so bind() inside torch.compile never touches the pybind schema
# (dynamo cannot iterate it: "missing tp_iter")
_SCHEMA_ARGS: dict[Any, tuple[tuple[str, bool, bool, Any], ...]] = {}


def _schema_args(target: Any) -> tuple[tuple[str, bool, bool, Any], ...]:
    found = _SCHEMA_ARGS.get(target)
    if found is None:
        found = tuple(
            (
                a.name,
                a.kwarg_only,
                a.has_default_value(),
                a.default_value if a.has_default_value() else None,
            )
            for a in target._schema.arguments
        )
        _SCHEMA_ARGS[target] = found
    return found


def bind(step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, (name, kwarg_only, has_default, default) in enumerate(_schema_args(step.target)):
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


def _identity(dtype: torch.dtype, largest: bool) -> Any:
    if dtype == torch.bool:
        return largest is False
    if dtype.is_floating_point:
        return float("-inf") if largest else float("inf")
    info = torch.iinfo(dtype)
    return info.min if largest else info.max


def segment(values: Tensor, index: Tensor, count: Any, how: str) -> Tensor:
    """Combine rows of ``values`` that share ``index`` into ``count`` rows."""
    shape = (count, *values.shape[1:])
    if how == "sum":
        return values.new_zeros(shape).index_add(0, index, values)
    expanded = index.reshape(-1, *([1] * (values.ndim - 1))).expand_as(values)
    if how in ("amax", "amin"):
        base = values.new_full(shape, _identity(values.dtype, how == "amax"))
        return base.scatter_reduce(0, expanded, values, how, include_self=True)
    if how == "prod":
        return values.new_ones(shape).scatter_reduce(0, expanded, values, "prod", include_self=True)
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
    if kind in ("argmax", "argmin"):
        if bound.get("dim") is None:
            raise Unsupported("argmax/argmin of a flattened ragged value")
        return _arg_reduce(ctx, step, x, dims[0], kind)
    values = x.values
    dtype = bound.get("dtype")
    if dtype is not None:
        values = values.to(dtype)
    value_dims = [1 + axes_of(x.layout)[p].index for p in dense]
    reduced = {axes_of(x.layout)[p].index for p in ragged}
    index, count, sz = reduce_index(ctx, x, reduced)
    out_struct = ctx.struct(sz) if sz else None
    segments = out_struct.segments() if out_struct is not None else None
    per_sample = torch.ones(ctx.batch_size, dtype=torch.int64, device=ctx.device)
    for k in reduced:
        per_sample = per_sample * x.struct.sizes[:, k]
    n = per_sample if segments is None else per_sample[segments]
    dense_count = 1
    for d in value_dims:
        dense_count *= values.shape[d]

    def over_dense(v: Tensor, fn: Any) -> Tensor:
        return fn(v, value_dims) if value_dims else v

    def expand_n(t: Tensor, like: Tensor) -> Tensor:
        return t.reshape(-1, *([1] * (like.ndim - 1)))

    if kind in ("sum", "mean"):
        out = segment(over_dense(values, lambda v, d: v.sum(d)), index, count, "sum")
        if kind == "mean":
            out = out / expand_n(n * dense_count, out).to(out.dtype)
    elif kind in ("amax", "amin", "prod"):
        if kind == "prod":
            v = values
            for d in sorted(value_dims, reverse=True):
                v = v.prod(d)
        else:
            reducer = torch.amax if kind == "amax" else torch.amin
            v = over_dense(values, lambda v, d: reducer(v, d))
        out = segment(v, index, count, kind)
    elif kind in ("any", "all"):
        flag = values.bool() if kind == "any" else ~values.bool()
        hits = segment(over_dense(flag.long(), lambda v, d: v.sum(d)), index, count, "sum")
        out = hits > 0 if kind == "any" else hits == 0
    elif kind in ("var", "std"):
        if value_dims:
            raise Unsupported("var/std over ragged and dense axes together")
        correction = bound.get("correction")
        if correction is None:
            unbiased = bound.get("unbiased")
            correction = 0 if unbiased is False else 1
        total = segment(values, index, count, "sum")
        nn = expand_n(n, total).to(values.dtype)
        mean = total / nn
        centred = values - mean[index]
        out = segment(centred * centred, index, count, "sum") / (nn - correction).clamp(min=0)
        if kind == "std":
            out = out.sqrt()
    elif kind == "logsumexp":
        peak = segment(
            over_dense(values.detach(), lambda v, d: torch.amax(v, d, keepdim=True)),
            index,
            count,
            "amax",
        )
        peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
        shifted = (values - peak[index]).exp()
        total = segment(over_dense(shifted, lambda v, d: v.sum(d)), index, count, "sum")
        out = total.log() + (peak.squeeze(value_dims) if value_dims else peak)
    elif kind == "norm":
        order = bound.get("ord", bound.get("p", 2))
        order = 2 if order is None else order
        if order not in (1, 2, 1.0, 2.0):
            raise Unsupported(f"norm of order {order}")
        power = values.abs() if order in (1, 1.0) else values * values
        out = segment(over_dense(power, lambda v, d: v.sum(d)), index, count, "sum")
        out = out if order in (1, 1.0) else out.sqrt()
    else:
        raise Unsupported(kind)
    return _finish(ctx, out.to(step.out.dtype), step.out.shape, sz, out_struct)


def _dense_only(
    step: Any, x: RaggedB, args: tuple[Any, ...], kwargs: dict[str, Any], dims: list[int]
) -> Any:
    value_dims = [1 + axes_of(x.layout)[p].index for p in dims]
    bound = bind(step, args, kwargs)
    names = [name for name, _, _, _ in _schema_args(step.target)]
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
    shape = step.out.shape
    positions = tuple(p for p, s in enumerate(shape) if isinstance(s, Sz))
    layout = canonical_layout(len(shape), positions)
    return RaggedB(values, layout, x.sz, x.struct)


def _arg_reduce(ctx: Ctx, step: Any, x: RaggedB, dim: int, kind: str) -> Any:
    k = axes_of(x.layout)[dim].index
    index, count, sz = reduce_index(ctx, x, {k})
    values = x.values
    best = segment(values.detach(), index, count, "amax" if kind == "argmax" else "amin")
    position = x.struct.coords()[k].reshape(-1, *([1] * (values.ndim - 1)))
    big = torch.iinfo(torch.int64).max
    candidate = torch.where(values == best[index], position, torch.full_like(position, big))
    first = segment(candidate.expand_as(values).contiguous(), index, count, "amin")
    first = torch.where(first == big, torch.full_like(first, -1), first)
    out_struct = ctx.struct(sz) if sz else None
    return _finish(ctx, first, step.out.shape, sz, out_struct)


# ----- softmax and cumsum ------------------------------------------------------------

_SOFTMAX = {
    aten.softmax: "softmax",
    aten._softmax: "softmax",
    aten._safe_softmax: "safe",
    aten.log_softmax: "log",
    aten._log_softmax: "log",
}


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
    peak = segment(values.detach(), index, count, "amax")
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    shifted = values - peak[index]
    exp = shifted.exp()
    total = segment(exp, index, count, "sum")
    if kind == "log":
        values = shifted - total.log()[index]
    else:
        values = exp / total[index]
        if kind == "safe":
            values = torch.where(total[index] == 0, torch.zeros_like(values), values)
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
    group, count, _ = reduce_index(ctx, x, {axis.index})
    # rows of one group are in increasing order along the axis: a stable sort by
    # group makes each group contiguous, then a global cumsum minus each group's base
    order = torch.sort(group, stable=True).indices
    ordered = values[order]
    running = ordered.cumsum(0)
    sorted_group = group[order]
    counts = torch.zeros(count, dtype=torch.int64, device=group.device).index_add(
        0, group, torch.ones_like(group)
    )
    starts = torch.cumsum(counts, 0) - counts
    before = running - ordered
    base = before[starts.clamp(max=max(values.shape[0] - 1, 0))] if values.shape[0] else before
    result = running - base[sorted_group] if values.shape[0] else running
    out = result[torch.argsort(order)]
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
    largest = step.target.overloadpacket is aten.max
    index, count, sz = reduce_index(ctx, x, {axis.index})
    best = segment(x.values, index, count, "amax" if largest else "amin")
    out_struct = ctx.struct(sz) if sz else None
    values = _finish(ctx, best, values_spec.shape, sz, out_struct)
    arg_step = type(step)(step.index, step.name, step.target, (), {}, index_spec, True)
    indices = _arg_reduce(ctx, arg_step, x, dim, "argmax" if largest else "argmin")
    return values, indices
