"""Constructors from user data, conversions to padded/nested form, and ``check``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._construct_nested import (
    check_nested,
    from_nested_list,
    nested_extents,
    nested_mask,
    nested_to_padded,
)
from ._errors import describe, fail, shape_text
from ._index import coordinates, lengths_of, offsets_of
from ._interop import padded_rows_where
from ._layout import Layout
from ._ragged import Ragged
from ._validate import check_partition, check_structure, is_tracing

# ----- validation ---------------------------------------------------------------


def _as_index(fn: str, name: str, value: Any, device: torch.device | None = None) -> Tensor:
    """An int64 tensor from user data, refusing floats and bools.

    The result never aliases the caller's tensor: a value owns its partition, so a
    later in-place edit of the caller's lengths/offsets cannot change it.
    """
    if not isinstance(value, Tensor):
        try:
            value = torch.as_tensor(value)
        except Exception as error:
            raise fail(fn, f"{name} must be an integer tensor, got {describe(value)}") from error
        if value.numel() == 0:
            value = value.to(torch.int64)
        if device is not None:
            value = value.to(device)
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise fail(fn, f"{name} must have an integer dtype, got {describe(value)}")
    if device is not None and value.device != device:
        raise fail(fn, f"{name} must be on {device} like values, got {describe(value)}")
    return value.to(torch.int64, copy=True)


def _check_values(fn: str, values: Any) -> Tensor:
    if not isinstance(values, Tensor):
        raise fail(fn, f"values must be a tensor, got {describe(values)}")
    if values.ndim < 1:
        raise fail(fn, f"values must have a packed leading axis [T, ...], got {describe(values)}")
    return values


def _validate(fn: str, values: Tensor, offsets: Tensor, sizes: Tensor, layout: Layout) -> None:
    """Every invariant of a partition from user data (host sync eagerly, not for hot paths)."""
    check_structure(fn, values, offsets, sizes, layout)
    check_partition(fn, values, offsets, sizes)


def _non_negative(fn: str, name: str, sizes: Tensor) -> None:
    if is_tracing(sizes):
        torch._assert_async((sizes >= 0).all(), f"{fn}: {name} must be non-negative")
    elif bool((sizes < 0).any()):
        raise fail(fn, f"{name} must be non-negative, got {sizes.tolist()}")


def _check_products(fn: str, sizes: Tensor, total: int) -> None:
    """Refuse sizes whose product exceeds the packed rows (int64 products could wrap)."""
    if sizes.numel() == 0:
        return
    # float64 products cannot wrap; they are exact below 2**53, far above any real T
    products = sizes.to(torch.float64).prod(dim=1)
    if bool((products > total).any()):
        bad = int((products > total).nonzero()[0, 0])
        raise fail(
            fn,
            f"sample {bad} has sizes {sizes[bad].tolist()} whose product exceeds the "
            f"{total} packed rows of values",
        )


def _check_total(fn: str, name: str, sizes: Tensor, total: int) -> None:
    """The samples' element counts (products of ``sizes`` rows) must add up to ``total``."""
    if is_tracing(sizes):
        rows = sizes.to(torch.float64).prod(dim=1).sum()
        torch._assert_async(
            rows == total, f"{fn}: {name} must account for values.shape[0] packed rows in total"
        )
        return
    _check_products(fn, sizes, total)
    counted = int(sizes.prod(dim=1).sum()) if sizes.numel() else 0
    if counted != total:
        raise fail(
            fn, f"{name} account for {counted} packed rows in total but values.shape[0] = {total}"
        )


def _ragged_positions(fn: str, ragged_dims: Any, rank: int) -> tuple[int, ...]:
    """Sample positions (0-based) of the batched logical ``ragged_dims``."""
    if isinstance(ragged_dims, int):
        ragged_dims = (ragged_dims,)
    try:
        dims = tuple(ragged_dims)
    except TypeError as error:
        raise fail(
            fn, f"ragged_dims must be a tuple of ints, got {describe(ragged_dims)}"
        ) from error
    ndim = rank + 1
    out = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or not -ndim <= d < ndim:
            raise fail(
                fn,
                f"ragged_dims entry {d!r} is out of range for samples of rank {rank} (batched rank {ndim})",
            )
        d = d % ndim
        if d == 0:
            raise fail(fn, "ragged_dims cannot include the batch axis 0")
        out.append(d - 1)
    if len(set(out)) != len(out):
        raise fail(fn, f"ragged_dims {dims} repeat an axis")
    if not out:
        raise fail(fn, "ragged_dims must name at least one ragged axis")
    return tuple(sorted(out))


def check(x: Ragged) -> Ragged:
    """Validate every invariant of ``x``; returns ``x`` unchanged.

    Eagerly this reads the partition on the host (a sync). Under
    ``torch.compile`` the same checks become device-side assertions that raise
    ``RuntimeError`` with the same words when the graph runs.

    Args:
        x: the value to check.

    Returns:
        ``x`` itself.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; offsets that do not start at 0,
            decrease or do not end at ``values.shape[0]``; ``sizes`` not ``[B, R]``,
            negative, or whose products disagree with the offsets.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.zeros(5, 2), torch.tensor([2, 3]))
        >>> raggedfn.check(x) is x
        True
    """
    if not isinstance(x, Ragged):
        raise fail("check", f"x must be a Ragged value, got {describe(x)}")
    if x.row_offsets or x.layout.num_nested:
        check_nested("check", x)
        return x
    _validate("check", x.values, x.offsets, x.sizes, x.layout)
    return x


# ----- constructors -----------------------------------------------------------


def from_list(tensors: Sequence[Any], ragged_dims: int | Sequence[int] = (1,)) -> Ragged:
    """Pack a list of per-sample tensors (or of lists of tensors: nested levels).

    Args:
        tensors: ``B`` tensors of equal rank, one per sample; or ``B`` lists of
            tensors ``[L, *dense]`` (documents of sentences), or lists of such
            lists (one more level each). A ``Ragged`` sample counts as the list of
            its samples, so ``from_list(unbind(x))`` rebuilds ``x``.
        ragged_dims: logical axes of the batched result (batch = 0) that vary per
            sample; every other axis must agree across samples. Lists of tensors
            always give the ragged axes ``1 .. R`` (leave the default).

    Returns:
        ``Ragged`` of logical shape ``(B, *sample shape)`` with the ragged axes
        marked ``None``; for lists of tensors ``(B, None, None, *dense)``, the
        second ragged axis nested in the first.

    Raises:
        RaggedError: ``tensors`` is not a non-empty list of tensors; samples that differ in
            rank, dtype or device, or in size along an axis that is not ragged;
            ``ragged_dims`` out of range, repeated, empty or naming the batch axis.

    Examples:
        >>> import torch, raggedfn
        >>> pairs = raggedfn.from_list([torch.zeros(2, 2, 4), torch.zeros(3, 3, 4)], ragged_dims=(1, 2))
        >>> pairs.shape, pairs.sizes.tolist(), pairs.values.shape
        ((2, None, None, 4), [[2, 2], [3, 3]], torch.Size([13, 4]))
        >>> a, b, c = torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(1, 4)
        >>> docs = raggedfn.from_list([[a, b], [], [c]])   # documents of sentences of tokens
        >>> docs.shape, docs.sizes.tolist()
        ((3, None, None, 4), [[2, 5], [0, 0], [1, 1]])
    """
    fn = "from_list"
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise fail(fn, f"tensors must be a list of tensors, got {describe(tensors)}")
    if len(tensors) == 0:
        raise fail(
            fn,
            "tensors is an empty list, so the dtype and dense shape are unknown; "
            "use from_lengths(values, torch.zeros(0, dtype=torch.int64)) for an empty batch",
        )
    if any(isinstance(t, (list, tuple, Ragged)) for t in tensors):
        if ragged_dims not in ((1,), 1, [1]):
            raise fail(
                fn,
                f"lists of tensors give nested ragged axes 1, 2, ... in order; ragged_dims "
                f"{ragged_dims!r} cannot place them elsewhere (leave the default)",
            )
        return from_nested_list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise fail(fn, f"sample {i} must be a tensor, got {describe(t)}")
    first = tensors[0]
    rank = first.ndim
    positions = _ragged_positions(fn, ragged_dims, rank)
    dense_positions = tuple(a for a in range(rank) if a not in positions)
    for i, t in enumerate(tensors):
        if t.ndim != rank:
            raise fail(
                fn,
                f"sample {i} has rank {t.ndim} (shape {shape_text(t.shape)}), expected rank {rank} like sample 0",
            )
        if t.dtype != first.dtype:
            raise fail(fn, f"sample {i} has dtype {t.dtype}, expected {first.dtype} like sample 0")
        if t.device != first.device:
            raise fail(fn, f"sample {i} is on {t.device}, expected {first.device} like sample 0")
        for a in dense_positions:
            if t.shape[a] != first.shape[a]:
                raise fail(
                    fn,
                    f"sample {i} has size {t.shape[a]} along axis {a + 1}, which is not ragged; "
                    f"expected {first.shape[a]} like sample 0 (shapes {shape_text(first.shape)} and {shape_text(t.shape)})",
                )
    layout = Layout.from_ragged_positions(rank, positions)
    to_physical = layout.logical_to_physical()
    dense_shape = tuple(first.shape[a] for a in dense_positions)
    packed = [
        t.permute(to_physical).reshape(math.prod(t.shape[a] for a in positions), *dense_shape)
        for t in tensors
    ]
    values = torch.cat(packed) if len(packed) > 1 else packed[0].clone()
    sizes = torch.tensor([[t.shape[a] for a in positions] for t in tensors], dtype=torch.int64)
    sizes = sizes.to(first.device)
    offsets = offsets_of(sizes.prod(dim=1))
    return Ragged(values, offsets, sizes, layout)


def from_offsets(values: Tensor, offsets: Any) -> Ragged:
    """One ragged axis from packed ``values [T, *dense]`` and ``offsets [B + 1]``.

    Args:
        values: packed ``[T, *dense]`` rows (used as given, not copied).
        offsets: int64-able ``[B + 1]``; sample ``i`` owns ``values[offsets[i]:offsets[i + 1]]`` (copied).

    Returns:
        ``Ragged`` of logical shape ``(B, N*, *dense)``.

    Raises:
        RaggedError: ``values`` is not a tensor with a packed axis; ``offsets`` is not a 1-D
            integer tensor (floats and bools are refused), does not start at 0, decreases,
            or does not end at ``values.shape[0]``.

    Examples:
        >>> import torch, raggedfn
        >>> raggedfn.from_offsets(torch.arange(5.0), torch.tensor([0, 2, 5])).lengths.tolist()
        [2, 3]
    """
    fn = "from_offsets"
    values = _check_values(fn, values)
    offsets = _as_index(fn, "offsets", offsets, values.device)
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise fail(fn, f"offsets must be a 1-D [B + 1] tensor, got {describe(offsets)}")
    sizes = lengths_of(offsets).unsqueeze(1)
    layout = Layout.standard(1, values.ndim - 1)
    _validate(fn, values, offsets, sizes, layout)
    return Ragged(values, offsets, sizes, layout)


def from_lengths(values: Tensor, lengths: Any) -> Ragged:
    """One ragged axis from packed ``values [T, *dense]`` and ``lengths [B]``.

    Args:
        values: packed ``[T, *dense]`` rows (used as given, not copied).
        lengths: ``[B]`` rows of each sample, adding up to ``T``.

    Returns:
        ``Ragged`` of logical shape ``(B, N*, *dense)``.

    Raises:
        RaggedError: ``values`` is not a tensor with a packed axis; ``lengths`` is not a 1-D
            integer tensor, has a negative entry, or does not add up to ``values.shape[0]``.

    Examples:
        >>> import torch, raggedfn
        >>> raggedfn.from_lengths(torch.arange(5.0), torch.tensor([2, 0, 3])).offsets.tolist()
        [0, 2, 2, 5]
    """
    fn = "from_lengths"
    values = _check_values(fn, values)
    lengths = _as_index(fn, "lengths", lengths, values.device)
    if lengths.ndim != 1:
        raise fail(fn, f"lengths must be a 1-D [B] tensor, got {describe(lengths)}")
    sizes = lengths.unsqueeze(1)
    layout = Layout.standard(1, values.ndim - 1)
    if is_tracing(lengths) or not _lengths_add_up(lengths, values.shape[0]):
        # graph assertions while tracing; eagerly, the check that fails raises its message
        _non_negative(fn, "lengths", lengths)
        _check_total(fn, "lengths", sizes, values.shape[0])
        offsets = offsets_of(lengths)
        _validate(fn, values, offsets, sizes, layout)
        return Ragged(values, offsets, sizes, layout)
    # non-negative lengths adding up to T: the offsets below are a valid partition by
    # construction, so check_partition (four more host reads) has nothing left to find
    return Ragged(values, offsets_of(lengths), sizes, layout)


def _lengths_add_up(lengths: Tensor, total: int) -> bool:
    """Every length is non-negative and they add up to ``total``, in one host read.

    The float64 sum cannot wrap around like an int64 one; it is exact while the
    running sums stay below 2**53, and once one passes it the sum cannot round
    back down to a ``total`` below it.
    """
    adds_up = lengths.to(torch.float64).sum() == total
    return bool((adds_up & (lengths >= 0).all()).item())


def from_sizes(
    values: Tensor, sizes: Any, ragged_dims: int | Sequence[int] | None = None
) -> Ragged:
    """Several ragged axes from packed ``values [T, *dense]`` and ``sizes [B, R]``.

    Each sample's ragged axes are stored row-major in the packed axis, in the
    order of ``sizes``' columns. ``ragged_dims`` (default ``(1, ..., R)``) places
    them among the logical axes; dense axes fill the rest in storage order.

    Args:
        values: packed ``[T, *dense]`` rows (used as given, not copied).
        sizes: ``[B, R]`` (or ``[B]`` for ``R = 1``) size of each sample along each ragged axis.
        ragged_dims: the logical axes (batch = 0) of the ragged axes, in the order of ``sizes``' columns.

    Returns:
        ``Ragged`` with ``R`` ragged axes.

    Raises:
        RaggedError: ``values`` is not a tensor with a packed axis; ``sizes`` is not an
            integer ``[B, R]`` tensor, has a negative entry, or its row products do not add
            up to ``values.shape[0]``; ``ragged_dims`` names another number of axes than
            ``R``.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_sizes(torch.zeros(13, 4), torch.tensor([[2, 2], [3, 3]]))
        >>> x.shape, x.offsets.tolist()
        ((2, None, None, 4), [0, 4, 13])
    """
    fn = "from_sizes"
    values = _check_values(fn, values)
    sizes = _as_index(fn, "sizes", sizes, values.device)
    if sizes.ndim == 1:
        raise fail(
            fn,
            f"expected sizes of shape [B, R], got {describe(sizes)}; for one ragged axis "
            "pass lengths.unsqueeze(1) or use from_lengths(values, lengths)",
        )
    if sizes.ndim != 2 or sizes.shape[1] < 1:
        raise fail(fn, f"sizes must be a [B, R] tensor with R >= 1, got {describe(sizes)}")
    num_ragged = sizes.shape[1]
    rank = num_ragged + values.ndim - 1
    if ragged_dims is None:
        ragged_dims = tuple(range(1, num_ragged + 1))
    positions = _ragged_positions(fn, ragged_dims, rank)
    if len(positions) != num_ragged:
        raise fail(
            fn,
            f"ragged_dims {ragged_dims} name {len(positions)} axes but sizes has R = {num_ragged} columns",
        )
    _non_negative(fn, "sizes", sizes)
    _check_total(fn, "sizes", sizes, values.shape[0])
    offsets = offsets_of(sizes.prod(dim=1))
    layout = Layout.from_ragged_positions(rank, positions)
    _validate(fn, values, offsets, sizes, layout)
    return Ragged(values, offsets, sizes, layout)


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
        positions = _ragged_positions(fn, ragged_dims, padded.ndim - 1)
        if len(positions) != 1:
            raise fail(
                fn,
                f"a mask selects along one ragged axis, got ragged_dims {ragged_dims}; "
                "give sizes for several ragged axes",
            )
        return padded_rows_where(padded, mask, positions[0])
    sizes = _as_index(fn, "lengths_or_sizes", lengths_or_sizes, padded.device)
    if sizes.ndim == 1:
        sizes = sizes.unsqueeze(1)
    rank = padded.ndim - 1
    positions = _ragged_positions(fn, ragged_dims, rank)
    if sizes.ndim != 2 or sizes.shape[0] != padded.shape[0] or sizes.shape[1] != len(positions):
        raise fail(
            fn,
            f"lengths_or_sizes must be [B] or [B, R] = [{padded.shape[0]}, {len(positions)}], "
            f"got {describe(sizes)}",
        )
    _non_negative(fn, "lengths_or_sizes", sizes)
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


# ----- conversions ------------------------------------------------------------


def _max_sizes(x: Ragged) -> list[int]:
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
    extents = nested_extents(x) if x.row_offsets else _max_sizes(x)
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
    extents = _max_sizes(x)
    ragged = [a.index for a in x.layout.axes if a.ragged]
    out = torch.ones(x.batch_size, *(1 for _ in ragged), dtype=torch.bool, device=x.device)
    for p, k in enumerate(ragged):
        shape = [x.batch_size] + [1] * len(ragged)
        shape[1 + p] = extents[k]
        inside = torch.arange(extents[k], device=x.device).unsqueeze(0) < x.sizes[:, k : k + 1]
        out = out & inside.reshape(shape)
    return out


def unbind(x: Ragged) -> tuple[Any, ...]:
    """Per-sample tensors in logical axis order (views of ``values`` where possible).

    For nested ragged axes each sample is a ``Ragged`` with one level less.

    Args:
        x: the ragged value.

    Returns:
        ``B`` tensors, sample ``i`` of logical shape ``x.shape[1:]`` with its own sizes
        (for nested ragged axes ``B`` values of one level less).

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value.

    Examples:
        >>> import torch, raggedfn
        >>> [t.shape for t in raggedfn.unbind(raggedfn.from_lengths(torch.zeros(3, 2), [1, 2]))]
        [torch.Size([1, 2]), torch.Size([2, 2])]
    """
    if not isinstance(x, Ragged):
        raise fail("unbind", f"x must be a Ragged value, got {describe(x)}")
    if x.row_offsets:
        return tuple(x[i] for i in range(x.batch_size))
    starts = x.offsets.tolist()
    sizes = x.sizes.tolist()
    perm = x.layout.physical_to_logical()
    dense = x.values.shape[1:]
    return tuple(
        x.values[starts[i] : starts[i + 1]].reshape(*sizes[i], *dense).permute(perm)
        for i in range(x.batch_size)
    )


def _require_tokens(fn: str, x: Ragged) -> None:
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    if x.num_ragged != 1 or not x.layout.axes[0].ragged:
        raise fail(
            fn,
            f"needs one ragged axis at logical axis 1, got logical shape {shape_text(x.shape)} "
            f"(ragged axes {x.ragged_dims})",
        )


def _dense_in_order(x: Ragged) -> Tensor:
    """``values`` with the dense axes in logical order (a copy only when needed)."""
    perm = [a.index for a in x.layout.axes if not a.ragged]
    if perm == sorted(perm):
        return x.values
    return x.values.permute(0, *(1 + j for j in perm))


def cu_seqlens(x: Ragged) -> tuple[Tensor, int]:
    """``(int32 [B + 1] cumulative lengths, max length)`` as varlen attention kernels take them.

    Args:
        x: a value of logical shape ``(B, N*, ...)``.

    Returns:
        ``(cu_seqlens, max_seqlen)``: int32 ``[B + 1]`` offsets and the largest length (a Python int, one host sync).

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value, or it does not have exactly one ragged
            axis at logical axis 1.

    Examples:
        >>> import torch, raggedfn
        >>> raggedfn.cu_seqlens(raggedfn.from_lengths(torch.zeros(5), [2, 3]))
        (tensor([0, 2, 5], dtype=torch.int32), 3)
    """
    _require_tokens("cu_seqlens", x)
    return x.offsets.to(torch.int32), _max_sizes(x)[0]


def to_nested(x: Ragged) -> Tensor:
    """A ``torch.nested`` jagged tensor sharing ``values`` (one ragged axis at axis 1).

    The min/max sequence lengths are passed so torch never pads to the total length.

    Args:
        x: a value of logical shape ``(B, N*, ...)`` with ``B >= 1``.

    Returns:
        A jagged nested tensor of shape ``(B, j, ...)`` whose ``values()`` is ``x.values``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; it does not have exactly one ragged
            axis at logical axis 1; the batch is empty (``B = 0``).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.zeros(5, 2), [2, 3])
        >>> njt = raggedfn.to_nested(x)
        >>> njt.is_nested, njt.values().data_ptr() == x.values.data_ptr()
        (True, True)
    """
    _require_tokens("to_nested", x)
    if x.batch_size == 0:
        raise fail("to_nested", "torch.nested cannot hold an empty batch (B = 0)")
    lengths = x.lengths
    return torch.nested.nested_tensor_from_jagged(
        _dense_in_order(x),
        x.offsets.clone(),  # the nested tensor must not share (and so could edit) our partition
        min_seqlen=int(lengths.min()),
        max_seqlen=int(lengths.max()),
    )


def from_nested(njt: Tensor) -> Ragged:
    """A ``Ragged`` sharing the packed values of a ``torch.nested`` jagged tensor.

    Args:
        njt: a ``layout=torch.jagged`` nested tensor ragged along axis 1, without holes.

    Returns:
        ``Ragged`` of logical shape ``(B, N*, ...)`` with ``values`` = ``njt.values()``.

    Raises:
        RaggedError: ``njt`` is not a ``torch.jagged`` nested tensor, is ragged along
            another axis than 1, or has holes (``lengths`` besides ``offsets``).

    Examples:
        >>> import torch, raggedfn
        >>> njt = torch.nested.nested_tensor_from_jagged(torch.zeros(5, 2), torch.tensor([0, 2, 5]))
        >>> raggedfn.from_nested(njt).lengths.tolist()
        [2, 3]
    """
    fn = "from_nested"
    if not isinstance(njt, Tensor) or not njt.is_nested or njt.layout != torch.jagged:
        got = (
            f"a nested tensor with layout {njt.layout}"
            if isinstance(njt, Tensor) and njt.is_nested
            else describe(njt)
        )
        raise fail(fn, f"njt must be a torch.nested tensor with layout=torch.jagged, got {got}")
    nested: Any = njt  # NestedTensor's jagged API is not in Tensor's type stubs
    if getattr(nested, "_ragged_idx", 1) != 1:
        raise fail(
            fn,
            f"only a jagged tensor ragged along axis 1 is supported, got ragged axis {nested._ragged_idx}",
        )
    if nested.lengths() is not None:
        raise fail(
            fn, "jagged tensors with holes (lengths given besides offsets) are not supported"
        )
    return from_offsets(nested.values(), nested.offsets())
