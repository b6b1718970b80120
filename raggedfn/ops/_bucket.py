"""Length buckets: run a dense per-sample computation on groups of similar samples.

Per-sample products (``matmul``, ``einsum``, ``attention``) are dense inside each
sample. Samples are sorted by their cost, grouped greedily into buckets whose
padded cost stays within ``slack`` of the real cost, padded to the bucket's
extents with one gather, computed with one batched dense call per bucket, and
the real elements are taken back out with one gather. Everything is a plain
composite of differentiable torch ops (gathers, whose backward is an
``index_put``), so gradients of any order come from autograd.

Bucket planning reads the sizes on the host (one ``tolist`` per call): this is
the one data-dependent step. It is cheap in eager mode; under ``torch.compile``
the ops that plan buckets run as one opaque custom-op node each
(``_prims.host_planned``), so the plan still runs on real sizes and the graph
does not break (see ``docs/compile.md``).

Each ragged axis of each operand is named by a *symbol* (an einsum letter);
axes with the same symbol have the same size in every sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._index import coordinates, host_list, offsets_of
from .._layout import Layout
from .._ragged import Ragged

SLACK = 1.25  # accept a sample into a bucket while padded cost <= SLACK * real cost
MIN_WORK = 4096  # ... or while the whole bucket is this small (per-call overhead dominates)


@dataclass(frozen=True)
class Bucket:
    """One group of samples and the padded extent of every symbol."""

    samples: tuple[int, ...]
    extents: dict[str, int]


def plan(sizes: dict[str, list[int]], batch_size: int) -> list[Bucket]:
    """Group samples so that padding each group to its extents wastes little work.

    Args:
        sizes: per symbol, the size of that axis in each of the ``B`` samples.
        batch_size: ``B``.

    Returns:
        Buckets covering every sample once; one empty bucket when ``B = 0`` (so
        results stay connected to the inputs in autograd).
    """
    symbols = list(sizes)
    if batch_size == 0:
        return [Bucket((), dict.fromkeys(symbols, 0))]
    rows = [tuple(sizes[s][b] for s in symbols) for b in range(batch_size)]
    costs = [math.prod(max(v, 1) for v in row) for row in rows]
    order = sorted(range(batch_size), key=lambda b: (costs[b], rows[b]), reverse=True)
    buckets: list[Bucket] = []
    members: list[int] = []
    extents: list[int] = []
    real = 0
    for b in order:
        if members:
            grown = [max(e, v) for e, v in zip(extents, rows[b], strict=True)]
            padded = (len(members) + 1) * math.prod(max(v, 1) for v in grown)
            if padded <= SLACK * (real + costs[b]) or padded <= MIN_WORK:
                members.append(b)
                extents = grown
                real += costs[b]
                continue
            buckets.append(Bucket(tuple(members), dict(zip(symbols, extents, strict=True))))
        members, extents, real = [b], list(rows[b]), costs[b]
    buckets.append(Bucket(tuple(members), dict(zip(symbols, extents, strict=True))))
    return buckets


def _to_logical(physical: Tensor, layout: Layout) -> Tensor:
    """``[G, *ragged extents, *dense]`` (storage order) to ``[G, *logical sample axes]``."""
    return physical.permute(0, *(1 + p for p in layout.physical_to_logical()))


def _to_physical(logical: Tensor, layout: Layout) -> Tensor:
    return logical.permute(0, *(1 + p for p in layout.logical_to_physical()))


def pad(x: Ragged, symbols: Sequence[str], buckets: Sequence[Bucket]) -> list[Tensor]:
    """Each bucket's samples of ``x`` padded with zeros, in logical axis order.

    Args:
        x: the operand; ragged axis ``k`` is named ``symbols[k]``.
        symbols: one symbol per ragged axis of ``x`` (storage order ``k``).
        buckets: from :func:`plan`.

    Returns:
        Per bucket a ``[G, *padded logical sample shape]`` tensor (views of one
        gathered buffer, so the backward is a single ``index_put``).
    """
    device = x.offsets.device
    dense = tuple(x.values.shape[1:])
    total = x.values.shape[0]
    num_ragged = len(symbols)
    indices = []
    shapes = []
    for bucket in buckets:
        extents = [bucket.extents[s] for s in symbols]
        count = len(bucket.samples)
        sel = torch.tensor(bucket.samples, dtype=torch.int64, device=device)
        sizes = x.sizes[sel]
        view = [count] + [1] * num_ragged
        linear = x.offsets[sel].view(view)
        valid = torch.ones(view, dtype=torch.bool, device=device)
        stride = torch.ones(count, dtype=torch.int64, device=device)
        for k in reversed(range(num_ragged)):
            shape = [1] * (1 + num_ragged)
            shape[1 + k] = extents[k]
            steps = torch.arange(extents[k], device=device).view(shape)
            valid = valid & (steps < sizes[:, k].view(view))
            linear = linear + steps * stride.view(view)
            stride = stride * sizes[:, k]
        indices.append(torch.where(valid, linear, total).reshape(-1))
        shapes.append((count, *extents, *dense))
    padded_values = torch.cat([x.values, x.values.new_zeros((1, *dense))])
    gathered = padded_values.index_select(0, torch.cat(indices))
    parts = torch.split(gathered, [idx.shape[0] for idx in indices])
    return [
        _to_logical(part.reshape(shape), x.layout)
        for part, shape in zip(parts, shapes, strict=True)
    ]


def pad_dense(t: Tensor, buckets: Sequence[Bucket]) -> list[Tensor]:
    """Each bucket's rows of a dense ``[B, ...]`` tensor."""
    out = []
    for bucket in buckets:
        sel = torch.tensor(bucket.samples, dtype=torch.int64, device=t.device)
        out.append(t[sel])
    return out


def unpad(
    parts: Sequence[Tensor],
    layout: Layout,
    symbols: Sequence[str],
    buckets: Sequence[Bucket],
    sizes: dict[str, list[int]],
    batch_size: int,
) -> Ragged:
    """The real elements of per-bucket padded results, as one ``Ragged``.

    Args:
        parts: per bucket a ``[G, *padded logical sample shape]`` tensor.
        layout: the layout of the result; ragged axis ``k`` is ``symbols[k]``.
        symbols: one symbol per ragged axis of the result.
        buckets: the buckets ``parts`` were computed on.
        sizes: per symbol, the size of that axis in each sample.
        batch_size: ``B``.
    """
    first = parts[0]
    device = first.device
    physical = [_to_physical(p, layout) for p in parts]
    flat = torch.cat([p.flatten(0, len(symbols)) for p in physical])
    num_ragged = len(symbols)
    starts = [0] * batch_size
    strides = [[0] * num_ragged for _ in range(batch_size)]
    base = 0
    for bucket in buckets:
        extents = [bucket.extents[s] for s in symbols]
        block = math.prod(extents)
        steps = [math.prod(extents[k + 1 :]) for k in range(num_ragged)]
        for slot, b in enumerate(bucket.samples):
            starts[b] = base + slot * block
            strides[b] = steps
        base += len(bucket.samples) * block
    out_sizes = torch.tensor(
        [[sizes[s][b] for s in symbols] for b in range(batch_size)], dtype=torch.int64
    ).reshape(batch_size, num_ragged)
    out_sizes = out_sizes.to(device)
    offsets = offsets_of(out_sizes.prod(dim=1))
    total = sum(math.prod(sizes[s][b] for s in symbols) for b in range(batch_size))
    segments, coords = coordinates(offsets, out_sizes, total)
    start_t = torch.tensor(starts, dtype=torch.int64, device=device)
    stride_t = torch.tensor(strides, dtype=torch.int64, device=device).reshape(
        batch_size, num_ragged
    )
    linear = start_t[segments]
    for k in range(num_ragged):
        linear = linear + coords[k] * stride_t[segments, k]
    return Ragged(flat.index_select(0, linear), offsets, out_sizes, layout)


def unpad_dense(parts: Sequence[Tensor], buckets: Sequence[Bucket], batch_size: int) -> Tensor:
    """Per-bucket ``[G, ...]`` results back in sample order as ``[B, ...]``."""
    order = [b for bucket in buckets for b in bucket.samples]
    position = [0] * batch_size
    for slot, b in enumerate(order):
        position[b] = slot
    flat = torch.cat(list(parts))
    return flat.index_select(0, torch.tensor(position, dtype=torch.int64, device=flat.device))


def ragged_sizes(x: Ragged) -> list[list[int]]:
    """``x.sizes`` on the host, one (new) list per ragged axis (the planning sync, read
    once per partition: ops on one partition share its ``sizes`` tensor)."""
    rows = host_list(x.sizes)
    return (
        [list(column) for column in zip(*rows, strict=True)]
        if rows
        else [[] for _ in range(x.num_ragged)]
    )


def sample_views(x: Ragged, sizes: Sequence[Sequence[int]]) -> list[Tensor]:
    """Each sample of ``x`` as a view in logical axis order (a sample's rows are contiguous).

    ``sizes[b]`` is sample ``b``'s size along each ragged axis (``k`` order). Cut with
    ``split``, so the backward of anything built from these views is one ``cat``, not
    ``B`` scatters. Reads the row counts on the host (the per-sample paths' one sync).
    """
    counts = (x.offsets[1:] - x.offsets[:-1]).tolist()
    dense = x.values.shape[1:]
    order = x.layout.physical_to_logical()
    parts = x.values.split(counts)
    return [p.reshape(*s, *dense).permute(order) for p, s in zip(parts, sizes, strict=True)]
