"""Padded conversions: ``from_padded``, ``to_padded`` and ``mask``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._construct_checks import as_index, non_negative, ragged_positions
from ._construct_nested import nested_extents, nested_mask, nested_to_padded
from ._errors import describe, fail, shape_text
from ._index import coordinates, offsets_of
from ._interop import padded_rows_where
from ._layout import Layout
from ._ragged import Ragged


def from_padded(
    padded: Tensor,
    lengths_or_sizes: Any = None,
    ragged_dims: int | Sequence[int] = (1,),
    *,
    mask: Tensor | None = None,
) -> Ragged:
    """Take the real elements out of a padded ``[B, *max logical shape]`` tensor.

    Give either the sizes (each sample's elements sit at the start of every
    ragged axis) or a ``mask`` over one ragged axis, such as a Hugging Face
    ``attention_mask``: then the rows where the mask is set are kept, in order,
    whichever side the padding is on.

    Args:
        padded: ``[B, ...]`` padded batch.
        lengths_or_sizes: ``[B]`` lengths (one ragged axis) or ``[B, R]`` sizes,
            columns in the order of ``ragged_dims``.
        ragged_dims: the logical axes of ``padded`` that are ragged.
        mask: bool or 0/1 integer ``[B, L]``, ``L`` the size of ``padded`` along
            the one ragged axis; instead of ``lengths_or_sizes``.

    Returns:
        ``Ragged`` of logical shape ``(B, *sample shape)`` with the ragged axes
        marked ``None``; its values are a copy.

    Raises:
        RaggedError: neither or both of ``lengths_or_sizes`` and ``mask``; sizes
            negative or beyond ``padded``; a mask of another shape or device, a
            float mask, an integer mask with values other than 0 and 1, or a mask
            with several ragged axes.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_padded(torch.arange(6.0).reshape(2, 3), torch.tensor([1, 3]))
        >>> x.values.tolist()
        [0.0, 3.0, 4.0, 5.0]
        >>> left = torch.tensor([[0, 0, 7], [4, 5, 6]])  # left-padded token ids
        >>> attention_mask = torch.tensor([[0, 0, 1], [1, 1, 1]])
        >>> y = raggedfn.from_padded(left, mask=attention_mask)
        >>> y.values.tolist(), y.lengths.tolist()
        ([7, 4, 5, 6], [1, 3])
    """
    fn = "from_padded"
    if not isinstance(padded, Tensor) or padded.ndim < 2:
        raise fail(
            fn,
            f"padded must be a [B, ...] tensor with at least one sample axis, got {describe(padded)}",
        )
    if (lengths_or_sizes is None) == (mask is None):
        raise fail(
            fn,
            "give exactly one of lengths_or_sizes and mask, got "
            + ("both" if mask is not None else "neither"),
        )
    if mask is not None:
        positions = ragged_positions(fn, ragged_dims, padded.ndim - 1)
        if len(positions) != 1:
            raise fail(
                fn,
                f"a mask selects along one ragged axis, got ragged_dims {ragged_dims}; "
                "give sizes for several ragged axes",
            )
        return padded_rows_where(padded, mask, positions[0])
    sizes = as_index(fn, "lengths_or_sizes", lengths_or_sizes, padded.device)
    if sizes.ndim == 1:
        sizes = sizes.unsqueeze(1)
    rank = padded.ndim - 1
    positions = ragged_positions(fn, ragged_dims, rank)
    if sizes.ndim != 2 or sizes.shape[0] != padded.shape[0] or sizes.shape[1] != len(positions):
        raise fail(
            fn,
            f"lengths_or_sizes must be [B] or [B, R] = [{padded.shape[0]}, {len(positions)}], "
            f"got {describe(sizes)}",
        )
    non_negative(fn, "lengths_or_sizes", sizes)
    for k, a in enumerate(positions):
        if sizes.shape[0] and int(sizes[:, k].max()) > padded.shape[1 + a]:
            raise fail(
                fn,
                f"sizes along axis {1 + a} reach {int(sizes[:, k].max())} but padded has only "
                f"{padded.shape[1 + a]} there (shape {shape_text(padded.shape)})",
            )
    layout = Layout.from_ragged_positions(rank, positions)
    offsets = offsets_of(sizes.prod(dim=1))
    total = int(offsets[-1])
    physical = padded.permute(0, *(1 + p for p in layout.logical_to_physical()))
    segments, coords = coordinates(offsets, sizes, total)
    values = physical[(segments, *coords)]
    return Ragged(values, offsets, sizes, layout)


def max_sizes(x: Ragged) -> list[int]:
    if x.batch_size == 0:
        return [0] * x.num_ragged
    return [int(s) for s in x.sizes.amax(dim=0).tolist()]


def to_padded(x: Ragged, fill: float = 0.0, shape: Sequence[int] | None = None) -> Tensor:
    """A padded ``[B, *max logical shape]`` tensor with ``fill`` outside each sample.

    Args:
        x: the ragged value.
        fill: value of the padding.
        shape: the padded shape to produce (logical order, batch first); each
            ragged extent must be at least the largest sample's.

    Returns:
        ``[B, *max logical shape]`` tensor (or ``shape``) in logical axis order.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``shape`` with the wrong number of
            entries, another batch size, a ragged extent smaller than the largest sample, or
            another dense size.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0]), torch.tensor([2.0, 3.0])])
        >>> raggedfn.to_padded(x, fill=-1.0).tolist()
        [[1.0, -1.0], [2.0, 3.0]]
    """
    fn = "to_padded"
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    layout = x.layout
    dense = tuple(x.values.shape[1:])
    extents = nested_extents(x) if x.row_offsets else max_sizes(x)
    if shape is not None:
        shape = tuple(int(s) for s in shape)
        if len(shape) != x.ndim:
            raise fail(
                fn,
                f"shape {shape} must have {x.ndim} entries (logical shape {shape_text(x.shape)})",
            )
        if shape[0] != x.batch_size:
            raise fail(fn, f"shape {shape} must start with the batch size {x.batch_size}")
        for p, a in enumerate(layout.axes):
            want = shape[1 + p]
            if a.ragged:
                if want < extents[a.index]:
                    raise fail(
                        fn,
                        f"shape {shape} has {want} along ragged axis {1 + p} but a sample has "
                        f"{extents[a.index]} there",
                    )
                extents[a.index] = want
            elif want != dense[a.index]:
                raise fail(
                    fn,
                    f"shape {shape} has {want} along dense axis {1 + p}, expected {dense[a.index]}",
                )
    if x.row_offsets:
        return nested_to_padded(x, fill, extents)
    total = x.values.shape[0]
    segments, coords = coordinates(x.offsets, x.sizes, total)
    physical = x.values.new_full((x.batch_size, *extents, *dense), fill)
    physical = physical.index_put((segments, *coords), x.values)
    return physical.permute(0, *(1 + p for p in layout.physical_to_logical()))


def mask(x: Ragged) -> Tensor:
    """Bool ``[B, *max ragged sizes]`` (ragged axes in logical order), True on real elements.

    Args:
        x: the ragged value.

    Returns:
        bool ``[B, *max ragged sizes]``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value.

    Examples:
        >>> import torch, raggedfn
        >>> raggedfn.mask(raggedfn.from_lengths(torch.zeros(3), torch.tensor([1, 2]))).tolist()
        [[True, False], [True, True]]
    """
    if not isinstance(x, Ragged):
        raise fail("mask", f"x must be a Ragged value, got {describe(x)}")
    if x.row_offsets:
        return nested_mask(x)
    extents = max_sizes(x)
    ragged = [a.index for a in x.layout.axes if a.ragged]
    out = torch.ones(x.batch_size, *(1 for _ in ragged), dtype=torch.bool, device=x.device)
    for p, k in enumerate(ragged):
        shape = [x.batch_size] + [1] * len(ragged)
        shape[1 + p] = extents[k]
        inside = torch.arange(extents[k], device=x.device).unsqueeze(0) < x.sizes[:, k : k + 1]
        out = out & inside.reshape(shape)
    return out
