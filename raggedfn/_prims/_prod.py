"""Segment product with a backward that vmap and double backward accept.

``scatter_reduce("prod")``'s own backward inspects the data for zeros
(``vmap`` over it fails), so the rule here is written out: the gradient of a
row is the product of the other rows of its segment, computed as
``product / row`` when the segment has no zero, as the product of the
nonzero rows for its single zero, and 0 otherwise. It is built from
``segment_prod`` itself, ``segment_sum`` and ``broadcast``, so it is
differentiable again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

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
        zero = values == 0
        zeros = broadcast(segment_sum(zero.to(values.dtype), segments, ctx.num_segments), segments)
        nonzero = torch.where(zero, torch.ones_like(values), values)
        others_of_zero = broadcast(segment_prod(nonzero, segments, ctx.num_segments), segments)
        others = torch.where(
            zero,
            torch.where(zeros == 1, others_of_zero, torch.zeros_like(values)),
            torch.where(
                zeros == 0, broadcast(product, segments) / nonzero, torch.zeros_like(values)
            ),
        )
        return broadcast(grad, segments) * others, None, None


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
    return _SegmentProd.apply(values, segments, num_segments)
