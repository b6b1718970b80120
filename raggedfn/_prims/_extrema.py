"""Segment maximum and minimum with their arg index (custom backward).

The forward is one ``scatter_reduce("amax"/"amin")`` plus one for the index.
The backward matches ``torch.amax``/``torch.amin``: the gradient is shared
evenly among the rows that tie for the extremum. It is built from
:func:`broadcast` and :func:`segment_sum`, so it is itself differentiable
(the tie pattern is locally constant), and ``grad(grad(.))`` works.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._segment import _column, broadcast, segment_sum


def identity(dtype: torch.dtype, largest: bool) -> float | int | bool:
    """The identity of max (``largest``) or min: -inf/+inf, or the integer extremes."""
    if dtype == torch.bool:
        return not largest
    if dtype.is_floating_point:
        return float("-inf") if largest else float("inf")
    info = torch.iinfo(dtype)
    return info.min if largest else info.max


def _ties(values: Tensor, segments: Tensor, extremum: Tensor) -> Tensor:
    """Bool ``[T, *rest]``: the row attains its segment's extremum (NaN ties NaN)."""
    target = broadcast(extremum, segments)
    hit = values == target
    if values.is_floating_point():
        hit = hit | (torch.isnan(values) & torch.isnan(target))
    return hit


def _extremum(
    values: Tensor, segments: Tensor, num_segments: int, largest: bool
) -> tuple[Tensor, Tensor]:
    rest = values.shape[1:]
    index = _column(segments, values).expand_as(values)
    start = values.new_full((num_segments, *rest), identity(values.dtype, largest))
    reduce = "amax" if largest else "amin"
    extremum = torch.scatter_reduce(start, 0, index, values, reduce, include_self=False)
    # First (smallest packed index) row that attains the extremum, as torch.argmax.
    total = values.shape[0]
    rows = _column(torch.arange(total, device=values.device), values)
    candidates = torch.where(_ties(values, segments, extremum), rows, total)
    first = torch.full(
        (num_segments, *rest), total, dtype=torch.int64, device=values.device
    ).scatter_reduce(0, index, candidates.expand_as(values), "amin", include_self=True)
    arg = torch.where(first == total, -1, first)
    return extremum, arg


class _SegmentExtremum(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        values: Tensor, segments: Tensor, num_segments: int, largest: bool
    ) -> tuple[Tensor, Tensor]:
        return _extremum(values, segments, num_segments, largest)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        values, segments, num_segments, _ = inputs
        extremum, arg = output
        ctx.mark_non_differentiable(arg)
        ctx.save_for_backward(values, segments, extremum)
        ctx.num_segments = num_segments

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _grad_arg: Any) -> tuple[Tensor | None, None, None, None]:
        values, segments, extremum = ctx.saved_tensors
        hit = _ties(values, segments, extremum).to(grad.dtype)
        ties = segment_sum(hit, segments, ctx.num_segments)
        # An empty segment has no tie and no row to receive its gradient.
        share = grad / torch.where(ties > 0, ties, torch.ones_like(ties))
        return broadcast(share, segments) * hit, None, None, None


def segment_max(values: Tensor, segments: Tensor, num_segments: int) -> tuple[Tensor, Tensor]:
    """Largest row of each segment and the packed index of its first occurrence.

    Args:
        values: ``[T, *rest]`` (float, integer or bool).
        segments: ``[T]`` int64 output row of each packed row.
        num_segments: ``S``.

    Returns:
        ``(max [S, *rest], arg [S, *rest] int64)``. A segment without rows has
        the identity (-inf, or the dtype's minimum) and arg -1. Ties share the
        gradient evenly, as ``torch.amax``.
    """
    return _SegmentExtremum.apply(values, segments, num_segments, True)


def segment_min(values: Tensor, segments: Tensor, num_segments: int) -> tuple[Tensor, Tensor]:
    """Smallest row of each segment and the packed index of its first occurrence.

    Like :func:`segment_max` with +inf (or the dtype's maximum) for empty segments.
    """
    return _SegmentExtremum.apply(values, segments, num_segments, False)
