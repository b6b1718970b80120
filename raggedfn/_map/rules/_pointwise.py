"""Batching rules for elementwise ops: pointwise math, where, casts, copies, dropout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..base._registry import rule, scalar_slots
from ..base._sizes import Unsupported
from ..base._steps import TSpec
from ..base._values import (
    Ctx,
    DenseB,
    RaggedB,
    SymB,
    align,
    canonical_layout,
    dense_shape,
    is_batched,
    lines_up,
    out_layout_for,
    sz_in_storage_order,
)

aten = torch.ops.aten


def _cast(values: Tensor, dtype: torch.dtype) -> Tensor:
    return values if values.dtype == dtype else values.to(dtype)


@rule(
    "pointwise",
    aten.masked_fill,
    aten.where,
    aten.__and__,
    aten.__or__,
    aten.__xor__,
    aten.__lshift__,
    aten.__rshift__,
    aten.floor_divide,  # elementwise, though not tagged pointwise
)
def pointwise(ctx: Ctx, step: Any, *args: Any, **kwargs: Any) -> Any:
    """Broadcast every operand to the result's packed layout, then run the op once."""
    spec = step.out
    if not isinstance(spec, TSpec):  # torch.where(condition): a tuple of index tensors
        raise Unsupported("where with one argument (the indices of the nonzero elements)")
    shape = spec.shape
    if not kwargs and not torch.compiler.is_compiling():  # (no memo on the step there)
        fast = same_rows(ctx, step, args)
        if fast is not None:
            values = step.target(*[a.values if type(a) is RaggedB else a for a in args])
            values = _cast(values, spec.dtype)
            if values.ndim == fast.values.ndim and values.shape[0] == fast.struct.total:
                return RaggedB(values, fast.layout, fast.sz, fast.struct)
    operands = [*args, *kwargs.values()]
    if spec.ragged:
        layout = out_layout_for(shape, operands)
        sz = sz_in_storage_order(shape, layout)
        struct = ctx.struct(sz)
    else:
        layout = canonical_layout(len(shape), ())
        struct = None

    def prepare(x: Any) -> Any:
        if isinstance(x, SymB):
            x = DenseB(ctx.eval(x.sz))
            if spec.dtype.is_floating_point:
                x = DenseB(x.data.to(spec.dtype))
        if isinstance(x, (list, tuple)) and any(is_batched(v) for v in x):
            raise Unsupported("a list of batched operands")
        return align(ctx, x, shape, layout, struct)

    target = step.target
    if any(isinstance(a, SymB) for a in operands):  # a per-sample number as an operand
        if step.twin is not None:
            target = step.twin  # the scalar operand's Tensor overload (t % t.shape[0])
        target = _tensor_slots(target, args, kwargs)
    values = target(*(prepare(a) for a in args), **{k: prepare(v) for k, v in kwargs.items()})
    values = _cast(values, spec.dtype)
    if struct is None:
        if values.ndim != len(shape) + 1:
            values = values.expand(ctx.batch_size, *shape)
        return DenseB(values)
    if values.ndim != 1 + len(shape) - len(sz) or values.shape[0] != struct.total:
        values = values.expand(struct.total, *dense_shape(shape, layout))
    return RaggedB(values, layout, sz, struct)


_TENSOR_BOUNDS = (aten.clamp, aten.clamp_min, aten.clamp_max)


def _tensor_slots(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``target``, or its Tensor overload, such that every per-sample number sits where
    the schema takes a tensor; a per-sample number in a Scalar slot without one
    (``alpha=t.shape[0]``, ``addcmul``'s ``value=``) runs the node's loop."""
    if getattr(target, "_schema", None) is None:
        return target
    scalar = [
        name
        for position, name in scalar_slots(target)
        if is_batched(args[position] if 0 <= position < len(args) else kwargs.get(name))
    ]
    if not scalar:
        return target
    packet = target.overloadpacket
    if packet in _TENSOR_BOUNDS and hasattr(packet, "Tensor"):
        return packet.Tensor  # per-sample bounds as tensors (torch.clamp(t, min=n))
    raise Unsupported(f"a per-sample number as the scalar argument {scalar[0]} of {packet}")


def same_rows(ctx: Ctx, step: Any, args: Sequence[Any]) -> RaggedB | None:
    """The first ragged operand when the general path would hand every operand over as it
    is: each ragged operand has the result's rank, layout, sizes and partition (the one
    ``ctx`` holds for them), and the rest are Python numbers or 0-d tensors (torch
    broadcasts those). ``None`` otherwise. The layout code and sizes tuple that lined up
    with the step's result are remembered on the step (a plan's inputs, and results of
    this path, carry the same sizes tuple at every call)."""
    first: RaggedB | None = None
    for a in args:
        if type(a) is RaggedB:
            if first is None:
                first = a
                if not a.sz or ctx.struct(a.sz) is not a.struct:
                    return None
                seen = step.__dict__.get("_same_rows")
                if seen is None or seen[1] is not a.sz or seen[0] != a.layout.code:
                    if not lines_up(a, step.out.shape):
                        return None
                    step._same_rows = (a.layout.code, a.sz)
            elif (
                a.struct is not first.struct
                or a.layout.code != first.layout.code
                or (a.sz is not first.sz and [s.key for s in a.sz] != [s.key for s in first.sz])
            ):
                return None
        elif not (type(a) in (int, float, bool) or (type(a) is Tensor and a.ndim == 0)):
            return None
    return first


@rule(
    aten.clone,
    aten.contiguous,
    aten.detach,
    aten.alias,
    aten.lift_fresh_copy,
    aten._to_copy,
    aten.to,
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.empty_like,
    aten.rand_like,
    aten.randn_like,
    aten.dropout,
    aten.feature_dropout,
    aten.alpha_dropout,
    aten.type_as,
    aten.positive,
)
def values_map(ctx: Ctx, step: Any, x: Any, *rest: Any, **kwargs: Any) -> Any:
    """Ops that act on each element of ``x`` alone: apply them to the packed values."""
    if any(is_batched(v) for v in (*rest, *kwargs.values())):
        if step.target.overloadpacket is aten.type_as:
            return pointwise_cast(ctx, step, x, rest[0])
        raise Unsupported("a batched second operand")
    if step.target.overloadpacket in (aten.feature_dropout, aten.alpha_dropout):
        raise Unsupported("feature/alpha dropout mixes elements across axes")
    if isinstance(x, SymB):
        raise Unsupported("a per-sample size as a tensor")
    if isinstance(x, DenseB):
        return DenseB(_cast(step.target(x.data, *rest, **kwargs), step.out.dtype))
    if not isinstance(x, RaggedB):
        raise Unsupported("an unbatched operand")
    values = step.target(x.values, *rest, **kwargs)
    return RaggedB(_cast(values, step.out.dtype), x.layout, x.sz, x.struct)


def pointwise_cast(ctx: Ctx, step: Any, x: Any, other: Any = None) -> Any:
    """``type_as(x, other)`` / ``x.to(other)``: ``x`` in ``other``'s dtype and device. A
    tensor shared by the samples (a constant such as ``torch.tensor(k).type_as(t)``)
    stays shared: the dtype and device are the same for every sample."""
    device = (
        other.values.device
        if isinstance(other, RaggedB)
        else other.data.device
        if isinstance(other, DenseB)
        else None
    )

    def cast(t: Tensor) -> Tensor:
        t = _cast(t, step.out.dtype)
        return t if device is None or t.device == device else t.to(device)

    if isinstance(x, RaggedB):
        return RaggedB(cast(x.values), x.layout, x.sz, x.struct)
    if isinstance(x, DenseB):
        return DenseB(cast(x.data))
    if isinstance(x, Tensor):
        return cast(x)
    raise Unsupported("type_as of a per-sample size")
