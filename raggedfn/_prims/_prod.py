"""Segment product with a backward that vmap and double backward accept.

``scatter_reduce("prod")``'s own backward inspects the data for zeros
(``vmap`` over it fails), so the rule here is written out: the gradient of a
row is the product of the other rows of its segment, computed as
``product / row`` when the segment has no zero, as the product of the
nonzero rows for its single zero, and 0 otherwise (see :func:`_others`, whose own
derivatives are exact as well). It is built from ``segment_prod`` itself,
``segment_sum`` and ``broadcast``, so it is differentiable again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._forward import call, refuse_compiled
from ._segment import _column, broadcast, segment_sum


def _product(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
    ones = values.new_ones((num_segments, *values.shape[1:]))
    index = _column(segments, values).expand_as(values)
    return torch.scatter_reduce(ones, 0, index, values, "prod", include_self=True)


class _SegmentProd(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
        return _product(values, segments, num_segments)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        values, segments, num_segments = inputs
        ctx.save_for_backward(values, segments, output)
        ctx.num_segments = num_segments

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        values, segments, product = ctx.saved_tensors
        return (
            broadcast(grad, segments) * _others(values, segments, ctx.num_segments, product),
            None,
            None,
        )


class _SegmentProdJvp(_SegmentProd):
    """With the forward-mode rule ``sum(t * others)`` per segment (eager calls)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _SegmentProd.setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[0], inputs[1], output)

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, *_: None) -> Tensor:
        values, segments, product = ctx.saved_tensors
        others = _others(values, segments, ctx.num_segments, product)
        return segment_sum(tangent * others, segments, ctx.num_segments)


def _others(values: Tensor, segments: Tensor, num_segments: int, product: Tensor) -> Tensor:
    """``[T, *rest]`` product of the other rows of each row's segment.

    Written so that its own first derivatives are exact too (second derivatives
    of the product), with zeros: ``zero_sum`` is 0 in value but carries the
    derivative with respect to the zero rows.
    """
    zero = values == 0
    ones = torch.ones_like(values)
    nothing = torch.zeros_like(values)
    count = broadcast(segment_sum(zero.to(values.dtype), segments, num_segments), segments)
    nonzero = torch.where(zero, ones, values)
    nonzero_product = broadcast(segment_prod(nonzero, segments, num_segments), segments)
    zero_sum = broadcast(
        segment_sum(torch.where(zero, values, nothing), segments, num_segments), segments
    )
    # A nonzero row: P / v without zeros; (zero row) * (nonzero product) / v with one.
    for_nonzero = torch.where(
        count == 0,
        broadcast(product, segments) / nonzero,
        torch.where(count == 1, zero_sum * nonzero_product / nonzero, nothing),
    )
    # A zero row: the nonzero product alone; times the other zero row with two.
    for_zero = torch.where(
        count == 1,
        nonzero_product,
        torch.where(count == 2, (zero_sum - values) * nonzero_product, nothing),
    )
    return torch.where(zero, for_zero, for_nonzero)


def segment_prod(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
    """Product of each segment's rows; 1 for a segment without rows.

    Args:
        values: ``[T, *rest]``.
        segments: ``[T]`` int64 output row of each packed row.
        num_segments: ``S``.

    Returns:
        ``[S, *rest]``; exact gradients with zeros in the segment.
    """
    if not (values.is_floating_point() or values.is_complex()):
        return _product(values, segments, num_segments)
    # torch 2.13 derives a zero forward derivative for scatter_reduce("prod"), and
    # dynamo differentiates the Function's forward body inside compiled transforms
    refuse_compiled(
        "prod", "torch 2.13's scatter_reduce('prod') has a zero forward-mode derivative"
    )
    return call(_SegmentProdJvp, _SegmentProd, _product, values, segments, num_segments)
