"""Constructors from user data (lists, lengths, offsets, sizes), ``unbind`` and ``check``.

Padded conversions live in ``_padded``, ``cu_seqlens``/``torch.nested`` in
``_construct_interop``, lists of lists and ``Ragged`` samples in ``_construct_lists``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._construct_checks import (
    as_index,
    check_total,
    check_values,
    non_negative,
    ragged_positions,
    validate_partition,
)
from ._construct_lists import from_nested_list
from ._construct_nested import (
    check_nested,
)
from ._errors import describe, fail, shape_text
from ._index import lengths_of, offsets_of
from ._layout import Layout
from ._ragged import Ragged
from ._validate import is_tracing

# ----- validation ---------------------------------------------------------------


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
    validate_partition("check", x.values, x.offsets, x.sizes, x.layout)
    return x


# ----- constructors -----------------------------------------------------------


def from_list(
    tensors: Sequence[Any],
    ragged_dims: int | Sequence[int] = (1,),
    *,
    rectangular_dims: Sequence[int] = (),
) -> Ragged:
    """Pack a list of per-sample tensors (or of lists of tensors: nested levels).

    Args:
        tensors: ``B`` tensors of equal rank, one per sample; or ``B`` lists of
            tensors ``[L, *dense]`` (documents of sentences), or lists of such
            lists (one more level each). A ``Ragged``, as a sample or at any level
            inside one, counts as the list of its samples, so ``from_list(unbind(x))``
            rebuilds ``x``.
        ragged_dims: logical axes of the batched result (batch = 0) that vary per
            sample; every other axis must agree across samples. For lists of
            tensors the list levels are logical axes ``1 .. D`` and the tensors'
            axes follow: ``ragged_dims`` names all ragged ones (default: the list
            levels and the tensors' leading axis). Several ragged axes of the
            tensors form one rectangle per tensor (a sentence's ``L x L`` pair state).
        rectangular_dims: for lists of lists, the list levels (logical axes ``>= 2``)
            whose lengths are equal within the element above (a rectangle with the
            level before, e.g. an ``N x N`` grid of edge lists).

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
        >>> p, q = torch.zeros(2, 2, 4), torch.zeros(3, 3, 4)  # a pair state per sentence
        >>> pairs = raggedfn.from_list([[p, q], [], [p]], ragged_dims=(1, 2, 3))
        >>> pairs.layout, pairs[0].sizes.tolist()
        (Layout('r0 n1 r2 d0'), [[2, 2], [3, 3]])
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
        dims = None if ragged_dims in ((1,), 1, [1]) else ragged_dims
        return from_nested_list(tensors, dims, rectangular_dims)
    if rectangular_dims:
        raise fail(fn, "rectangular_dims applies to lists of lists (nested levels) only")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise fail(fn, f"sample {i} must be a tensor, got {describe(t)}")
    first = tensors[0]
    rank = first.ndim
    positions = ragged_positions(fn, ragged_dims, rank)
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
    values = check_values(fn, values)
    offsets = as_index(fn, "offsets", offsets, values.device)
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise fail(fn, f"offsets must be a 1-D [B + 1] tensor, got {describe(offsets)}")
    sizes = lengths_of(offsets).unsqueeze(1)
    layout = Layout.standard(1, values.ndim - 1)
    validate_partition(fn, values, offsets, sizes, layout)
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
    values = check_values(fn, values)
    lengths = as_index(fn, "lengths", lengths, values.device)
    if lengths.ndim != 1:
        raise fail(fn, f"lengths must be a 1-D [B] tensor, got {describe(lengths)}")
    sizes = lengths.unsqueeze(1)
    layout = Layout.standard(1, values.ndim - 1)
    if is_tracing(lengths) or not _lengths_add_up(lengths, values.shape[0]):
        # graph assertions while tracing; eagerly, the check that fails raises its message
        non_negative(fn, "lengths", lengths)
        check_total(fn, "lengths", sizes, values.shape[0])
        offsets = offsets_of(lengths)
        validate_partition(fn, values, offsets, sizes, layout)
        return Ragged(values, offsets, sizes, layout)
    # non-negative lengths adding up to T: the offsets below are a valid partition by
    # construction, so check_partition (four more host reads) has nothing left to find;
    # and the parts are well formed by construction (values checked above, lengths an
    # owned int64 [B] copy on values' device), so check_structure has nothing either
    return Ragged._make(values, offsets_of(lengths), sizes, layout)


# Up to this many samples the lengths are checked on the host in Python (one read, no
# kernels); above it, by two reductions and one read (Python's per-item cost wins there).
HOST_CHECK_MAX = 1024


def _lengths_add_up(lengths: Tensor, total: int) -> bool:
    """Every length is non-negative and they add up to ``total``, in one host read.

    Python ints cannot wrap around. The float64 sum of the kernel path cannot
    either; it is exact while the running sums stay below 2**53, and once one
    passes it the sum cannot round back down to a ``total`` below it.
    """
    if lengths.shape[0] <= HOST_CHECK_MAX:
        host = lengths.tolist()
        return sum(host) == total and min(host, default=0) >= 0
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
    values = check_values(fn, values)
    sizes = as_index(fn, "sizes", sizes, values.device)
    if sizes.ndim == 1:
        raise fail(
            fn,
            f"expected sizes of shape [B, R], got {describe(sizes)}; for one ragged axis "
            "pass lengths.unsqueeze(1) or use from_lengths(values, lengths)",
        )
    if sizes.ndim != 2 or sizes.shape[1] < 1:
        raise fail(fn, f"sizes must be a [B, R] tensor with R >= 1, got {describe(sizes)}")
    # R is static (the layout has R ragged axes): a symbolic R (make_fx's symbolic
    # tracing, torch.compile(dynamic=True)) is specialized to its value
    num_ragged = operator.index(sizes.shape[1])
    rank = num_ragged + values.ndim - 1
    if ragged_dims is None:
        ragged_dims = tuple(range(1, num_ragged + 1))
    positions = ragged_positions(fn, ragged_dims, rank)
    if len(positions) != num_ragged:
        raise fail(
            fn,
            f"ragged_dims {ragged_dims} name {len(positions)} axes but sizes has R = {num_ragged} columns",
        )
    non_negative(fn, "sizes", sizes)
    check_total(fn, "sizes", sizes, values.shape[0])
    offsets = offsets_of(sizes.prod(dim=1))
    layout = Layout.from_ragged_positions(rank, positions)
    validate_partition(fn, values, offsets, sizes, layout)
    return Ragged(values, offsets, sizes, layout)


# ----- conversions ------------------------------------------------------------


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
