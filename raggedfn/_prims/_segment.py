"""Segment sums, broadcasts and padding (means: ``_mean``; running sums: ``_cumsum``).

Everything here is a plain composite of differentiable torch ops: autograd,
``torch.func`` (grad, vjp, jacrev, jacfwd, vmap) and ``torch.compile`` derive
the rules, and each derived backward is again differentiable.

Conventions shared by every primitive in ``raggedfn._prims``:

* ``values`` is ``[T, *rest]``: one packed row per leading index.
* ``segments`` is ``[T]`` int64: the output row of each packed row, in
  ``[0, num_segments)``, in any order (not necessarily sorted or contiguous).
* ``num_segments`` (``S``) is a Python int (or SymInt), so output shapes are
  static: nothing reads tensor data on the host.
* Segments without rows are legal: sum 0, mean NaN (``_mean``), product 1 (``_prod``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._forward import compiled_transform, plain_eager


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
    if plain_eager():
        # into the fresh zeros: the out-of-place index_add would copy them first
        return zeros.index_add_(0, segments, values)
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
