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

from ._forward import call, plain_eager
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


def _reduce(values: Tensor, segments: Tensor, num_segments: int, largest: bool) -> Tensor:
    index = _column(segments, values).expand_as(values)
    start = values.new_full((num_segments, *values.shape[1:]), identity(values.dtype, largest))
    reduce = "amax" if largest else "amin"
    return torch.scatter_reduce(start, 0, index, values, reduce, include_self=False)


def _composite(values: Tensor, segments: Tensor, num_segments: int, largest: bool) -> Tensor:
    """:func:`_reduce` as torch ops whose derivatives (of every order) are the Function's:
    the mean of the tied rows' derivatives, zero for a NaN extremum (torch's
    ``scatter_reduce`` gives NaN there). For ``torch.func`` transforms inside compiled
    code (``_forward.call``), where torch's own rules apply instead of the Function's.

    The value is exactly the extremum: a finite one plus a sum of exact zeros
    (``detached - values`` on tied rows, subtracted, so that ``e - (+0)`` keeps the
    sign of a zero ``e``); an infinite one as the mean of its tied rows (``inf - inf``
    would be NaN).
    """
    detached = values.detach()
    extremum = _reduce(detached, segments, num_segments, largest)
    if not values.is_floating_point():
        return extremum
    hit = detached == broadcast(extremum, segments)
    finite = torch.isfinite(detached)
    zero = torch.zeros_like(values)
    count = segment_sum(hit.to(values.dtype), segments, num_segments)
    ties = torch.where(count > 0, count, torch.ones_like(count))
    moved = segment_sum(torch.where(hit & finite, detached - values, zero), segments, num_segments)
    spread = segment_sum(torch.where(hit & ~finite, values, zero), segments, num_segments)
    infinite = torch.isinf(extremum) & (count > 0)  # not an empty segment's identity
    return torch.where(infinite, spread / ties, extremum - moved / ties)


def _first_hit(values: Tensor, segments: Tensor, num_segments: int, extremum: Tensor) -> Tensor:
    """Smallest packed index attaining each segment's extremum (as torch.argmax); -1 if none."""
    total = values.shape[0]
    index = _column(segments, values).expand_as(values)
    rows = _column(torch.arange(total, device=values.device), values)
    candidates = torch.where(_ties(values, segments, extremum), rows, total)
    first = torch.full(
        (num_segments, *values.shape[1:]), total, dtype=torch.int64, device=values.device
    ).scatter_reduce(0, index, candidates.expand_as(values), "amin", include_self=True)
    return torch.where(first == total, -1, first)


class _SegmentExtremum(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(values: Tensor, segments: Tensor, num_segments: int, largest: bool) -> Tensor:
        return _reduce(values, segments, num_segments, largest)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        values, segments, num_segments, _ = inputs
        ctx.save_for_backward(values, segments, output)
        ctx.num_segments = num_segments

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        values, segments, extremum = ctx.saved_tensors
        if not torch.is_grad_enabled() and plain_eager() and _reusable(values, grad):
            return _first_order_share(values, segments, extremum, grad), None, None, None
        # Plain equality, as torch.amax's rule: a NaN extremum gets no gradient
        # (isnan over every row would double the cost of this backward).
        hit = (values == broadcast(extremum, segments)).to(grad.dtype)
        ties = segment_sum(hit, segments, ctx.num_segments)
        # An empty segment has no tie and no row to receive its gradient.
        share = grad / torch.where(ties > 0, ties, torch.ones_like(ties))
        return broadcast(share, segments) * hit, None, None, None


def _reusable(values: Tensor, grad: Tensor) -> bool:
    """The gathered extremum's buffer can hold the tie pattern in ``grad``'s dtype."""
    return values.dtype == grad.dtype and values.dtype.is_floating_point


def _first_order_share(values: Tensor, segments: Tensor, extremum: Tensor, grad: Tensor) -> Tensor:
    """The backward above in two ``[T, *rest]`` buffers instead of five (a first-order
    backward records no graph, so its fresh buffers are written in place): the gathered
    extremum becomes the tie pattern, the gathered share is scaled by it. The same
    kernels on the same values in the same order: bit-identical to the general rule."""
    hit = broadcast(extremum, segments)  # fresh [T, *rest]
    hit.eq_(values)  # 1.0 where the row attains its segment's extremum, else 0.0
    ties = segment_sum(hit, segments, extremum.shape[0])
    share = grad / ties.masked_fill_(ties == 0, 1)  # an empty segment: no row to receive it
    return broadcast(share, segments).mul_(hit)


class _SegmentExtremumJvp(_SegmentExtremum):
    """With the forward-mode rule: the mean tangent of the rows that tie (eager calls).

    The transpose of the backward (``jacfwd == jacrev``), so a NaN extremum gets
    a zero tangent and an empty segment too.
    """

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _SegmentExtremum.setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[0], inputs[1], output)

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, *_: None) -> Tensor:
        values, segments, extremum = ctx.saved_tensors
        hit = (values == broadcast(extremum, segments)).to(tangent.dtype)
        ties = segment_sum(hit, segments, ctx.num_segments)
        total = segment_sum(tangent * hit, segments, ctx.num_segments)
        return total / torch.where(ties > 0, ties, torch.ones_like(ties))


def _extremum(values: Tensor, segments: Tensor, num_segments: int, largest: bool) -> Tensor:
    return call(
        _SegmentExtremumJvp, _SegmentExtremum, _composite, values, segments, num_segments, largest
    )


def segment_amax(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
    """Largest row of each segment, ``[S, *rest]``; the identity for an empty segment.

    Args:
        values: ``[T, *rest]`` (float, integer or bool).
        segments: ``[T]`` int64 output row of each packed row.
        num_segments: ``S``.

    Returns:
        ``[S, *rest]``: -inf (or the dtype's minimum) where a segment has no
        rows. Ties share the gradient evenly, as ``torch.amax``. One
        ``scatter_reduce`` forward; the backward recomputes the tie pattern.
    """
    return _extremum(values, segments, num_segments, True)


def segment_amin(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
    """Smallest row of each segment; +inf (or the dtype's maximum) for an empty one."""
    return _extremum(values, segments, num_segments, False)


def segment_max(values: Tensor, segments: Tensor, num_segments: int) -> tuple[Tensor, Tensor]:
    """Largest row of each segment and the packed index of its first occurrence.

    Args:
        values: ``[T, *rest]`` (float, integer or bool).
        segments: ``[T]`` int64 output row of each packed row.
        num_segments: ``S``.

    Returns:
        ``(max [S, *rest], arg [S, *rest] int64)``. A segment without rows has
        the identity (-inf, or the dtype's minimum) and arg -1. The maximum is
        :func:`segment_amax` (differentiable); the index is not.
    """
    extremum = segment_amax(values, segments, num_segments)
    with torch.no_grad():
        arg = _first_hit(values.detach(), segments, num_segments, extremum.detach())
    return extremum, arg


def segment_min(values: Tensor, segments: Tensor, num_segments: int) -> tuple[Tensor, Tensor]:
    """Smallest row of each segment and the packed index of its first occurrence.

    Like :func:`segment_max` with +inf (or the dtype's maximum) for empty segments.
    """
    extremum = segment_amin(values, segments, num_segments)
    with torch.no_grad():
        arg = _first_hit(values.detach(), segments, num_segments, extremum.detach())
    return extremum, arg
