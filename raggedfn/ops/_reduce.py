"""Reductions over logical axes: sum, mean, amax, amin, argmax, argmin, ...

Axes are logical (batch = 0, negative allowed), ragged or dense, one or a
tuple. ``dim=None`` reduces everything into a 0-d tensor, like torch; the
batch axis can only be reduced that way. Removing the last ragged axis gives a
dense ``[B, ...]`` tensor; otherwise the result is a ``Ragged`` with the other
axes in their order. With ``keepdim`` a reduced ragged axis becomes a dense
axis of size 1 at its logical position.

Empty samples (DESIGN §4): sum 0, prod 1, mean/var/std NaN, amax/amin the
identity (-inf/+inf, the dtype's extremes for integers), argmax/argmin -1,
logsumexp -inf, all True, any False, norm 0 (+inf for ``p=-inf``).
Gradients through them are finite; in forward mode the mean of an empty
sample has a NaN tangent, as ``torch.mean`` of an empty tensor.

Reducing one of two ragged axes (an ``(N*, M*)`` sample) reads the number of
output rows on the host once, since it depends on the data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .._errors import fail
from .._index import segment_ids
from .._prims import (
    broadcast,
    segment_logsumexp,
    segment_mean,
    segment_prod,
    segment_sum,
)
from .._ragged import Ragged
from ._reduce_extrema import _extremum, _size, amax, amin, argmax, argmin
from ._reduce_plan import (
    apply,
    finish,
    full_result,
    integer_sum_dtype,
    map_result,
    plan,
    reduced_axes,
    require_ragged,
    whole_samples,
)

Dim = int | Sequence[int] | None
Result = Ragged | Tensor

__all__ = [
    "all",
    "amax",
    "amin",
    "any",
    "argmax",
    "argmin",
    "logsumexp",
    "mean",
    "norm",
    "prod",
    "std",
    "sum",
    "var",
]


def _sum_op(values: Tensor, dims: tuple[int, ...]) -> Tensor:
    return values.sum(dims, keepdim=True)


def _segment_sum(values: Tensor, segments: Tensor, num: int, _counts: Tensor) -> Tensor:
    return segment_sum(values, segments, num)


def _require_float(fn: str, x: Ragged) -> None:
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise fail(fn, f"x must have a floating point or complex dtype, got {x.dtype}")


def sum(
    x: Ragged, dim: Dim = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> Result:
    """Sum over logical axes; an empty sample sums to 0.

    Args:
        x: a ``Ragged`` value.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        keepdim: keep reduced axes with size 1.
        dtype: cast to this dtype first (integers and bool sum as int64).

    Returns:
        A ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(0, 3)])
        >>> raggedfn.sum(x, 1)
        tensor([[2., 2., 2.],
                [0., 0., 0.]])
    """
    x = require_ragged(x, "sum")
    if dtype is None and whole_samples(x, dim, keepdim) and x.values.is_floating_point():
        # the sum of each sample's rows, as the general path below computes it, without
        # its planning: a value with one ragged axis summed over it, to a dense result
        return segment_sum(x.values, segment_ids(x.offsets, x.values.shape[0]), x.batch_size)
    axes = reduced_axes(x, dim, "sum")
    values = integer_sum_dtype(x.values, dtype)
    if axes is None:
        return full_result(x, values.sum(), keepdim)
    p = plan(x, axes)
    return finish(x, p, apply(p, values, _sum_op, _segment_sum), keepdim)


def mean(
    x: Ragged, dim: Dim = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> Result:
    """Mean over logical axes; an empty sample has mean NaN (as torch).

    Args:
        x: a floating point ``Ragged`` value (or pass ``dtype``).
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        keepdim: keep reduced axes with size 1.
        dtype: cast to this dtype first.

    Returns:
        A ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated; ``x`` is not floating point (or complex).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 3.0]), torch.tensor([2.0])])
        >>> raggedfn.mean(x, 1)
        tensor([2., 2.])
    """
    x = require_ragged(x, "mean")
    if dtype is not None:
        x = x.with_values(x.values.to(dtype))
    _require_float("mean", x)
    axes = reduced_axes(x, dim, "mean")
    if axes is None:
        return full_result(x, x.values.mean(), keepdim)
    p = plan(x, axes)

    def dense(values: Tensor, dims: tuple[int, ...]) -> Tensor:
        return values.mean(dims, keepdim=True)

    return finish(x, p, apply(p, x.values, dense, segment_mean), keepdim)


def logsumexp(x: Ragged, dim: Dim = None, keepdim: bool = False) -> Result:
    """``log(sum(exp(x)))`` over logical axes, stabilised; -inf for an empty sample.

    Args:
        x: a floating point ``Ragged`` value.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        keepdim: keep reduced axes with size 1.

    Returns:
        A ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated; ``x`` is not floating point (or complex).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2), torch.zeros(0)])
        >>> raggedfn.logsumexp(x, 1)
        tensor([0.6931,   -inf])
    """
    x = require_ragged(x, "logsumexp")
    _require_float("logsumexp", x)
    axes = reduced_axes(x, dim, "logsumexp")
    if axes is None:
        return full_result(x, torch.logsumexp(x.values.reshape(-1), 0), keepdim)
    p = plan(x, axes)
    if p.segments is None:
        return finish(x, p, _dense_logsumexp(x.values, p.dense_dims), keepdim)
    # dense and ragged axes in one pass: one shift and one sum (see segment_logsumexp)
    out = segment_logsumexp(x.values, p.segments, p.num_segments, p.dense_dims)
    return finish(x, p, out, keepdim)


def _dense_logsumexp(values: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``torch.logsumexp(values, dims, keepdim=True)`` with a finite gradient for a line that
    is -inf throughout (torch's is NaN there: exp(-inf - -inf))."""
    if _size(values, dims) == 0:
        return torch.logsumexp(values, dims, keepdim=True)
    # the max of the finite entries (see _prims._softmax._shift): with a +inf entry the
    # others' exp cannot overflow, so their slope is 0 as torch's
    finite = values.detach().nan_to_num(nan=-math.inf, posinf=-math.inf)
    shift = finite.amax(dims, keepdim=True).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    total = torch.exp(values - shift).sum(dims, keepdim=True)
    present = total != 0  # a NaN entry's NaN total is kept (total > 0 would make it -inf)
    safe = torch.where(present, total, torch.ones_like(total))
    return torch.where(present, torch.log(safe), float("-inf")) + shift


def prod(
    x: Ragged, dim: Dim = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> Result:
    """Product over logical axes; an empty sample gives 1.

    Args:
        x: a ``Ragged`` value.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        keepdim: keep reduced axes with size 1.
        dtype: cast to this dtype first (integers and bool multiply as int64).

    Returns:
        A ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated; forward-mode AD inside ``torch.compile`` (torch 2.13 gives the
            segmented product a zero forward derivative there).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([2.0, 3.0]), torch.tensor([])])
        >>> raggedfn.prod(x, 1)
        tensor([6., 1.])
    """
    x = require_ragged(x, "prod")
    axes = reduced_axes(x, dim, "prod")
    values = integer_sum_dtype(x.values, dtype)
    if axes is None:
        return full_result(x, values.prod(), keepdim)
    p = plan(x, axes)

    def dense(v: Tensor, dims: tuple[int, ...]) -> Tensor:
        for d in dims:
            v = v.prod(d, keepdim=True)
        return v

    def segment(v: Tensor, segments: Tensor, num: int, _counts: Tensor) -> Tensor:
        return segment_prod(v, segments, num)

    return finish(x, p, apply(p, values, dense, segment), keepdim)


def _spread(fn: str, x: Ragged, dim: Dim, correction: float, keepdim: bool, root: bool) -> Result:
    """var (or std, ``root``) accumulated in float64 below float64, as torch's CPU var/std:
    squares of values below ~1e-19 (subnormals among them) vanish in float32, and the
    result rounds only once."""
    x = require_ragged(x, fn)
    _require_float(fn, x)
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = x.with_values(x.values.to(torch.float64))
    result = _moment(fn, x, dim, correction, keepdim, root)
    return result if x.dtype == dtype else map_result(result, lambda v: v.to(dtype))


def _moment(
    fn: str, x: Ragged, dim: Dim, correction: float, keepdim: bool, root: bool = False
) -> Result:
    axes = reduced_axes(x, dim, fn)
    values = x.values
    if axes is None:
        flat = values.reshape(-1, 1)
        count = torch.full((1, 1), flat.shape[0], dtype=flat.dtype, device=flat.device)
        total = flat.sum(0, keepdim=True)
        mean = _safe_divide(total, count)
        centered = flat - mean
        squares = (centered * centered.conj()).real.sum(0, keepdim=True)
        return full_result(x, _variance(squares, count, correction, root).reshape(()), keepdim)
    p = plan(x, axes)
    per_row = _size(values, p.dense_dims)
    total = apply(p, values, _sum_op, _segment_sum)
    if p.counts is None:
        count = torch.full((1,) * total.ndim, per_row, dtype=total.dtype, device=total.device)
    else:
        count = (p.counts * per_row).to(total.dtype).reshape(-1, *([1] * (total.ndim - 1)))
    mean = _safe_divide(total, count)
    centered = values - (mean if p.segments is None else broadcast(mean, p.segments))
    squares = apply(p, (centered * centered.conj()).real, _sum_op, _segment_sum)
    return finish(x, p, _variance(squares, count, correction, root), keepdim)


def _safe_divide(total: Tensor, count: Tensor) -> Tensor:
    """``total / count`` where ``count > 0`` (the rest is never read back into rows)."""
    return total / torch.where(count > 0, count, torch.ones_like(count))


def _variance(squares: Tensor, count: Tensor, correction: float, root: bool = False) -> Tensor:
    """``squares / (count - correction)`` (its square root with ``root``); NaN (0/0) or inf
    where that is <= 0, as torch, but as a constant there so that the gradient is 0
    instead of NaN."""
    dof = count - correction
    positive = dof > 0
    quotient = squares / torch.where(positive, dof, torch.ones_like(dof))
    if root:
        # behind the wheres: the tangent at an undefined variance is 0 (not 0 / sqrt(NaN)),
        # and at a zero variance (all-equal values) the gradient is 0 as torch.std's
        # (sqrt alone gives inf * 0 = NaN there); a NaN variance (an infinite input)
        # stays NaN, as torch.std's
        nonzero = positive & (quotient > 0)
        safe = torch.sqrt(torch.where(nonzero, quotient, torch.ones_like(quotient)))
        rest = torch.where(torch.isnan(quotient), quotient, torch.zeros_like(quotient))
        quotient = torch.where(nonzero, safe, rest)
    undefined = torch.where(squares.detach() > 0, float("inf"), float("nan")).to(quotient.dtype)
    return torch.where(positive, quotient, undefined)


def var(x: Ragged, dim: Dim = None, *, correction: float = 1, keepdim: bool = False) -> Result:
    """Variance over logical axes with ``correction`` (Bessel's by default).

    NaN where ``count - correction`` is 0 or less (an empty sample, a single
    element with ``correction=1``), as torch, but with a zero gradient there.

    Args:
        x: a floating point ``Ragged`` value.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        correction: subtracted from the element count in the denominator.
        keepdim: keep reduced axes with size 1.

    Returns:
        A ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated; ``x`` is not floating point (or complex).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0, 2.0])])
        >>> raggedfn.var(x, 1)
        tensor([2., 0.])
    """
    return _spread("var", x, dim, correction, keepdim, root=False)


def std(x: Ragged, dim: Dim = None, *, correction: float = 1, keepdim: bool = False) -> Result:
    """Standard deviation over logical axes: ``sqrt(var(...))``; see :func:`var`.

    Args:
        x: a floating point ``Ragged`` value.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        correction: subtracted from the element count in the denominator.
        keepdim: keep reduced axes with size 1.

    Returns:
        A ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated; ``x`` is not floating point (or complex).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0])])
        >>> raggedfn.std(x, 1, correction=0)
        tensor([1., 0.])
    """
    return _spread("std", x, dim, correction, keepdim, root=True)


def _logical(fn: str, x: Ragged, dim: Dim, keepdim: bool, every: bool) -> Result:
    x = require_ragged(x, fn)
    axes = reduced_axes(x, dim, fn)
    values = x.values.to(torch.bool)
    if axes is None:
        return full_result(x, values.all() if every else values.any(), keepdim)
    p = plan(x, axes)
    # Count the rows that break the rule (false for all, true for any).
    counted = (~values if every else values).to(torch.int64)
    reduced = apply(p, counted, _sum_op, _segment_sum)
    return finish(x, p, reduced == 0 if every else reduced > 0, keepdim)


def all(x: Ragged, dim: Dim = None, keepdim: bool = False) -> Result:
    """Whether every element is nonzero along logical axes; True for an empty sample.

    Args:
        x: a ``Ragged`` value.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        keepdim: keep reduced axes with size 1.

    Returns:
        Bool; a ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1, 0]), torch.tensor([], dtype=torch.int64)])
        >>> raggedfn.all(x, 1)
        tensor([False,  True])
    """
    return _logical("all", x, dim, keepdim, True)


def any(x: Ragged, dim: Dim = None, keepdim: bool = False) -> Result:
    """Whether some element is nonzero along logical axes; False for an empty sample.

    Args:
        x: a ``Ragged`` value.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        keepdim: keep reduced axes with size 1.

    Returns:
        Bool; a ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1, 0]), torch.tensor([], dtype=torch.int64)])
        >>> raggedfn.any(x, 1)
        tensor([ True, False])
    """
    return _logical("any", x, dim, keepdim, False)


def norm(x: Ragged, p: float | str = 2, dim: Dim = None, keepdim: bool = False) -> Result:
    """Vector p-norm over logical axes (``torch.norm``'s argument order).

    ``p`` may be any float, ``inf``, ``-inf``, 0 (count of nonzeros) or
    ``"fro"`` (2). An empty sample has norm 0 (+inf for ``p=-inf``); the
    gradient at a zero vector is 0, as ``torch.linalg.vector_norm``.

    Args:
        x: a floating point ``Ragged`` value.
        p: the order of the norm.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        keepdim: keep reduced axes with size 1.

    Returns:
        A ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated; ``x`` is not floating point (or complex); ``p`` is not a number,
            ``inf``, ``-inf`` or ``'fro'``.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([3.0, 4.0]), torch.tensor([])])
        >>> raggedfn.norm(x, 2, 1)
        tensor([5., 0.])
    """
    x = require_ragged(x, "norm")
    _require_float("norm", x)
    if p == "fro":
        p = 2
    if isinstance(p, str) or isinstance(p, bool) or not isinstance(p, (int, float)):
        raise fail("norm", f"p must be a number, inf, -inf or 'fro', got {p!r}")
    magnitude = x.with_values(x.values.abs())
    if p == math.inf:
        return _norm_extremum(magnitude, dim, keepdim, largest=True)
    if p == -math.inf:
        return _norm_extremum(magnitude, dim, keepdim, largest=False)
    if p == 0:
        return sum(x.with_values((x.values != 0).to(magnitude.dtype)), dim, keepdim)
    powered = sum(magnitude.with_values(magnitude.values.pow(p)), dim, keepdim)

    def root(total: Tensor) -> Tensor:
        positive = total > 0
        safe = torch.where(positive, total, torch.ones_like(total))
        return torch.where(positive, safe.pow(1.0 / p), torch.zeros_like(total))

    return map_result(powered, root)


def _norm_extremum(magnitude: Ragged, dim: Dim, keepdim: bool, largest: bool) -> Result:
    result = _extremum("norm", magnitude, dim, keepdim, largest)
    if not largest:
        return result
    # Absolute values are >= 0, so the max norm of an empty sample is 0, not -inf.
    return map_result(result, lambda v: v.clamp(min=0))
