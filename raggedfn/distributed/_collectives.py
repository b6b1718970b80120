"""Exchanging samples of ``Ragged`` values between ranks: ``all_gather`` and ``all_to_all``.

Both are one plan: every rank sends a run of consecutive samples to every rank.
Two ``all_to_all_single`` calls carry it out: a fixed-size header (samples and
packed rows per destination, a fingerprint of layout / dense shape / dtype, an
error flag, and the samples' ``[b, R]`` sizes inline), then the packed values,
once, with uneven splits. A batch with more sizes than the header holds
(``_INLINE_SIZES`` entries per rank over all destinations) exchanges them in a
third call after the values. Between the two calls only what the values
exchange needs is done (every rank waits for the slowest there). Only the values exchange is differentiable; its
backward is the reverse exchange. Every rank checks every header, so bad input on
one rank raises a ``RaggedError`` on all ranks instead of leaving the others
waiting.

``all_to_all`` with ``output_splits`` and ``output_sizes`` (what this rank
receives, known to the caller) skips the header: one call, the values exchange.
Nested values add one integer exchange after the values: the per-element
lengths of every level after the first, in sample order (``_with_levels``).
"""

from __future__ import annotations

import functools
import itertools
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .._errors import describe, fail
from .._index import lengths_of, offsets_of
from .._prims._collective import all_to_all_single
from .._ragged import Ragged

# header columns: samples and packed rows sent to that rank, the fingerprint, whether
# this rank's input is bad, whether its sizes overflow the header; then inline sizes
_SAMPLES, _ROWS, _FINGERPRINT, _ERROR, _OVERFLOW = range(5)
_META = 5
# sizes entries a rank sends inline in the header, over all destinations; batches with
# more go in an exchange of their own
_INLINE_SIZES = 4096
# up to this many sizes entries the header is built from Python lists
_HOST_SIZES = 256


def all_gather(x: Ragged, group: Any = None) -> Ragged:
    """The samples of every rank, in rank order, on every rank.

    Ranks may hold different batch sizes and lengths, or no samples at all;
    they must agree on the layout, the dense shape and the dtype. Nested values
    (documents -> sentences -> tokens) move with every level.

    Args:
        x: this rank's ``Ragged`` of logical shape ``(B_r, ...)``; on the device
            the backend works on (CPU for gloo, this rank's GPU for NCCL).
        group: the process group (``None``: the default group).

    Returns:
        ``(B_0 + ... + B_{W-1}, ...)``: rank 0's samples, then rank 1's, ...
        Differentiable in ``x.values``: the gradient of this rank's samples is
        the sum of the gradients every rank computes for them.

    Example:
        Run on both ranks of a group of 2 (``rank = dist.get_rank()``): rank 0
        holds one sample of length 2, rank 1 two of lengths 1 and 3.

        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(n, 4) for n in ([2] if rank == 0 else [1, 3])])  # doctest: +SKIP
        >>> raggedfn.distributed.all_gather(x).lengths.tolist()  # doctest: +SKIP
        [2, 1, 3]
    """
    fn = "all_gather"
    _require_ragged(fn, x)
    world = dist.get_world_size(group)
    # send every sample to every rank: W copies of this rank's batch
    values = x.values.unsqueeze(0).expand(world, *x.values.shape).reshape(-1, *x.values.shape[1:])
    sizes = x.sizes.repeat(world, 1)
    batch, rows = x.batch_size, x.values.shape[0]
    levels = [torch.cat([lengths_of(p)] * world) for p in x.row_offsets]
    got = _exchange(fn, x, values, sizes, [batch] * world, [rows] * world, None, world, group)
    return _with_levels(got, sizes, levels, [batch] * world, group)


def all_to_all(
    x: Ragged,
    splits: Sequence[int] | Tensor,
    group: Any = None,
    *,
    output_splits: Sequence[int] | Tensor | None = None,
    output_sizes: Tensor | None = None,
) -> Ragged:
    """Send ``splits[r]`` consecutive samples of ``x`` to rank ``r``; receive from every rank.

    The torchrec ``KeyedJaggedTensor`` / JAX ``ragged_all_to_all`` exchange for
    samples: rank ``r`` receives ``x[start:start + splits[r]]`` of every rank,
    with ``start = sum(splits[:r])``. The ranks first exchange a small header
    (what each receives, checked on every rank), then the values, once.

    Args:
        x: this rank's ``Ragged`` of logical shape ``(B, ...)`` (see
            :func:`all_gather` for the device).
        splits: ``W`` non-negative ints (a list or a 1-D integer tensor) adding
            up to ``B``; ``W`` is the group's size.
        group: the process group (``None``: the default group).
        output_splits: optional, with ``output_sizes``: the number of samples
            this rank receives from each rank (``W`` ints), as
            ``torch.distributed.all_to_all_single``'s ``output_split_sizes``.
            Given both, the header exchange is skipped: one collective moves
            the values. As with ``output_split_sizes``, they must match what the
            other ranks send; nothing checks them across ranks, and bad input
            raises on its own rank only.
        output_sizes: optional, with ``output_splits``: the received samples'
            sizes, ``[sum(output_splits), R]`` integers like ``Ragged.sizes``
            (``[sum(output_splits)]`` lengths for one ragged axis), in the order
            of the result; e.g. ``x.sizes`` when the exchange sends back what an
            earlier one brought.

    Returns:
        The received samples ordered by source rank (then by position at the
        source). Differentiable in ``x.values``: the backward sends every
        gradient back where its sample came from.

    Example:
        Run on both ranks of a group of 2 (``rank = dist.get_rank()``): each holds
        samples of lengths 1, 2, 3; rank 0 keeps its first sample, rank 1 none.

        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(n, 4) for n in (1, 2, 3)])  # doctest: +SKIP
        >>> splits = [1, 2] if rank == 0 else [0, 3]  # doctest: +SKIP
        >>> y = raggedfn.distributed.all_to_all(x, splits)  # doctest: +SKIP
        >>> y.lengths.tolist()  # rank 0: [1]; rank 1: [2, 3, 1, 2, 3]  # doctest: +SKIP

        Sending the samples back, the receive sizes are known (``x.sizes``):

        >>> got = [1, 0] if rank == 0 else [2, 3]  # samples y holds from each rank  # doctest: +SKIP
        >>> back = raggedfn.distributed.all_to_all(y, got, output_splits=splits, output_sizes=x.sizes)  # doctest: +SKIP
        >>> torch.equal(back.values, x.values)  # doctest: +SKIP
        True
    """
    fn = "all_to_all"
    _require_ragged(fn, x)
    world = dist.get_world_size(group)
    counts, problem = _check_splits(fn, "splits", splits, world, x.batch_size, "the batch size")
    known = output_splits is not None or output_sizes is not None
    if known:
        if problem is not None:
            raise fail(fn, problem)
        got = _known_exchange(fn, x, counts, output_splits, output_sizes, world, group)
    else:
        rows = [0] * world if problem is not None else _rows(x.offsets, counts)
        got = _exchange(fn, x, x.values, x.sizes, counts, rows, problem, world, group)
    levels = [lengths_of(p) for p in x.row_offsets]
    return _with_levels(got, x.sizes, levels, counts, group)


def _require_ragged(fn: str, x: Any) -> None:
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")


def _runs(counts: Tensor, samples: list[int]) -> list[int]:
    """Sums of ``counts`` (one per sample) over runs of ``samples`` consecutive samples."""
    return _rows(offsets_of(counts), samples)


def _with_levels(
    exchanged: tuple[Ragged, list[int]],
    sizes: Tensor,
    levels: list[Tensor],
    samples_to: list[int],
    group: Any,
) -> Ragged:
    """``got`` (samples exchanged with their sizes) with its nested levels: every sent
    sample's lengths of levels ``1 .. R - 1`` (one per element of the level above) go
    where the sample went, all levels in one integer exchange after the values."""
    got, heard = exchanged  # heard: the samples received from each rank, in rank order
    if not levels:
        return got
    got_sizes, world = got.sizes, len(samples_to)
    sent = [_runs(sizes[:, k], samples_to) for k in range(len(levels))]  # [level][rank]
    came = [_runs(got_sizes[:, k], heard) for k in range(len(levels))]
    pieces = [level.split(sent[k]) for k, level in enumerate(levels)]
    send = torch.cat([pieces[k][r] for r in range(world) for k in range(len(levels))])
    received = send.new_empty(sum(sum(c) for c in came))
    splits_to = [sum(sent[k][r] for k in range(len(levels))) for r in range(world)]
    splits_from = [sum(came[k][r] for k in range(len(levels))) for r in range(world)]
    dist.all_to_all_single(received, send, splits_from, splits_to, group=group)
    chunks = received.split([came[k][r] for r in range(world) for k in range(len(levels))])
    row_offsets = tuple(
        offsets_of(torch.cat([chunks[r * len(levels) + k] for r in range(world)]))
        for k in range(len(levels))
    )
    offsets = offsets_of(got_sizes[:, -1])
    return Ragged._make(got.values, offsets, got_sizes, got.layout, row_offsets)


def _rows(offsets: Tensor, counts: list[int]) -> list[int]:
    """Packed rows in each run of ``counts`` consecutive samples.

    Reads only the ``W - 1`` inner boundaries (a scalar each: cheaper than an
    index tensor for the few ranks of a group); the ends are 0 and ``T``.
    """
    inner = itertools.accumulate(counts[:-1])
    at = [0, *(int(offsets[b]) for b in inner), int(offsets[-1])]
    return [b - a for a, b in itertools.pairwise(at)]


def _check_splits(
    fn: str, name: str, splits: Any, world: int, total: int, what: str
) -> tuple[list[int], str | None]:
    """The splits as ints, or zeros and why they are bad (reported on every rank)."""
    if type(splits) in (list, tuple) and all(type(s) is int for s in splits):  # the usual case
        counts = list(splits)
        if len(counts) == world and min(counts) >= 0 and sum(counts) == total:
            return counts, None
    if isinstance(splits, Tensor):
        if splits.ndim != 1 or splits.is_floating_point() or splits.is_complex():
            return [0] * world, f"{name} must be a 1-D integer tensor, got {describe(splits)}"
        splits = splits.tolist()
    try:
        counts = [int(s) for s in splits]
    except (TypeError, ValueError):
        return [0] * world, f"{name} must be a sequence of ints, got {describe(splits)}"
    if any(isinstance(s, bool) or int(s) != s for s in splits):
        return [0] * world, f"{name} must be a sequence of ints, got {describe(splits)}"
    if len(counts) != world:
        return [0] * world, f"{name} has {len(counts)} entries but the group has {world} ranks"
    if any(c < 0 for c in counts) or sum(counts) != total:
        return [
            0
        ] * world, f"{name} must be non-negative and add up to {what} {total}, got {counts}"
    return counts, None


@functools.lru_cache(maxsize=256)
def _fingerprint(code: str, dense: tuple[int, ...], dtype: torch.dtype) -> int:
    """Same on every rank iff the layouts, dense shapes and dtypes agree."""
    return zlib.crc32(f"{code}|{dense}|{dtype}".encode())


def _exchange(
    fn: str,
    x: Ragged,
    values: Tensor,
    sizes: Tensor,
    samples_to: list[int],
    rows_to: list[int],
    problem: str | None,
    world: int,
    group: Any,
) -> tuple[Ragged, list[int]]:
    num_ragged = x.layout.num_ragged
    capacity = max(8, _INLINE_SIZES // world)  # sizes entries per destination in the header
    entries = [n * num_ragged for n in samples_to]
    overflow = problem is None and max(entries) > capacity
    fingerprint = _fingerprint(x.layout.code, tuple(x.values.shape[1:]), x.dtype)
    meta = [
        [samples_to[r], rows_to[r], fingerprint, problem is not None, overflow]
        for r in range(world)
    ]
    if problem is None and not overflow and sum(entries) <= _HOST_SIZES:
        # a small batch: the header's rows as Python lists, one tensor (fewest torch calls)
        flat, start, width = sizes.reshape(-1).tolist(), 0, max(entries)
        for r in range(world):
            meta[r] += flat[start : start + entries[r]] + [0] * (width - entries[r])
            start += entries[r]
        body = torch.tensor(meta, dtype=torch.int64, device=x.device)
        header = F.pad(body, (0, capacity - width))
    else:
        header = torch.zeros(world, _META + capacity, dtype=torch.int64, device=x.device)
        header[:, :_META] = torch.tensor(meta, dtype=torch.int64)
        if problem is None and not overflow:
            # destination r's sizes, zero-padded to the longest: one copy into the header
            blocks = sizes.reshape(-1).split(entries)
            inline = torch.nn.utils.rnn.pad_sequence(blocks, batch_first=True)
            header[:, _META : _META + inline.shape[1]] = inline
    received = torch.empty_like(header)
    dist.all_to_all_single(received, header, group=group)
    heard = received[:, :_META].tolist()
    if problem is not None:
        raise fail(fn, problem)
    _check_heard(fn, x, heard, fingerprint)
    # the values go first: the sizes' bookkeeping below waits no peer between the calls
    got_values = all_to_all_single(values, [h[_ROWS] for h in heard], rows_to, group)
    samples_from = [h[_SAMPLES] for h in heard]
    if any(h[_OVERFLOW] for h in heard):  # every rank sees the same flags: all exchange
        got_sizes = sizes.new_empty((sum(samples_from), num_ragged))
        dist.all_to_all_single(got_sizes, sizes.contiguous(), samples_from, samples_to, group=group)
    else:
        got = [received[r, _META : _META + n * num_ragged] for r, n in enumerate(samples_from)]
        got_sizes = torch.cat(got).reshape(-1, num_ragged)
    return Ragged._make(
        got_values, _offsets(got_sizes, x.is_nested), got_sizes, x.layout
    ), samples_from


def _check_heard(fn: str, x: Ragged, heard: list[list[int]], fingerprint: int) -> None:
    """Raise on every rank if any rank's input was bad or disagrees with this rank's."""
    failed = [r for r, h in enumerate(heard) if h[_ERROR]]
    if failed:
        raise fail(fn, f"rank(s) {failed} of the group passed bad input (see the error there)")
    differ = [r for r, h in enumerate(heard) if h[_FINGERPRINT] != fingerprint]
    if differ:
        here = x.layout.describe(tuple(x.values.shape[1:]))
        raise fail(
            fn,
            f"rank(s) {differ} hold values of another layout, dense shape or dtype than this "
            f"rank's {here} {x.dtype}; every rank must agree",
        )


def _offsets(sizes: Tensor, nested: bool = False) -> Tensor:
    """``[N + 1]`` offsets of samples of ``[N, R]`` sizes (one op less for one ragged axis;
    nested: the last column counts the rows)."""
    if nested:
        lengths = sizes[:, -1]
    else:
        lengths = sizes[:, 0] if sizes.shape[1] == 1 else sizes.prod(dim=1)
    offsets = sizes.new_zeros(sizes.shape[0] + 1)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _known_exchange(
    fn: str,
    x: Ragged,
    counts: list[int],
    output_splits: Any,
    output_sizes: Any,
    world: int,
    group: Any,
) -> tuple[Ragged, list[int]]:
    """``all_to_all`` with the receive side known: the values exchange alone (nested
    levels follow in :func:`_with_levels`)."""
    if output_splits is None or output_sizes is None:
        raise fail(fn, "output_splits and output_sizes go together: pass both or neither")
    num_ragged = x.layout.num_ragged
    if (
        not isinstance(output_sizes, Tensor)
        or output_sizes.is_floating_point()
        or output_sizes.is_complex()
        or output_sizes.dtype == torch.bool
        or output_sizes.ndim not in (1, 2)
        or (output_sizes.ndim == 1 and num_ragged != 1)
        or (output_sizes.ndim == 2 and output_sizes.shape[1] != num_ragged)
    ):
        form = "[N] or [N, 1]" if num_ragged == 1 else f"[N, {num_ragged}]"
        raise fail(
            fn,
            f"output_sizes must be an integer tensor of shape {form} (the received samples' "
            f"sizes), got {describe(output_sizes)}",
        )
    if output_sizes.device != x.device:
        raise fail(fn, f"output_sizes must be on {x.device}, got {describe(output_sizes)}")
    got_sizes = output_sizes.to(torch.int64).reshape(-1, num_ragged)
    samples_from, problem = _check_splits(
        fn, "output_splits", output_splits, world, got_sizes.shape[0], "the number of output_sizes"
    )
    if problem is not None:
        raise fail(fn, problem)
    if bool((got_sizes < 0).any()):
        raise fail(fn, "output_sizes must be non-negative")
    offsets = _offsets(got_sizes, x.is_nested)
    rows_to, rows_from = _rows(x.offsets, counts), _rows(offsets, samples_from)
    rank = dist.get_rank(group)
    if (samples_from[rank], rows_from[rank]) != (counts[rank], rows_to[rank]):
        raise fail(
            fn,
            f"output_splits and output_sizes expect {samples_from[rank]} samples of "
            f"{rows_from[rank]} rows from this rank (rank {rank}), but it sends itself "
            f"{counts[rank]} samples of {rows_to[rank]} rows",
        )
    got_values = all_to_all_single(x.values, rows_from, rows_to, group)
    return Ragged._make(got_values, offsets, got_sizes, x.layout), samples_from


__all__ = ["all_gather", "all_to_all"]
