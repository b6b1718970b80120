"""Interop with packed-sequence conventions: masks, per-row sample ids and positions.

Hugging Face batches carry an ``attention_mask`` (``[B, L]``, 1 on real tokens, on
either padding side) and, on its padding-free path, packed ``position_ids``;
varlen attention kernels take ``cu_seqlens`` and per-token sequence ids
(``seq_idx``); PyG carries ``batch`` (graph id of every node) and ``ptr``
(offsets). Everything here is derived from a value's partitions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._axes import sample_axis
from ._errors import describe, fail
from ._index import coordinates
from ._index import segment_ids as _segment_ids
from ._layout import Layout
from ._nested import ancestors, parents, row_positions
from ._ragged import Ragged, like


def padded_rows_where(padded: Tensor, mask: Any, axis: int) -> Ragged:
    """``from_padded(padded, mask=mask)`` for one ragged sample axis ``axis`` (0-based).

    Every row of ``padded`` along ``axis`` whose ``mask`` entry is set is kept, in
    order, whatever side the padding is on (holes are allowed).
    """
    fn = "from_padded"
    if not isinstance(mask, Tensor):
        raise fail(fn, f"mask must be a bool or 0/1 integer tensor, got {describe(mask)}")
    if mask.is_floating_point() or mask.is_complex():
        raise fail(
            fn,
            f"mask must be a bool or 0/1 integer tensor, got {describe(mask)}; "
            "convert a float mask with mask > 0.5 (or mask.bool()) if that is what it means",
        )
    if mask.device != padded.device:
        raise fail(fn, f"mask must be on {padded.device} like padded, got {describe(mask)}")
    want = (padded.shape[0], padded.shape[1 + axis])
    if tuple(mask.shape) != want:
        raise fail(
            fn,
            f"mask must have shape [B, L] = {list(want)} (batch and ragged axis {1 + axis} of "
            f"padded, shape {tuple(padded.shape)}), got {describe(mask)}",
        )
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            b, i = (int(v) for v in bad.nonzero()[0])
            raise fail(
                fn,
                f"an integer mask must hold only 0 and 1, got mask[{b}, {i}] = {int(mask[b, i])}",
            )
        mask = mask != 0
    # ragged axis next to the batch axis, dense axes after it in logical order
    rows = padded.movedim(1 + axis, 1)[mask]
    lengths = mask.sum(dim=1)
    zero = torch.zeros(1, dtype=torch.int64, device=padded.device)
    offsets = torch.cat([zero, torch.cumsum(lengths, 0)])
    layout = Layout.from_ragged_positions(padded.ndim - 1, (axis,))
    return Ragged(rows, offsets, lengths.unsqueeze(1), layout)


def segment_ids(x: Ragged, dim: int | None = None) -> Tensor:
    """int64 ``[T]``: the index of the segment that owns each packed row of ``x.values``.

    By default the segment is the sample: PyG's ``batch`` vector and the per-token
    sequence index of packed attention kernels (``seq_idx``). It follows the
    partition of ``x``, so it works for any number of ragged axes: a row of a pair
    state ``(B, N*, N*, C)`` gets its sample's index too. With nested ragged axes,
    ``dim`` names one of them and the segment is the element of the axis above
    it, numbered across the batch: for graphs -> nodes -> incoming edges
    ``segment_ids(x, 2)`` is the (batch-wide) target node of every edge, for
    documents -> sentences -> tokens the sentence of every token. Computed on the
    device without a host sync; ``from_segment_ids`` and ``group_by`` go the
    other way.

    Args:
        x: a ``Ragged`` value with packed ``values [T, *dense]``.
        dim: a logical ragged axis; ``None`` (the default) or the first ragged axis
            gives the sample.

    Returns:
        int64 tensor ``[T]``, sorted: for samples, ``lengths[i]`` (rows of sample
        ``i``) entries equal to ``i``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is not a ragged axis,
            or is a later ragged axis of a value without nested axes.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.zeros(5, 8), [2, 0, 3])
        >>> raggedfn.segment_ids(x)
        tensor([0, 0, 2, 2, 2])
        >>> pairs = raggedfn.from_list([torch.zeros(1, 1), torch.zeros(2, 2)], ragged_dims=(1, 2))
        >>> raggedfn.segment_ids(pairs)
        tensor([0, 1, 1, 1, 1])
        >>> docs = raggedfn.from_nested_lengths(torch.zeros(5, 8), [[2, 1], [2, 0, 3]])
        >>> raggedfn.segment_ids(docs).tolist(), raggedfn.segment_ids(docs, 2).tolist()
        ([0, 0, 1, 1, 1], [0, 0, 2, 2, 2])
    """
    fn = "segment_ids"
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    if dim is not None:
        axis = sample_axis(x, dim, fn)
        if not axis.ragged:
            raise fail(
                fn, f"dim {dim} is a dense axis of logical shape {x.shape}; name a ragged axis"
            )
        if axis.index > 0:
            if not x.row_offsets:
                raise fail(
                    fn,
                    f"dim {dim} is ragged axis {axis.index} of a value without nested axes "
                    f"(logical shape {x.shape}): its rows belong to samples only; leave dim=None",
                )
            owners = parents(x.sizes, x.row_offsets, x.values.shape[0])
            return ancestors(owners, axis.index - 1)
    # a copy: the ops reuse (and must not see edits of) the ids remembered for the partition
    return _segment_ids(x.offsets, x.values.shape[0]).clone()


def positions(x: Ragged, dim: int | None = None) -> Ragged:
    """int64 ``Ragged`` of each element's index along a ragged axis: ``0..n_i - 1`` per sample.

    For token batches this is Hugging Face's packed ``position_ids`` (positions
    restart at 0 in every sequence), the input of position embeddings and RoPE on
    a padding-free batch.

    Args:
        x: a ``Ragged`` value, logical shape ``(B, N*, ...)`` or with several ragged
            axes (then ``dim`` is required).
        dim: the logical ragged axis to count along (negative allowed). Defaults to
            the only ragged axis.

    Returns:
        int64 ``Ragged`` with the ragged axes of ``x`` and no dense axes (shape
        ``(B, N*)`` for tokens, ``(B, N*, N*)`` for pair states), sharing the
        partitions of ``x``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is missing while ``x``
            has several ragged axes, is out of range, or names a dense axis.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.zeros(5, 8), [2, 3])
        >>> pos = raggedfn.positions(x)
        >>> pos.shape, pos.values.tolist()
        ((2, None), [0, 1, 0, 1, 2])
        >>> pairs = raggedfn.from_list([torch.zeros(2, 2, 4)], ragged_dims=(1, 2))
        >>> raggedfn.positions(pairs, dim=2).values.tolist()
        [0, 1, 0, 1]
    """
    fn = "positions"
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    if dim is None:
        if x.num_ragged != 1:
            raise fail(
                fn,
                f"x has {x.num_ragged} ragged axes (logical axes {x.ragged_dims}); "
                "pass dim= to say which one to count along",
            )
        axis = next(a for a in x.layout.axes if a.ragged)
    else:
        axis = sample_axis(x, dim, fn)
        if not axis.ragged:
            raise fail(
                fn,
                f"dim {dim} is a dense axis of logical shape {x.shape}; "
                f"positions count along a ragged axis {x.ragged_dims}",
            )
    total = x.values.shape[0]
    if x.row_offsets:
        along = row_positions(x.sizes, x.row_offsets, total, axis.index)
    else:
        along = coordinates(x.offsets, x.sizes, total)[1][axis.index]
    layout = Layout(tuple(a for a in x.layout.axes if a.ragged))
    return like(x, along, layout)
