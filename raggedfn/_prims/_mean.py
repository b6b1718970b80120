"""Segment means: NaN for a segment without rows, as ``torch.mean`` of an empty tensor.

The NaN comes from a small rule of its own (``_EmptyNaN``) so that each mode of
differentiation matches the per-sample loop:

* reverse mode: a segment without rows has no row to send a gradient to; the
  rule sends zero into the segment sum there, so no NaN or infinity enters a
  backward graph (double backward included), as ``torch.mean``'s backward of an
  empty tensor is an empty tensor;
* forward mode: the tangent there is NaN, as torch's forward derivative of
  ``torch.mean`` on an empty tensor (a zero-length sum divided by 0). A plain
  ``where`` would give 0 there, and a plain division NaN in the backward too.

Inside ``torch.compile`` with forward mode or a ``torch.func`` transform, dynamo
refuses a custom ``jvp``; the body there is the plain ``where`` (tangent 0 for an
empty segment, see ``docs/transforms.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._forward import call
from ._segment import _column, segment_counts, segment_sum


def _nan_where_empty(mean: Tensor, present: Tensor) -> Tensor:
    return torch.where(present, mean, torch.full_like(mean, float("nan")))


class _EmptyNaN(torch.autograd.Function):
    """``where(present, mean, NaN)``; the backward sends 0 where a segment is empty."""

    generate_vmap_rule = True

    @staticmethod
    def forward(mean: Tensor, present: Tensor) -> Tensor:
        return _nan_where_empty(mean, present)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (present,) = ctx.saved_tensors
        return torch.where(present, grad, torch.zeros_like(grad)), None


class _EmptyNaNJvp(_EmptyNaN):
    """With the forward-mode rule: the tangent, NaN where a segment is empty (eager)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _EmptyNaN.setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[1])

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, *_: None) -> Tensor:
        (present,) = ctx.saved_tensors
        return _nan_where_empty(tangent, present)


def segment_mean(
    values: Tensor, segments: Tensor, num_segments: int, counts: Tensor | None = None
) -> Tensor:
    """Mean of each segment's rows; NaN for a segment without rows.

    Args:
        values: ``[T, *rest]`` floating point.
        segments: ``[T]`` int64 output row of every packed row.
        num_segments: ``S``.
        counts: ``[S]`` rows per segment when the caller already knows them.

    Returns:
        ``[S, *rest]``. Derivatives as the per-sample ``torch.mean``: the gradient
        reaches only the rows (every order stays finite; an empty segment has no
        row), and the forward-mode tangent of an empty segment is NaN.
    """
    if counts is None:
        counts = segment_counts(segments, num_segments)
    total = segment_sum(values, segments, num_segments)
    counts = _column(counts, total)
    present = counts > 0
    safe = torch.where(present, counts, torch.ones_like(counts)).to(total.dtype)
    return call(_EmptyNaNJvp, _EmptyNaN, _nan_where_empty, total / safe, present)
