"""Segment sums, means, products, cumulative sums, broadcasts and padding.

Everything here is a plain composite of differentiable torch ops: autograd,
``torch.func`` (grad, vjp, jacrev, jacfwd, vmap) and ``torch.compile`` derive
the rules, and each derived backward is again differentiable.

Conventions shared by every primitive in ``raggedfn._prims``:

* ``values`` is ``[T, *rest]``: one packed row per leading index.
* ``segments`` is ``[T]`` int64: the output row of each packed row, in
  ``[0, num_segments)``, in any order (not necessarily sorted or contiguous).
* ``num_segments`` (``S``) is a Python int (or SymInt), so output shapes are
  static: nothing reads tensor data on the host.
* Segments without rows are legal: sum 0, mean NaN (product 1: see ``_prod``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._forward import compiled_transform


def _column(index: Tensor, values: Tensor) -> Tensor:
    """``index [T]`` viewed as ``[T, 1, ...]`` to broadcast against ``values``."""
    return index.reshape(index.shape[0], *([1] * (values.ndim - 1)))


def segment_sum(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
    """``out[s] = sum of values[t] over rows t with segments[t] == s``; ``[S, *rest]``.

    ``index_add``'s backward is an ``index_select`` and vice versa, so this
    needs no custom rule.
    """
    zeros = values.new_zeros((num_segments, *values.shape[1:]))
    if compiled_transform():  # see take_rows
        return zeros.scatter_add(0, _column(segments, values).expand_as(values), values)
    return torch.index_add(zeros, 0, segments, values)


def broadcast(per_segment: Tensor, segments: Tensor) -> Tensor:
    """Each packed row gets its segment's value: ``[S, *rest] -> [T, *rest]``.

    The backward is :func:`segment_sum` (``index_select``'s rule is ``index_add``).
    """
    return take_rows(per_segment, segments)


def take_rows(values: Tensor, index: Tensor) -> Tensor:
    """``values[index]`` along the leading axis: ``[S, *rest] -> [T, *rest]``.

    ``index_select`` (the fastest row gather on CPU), except inside ``torch.func``
    transforms or forward mode traced by ``torch.compile``: there inductor 2.13 gives
    silently wrong results for the batched backward of ``index_select``
    (``jacrev``/``vmap(grad)``) and fails on its forward derivatives (``jvp``:
    an assertion in its CPU code generation; ``hessian``: a crash), while ``gather``
    (and ``scatter_add`` for :func:`segment_sum`) compiles right.
    """
    if compiled_transform():
        return values.gather(0, _column(index, values).expand(-1, *values.shape[1:]))
    return values.index_select(0, index)


def segment_counts(segments: Tensor, num_segments: int) -> Tensor:
    """``[S]`` int64 number of rows in each segment."""
    ones = torch.ones_like(segments)
    return torch.index_add(segments.new_zeros(num_segments), 0, segments, ones)


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
        ``[S, *rest]``. The NaN of an empty segment sits behind a ``where``, so
        every derivative (of any order) stays finite.
    """
    if counts is None:
        counts = segment_counts(segments, num_segments)
    total = segment_sum(values, segments, num_segments)
    counts = _column(counts, total)
    present = counts > 0
    safe = torch.where(present, counts, torch.ones_like(counts)).to(total.dtype)
    return torch.where(present, total / safe, torch.full_like(total, float("nan")))


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype a segmented running sum is accumulated in (torch.cumsum's result dtype)."""
    if dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex):
        return torch.int64
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float64
    return dtype


def _running(values: Tensor, starts: Tensor) -> Tensor:
    """Inclusive running sum inside contiguous segments: the running sum over all rows
    minus its value just before each row's segment start."""
    running = torch.cumsum(values, 0)
    before = torch.cat([running.new_zeros((1, *running.shape[1:])), running[:-1]])
    return running - take_rows(before, starts)


# +inf and -inf (NaN counts as both) in a segment prefix, packed into one int64 running sum:
# counts stay below 2**31, so the difference of two running codes splits exactly
_NEGATIVE = 1 << 31


def segment_cumsum(values: Tensor, starts: Tensor) -> Tensor:
    """Inclusive running sum along packed order inside contiguous segments.

    Args:
        values: ``[T, *rest]``.
        starts: ``[T]`` int64, the packed index of the first row of each row's
            segment; every segment must occupy consecutive rows.

    Returns:
        ``[T, *rest]`` in ``torch.cumsum``'s result dtype (int64 for integers
        and bool). The running sum over all rows minus its value just before
        the segment start: one ``cumsum`` and two gathers, no host sync.
        Floating inputs below float64 accumulate in float64 so that the
        difference loses nothing at their precision; float64 inputs lose up
        to ``T * eps`` relative to the largest running total. Infinite and NaN
        entries are kept out of that difference (``inf - inf`` would spill NaN
        into later segments): they are counted per prefix instead, giving
        ``+-inf`` or NaN exactly where ``torch.cumsum`` of the segment does. Their
        own gradient is 0, which is torch's wherever the loss is finite (every
        output downstream of them is infinite or NaN).
    """
    out_dtype = torch.int64 if _accumulator(values.dtype) == torch.int64 else values.dtype
    wide = values.to(_accumulator(values.dtype))
    if not wide.is_floating_point():
        return _running(wide, starts).to(out_dtype)
    finite = torch.isfinite(wide)
    total = _running(torch.where(finite, wide, torch.zeros_like(wide)), starts)
    up = (wide == float("inf")) | torch.isnan(wide)
    down = (wide == float("-inf")) | torch.isnan(wide)
    code = _running(up.to(torch.int64) + down.to(torch.int64) * _NEGATIVE, starts)
    positive, negative = code % _NEGATIVE > 0, code >= _NEGATIVE
    total = torch.where(positive, float("inf"), total)
    total = torch.where(negative, float("-inf"), total)
    total = torch.where(positive & negative, float("nan"), total)
    return total.to(out_dtype)


def pad(
    values: Tensor,
    segments: Tensor,
    positions: Tensor,
    num_segments: int,
    max_length: int,
    fill: float = 0.0,
) -> Tensor:
    """Scatter packed rows into a padded ``[S, max_length, *rest]`` tensor.

    Args:
        values: ``[T, *rest]``.
        segments: ``[T]`` row of the padded batch of each packed row.
        positions: ``[T]`` position of each packed row inside its segment
            (``< max_length``).
        num_segments: ``S``.
        max_length: padded length ``L`` (the caller reads it; a host value).
        fill: value of the padding.

    Returns:
        ``[S, L, *rest]``; the backward is :func:`unpad` of the gradient.
    """
    rest = values.shape[1:]
    flat = values.new_full((num_segments * max_length, *rest), fill)
    where = segments * max_length + positions
    return torch.index_copy(flat, 0, where, values).reshape(num_segments, max_length, *rest)


def unpad(padded: Tensor, segments: Tensor, positions: Tensor) -> Tensor:
    """Gather packed rows out of a padded ``[S, L, *rest]`` tensor: ``[T, *rest]``.

    The inverse of :func:`pad`; its backward scatters the gradient back.
    """
    num_segments, max_length = padded.shape[0], padded.shape[1]
    flat = padded.reshape(num_segments * max_length, *padded.shape[2:])
    return take_rows(flat, segments * max_length + positions)
