"""Invariants of a ``Ragged`` value: structural checks and value checks.

Two levels, by cost:

- :func:`check_structure` reads only types, dtypes, ranks, shapes and devices
  (no device sync). It runs on every construction of a value, including pytree
  unflatten and unpickling.
- :func:`check_partition` reads the partition data: offsets start at 0, never
  decrease and end at ``T``; sizes are non-negative and their products match
  the offsets. Eagerly that is a host sync, so it runs only where data comes
  from outside raggedfn (public constructors, ``raggedfn.check``, unpickling,
  ``torch.load``), never on values raggedfn itself built. While tracing
  (``torch.compile``, fake tensors) there is no data to read: the same
  conditions go into the graph as device-side assertions with the same words.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._errors import describe, fail, shape_text
from ._index import lengths_of
from ._layout import Layout
from ._mixed import uniform_checks


def is_tracing(t: Tensor) -> bool:
    """True under torch.compile, fx or fake-tensor tracing (no data to read)."""
    if torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_symbolic_tracing():
        return True
    if (
        type(t) is Tensor
        and not torch._is_functional_tensor(t)
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    ):
        return False  # a plain tensor wraps nothing: not fake (the common eager case, cheaply)
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def check_structure(
    fn: str, values: Any, offsets: Any, sizes: Any, layout: Any, row_offsets: Any = ()
) -> None:
    """The invariants readable without the data; raises ``RaggedError``."""
    if not isinstance(layout, Layout):
        raise fail(fn, f"expected layout to be a Layout, got {describe(layout)}")
    for name, leaf in (("values", values), ("offsets", offsets), ("sizes", sizes)):
        if not isinstance(leaf, Tensor):
            raise fail(fn, f"expected {name} to be a tensor, got {describe(leaf)}")
    if offsets.ndim != 1 or offsets.dtype != torch.int64:
        raise fail(fn, f"expected offsets to be an int64 [B + 1] tensor, got {describe(offsets)}")
    if offsets.shape[0] < 1:
        raise fail(fn, "expected offsets to hold at least one entry ([B + 1] with B >= 0), got 0")
    if sizes.ndim != 2 or sizes.dtype != torch.int64:
        raise fail(fn, f"expected sizes to be an int64 [B, R] tensor, got {describe(sizes)}")
    if values.ndim < 1:
        raise fail(
            fn, f"expected values with a packed leading axis [T, ...], got {describe(values)}"
        )
    if values.ndim - 1 != layout.num_dense:
        raise fail(
            fn,
            f"expected values with {layout.num_dense} dense axes as the layout {layout.code!r} "
            f"declares, got values of shape {shape_text(values.shape)}",
        )
    if sizes.shape[1] != layout.num_ragged:
        raise fail(
            fn,
            f"expected sizes with {layout.num_ragged} columns (one per ragged axis of the layout "
            f"{layout.code!r}), got sizes of shape {shape_text(sizes.shape)}",
        )
    if sizes.shape[0] != offsets.shape[0] - 1:
        raise fail(
            fn,
            f"expected sizes of shape [B, R] with B = len(offsets) - 1 = {offsets.shape[0] - 1}, "
            f"got sizes of shape {shape_text(sizes.shape)}",
        )
    if not (values.device == offsets.device == sizes.device):
        raise fail(
            fn,
            f"expected values, offsets and sizes on one device, got {values.device}, "
            f"{offsets.device} and {sizes.device}",
        )
    if row_offsets or layout.num_nested:
        _check_row_offsets(fn, values, row_offsets, layout)


def _check_row_offsets(fn: str, values: Tensor, row_offsets: Any, layout: Layout) -> None:
    """A nested layout has one int64 ``[N + 1]`` partition per ragged axis after the first."""
    if not isinstance(row_offsets, tuple):
        raise fail(
            fn, f"expected row_offsets to be a tuple of tensors, got {describe(row_offsets)}"
        )
    if len(row_offsets) != layout.num_nested:
        raise fail(
            fn,
            f"expected {layout.num_nested} row_offsets tensors (one per ragged axis after the "
            f"first of a nested layout, here {layout.code!r}), got {len(row_offsets)}",
        )
    for k, parts in enumerate(row_offsets):
        if not isinstance(parts, Tensor) or parts.ndim != 1 or parts.dtype != torch.int64:
            raise fail(
                fn,
                f"expected row_offsets[{k}] to be an int64 [N + 1] tensor, got {describe(parts)}",
            )
        if parts.shape[0] < 1:
            raise fail(fn, f"expected row_offsets[{k}] to hold at least one entry, got 0")
        if parts.device != values.device:
            raise fail(
                fn, f"expected row_offsets[{k}] on {values.device} like values, got {parts.device}"
            )


def check_partition(
    fn: str,
    values: Tensor,
    offsets: Tensor,
    sizes: Tensor,
    row_offsets: tuple[Tensor, ...] = (),
    layout: Layout | None = None,
) -> None:
    """Value checks on a partition (host sync eagerly; graph assertions while tracing).

    Call :func:`check_structure` first: this assumes the shapes and dtypes hold.
    ``layout`` (of a nested value): its rectangular ragged axes are checked too.
    """
    total = values.shape[0]
    steps = lengths_of(offsets)
    if row_offsets:
        _check_nested(fn, total, offsets, sizes, row_offsets, layout)
        return
    if is_tracing(offsets) or is_tracing(sizes):
        _assert_partition(fn, total, offsets, steps, sizes)
        return
    if int(offsets[0]) != 0:
        raise fail(fn, f"offsets must start at 0, got offsets[0] = {int(offsets[0])}")
    if bool((steps < 0).any()):
        bad = int((steps < 0).nonzero()[0, 0])
        raise fail(
            fn,
            f"offsets must never decrease, got offsets[{bad}] = {int(offsets[bad])} > "
            f"offsets[{bad + 1}] = {int(offsets[bad + 1])}",
        )
    if int(offsets[-1]) != total:
        raise fail(
            fn,
            f"offsets must end at values.shape[0] = {total}, got offsets[-1] = {int(offsets[-1])}",
        )
    if bool((sizes < 0).any()):
        bad = int((sizes < 0).any(dim=1).nonzero()[0, 0])
        raise fail(fn, f"sizes must be non-negative, got sizes[{bad}] = {sizes[bad].tolist()}")
    # float64 products cannot wrap around like int64 ones (exact below 2**53)
    counts = sizes.to(torch.float64).prod(dim=1)
    if not torch.equal(counts, steps.to(torch.float64)):
        bad = int((counts != steps).nonzero()[0, 0])
        raise fail(
            fn,
            f"sample {bad} has sizes {sizes[bad].tolist()} (product {int(counts[bad])}) but "
            f"offsets give it {int(steps[bad])} rows",
        )


def _assert_partition(fn: str, total: Any, offsets: Tensor, steps: Tensor, sizes: Tensor) -> None:
    """:func:`check_partition` as device-side assertions (no sync; raise when the graph runs)."""
    torch._assert_async(offsets[0] == 0, f"{fn}: offsets must start at 0")
    torch._assert_async((steps >= 0).all(), f"{fn}: offsets must never decrease")
    torch._assert_async(offsets[-1] == total, f"{fn}: offsets must end at values.shape[0]")
    torch._assert_async((sizes >= 0).all(), f"{fn}: sizes must be non-negative")
    counts = sizes.to(torch.float64).prod(dim=1)
    torch._assert_async(
        (counts == steps.to(torch.float64)).all(),
        f"{fn}: a sample's sizes (their product) disagree with the rows offsets give it",
    )


def _check_nested(
    fn: str,
    total: Any,
    offsets: Tensor,
    sizes: Tensor,
    row_offsets: tuple[Tensor, ...],
    layout: Layout | None,
) -> None:
    """A chain of nested partitions: each level's offsets run from 0 to the number of
    elements of the next level, and the per-sample counts (``sizes``) and ``offsets``
    agree with their composition."""
    tracing = is_tracing(offsets) or any(is_tracing(p) for p in row_offsets)
    ends = [p.shape[0] - 1 for p in row_offsets[1:]] + [total]
    checks: list[tuple[Tensor, str]] = [
        (offsets[0] == 0, "offsets must start at 0"),
        ((lengths_of(offsets) >= 0).all(), "offsets must never decrease"),
        (offsets[-1] == total, "offsets must end at values.shape[0]"),
        ((sizes >= 0).all(), "sizes must be non-negative"),
    ]
    level = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes[:, 0], 0)])
    checks.append(
        (
            level[-1] == row_offsets[0].shape[0] - 1,
            "sizes[:, 0] must add up to the elements partitioned by row_offsets[0]",
        )
    )
    for k, (parts, end) in enumerate(zip(row_offsets, ends, strict=True)):
        checks.append((parts[0] == 0, f"row_offsets[{k}] must start at 0"))
        checks.append(((lengths_of(parts) >= 0).all(), f"row_offsets[{k}] must never decrease"))
        checks.append(
            (parts[-1] == end, f"row_offsets[{k}] must end at the element count of the next level")
        )
        # clamped: a bad partition must give an error, never an out-of-range read
        level = parts.index_select(0, level.clamp(0, parts.shape[0] - 1))
        checks.append(
            (
                (lengths_of(level) == sizes[:, k + 1]).all(),
                f"sizes[:, {k + 1}] must count each sample's elements of nested axis {k + 1}",
            )
        )
    checks.append(((level == offsets).all(), "offsets must equal the composed row_offsets"))
    for ok, message in checks:
        if tracing:
            torch._assert_async(ok, f"{fn}: {message}")
        elif not bool(ok):
            raise fail(
                fn,
                f"{message}, got offsets {offsets.tolist()[:8]}, sizes "
                f"{sizes.tolist()[:8]}, row_offsets {[p.tolist()[:8] for p in row_offsets]}",
            )
    if layout is None:
        return
    # after the partition checks: the parents read here are then in range
    for ok, message in uniform_checks(sizes, row_offsets, total, layout):
        if tracing:
            torch._assert_async(ok, f"{fn}: {message}")
        elif not bool(ok):
            raise fail(fn, message)
