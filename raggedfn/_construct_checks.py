"""Checks of user data shared by the constructors: index tensors, sizes, ragged axes."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._errors import describe, fail
from ._layout import Layout
from ._validate import check_partition, check_structure, is_tracing


def as_index(fn: str, name: str, value: Any, device: torch.device | None = None) -> Tensor:
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


def check_values(fn: str, values: Any) -> Tensor:
    if not isinstance(values, Tensor):
        raise fail(fn, f"values must be a tensor, got {describe(values)}")
    if values.ndim < 1:
        raise fail(fn, f"values must have a packed leading axis [T, ...], got {describe(values)}")
    return values


def validate_partition(
    fn: str, values: Tensor, offsets: Tensor, sizes: Tensor, layout: Layout
) -> None:
    """Every invariant of a partition from user data (host sync eagerly, not for hot paths)."""
    check_structure(fn, values, offsets, sizes, layout)
    check_partition(fn, values, offsets, sizes)


def non_negative(fn: str, name: str, sizes: Tensor) -> None:
    if is_tracing(sizes):
        torch._assert_async((sizes >= 0).all(), f"{fn}: {name} must be non-negative")
    elif bool((sizes < 0).any()):
        raise fail(fn, f"{name} must be non-negative, got {sizes.tolist()}")


def check_products(fn: str, sizes: Tensor, total: int) -> None:
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


def check_total(fn: str, name: str, sizes: Tensor, total: int) -> None:
    """The samples' element counts (products of ``sizes`` rows) must add up to ``total``."""
    if is_tracing(sizes):
        rows = sizes.to(torch.float64).prod(dim=1).sum()
        torch._assert_async(
            rows == total, f"{fn}: {name} must account for values.shape[0] packed rows in total"
        )
        return
    check_products(fn, sizes, total)
    counted = int(sizes.prod(dim=1).sum()) if sizes.numel() else 0
    if counted != total:
        raise fail(
            fn, f"{name} account for {counted} packed rows in total but values.shape[0] = {total}"
        )


def ragged_positions(fn: str, ragged_dims: Any, rank: int) -> tuple[int, ...]:
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
