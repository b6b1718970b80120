"""Running sums inside contiguous segments, each as exact as ``torch.cumsum`` of its
own segment, with explicit backward and forward-mode rules.

One ``torch.cumsum`` over all packed rows, minus its value before each segment's
start, would make a segment's rounding error scale with the running total of
every segment before it (and its backward, a reverse running sum, with every
segment after it): a float64 sample of magnitude 1e4 after one of 1e15 lost five
digits against the per-sample loop. Here each segment's first row also subtracts
the previous segment's total (a per-segment sum), so the running sum restarts
near 0 at every segment; what is left of earlier segments is their rounding
(``eps`` times their magnitude), and the base each segment subtracts is read at
its own first row, so that residue cancels to ``eps`` of it again.

The backward is the same scan on the reversed rows (reverse running sums within
segments), so no derivative mixes segments either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false

from ._forward import call
from ._segment import segment_counts, segment_sum, take_rows

# +inf and -inf (NaN counts as both) in a segment prefix, packed into one int64 running sum:
# counts stay below 2**31, so the difference of two running codes splits exactly
_NEGATIVE = 1 << 31


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype a segmented running sum is accumulated in (torch.cumsum's result dtype)."""
    if dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex):
        return torch.int64
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float64
    return dtype


def _before(values: Tensor, starts: Tensor) -> Tensor:
    """``[T, *rest]``: for each segment's first row, the total of the segment before
    it (0 elsewhere and at row 0); a per-segment sum, not a running total."""
    count = values.shape[0]
    rows = torch.arange(count, device=starts.device)
    totals = segment_sum(values, starts, count)  # at each segment's first row
    previous = take_rows(totals, take_rows(starts, (rows - 1).clamp_min(0)))
    first = (starts == rows) & (rows > 0)
    shape = (count, *([1] * (values.ndim - 1)))
    return torch.where(first.reshape(shape), previous, torch.zeros_like(previous))


def _running(values: Tensor, starts: Tensor) -> Tensor:
    """Inclusive running sum inside contiguous segments (see the module docstring)."""
    # an unbacked row count (a packed size read from the data under torch.compile)
    # cannot decide this branch; the general path below is exact for 0 rows too
    if guard_or_false(values.shape[0] == 0):
        return values.clone()
    shifted = values - _before(values, starts) if values.is_floating_point() else values
    running = torch.cumsum(shifted, 0)
    # the running sum just before each segment, read where the segment starts
    base = running - values
    return running - take_rows(base, starts)


def _scan(values: Tensor, starts: Tensor) -> Tensor:
    """The forward: exact integers, floating sums with infinities kept in their segment."""
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


def _reversed_starts(starts: Tensor) -> Tensor:
    """The ``starts`` of the reversed rows: row ``T-1-i`` starts where row ``i``'s
    segment ends."""
    count = starts.shape[0]
    last = starts + take_rows(segment_counts(starts, count), starts) - 1
    return (count - 1 - last).flip(0)


def _reverse_scan(grad: Tensor, starts: Tensor) -> Tensor:
    """``out[i] = sum of grad[j]`` over rows ``j >= i`` of ``i``'s segment."""
    return segment_cumsum(grad.flip(0), _reversed_starts(starts)).flip(0)


class _SegmentCumsum(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(values: Tensor, starts: Tensor) -> Tensor:
        return _scan(values, starts)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (starts,) = ctx.saved_tensors
        return _reverse_scan(grad, starts), None


class _SegmentCumsumJvp(_SegmentCumsum):
    """With the forward-mode rule: the scan of the tangent (eager calls)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _SegmentCumsum.setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[1])

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, *_: None) -> Tensor:
        (starts,) = ctx.saved_tensors
        return segment_cumsum(tangent, starts)


def segment_cumsum(values: Tensor, starts: Tensor) -> Tensor:
    """Inclusive running sum along packed order inside contiguous segments.

    Args:
        values: ``[T, *rest]``.
        starts: ``[T]`` int64, the packed index of the first row of each row's
            segment; every segment must occupy consecutive rows.

    Returns:
        ``[T, *rest]`` in ``torch.cumsum``'s result dtype (int64 for integers
        and bool), without host syncs. Floating inputs below float64 accumulate
        in float64; in every dtype a segment's error is that of its own running
        sum plus ``eps`` times the rounding left by earlier segments (see the
        module docstring), and the backward (reverse running sums) likewise.
        Infinite and NaN entries are counted per prefix apart from the finite
        sum, giving ``+-inf`` or NaN exactly where ``torch.cumsum`` of the
        segment does (``inf - inf`` never spills NaN into later segments).
    """
    if not values.is_floating_point():
        return _scan(values, starts)
    return call(_SegmentCumsumJvp, _SegmentCumsum, _scan, values, starts)
