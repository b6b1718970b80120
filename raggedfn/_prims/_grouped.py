"""Grouped matrix products: one weight per segment of packed rows (mixture of experts).

``segment_matmul(values, offsets, weight, bias)`` multiplies the rows of group
``g`` (``values[offsets[g]:offsets[g+1]]``, ``[n_g, K]``) by ``weight[g]``
(``[K, F]``) and adds ``bias[g]``: one GEMM per non-empty group, forward and
backward, never a gather of ``[T, K, F]`` weights. ``segment_outer`` is its
weight gradient, ``out[g] = values_g^T @ other_g`` (``[G, K, F]``). The two
rules are written with each other, so every derivative of any order is again
one GEMM per group:

* ``segment_matmul``: ``dx = segment_matmul(g, W^T)``, ``dW = segment_outer(x, g)``,
  ``db = segment_sum(g)``;
* ``segment_outer``: ``da = segment_matmul(b, C^T)``, ``db = segment_matmul(a, C)``.

Both read the group boundaries on the host (``offsets.tolist()``): eagerly one
sync per call; under ``torch.compile`` the public op runs as one opaque
``host_planned`` node instead (see ``_opaque``). Forward-mode rules (``jvp``)
live in subclasses used eagerly; dynamo 2.13 refuses a Function with ``jvp``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from .._index import segment_ids
from ._opaque import implement
from ._segment import broadcast, segment_sum


def _bounds(offsets: Tensor) -> list[tuple[int, int, int]]:
    """``(group, start, stop)`` of every non-empty group."""
    edges = offsets.tolist()
    return [(g, a, b) for g, (a, b) in enumerate(itertools.pairwise(edges)) if b > a]


def _matmul(values: Tensor, offsets: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    pieces = []
    for g, start, stop in _bounds(offsets):
        rows = values[start:stop]
        pieces.append(rows @ weight[g] if bias is None else torch.addmm(bias[g], rows, weight[g]))
    if not pieces:
        return values.new_zeros((values.shape[0], weight.shape[2]))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _outer(values: Tensor, other: Tensor, offsets: Tensor) -> Tensor:
    groups = offsets.shape[0] - 1
    out = values.new_zeros((groups, values.shape[1], other.shape[1]))
    bounds = _bounds(offsets)
    if not bounds:
        return out
    blocks = torch.stack([values[a:b].T @ other[a:b] for _, a, b in bounds])
    which = torch.tensor([g for g, _, _ in bounds], device=values.device)
    return out.index_copy(0, which, blocks)


class _SegmentMatmul(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(values: Tensor, offsets: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return _matmul(values, offsets, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        values, offsets, weight, bias = inputs
        ctx.save_for_backward(values, offsets, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(
        ctx: Any, grad: Tensor
    ) -> tuple[Tensor | None, None, Tensor | None, Tensor | None]:
        values, offsets, weight = ctx.saved_tensors
        grad_values = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_values = segment_matmul(grad, offsets, weight.transpose(1, 2))
        if ctx.needs_input_grad[2]:
            grad_weight = segment_outer(values, grad, offsets)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            groups = offsets.shape[0] - 1
            grad_bias = segment_sum(grad, segment_ids(offsets, grad.shape[0]), groups)
        return grad_values, None, grad_weight, grad_bias


class _SegmentMatmulJvp(_SegmentMatmul):
    """With the forward-mode rule (product rule, each term one GEMM per group)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _SegmentMatmul.setup_context(ctx, inputs, output)
        values, offsets, weight, _ = inputs
        ctx.save_for_forward(values, offsets, weight)

    @staticmethod
    def jvp(
        ctx: Any,
        t_values: Tensor | None,
        _t_offsets: None,
        t_weight: Tensor | None,
        t_bias: Tensor | None,
    ) -> Tensor:
        values, offsets, weight = ctx.saved_tensors
        out = values.new_zeros((values.shape[0], weight.shape[2]))
        if t_values is not None:
            out = out + segment_matmul(t_values, offsets, weight)
        if t_weight is not None:
            out = out + segment_matmul(values, offsets, t_weight)
        if t_bias is not None:
            out = out + broadcast(t_bias, segment_ids(offsets, values.shape[0]))
        return out


class _SegmentOuter(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(values: Tensor, other: Tensor, offsets: Tensor) -> Tensor:
        return _outer(values, other, offsets)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        values, other, offsets = inputs
        ctx.save_for_backward(values, other, offsets)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        values, other, offsets = ctx.saved_tensors
        grad_values = grad_other = None
        if ctx.needs_input_grad[0]:
            grad_values = segment_matmul(other, offsets, grad.transpose(1, 2))
        if ctx.needs_input_grad[1]:
            grad_other = segment_matmul(values, offsets, grad)
        return grad_values, grad_other, None


class _SegmentOuterJvp(_SegmentOuter):
    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _SegmentOuter.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def jvp(ctx: Any, t_values: Tensor | None, t_other: Tensor | None, _t: None) -> Tensor:
        values, other, offsets = ctx.saved_tensors
        out = values.new_zeros((offsets.shape[0] - 1, values.shape[1], other.shape[1]))
        if t_values is not None:
            out = out + segment_outer(t_values, other, offsets)
        if t_other is not None:
            out = out + segment_outer(values, t_other, offsets)
        return out


def segment_matmul(
    values: Tensor, offsets: Tensor, weight: Tensor, bias: Tensor | None = None
) -> Tensor:
    """``values[offsets[g]:offsets[g+1]] @ weight[g] + bias[g]`` for every group ``g``.

    Args:
        values: ``[T, K]`` packed rows, grouped.
        offsets: int64 ``[G + 1]`` group boundaries.
        weight: ``[G, K, F]``.
        bias: ``[G, F]`` or None.

    Returns:
        ``[T, F]``; one GEMM per non-empty group, forward and backward.
    """
    if torch.compiler.is_compiling():
        return _SegmentMatmul.apply(values, offsets, weight, bias)
    return _SegmentMatmulJvp.apply(values, offsets, weight, bias)


def segment_outer(values: Tensor, other: Tensor, offsets: Tensor) -> Tensor:
    """``values_g^T @ other_g`` for every group: ``[G, K, F]`` (zero for an empty group).

    Args:
        values: ``[T, K]``.
        other: ``[T, F]``.
        offsets: int64 ``[G + 1]`` group boundaries.
    """
    if torch.compiler.is_compiling():
        return _SegmentOuter.apply(values, other, offsets)
    return _SegmentOuterJvp.apply(values, other, offsets)


@implement("segment_matmul")
def _planned(tensors: Any, meta: str) -> Tensor:
    """The opaque compiled node (``host_planned``): ``[values, offsets, weight(, bias)]``."""
    values, offsets, weight, *bias = tensors
    return segment_matmul(values, offsets, weight, bias[0] if bias else None)
