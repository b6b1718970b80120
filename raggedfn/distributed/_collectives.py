"""Exchanging samples of ``Ragged`` values between ranks: ``all_gather`` and ``all_to_all``.

Both are one plan: every rank sends a run of consecutive samples to every rank.
Two ``all_to_all_single`` calls carry it out: a fixed-size header (samples and
packed rows per destination, a fingerprint of layout / dense shape / dtype, an
error flag, and the samples' ``[b, R]`` sizes inline), then the packed values,
once, with uneven splits. A batch with more sizes than the header holds
(``_INLINE_SIZES`` entries per rank over all destinations) exchanges them in a
third call before the values. Only the values exchange is differentiable; its
backward is the reverse exchange. Every rank checks every header, so bad input on
one rank raises a ``RaggedError`` on all ranks instead of leaving the others
waiting.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._errors import describe, fail
from .._index import offsets_of
from .._prims._collective import all_to_all_single
from .._ragged import Ragged

# header columns: samples and packed rows sent to that rank, the fingerprint, whether
# this rank's input is bad, whether its sizes overflow the header; then inline sizes
_SAMPLES, _ROWS, _FINGERPRINT, _ERROR, _OVERFLOW = range(5)
_META = 5
# sizes entries a rank sends inline in the header, over all destinations; batches with
# more go in an exchange of their own
_INLINE_SIZES = 4096


def all_gather(x: Ragged, group: Any = None) -> Ragged:
    """The samples of every rank, in rank order, on every rank.

    Ranks may hold different batch sizes and lengths, or no samples at all;
    they must agree on the layout, the dense shape and the dtype.

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
    return _exchange(fn, x, values, sizes, [batch] * world, [rows] * world, None, group)


def all_to_all(x: Ragged, splits: Sequence[int] | Tensor, group: Any = None) -> Ragged:
    """Send ``splits[r]`` consecutive samples of ``x`` to rank ``r``; receive from every rank.

    The torchrec ``KeyedJaggedTensor`` / JAX ``ragged_all_to_all`` exchange for
    samples: rank ``r`` receives ``x[start:start + splits[r]]`` of every rank,
    with ``start = sum(splits[:r])``.

    Args:
        x: this rank's ``Ragged`` of logical shape ``(B, ...)`` (see
            :func:`all_gather` for the device).
        splits: ``W`` non-negative ints (a list or a 1-D integer tensor) adding
            up to ``B``; ``W`` is the group's size.
        group: the process group (``None``: the default group).

    Returns:
        The received samples ordered by source rank (then by position at the
        source). Differentiable in ``x.values``: the backward sends every
        gradient back where its sample came from.

    Example:
        Run on both ranks of a group of 2 (``rank = dist.get_rank()``): each holds
        samples of lengths 1, 2, 3; rank 0 keeps its first sample, rank 1 none.

        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(n, 4) for n in (1, 2, 3)])  # doctest: +SKIP
        >>> y = raggedfn.distributed.all_to_all(x, [1, 2] if rank == 0 else [0, 3])  # doctest: +SKIP
        >>> y.lengths.tolist()  # rank 0: [1]; rank 1: [2, 3, 1, 2, 3]  # doctest: +SKIP
    """
    fn = "all_to_all"
    _require_ragged(fn, x)
    world = dist.get_world_size(group)
    counts, problem = _check_splits(fn, splits, world, x.batch_size)
    rows: list[int] = [0] * world
    if problem is None:
        bounds = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
        at = x.offsets.index_select(0, bounds.to(x.offsets.device)).tolist()
        rows = [b - a for a, b in itertools.pairwise(at)]
    return _exchange(fn, x, x.values, x.sizes, counts, rows, problem, group)


def _require_ragged(fn: str, x: Any) -> None:
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")


def _check_splits(fn: str, splits: Any, world: int, batch: int) -> tuple[list[int], str | None]:
    """The splits as ints, or zeros and why they are bad (reported on every rank)."""
    if isinstance(splits, Tensor):
        if splits.ndim != 1 or splits.is_floating_point() or splits.is_complex():
            return [0] * world, f"splits must be a 1-D integer tensor, got {describe(splits)}"
        splits = splits.tolist()
    try:
        counts = [int(s) for s in splits]
    except (TypeError, ValueError):
        return [0] * world, f"splits must be a sequence of ints, got {describe(splits)}"
    if any(isinstance(s, bool) or int(s) != s for s in splits):
        return [0] * world, f"splits must be a sequence of ints, got {describe(splits)}"
    if len(counts) != world:
        return [0] * world, f"splits has {len(counts)} entries but the group has {world} ranks"
    if any(c < 0 for c in counts) or sum(counts) != batch:
        return [0] * world, (
            f"splits must be non-negative and add up to the batch size {batch}, got {counts}"
        )
    return counts, None


def _fingerprint(x: Ragged) -> int:
    """Same on every rank iff the layouts, dense shapes and dtypes agree."""
    text = f"{x.layout.code}|{tuple(x.values.shape[1:])}|{x.dtype}"
    return zlib.crc32(text.encode())


def _exchange(
    fn: str,
    x: Ragged,
    values: Tensor,
    sizes: Tensor,
    samples_to: list[int],
    rows_to: list[int],
    problem: str | None,
    group: Any,
) -> Ragged:
    world = dist.get_world_size(group)
    num_ragged = x.layout.num_ragged
    capacity = max(8, _INLINE_SIZES // world)  # sizes entries per destination in the header
    overflow = problem is None and any(n * num_ragged > capacity for n in samples_to)
    meta = [
        [samples_to[r], rows_to[r], _fingerprint(x), problem is not None, overflow]
        for r in range(world)
    ]
    header = torch.zeros(world, _META + capacity, dtype=torch.int64, device=x.device)
    header[:, :_META] = torch.tensor(meta, dtype=torch.int64)
    starts = list(itertools.accumulate(samples_to, initial=0))
    if problem is None and not overflow:
        for r in range(world):
            block = sizes[starts[r] : starts[r + 1]].reshape(-1)
            header[r, _META : _META + block.shape[0]] = block
    received = torch.empty_like(header)
    dist.all_to_all_single(received, header, group=group)
    heard = received[:, :_META].tolist()
    if problem is not None:
        raise fail(fn, problem)
    failed = [r for r in range(world) if heard[r][_ERROR]]
    if failed:
        raise fail(fn, f"rank(s) {failed} of the group passed bad input (see the error there)")
    mine = heard[dist.get_rank(group)][_FINGERPRINT]
    differ = [r for r in range(world) if heard[r][_FINGERPRINT] != mine]
    if differ:
        here = x.layout.describe(tuple(x.values.shape[1:]))
        raise fail(
            fn,
            f"rank(s) {differ} hold values of another layout, dense shape or dtype than this "
            f"rank's {here} {x.dtype}; every rank must agree",
        )
    samples_from = [h[_SAMPLES] for h in heard]
    rows_from = [h[_ROWS] for h in heard]
    if any(h[_OVERFLOW] for h in heard):  # every rank sees the same flags: all exchange
        got_sizes = sizes.new_empty((sum(samples_from), num_ragged))
        dist.all_to_all_single(got_sizes, sizes.contiguous(), samples_from, samples_to, group=group)
    else:
        blocks = [received[r, _META : _META + n * num_ragged] for r, n in enumerate(samples_from)]
        got_sizes = torch.cat(blocks).reshape(-1, num_ragged)
    got_values = all_to_all_single(values, rows_from, rows_to, group)
    offsets = offsets_of(got_sizes.prod(dim=1))
    return Ragged(got_values, offsets, got_sizes, x.layout)


__all__ = ["all_gather", "all_to_all"]
