"""Softmax, log-softmax and logsumexp normalised within segments.

``segment_softmax`` and ``segment_log_softmax`` carry custom backward rules
(``y * (g - sum(g * y))`` and ``g - exp(y) * sum(g)``): one segment sum and one
gather instead of the four kernels autograd would record for the composite.
Their backwards use :func:`segment_sum`/:func:`broadcast` and the saved output,
so they are differentiable again. ``segment_logsumexp`` is a composite; over a
segment of only ``-inf`` it follows torch (value ``-inf``, gradient NaN).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import Tensor

from .._index import host_bounds
from ._extrema import _reduce, identity
from ._forward import call, plain_eager
from ._segment import broadcast, segment_counts, segment_sum


def _peak(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
    """Per-segment max, a constant (the forward kernel alone, no autograd.Function)."""
    with torch.no_grad():
        return _reduce(values.detach(), segments, num_segments, largest=True)


def _shift(
    values: Tensor, segments: Tensor, num_segments: int, dims: tuple[int, ...] = ()
) -> Tensor:
    """The logsumexp shift: per-segment max over the finite entries (and over ``dims``,
    kept with size 1), 0 where there is none. A +inf entry still makes the sum +inf
    (torch.logsumexp's value) while the finite entries' ``exp`` cannot overflow, so their
    slope ``exp(x - lse)`` is 0 as torch's (a shift of 0 would give inf / inf there)."""
    with torch.no_grad():  # a constant: the forward kernels alone
        finite = values.detach().nan_to_num(nan=-math.inf, posinf=-math.inf)
        if dims and all(finite.shape[d] > 0 for d in dims):
            finite = finite.amax(dims, keepdim=True)
        elif dims:  # amax refuses an empty axis: nothing there, so no shift
            shape = [1 if d in dims else n for d, n in enumerate(finite.shape)]
            finite = finite.new_full(shape, -math.inf)
        peak = _reduce(finite, segments, num_segments, largest=True)
    return peak.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


# Softmax and log-softmax subtract the raw per-segment max, as torch.softmax does: a
# segment with a +inf entry, only -inf entries or a NaN entry is NaN throughout
# (exp(inf - inf), exp(-inf - -inf)). A max made finite (as logsumexp's shift) would give
# inf/inf at the +inf entry and 0 beside it. A segment without rows is never gathered.


def _softmax(
    values: Tensor, segments: Tensor, num_segments: int, _bounds: Tensor | None = None
) -> Tensor:
    exp = torch.exp(values - broadcast(_peak(values, segments, num_segments), segments))
    return exp / broadcast(segment_sum(exp, segments, num_segments), segments)


# Up to this many elements (CPU, float32/64) a softmax over sorted segments reduces with
# torch.segment_reduce: one kernel each for the max and the sum, where scatter_reduce and
# index_add take three and two; above it they are faster (segment_reduce 1.2x slower at
# 57k elements, 2x faster at 4k; benchmarks/overhead.py, docs/benchmarks.md)
SEGMENT_REDUCE_MAX = 16384


# From this many elements per segment on average (CPU, eager, sorted segments) softmax and
# its backward run torch's fused kernel once per segment on its rows, writing into one
# output: the per-sample loop's own kernel (one pass where the segment form takes about
# seven), 1.7-3x faster from 6k elements per segment, slower below 2k (32 segments, 64-256
# features, process time; benchmarks/segment_ops.py)
PER_SEGMENT_MIN = 4096


def _per_segment(values: Tensor, num_segments: int, bounds: Tensor | None) -> list[int] | None:
    """The host bounds when softmax should run per segment, else None."""
    if (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or bounds is None
        or values.device.type != "cpu"
        or values.numel() < PER_SEGMENT_MIN * max(num_segments, 1)
    ):
        return None
    host = host_bounds(bounds)  # remembered with the partition: one read per partition
    # every row in a segment (else the segment form, whose gather refuses the others)
    return host if host[0] == 0 and host[-1] == values.shape[0] else None


def _softmax_forward(
    values: Tensor, segments: Tensor, num_segments: int, bounds: Tensor | None
) -> Tensor:
    """:func:`_softmax` reusing its own fresh buffers (a Function's forward is not recorded)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        out = values - broadcast(_peak(values, segments, num_segments), segments)
        out.exp_()
        return out.div_(broadcast(segment_sum(out, segments, num_segments), segments))
    host = _per_segment(values, num_segments, bounds)
    if host is not None:
        out = torch.empty_like(values, memory_format=torch.contiguous_format)
        for start, stop in itertools.pairwise(host):
            if stop > start:
                torch._softmax(values[start:stop], 0, False, out=out[start:stop])
        return out
    if (
        bounds is not None
        and values.numel() <= SEGMENT_REDUCE_MAX
        and values.device.type == "cpu"
        and values.dtype in (torch.float32, torch.float64)
    ):
        # segment s is the rows bounds[s]:bounds[s + 1]; rows past the last segment (bad
        # offsets) have id S, which index_select refuses; an empty segment's -inf max is
        # never gathered
        peak = torch.segment_reduce(values, "max", offsets=bounds)
        out = values - peak.index_select(0, segments)
        out.exp_()
        total = torch.segment_reduce(out, "sum", offsets=bounds)
        return out.div_(total.index_select(0, segments))
    # plain eager (no transform batches ``values``): the same kernels, the segment
    # reductions written into their fresh buffers, without the wrappers' per-call checks
    rest = values.shape[1:]
    index = segments.view(-1, *[1] * len(rest)).expand_as(values)
    peak = values.new_full((num_segments, *rest), identity(values.dtype, True))
    peak.scatter_reduce_(0, index, values, "amax", include_self=False)
    out = values - peak.index_select(0, segments)
    out.exp_()
    total = out.new_zeros((num_segments, *rest)).index_add_(0, segments, out)
    return out.div_(total.index_select(0, segments))


def _log_softmax(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
    shifted = values - broadcast(_peak(values, segments, num_segments), segments)
    total = segment_sum(torch.exp(shifted), segments, num_segments)
    return shifted - broadcast(torch.log(total), segments)


# A first-order backward (no graph recorded, plain eager) writes its result into a fresh
# buffer of its own instead of one per operation: two [T, *rest] buffers where the
# general rules below make four, the same operations on the same values in the same
# order (bit for bit). Multi-MiB buffers are fresh pages at every call under glibc's
# defaults (docs/benchmarks-method.md).


def _first_order_softmax(grad: Tensor, out: Tensor, gathered: Tensor) -> Tensor:
    """``out * (grad - gathered)`` in ``gathered``'s fresh buffer."""
    return torch.sub(grad, gathered, out=gathered).mul_(out)


def _first_order_log_softmax(grad: Tensor, out: Tensor, gathered: Tensor) -> Tensor:
    """``grad - exp(out) * gathered`` in ``exp(out)``'s buffer."""
    scaled = torch.exp(out).mul_(gathered)
    return torch.sub(grad, scaled, out=scaled)


class _SegmentSoftmax(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        values: Tensor, segments: Tensor, num_segments: int, bounds: Tensor | None
    ) -> Tensor:
        return _softmax_forward(values, segments, num_segments, bounds)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, segments, num_segments, bounds = inputs
        ctx.save_for_backward(output, segments)
        ctx.num_segments = num_segments
        ctx.bounds = bounds  # host-side sample bounds (never batched): not a saved tensor

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out, segments = ctx.saved_tensors
        bounds = ctx.bounds
        # a first-order backward (no graph to record) takes torch's fused kernel per segment
        host = None if torch.is_grad_enabled() else _per_segment(out, ctx.num_segments, bounds)
        if host is not None:
            grad = grad.contiguous()
            result = torch.empty_like(out, memory_format=torch.contiguous_format)
            for start, stop in itertools.pairwise(host):
                if stop > start:
                    torch._softmax_backward_data(
                        grad[start:stop],
                        out[start:stop],
                        0,
                        out.dtype,
                        grad_input=result[start:stop],
                    )
            return result, None, None, None
        inner = segment_sum(grad * out, segments, ctx.num_segments)
        if not torch.is_grad_enabled() and plain_eager():
            return _first_order_softmax(grad, out, broadcast(inner, segments)), None, None, None
        return out * (grad - broadcast(inner, segments)), None, None, None


class _SegmentSoftmaxJvp(_SegmentSoftmax):
    """With the forward-mode rule ``y * (t - sum(t * y))`` (eager calls; see ``_forward``)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _SegmentSoftmax.setup_context(ctx, inputs, output)
        ctx.save_for_forward(output, inputs[1])

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, *_: None) -> Tensor:
        out, segments = ctx.saved_tensors
        inner = segment_sum(tangent * out, segments, ctx.num_segments)
        return out * (tangent - broadcast(inner, segments))


class _SegmentLogSoftmax(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
        return _log_softmax(values, segments, num_segments)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, segments, num_segments = inputs
        ctx.save_for_backward(output, segments)
        ctx.num_segments = num_segments

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        out, segments = ctx.saved_tensors
        total = segment_sum(grad, segments, ctx.num_segments)
        if not torch.is_grad_enabled() and plain_eager():
            return _first_order_log_softmax(grad, out, broadcast(total, segments)), None, None
        return grad - torch.exp(out) * broadcast(total, segments), None, None


class _SegmentLogSoftmaxJvp(_SegmentLogSoftmax):
    """With the forward-mode rule ``t - sum(exp(y) * t)`` (eager calls)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _SegmentLogSoftmax.setup_context(ctx, inputs, output)
        ctx.save_for_forward(output, inputs[1])

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, *_: None) -> Tensor:
        out, segments = ctx.saved_tensors
        total = segment_sum(torch.exp(out) * tangent, segments, ctx.num_segments)
        return tangent - broadcast(total, segments)


def segment_softmax(
    values: Tensor, segments: Tensor, num_segments: int, bounds: Tensor | None = None
) -> Tensor:
    """Softmax over the rows of each segment, elementwise in the trailing axes.

    Args:
        values: ``[T, *rest]`` floating point.
        segments: ``[T]`` int64 segment of every packed row (any order).
        num_segments: ``S``, an upper bound on the segment ids.
        bounds: optional ``[S + 1]`` int64 when the segments are sorted runs: segment
            ``s`` is the rows ``bounds[s]:bounds[s + 1]``, within ``[0, T]`` (as
            :func:`raggedfn._index.segment_bounds` gives them, never raw user offsets).
            Lets small CPU inputs reduce with ``torch.segment_reduce``.

    Returns:
        ``[T, *rest]``; an empty segment has no rows, so nothing to normalise.
    """
    return call(
        _SegmentSoftmaxJvp, _SegmentSoftmax, _softmax, values, segments, num_segments, bounds
    )


def segment_log_softmax(values: Tensor, segments: Tensor, num_segments: int) -> Tensor:
    """Log-softmax over the rows of each segment; see :func:`segment_softmax`."""
    return call(
        _SegmentLogSoftmaxJvp, _SegmentLogSoftmax, _log_softmax, values, segments, num_segments
    )


def segment_logsumexp(
    values: Tensor, segments: Tensor, num_segments: int, dims: tuple[int, ...] = ()
) -> Tensor:
    """``log(sum(exp(values)))`` of each segment, stabilised; ``[S, *rest]``.

    With ``dims`` (axes of ``values`` after the leading one) the sum also runs over
    those axes, kept with size 1: one shift (the max over everything reduced) and one
    sum, as ``torch.logsumexp`` over all the axes at once. Two stages (a logsumexp of
    each row, then of the rows) would give the same value but a NaN slope where a row's
    partial result is ``+inf`` and its cotangent 0, where torch's is 0.

    As ``torch.logsumexp`` (and so as the per-sample loop it stands for): a
    segment whose rows are all ``-inf`` gives ``-inf`` and its gradient is
    ``softmax`` of those rows, ``exp(-inf - -inf)``, which is NaN (0/0, as in
    torch and as :func:`segment_softmax` of the same rows). A segment without
    rows also gives ``-inf``, but it has no rows to differentiate: its log is
    taken behind a ``where``, so that no derivative of any order is NaN there.
    """
    shift = _shift(values, segments, num_segments, dims)
    exp = torch.exp(values - broadcast(shift, segments))
    if dims:
        exp = exp.sum(dims, keepdim=True)
    total = segment_sum(exp, segments, num_segments)
    counts = segment_counts(segments, num_segments).view(-1, *[1] * (total.ndim - 1))
    present = (counts > 0).expand_as(total)
    safe = torch.where(present, total, torch.ones_like(total))
    log = torch.where(present, torch.log(safe), torch.full_like(total, float("-inf")))
    return log + shift


# ----- softmax over the last axis of per-sample blocks ------------------------------------


def _views(t: Tensor, blocks: tuple[tuple[int, int, int], ...]) -> list[Tensor]:
    """``t[start:stop]`` as ``[rows, cols, *rest]`` for every non-empty block."""
    rest = t.shape[1:]
    return [t[a:b].view(rows, (b - a) // rows, *rest) for a, b, rows in blocks if b > a]


class _BlockSoftmax(torch.autograd.Function):
    """Softmax over axis 1 of every block ``values[start:stop].view(rows, cols, *rest)``:
    torch's fused kernel once per block, forward and first-order backward."""

    @staticmethod
    def forward(values: Tensor, blocks: tuple[tuple[int, int, int], ...]) -> Tensor:
        values = values.contiguous()
        out = torch.empty_like(values)
        for v, o in zip(_views(values, blocks), _views(out, blocks), strict=True):
            torch._softmax(v, 1, False, out=o)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.save_for_backward(output)
        ctx.blocks = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (out,) = ctx.saved_tensors
        grad = grad.contiguous()
        pairs = zip(_views(grad, ctx.blocks), _views(out, ctx.blocks), strict=True)
        if torch.is_grad_enabled():  # a graph to record: differentiable ops per block
            pieces = [y * (g - (g * y).sum(1, keepdim=True)) for g, y in pairs]
            if not pieces:
                return grad * out, None
            return torch.cat([p.reshape(-1, *out.shape[1:]) for p in pieces]), None
        result = torch.empty_like(out)
        for (g, y), r in zip(pairs, _views(result, ctx.blocks), strict=True):
            torch._softmax_backward_data(g, y, 1, out.dtype, grad_input=r)
        return result, None


def block_softmax(values: Tensor, blocks: tuple[tuple[int, int, int], ...]) -> Tensor:
    """Softmax over the second axis of blocks of packed rows, eagerly (outside
    ``torch.compile``, ``torch.func`` transforms and forward mode: callers take
    :func:`segment_softmax` there).

    Args:
        values: ``[T, *rest]`` floating point.
        blocks: host ``(start, stop, rows)`` per block, covering ``[0, T)`` in order;
            block rows ``start:stop`` are a row-major ``[rows, cols, *rest]`` array
            (``cols = (stop - start) // rows``), normalised along ``cols``: a pair
            state ``[N_q, N_k]`` of one sample over its keys, one kernel per sample
            where the segment form takes about seven passes over all rows.

    Returns:
        ``[T, *rest]``.
    """
    return _BlockSoftmax.apply(values, blocks)
