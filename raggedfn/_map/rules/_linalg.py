"""Batching rules for linear algebra and layers: linear, matmul, norms, attention, embedding."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._layout import Axis
from ..._ragged import Ragged
from ..base._registry import rule
from ..base._sizes import Sz, Unsupported
from ..base._values import (
    Ctx,
    DenseB,
    RaggedB,
    axes_of,
    canonical_layout,
    canonicalize,
    dense_shape,
    is_batched,
    make_layout,
    num_dense_of,
    struct_rows,
    sz_in_storage_order,
    take_rows,
)
from ._reduce import segment

aten = torch.ops.aten


def _trailing_dense(x: RaggedB, count: int) -> bool:
    return all(not a.ragged for a in axes_of(x.layout)[len(axes_of(x.layout)) - count :])


@rule(aten.linear)
def linear_rule(ctx: Ctx, step: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    if is_batched(weight) or is_batched(bias):
        raise Unsupported("a per-sample weight")
    if not isinstance(x, RaggedB):
        raise Unsupported("linear of a per-sample size")
    x = canonicalize(ctx, x)
    if not _trailing_dense(x, 1):
        raise Unsupported("linear over a ragged axis")
    lead = x.values.shape[:-1]
    # one 2-D matrix product: [T, ..., D] @ W.T as [T * ..., D] (no batched-matmul reshapes)
    values = F.linear(x.values.reshape(-1, x.values.shape[-1]), weight, bias)
    return RaggedB(values.reshape(*lead, values.shape[-1]), x.layout, x.sz, x.struct)


@rule(aten.layer_norm, aten.rms_norm)
def norm_rule(ctx: Ctx, step: Any, x: Any, shape: Any, *rest: Any, **kwargs: Any) -> Any:
    if any(is_batched(v) for v in (*rest, *kwargs.values())):
        raise Unsupported("a per-sample weight")
    if not isinstance(x, RaggedB):
        raise Unsupported("a norm of a per-sample size")
    x = canonicalize(ctx, x)
    if not _trailing_dense(x, len(shape)):
        raise Unsupported("a norm over a ragged axis")
    values = step.target(x.values, shape, *rest, **kwargs)
    return RaggedB(values, x.layout, x.sz, x.struct)


@rule(aten.embedding)
def embedding_rule(ctx: Ctx, step: Any, weight: Any, indices: Any, *rest: Any) -> Any:
    if is_batched(weight) or not isinstance(indices, RaggedB):
        raise Unsupported("a per-sample embedding table")
    values = step.target(weight, indices.values, *rest)
    layout = make_layout((*axes_of(indices.layout), Axis(False, num_dense_of(indices.layout))))
    return RaggedB(values, layout, indices.sz, indices.struct)


# ----- matmul ---------------------------------------------------------------------------


def logical(x: Any) -> tuple[Any, ...]:
    if isinstance(x, RaggedB):
        return x.shape()
    if isinstance(x, DenseB):
        return tuple(x.data.shape[1:])
    return tuple(x.shape)


@rule(aten.matmul, aten.mm, aten.bmm)
def matmul_rule(ctx: Ctx, step: Any, a: Any, b: Any) -> Any:
    shape_a, shape_b = logical(a), logical(b)
    if len(shape_a) == 1 or len(shape_b) == 1:
        return _vector_matmul(ctx, step, a, b, shape_a, shape_b)
    if isinstance(a, RaggedB) and isinstance(b, Tensor) and b.ndim == 2:
        x = canonicalize(ctx, a)
        if not _trailing_dense(x, 1):
            raise Unsupported("contraction over a ragged axis with a fixed matrix")
        values = x.values @ b
        return RaggedB(values, x.layout, x.sz, x.struct)
    return _pair_matmul(ctx, step, a, b, shape_a, shape_b)


def _unsqueezed(ctx: Ctx, x: Any, shape: tuple[Any, ...], dim: int) -> Any:
    from ._shape import reshape_to

    new_shape = list(shape)
    new_shape.insert(dim % (len(shape) + 1), 1)
    if isinstance(x, Tensor):
        return x.unsqueeze(dim)
    if isinstance(x, DenseB):
        return DenseB(x.data.unsqueeze(dim % (len(shape) + 1) + 1))
    return reshape_to(ctx, x, tuple(new_shape))


def _vector_matmul(
    ctx: Ctx, step: Any, a: Any, b: Any, shape_a: tuple[Any, ...], shape_b: tuple[Any, ...]
) -> Any:
    """``matmul`` with a 1-D operand: as torch, a row / column matrix, then squeezed."""
    from ._shape import reshape_to

    if len(shape_a) == 1:
        a, shape_a = _unsqueezed(ctx, a, shape_a, 0), (1, *shape_a)
    if len(shape_b) == 1:
        b, shape_b = _unsqueezed(ctx, b, shape_b, 1), (*shape_b, 1)
    if any(isinstance(s, Sz) for s in (*shape_a[:-2], *shape_b[:-2])):
        raise Unsupported("matmul with ragged batch axes")
    lead = tuple(torch.broadcast_shapes(torch.Size(shape_a[:-2]), torch.Size(shape_b[:-2])))
    full = type(step.out)((*lead, shape_a[-2], shape_b[-1]), step.out.dtype)
    inner = type(step)(step.index, step.name, step.target, (), {}, full, True)
    result = matmul_rule(ctx, inner, a, b)
    return reshape_to(ctx, result, step.out.shape)


def _pair_matmul(
    ctx: Ctx, step: Any, a: Any, b: Any, shape_a: tuple[Any, ...], shape_b: tuple[Any, ...]
) -> Any:
    """General product: enumerate the ragged coordinates of (m, k, n) as packed rows."""
    lead_a, lead_b = shape_a[:-2], shape_b[:-2]
    if any(isinstance(s, Sz) for s in (*lead_a, *lead_b)):
        raise Unsupported("matmul with ragged batch axes")
    m, k, n = shape_a[-2], shape_a[-1], shape_b[-1]
    if lead_a == lead_b and not torch.compiler.is_compiling():
        return _product(ctx, step, a, b, len(lead_a))
    labels = {"m": m, "k": k, "n": n}
    ragged = [name for name in ("m", "k", "n") if isinstance(labels[name], Sz)]
    if not ragged:
        raise Unsupported("matmul without ragged axes")
    space = ctx.struct(tuple(labels[name] for name in ragged))
    segments = space.segments()
    coords = dict(zip(ragged, space.coords(), strict=True))
    lead = torch.broadcast_shapes(torch.Size(lead_a), torch.Size(lead_b))

    def gather(x: Any, rows_label: str, cols_label: str, shape: tuple[Any, ...]) -> Tensor:
        # -> [T, *lead, rows or 1, cols or 1]
        if isinstance(x, RaggedB):
            x = canonicalize(ctx, x)
            picks = [
                coords[rows_label] if isinstance(shape[-2], Sz) else None,
                coords[cols_label] if isinstance(shape[-1], Sz) else None,
            ]
            rows = struct_rows(x.struct, segments, [c for c in picks if c is not None])
            t = take_rows(x.values, rows)
            full = [t.shape[0], *shape[:-2]]
            full += [1 if isinstance(s, Sz) else s for s in shape[-2:]]
            t = t.reshape(full)
        elif isinstance(x, DenseB):
            t = take_rows(x.data, segments)
        else:
            t = x.unsqueeze(0)
        return t.reshape(t.shape[0], *([1] * (len(lead) - (t.ndim - 3))), *t.shape[1:])

    ga = gather(a, "m", "k", shape_a).unsqueeze(-1)  # [T, *lead, m, k, 1]
    gb = gather(b, "k", "n", shape_b).unsqueeze(-3)  # [T, *lead, 1, k, n]
    product = (ga * gb).sum(-2)  # [T, *lead, m, n]
    out_shape = step.out.shape
    keep = [name for name in ("m", "n") if isinstance(labels[name], Sz)]
    if "k" in ragged:
        if keep:
            target = ctx.struct(tuple(labels[name] for name in keep))
            index = struct_rows(target, segments, [coords[name] for name in keep])
            count = target.total
        else:
            index, count = segments, ctx.batch_size
        product = segment(product, index, count, "sum")
    positions = tuple(p for p, s in enumerate(out_shape) if isinstance(s, Sz))
    if not positions:
        return DenseB(product.reshape(ctx.batch_size, *out_shape))
    layout = canonical_layout(len(out_shape), positions)
    sz = sz_in_storage_order(out_shape, layout)
    struct = ctx.struct(sz)
    values = product.reshape(product.shape[0], *dense_shape(out_shape, layout))
    return RaggedB(values, layout, sz, struct)


def _product(ctx: Ctx, step: Any, a: Any, b: Any, lead: int) -> Any:
    """``a @ b`` with equal batch axes, through ``raggedfn.einsum`` (length-bucketed
    dense products; one product of the packed rows when only ``a``'s rows are ragged
    and ``b`` is shared), not the packed ``(m, k, n)`` enumeration, which holds a row
    per ``(m, k, n)`` coordinate (``q @ k^T`` over heads, ``p @ v``, DeBERTa's
    ``q @ pos_key^T`` against a per-sample ``pos_key``: a ``[T, H, K, N]`` product)."""
    from ...ops._products import einsum

    def operand(x: Any) -> tuple[Any, str]:
        if isinstance(x, RaggedB):
            x = canonicalize(ctx, x)
            return Ragged._make(x.values, x.struct.offsets, x.struct.sizes, x.layout), "z"
        if isinstance(x, DenseB):
            return x.data, "z"
        return x, ""

    letters = "ABCDEFGH"[:lead]
    left, batch_a = operand(a)
    right, batch_b = operand(b)
    equation = f"{batch_a}{letters}ik,{batch_b}{letters}kj->z{letters}ij"
    out = einsum(equation, left, right)
    out_shape = step.out.shape
    if not isinstance(out, Ragged):
        return DenseB(out.reshape(ctx.batch_size, *out_shape).to(step.out.dtype))
    positions = tuple(p for p, s in enumerate(out_shape) if isinstance(s, Sz))
    layout = canonical_layout(len(out_shape), positions)
    if out.layout != layout:
        raise Unsupported("a product whose result is not in canonical layout")
    sz = sz_in_storage_order(out_shape, layout)
    return RaggedB(out.values.to(step.out.dtype), layout, sz, ctx.struct(sz))


@rule(aten.addmm)
def addmm_rule(
    ctx: Ctx, step: Any, bias: Any, x: Any, weight: Any, *, beta: Any = 1, alpha: Any = 1
) -> Any:
    """``beta * bias + alpha * (x @ weight)`` for per-sample rows ``x`` (GPT-2's Conv1D)."""
    if is_batched(bias) or is_batched(weight) or not isinstance(x, RaggedB):
        raise Unsupported("addmm with a per-sample bias or weight")
    x = canonicalize(ctx, x)
    if not _trailing_dense(x, 1) or len(axes_of(x.layout)) != 2:
        raise Unsupported("addmm over a ragged contraction")
    values = torch.addmm(bias, x.values, weight, beta=beta, alpha=alpha)
    return RaggedB(values.to(step.out.dtype), x.layout, x.sz, x.struct)


# ----- einsum and group_norm -----------------------------------------------------------


@rule(aten.einsum)
def einsum_rule(ctx: Ctx, step: Any, equation: str, tensors: Any, path: Any = None) -> Any:
    """Every ragged label becomes a coordinate of one packed iteration space; the dense
    labels go to ``torch.einsum``; summed ragged labels are segment sums."""
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise Unsupported("einsum with '...' or without '->'")
    inputs, output = equation.split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != len(tensors):
        raise Unsupported("einsum operand count")
    sizes: dict[str, Any] = {}
    for sub, t in zip(subscripts, tensors, strict=True):
        if len(set(sub)) != len(sub):
            raise Unsupported("einsum with a repeated label in one operand (diagonal)")
        for label, size in zip(sub, logical(t), strict=True):
            sizes.setdefault(label, size)
    ragged = [
        label for label in dict.fromkeys(inputs.replace(",", "")) if isinstance(sizes[label], Sz)
    ]
    if not ragged:
        raise Unsupported("einsum without ragged labels")
    space = ctx.struct(tuple(sizes[label] for label in ragged))
    segments = space.segments()
    coords = dict(zip(ragged, space.coords(), strict=True))
    row = next(c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in equation)
    operands, subs = [], []
    for sub, t in zip(subscripts, tensors, strict=True):
        if isinstance(t, RaggedB):
            t = canonicalize(ctx, t)
            own = [label for label in sub if label in coords]
            operands.append(
                take_rows(t.values, struct_rows(t.struct, segments, [coords[lb] for lb in own]))
            )
            subs.append(row + "".join(label for label in sub if label not in coords))
        elif isinstance(t, DenseB):
            operands.append(take_rows(t.data, segments))
            subs.append(row + sub)
        elif isinstance(t, Tensor):
            operands.append(t)
            subs.append(sub)
        else:
            raise Unsupported("einsum of a per-sample size")
    dense_out = "".join(label for label in output if label not in coords)
    product = torch.einsum(",".join(subs) + "->" + row + dense_out, *operands)
    kept = [label for label in output if label in coords]
    out_shape = step.out.shape
    if len(kept) != len(ragged):
        if kept:
            target = ctx.struct(tuple(sizes[label] for label in kept))
            index = struct_rows(target, segments, [coords[label] for label in kept])
            product = segment(product, index, target.total, "sum")
        else:
            product = segment(product, segments, ctx.batch_size, "sum")
    elif kept != ragged:
        raise Unsupported("einsum that reorders ragged labels")
    positions = tuple(p for p, s in enumerate(out_shape) if isinstance(s, Sz))
    if not positions:
        return DenseB(product.reshape(ctx.batch_size, *out_shape))
    layout = canonical_layout(len(out_shape), positions)
    sz = sz_in_storage_order(out_shape, layout)
    return RaggedB(product.to(step.out.dtype), layout, sz, ctx.struct(sz))


@rule(aten.group_norm)
def group_norm_rule(
    ctx: Ctx,
    step: Any,
    x: Any,
    groups: int,
    weight: Any = None,
    bias: Any = None,
    eps: float | None = None,
    cudnn_enabled: bool = True,
) -> Any:
    """``group_norm`` of one sample ``(N, C, *spatial)`` whose spatial axes are ragged."""
    # float defaults are None: under dynamic=True dynamo reads a float default as a
    # graph input and restarts the frame analysis on it (see _dynamo_reads.static)
    eps = 1e-5 if eps is None else eps
    if is_batched(weight) or is_batched(bias) or not isinstance(x, RaggedB):
        raise Unsupported("a per-sample weight")
    shape = x.shape()
    if len(shape) < 3 or any(isinstance(s, Sz) for s in shape[:2]):
        raise Unsupported("group_norm with ragged batch or channel axes")
    if not all(isinstance(s, Sz) for s in shape[2:]):
        raise Unsupported("group_norm with mixed ragged and fixed spatial axes")
    x = canonicalize(ctx, x)
    n, c = shape[0], shape[1]
    values = x.values.reshape(-1, n, groups, c // groups)  # [rows, N, G, C/G]
    segments = x.struct.segments()
    rows = x.struct.sizes.prod(dim=1).to(values.dtype) * (c // groups)
    total = segment(values.sum(-1), segments, ctx.batch_size, "sum")
    mean = total / rows[:, None, None]
    centred = values - mean[segments].unsqueeze(-1)
    var = (
        segment((centred * centred).sum(-1), segments, ctx.batch_size, "sum") / rows[:, None, None]
    )
    out = (centred * torch.rsqrt(var + eps)[segments].unsqueeze(-1)).reshape(-1, n, c)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return RaggedB(out.to(step.out.dtype), x.layout, x.sz, x.struct)
