"""Per-sample loops: for one graph node without a batching rule, or for a whole function.

Both are correct and slow (a Python loop with host syncs); ``map_report``
lists every use and ``strict=True`` refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .._construct import from_list
from .._errors import fail
from .._ragged import Ragged
from ._sizes import Sz
from ._trace import TSpec
from ._values import Ctx, DenseB, RaggedB, SymB, canonical_layout, make_ragged


def sample_of(ctx: Ctx, value: Any, i: int) -> Any:
    """Sample ``i`` of a batched interpreter value as an ordinary tensor (host sync)."""
    if isinstance(value, DenseB):
        return value.data[i]
    if isinstance(value, SymB):
        return int(ctx.eval(value.sz)[i])
    if isinstance(value, RaggedB):
        start, stop = (int(v) for v in value.struct.offsets[i : i + 2].tolist())
        sizes = [int(s) for s in value.struct.sizes[i].tolist()]
        block = value.values[start:stop].reshape(*sizes, *value.values.shape[1:])
        return block.permute(value.layout.physical_to_logical())
    if isinstance(value, (list, tuple)):
        return type(value)(sample_of(ctx, v, i) for v in value)
    return value


def restack(ctx: Ctx, outs: list[Any], spec: Any) -> Any:
    """Per-sample results of one node packed as the batched value its traced spec says."""
    if isinstance(spec, tuple):
        return tuple(restack(ctx, [o[j] for o in outs], s) for j, s in enumerate(spec))
    if isinstance(spec, Sz):
        return SymB(spec)
    if not isinstance(spec, TSpec):
        if outs and all(o == outs[0] for o in outs):
            return outs[0]
        return DenseB(torch.tensor(outs))
    if not spec.ragged:
        if not outs:
            return DenseB(torch.empty(0, *spec.shape, dtype=spec.dtype, device=ctx.device))
        return DenseB(torch.stack(outs))
    positions = tuple(p for p, s in enumerate(spec.shape) if isinstance(s, Sz))
    layout = canonical_layout(len(spec.shape), positions)
    dense = [s for s in spec.shape if not isinstance(s, Sz)]
    to_physical = layout.logical_to_physical()
    parts = [o.permute(to_physical).reshape(-1, *dense) for o in outs]
    if parts:
        values = torch.cat(parts)
    else:
        values = torch.empty(0, *dense, dtype=spec.dtype, device=ctx.device)
    out = make_ragged(ctx, values, spec.shape, layout)
    if out.struct.total != values.shape[0]:  # the traced sizes disagree with the samples
        raise fail("map", "a per-sample loop produced sizes that differ from the trace")
    return out


def node_loop(
    ctx: Ctx, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], spec: Any
) -> Any:
    outs = []
    for i in range(ctx.batch_size):
        a = sample_of(ctx, args, i)
        k = {key: sample_of(ctx, v, i) for key, v in kwargs.items()}
        outs.append(target(*a, **k))
    return restack(ctx, outs, spec)


def function_loop(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    in_dims: tuple[Any, ...],
    batch_size: int,
    specs: list[Any] | None = None,
) -> Any:
    """``[fn(*sample_i) for i]`` restacked.

    ``specs`` (the traced outputs, when a trace exists) say which axes are ragged,
    so the result has the same structure as a batched run; without them, axes
    whose sizes differ between samples become ragged.
    """

    def pick(a: Any, i: int) -> Any:
        return pytree.tree_map(lambda leaf: leaf[i], a, is_leaf=lambda v: isinstance(v, Ragged))

    results = []
    for i in range(batch_size):
        sample = [pick(a, i) if d == 0 else a for a, d in zip(args, in_dims, strict=True)]
        results.append(fn(*sample))
    if not results:
        raise fail(
            "map",
            "f could not be traced and the batch is empty, so the output structure is unknown",
        )
    flat = [pytree.tree_flatten(r) for r in results]
    spec = flat[0][1]
    columns = list(zip(*(leaves for leaves, _ in flat), strict=True))
    if specs is None or len(specs) != len(columns):
        specs = [None] * len(columns)
    packed = [_stack_column(list(col), s) for col, s in zip(columns, specs, strict=True)]
    return pytree.tree_unflatten(packed, spec)


def _stack_column(col: list[Any], spec: Any = None) -> Any:
    if not all(isinstance(c, Tensor) for c in col):
        return torch.tensor(col)
    if isinstance(spec, TSpec) and all(c.ndim == len(spec.shape) for c in col):
        positions = tuple(1 + p for p, s in enumerate(spec.shape) if isinstance(s, Sz))
        if positions:
            return from_list(col, ragged_dims=positions)
    shapes = {tuple(c.shape) for c in col}
    if len(shapes) == 1:
        return torch.stack(col)
    rank = col[0].ndim
    varying = tuple(1 + a for a in range(rank) if len({c.shape[a] for c in col}) > 1)
    return from_list(col, ragged_dims=varying)


def to_output(ctx: Ctx, value: Any) -> Any:
    """An interpreter value as the user-facing result."""
    if isinstance(value, RaggedB):
        return Ragged(value.values, value.struct.offsets, value.struct.sizes, value.layout)
    if isinstance(value, DenseB):
        return value.data
    if isinstance(value, SymB):
        return ctx.eval(value.sz)
    if isinstance(value, Tensor):
        return value.unsqueeze(0).expand(ctx.batch_size, *value.shape)
    return value


__all__ = ["function_loop", "node_loop", "restack", "sample_of", "to_output"]
