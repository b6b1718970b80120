"""Index tensors derived from partitions: segment ids and per-axis coordinates.

Everything here has static output sizes (``output_size=T``), so it needs no
host sync and compiles without data-dependent shapes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def lengths_of(offsets: Tensor) -> Tensor:
    """``[B]`` rows owned by each sample."""
    return offsets[1:] - offsets[:-1]


def offsets_of(lengths: Tensor) -> Tensor:
    """``[B + 1]`` offsets from ``[B]`` lengths (int64)."""
    return F.pad(torch.cumsum(lengths.to(torch.int64), 0), (1, 0))


# id(offsets) -> (weak ref to offsets, offsets._version, T, segment ids, their _version,
#                 the samples' bounds, their _version)
_SEGMENT_IDS: dict[int, tuple[weakref.ref[Tensor], int, int, Tensor, int, Tensor, int]] = {}


_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


def _plain_eager(t: Tensor) -> bool:
    """``t`` is an ordinary tensor, used eagerly: no tracing, transform or dispatch mode.

    Only then may a derived index tensor be reused across calls: under
    ``torch.compile``, ``make_fx``, ``torch.func`` transforms or a dispatch mode
    (fake tensors, functionalization) a result belongs to that one trace or level;
    an inference-mode tensor cannot be saved for a later backward.
    """
    return (
        not torch.compiler.is_compiling()
        and type(t) is Tensor
        and not torch.is_inference_mode_enabled()
        and not t.is_inference()
        and torch._C._len_torch_dispatch_stack() == 0
        # a pre-dispatch mode (make_fx(pre_dispatch=True)) turns this key on while it is
        # set: one C call instead of counting torch's Python-side mode stack
        and not torch._C._dispatch_tls_is_dispatch_key_included(_PRE_DISPATCH)
        and torch._C._functorch.peek_interpreter_stack() is None
    )


def _forget(key: int) -> Callable[[weakref.ref[Tensor]], None]:
    """The callback dropping the ids remembered under ``key`` once its offsets die."""

    def forget(_: weakref.ref[Tensor]) -> None:
        _SEGMENT_IDS.pop(key, None)

    return forget


def segment_ids(offsets: Tensor, total: int) -> Tensor:
    """``[T]`` sample index of every packed row.

    Malformed offsets (never validated on hot paths) must not crash the process:
    in torch 2.13 ``repeat_interleave(..., output_size=T)`` corrupts the heap
    ("free(): invalid pointer") unless the repeats are non-negative and sum to
    exactly ``T``. So the lengths are clamped to be non-negative and to end by
    ``T``, and rows past the last sample get the out-of-range id ``B`` (a later
    index raises). On valid offsets none of this changes the result.

    Eagerly, the result is remembered for the ``offsets`` tensor (values that
    share a partition, e.g. through ``with_values``, share their offsets) and
    reused while neither tensor was modified in place, so a chain of ops on one
    partition computes it once. Callers must not modify it in place (a caller
    that hands it out copies it).
    """
    return _segments(offsets, total)[0]


def segment_bounds(offsets: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """``(segment ids [T], bounds [B + 1])``: :func:`segment_ids`, and the offsets of the
    samples as those ids number them.

    Safe for kernels that trust offsets (``torch.segment_reduce(..., offsets=)``
    reads out of bounds on offsets outside ``[0, T]``) even when ``offsets`` are
    malformed: they start at 0 and stay within ``[0, T]``, and equal ``offsets``
    when those are valid (``segment_reduce`` refuses decreasing ones).
    Remembered with the segment ids; callers must not modify either in place.
    """
    return _segments(offsets, total)


def _segments(offsets: Tensor, total: int) -> tuple[Tensor, Tensor]:
    cacheable = _plain_eager(offsets)
    if cacheable:
        hit = _SEGMENT_IDS.get(id(offsets))
        if (
            hit is not None
            and hit[0]() is offsets
            and hit[1] == offsets._version
            and hit[2] == total
            and hit[4] == hit[3]._version
            and hit[6] == hit[5]._version
        ):
            return hit[3], hit[5]
    # (min=0 too: a cumsum that wrapped around int64 must not point before the rows)
    ends = torch.cumsum(lengths_of(offsets).clamp(min=0), 0).clamp(min=0, max=total)
    # (a SymInt pad value would specialise T under torch.compile: full() keeps it symbolic)
    bounds = torch.cat([ends.new_zeros(1), ends, ends.new_full((1,), total)])
    # repeat_interleave of the counts alone numbers the rows 0..B: no gather of ids needed
    # (the last count: rows past the last sample, 0 for valid offsets)
    counts = lengths_of(bounds)
    ids = torch.repeat_interleave(counts, output_size=total)
    starts = bounds[:-1]
    if cacheable and type(ids) is Tensor:
        key = id(offsets)
        ref = weakref.ref(offsets, _forget(key))
        entry = (ref, offsets._version, total, ids, ids._version, starts, starts._version)
        _SEGMENT_IDS[key] = entry
    return ids, starts


# id(tensor) -> (weak ref to it, its _version, tensor.tolist())
_HOST_LISTS: dict[int, tuple[weakref.ref[Tensor], int, Any]] = {}
# id(tensor) -> (weak ref to it, its _version, bool(tensor.all()))
_HOST_ALL: dict[int, tuple[weakref.ref[Tensor], int, Any]] = {}


def _forget_host(
    store: dict[int, tuple[weakref.ref[Tensor], int, Any]], key: int
) -> Callable[[weakref.ref[Tensor]], None]:
    def forget(_: weakref.ref[Tensor]) -> None:
        store.pop(key, None)

    return forget


def _remembered(
    store: dict[int, tuple[weakref.ref[Tensor], int, Any]],
    t: Tensor,
    read: Callable[[Tensor], Any],
) -> Any:
    """``read(t)``, remembered in ``store`` with ``t`` while it is alive and not modified
    in place (its ``_version``), eagerly; under tracing, transforms or dispatch modes
    every call reads afresh."""
    if not _plain_eager(t):
        return read(t)
    key = id(t)
    hit = store.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    host = read(t)
    store[key] = (weakref.ref(t, _forget_host(store, key)), t._version, host)
    return host


def host_list(t: Tensor) -> list[Any]:
    """``t.tolist()``, read once per tensor (one host sync per partition).

    For the partition tensors of a value and those derived from them (``x.sizes``, the
    bounds :func:`segment_bounds` remembers with the offsets): every op on one
    partition (and each backward) passes the same tensor, so the host copy is
    remembered with it, eagerly, while the tensor is alive and not modified in place.
    Under tracing, transforms or dispatch modes every call reads afresh. Callers must
    not modify the list.
    """
    out: list[Any] = _remembered(_HOST_LISTS, t, Tensor.tolist)
    return out


def _read_all(t: Tensor) -> bool:
    return bool(t.all())  # one host sync


def host_all(t: Tensor) -> bool:
    """``bool(t.all())``, read once per tensor, as :func:`host_list`: several ops given
    the same tensor (one attention mask for every layer of a model) pay one host sync.
    """
    return bool(_remembered(_HOST_ALL, t, _read_all))


def host_bounds(bounds: Tensor) -> list[int]:
    """The sample bounds from :func:`segment_bounds` on the host: :func:`host_list`."""
    return host_list(bounds)


def local_positions(offsets: Tensor, segments: Tensor, total: int) -> Tensor:
    """``[T]`` position of every packed row inside its sample."""
    # index_select: advanced indexing is several times slower for these lookups on CPU
    return torch.arange(total, device=offsets.device) - offsets.index_select(0, segments)


def coordinates(offsets: Tensor, sizes: Tensor, total: int) -> tuple[Tensor, list[Tensor]]:
    """Sample index and the coordinate along each ragged axis, for every packed row.

    Returns ``(segments [T], [coord_0 [T], ..., coord_{R-1} [T]])`` where the
    ragged axes are stored row-major in ``k`` order.
    """
    segments = segment_ids(offsets, total)
    rest = local_positions(offsets, segments, total)
    num_ragged = sizes.shape[1]
    coords: list[Tensor] = [rest] * num_ragged
    for k in range(num_ragged - 1, 0, -1):
        size_k = sizes[:, k].index_select(0, segments)
        coords[k] = torch.remainder(rest, size_k)
        rest = torch.div(rest, size_k, rounding_mode="floor")
    if num_ragged:
        coords[0] = rest
    return segments, coords


def reduced_rows(
    offsets: Tensor, sizes: Tensor, total: int, reduce: tuple[int, ...]
) -> tuple[Tensor, int, Tensor, Tensor | None, Tensor | None]:
    """Output row of every packed row when the ragged axes ``reduce`` are reduced.

    The output keeps the other ragged axes, stored row-major in ``k`` order.

    Returns:
        ``(segments [T], num_segments, counts [S], offsets [B + 1] | None,
        sizes [B, R'] | None)``: the output row of each packed row, the number
        of output rows, the packed rows reduced into each output row, and the
        output partition (``None`` when no ragged axis is left: then the output
        row is the sample). Keeping some ragged axes reads the output's total
        row count on the host (one sync): it depends on the data.
    """
    num_ragged = sizes.shape[1]
    keep = [k for k in range(num_ragged) if k not in reduce]
    # one axis: a view of sizes (no index tensor to build, no product)
    reduced_count = sizes[:, reduce[0]] if len(reduce) == 1 else sizes[:, list(reduce)].prod(1)
    if not keep:
        return segment_ids(offsets, total), offsets.shape[0] - 1, reduced_count, None, None
    segments, coords = coordinates(offsets, sizes, total)
    kept_sizes = sizes[:, keep]
    kept_lengths = kept_sizes.prod(1)
    kept_offsets = offsets_of(kept_lengths)
    num_rows = int(kept_offsets[-1])
    flat = torch.zeros_like(segments)
    for k in keep:
        flat = flat * sizes[segments, k] + coords[k]
    rows = kept_offsets[segments] + flat
    counts = torch.repeat_interleave(reduced_count, kept_lengths, output_size=num_rows)
    return rows, num_rows, counts, kept_offsets, kept_sizes


def line_starts(offsets: Tensor, sizes: Tensor, total: int, axis: int) -> tuple[Tensor, Tensor]:
    """The lines of packed rows along ragged axis ``axis``.

    A line holds the rows of one sample that differ only in their coordinate
    along ``axis``. Returns ``(starts [T], positions [T])``: the packed index
    of the first row of each row's line (a unique line id in ``[0, T)``) and
    the row's coordinate along ``axis``.
    """
    segments, coords = coordinates(offsets, sizes, total)
    stride = torch.ones_like(segments)
    for k in range(axis + 1, sizes.shape[1]):
        stride = stride * sizes[segments, k]
    position = coords[axis]
    return torch.arange(total, device=offsets.device) - position * stride, position


def line_major_rows(offsets: Tensor, sizes: Tensor, total: int, axis: int) -> Tensor:
    """``[T]`` where each packed row goes when ragged ``axis`` is moved innermost.

    After ``values.index_copy(0, result, values)``-style reordering, every line
    along ``axis`` (see :func:`line_starts`) occupies consecutive rows in
    increasing coordinate.
    """
    segments, coords = coordinates(offsets, sizes, total)
    flat = torch.zeros_like(segments)
    for k in range(sizes.shape[1]):
        if k != axis:
            flat = flat * sizes[segments, k] + coords[k]
    return offsets[segments] + flat * sizes[segments, axis] + coords[axis]


def gather_ranges(starts: Tensor, lengths: Tensor, total: Any = None) -> tuple[Tensor, Tensor]:
    """Concatenated index ranges ``starts[j] .. starts[j] + lengths[j]``.

    Returns ``(source [N], offsets [J + 1])``: the indices, and where each range
    begins in them. Without ``total`` (the known ``N``, e.g. from tensor shapes)
    it reads ``N`` on the host (one sync): it depends on the data.
    """
    offsets = offsets_of(lengths)
    if total is None:
        total = int(offsets[-1])
    rows = segment_ids(offsets, total)
    source = starts.index_select(0, rows) + local_positions(offsets, rows, total)
    return source, offsets
