"""Helpers for ``torch.compile`` and ``torch.export`` of functions of ``Ragged`` values
(see docs/compile.md and docs/deploy.md)."""

from __future__ import annotations

from typing import Any

import torch._dynamo
import torch.utils._pytree as pytree

from .._errors import describe, fail
from .._layout import Layout
from .._ragged import Ragged

__all__ = ["dynamic_shapes", "mark_dynamic"]

# A Layout is static metadata. As a pytree constant, dynamo treats a Layout read
# from an input as a constant guarded by ``__eq__``; otherwise
# ``torch.compile(dynamic=True)`` turns its axis numbers into symbols and every op
# that builds a new Layout (transpose, unsqueeze, ...) fails to trace.
if Layout not in pytree.SUPPORTED_NODES:
    pytree.register_constant(Layout)


def mark_dynamic(*trees: Any) -> None:
    """Mark the packed and batch axes of every ``Ragged`` in ``trees`` as dynamic.

    Compile with the default ``dynamic=None`` and call this on each input before
    the compiled call: the packed axis ``T`` of ``values`` and the batch axis of
    ``offsets``/``sizes`` become symbols from the first compile on, while dense
    axes and parameters stay static, so new lengths reuse the graph. It uses
    ``torch._dynamo.maybe_mark_dynamic``, which only tags the tensors (no data
    changes) and lets torch specialise where it must (e.g. ``B = 1``).

    Args:
        trees: ``Ragged`` values or pytrees holding them; other leaves are ignored.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.zeros(5, 2), [2, 3])
        >>> raggedfn.mark_dynamic(x)  # then call a torch.compile'd function on x
        >>> x.values._dynamo_weak_dynamic_indices
        {0}
    """
    leaves = pytree.tree_leaves(trees, is_leaf=lambda v: isinstance(v, Ragged))
    for leaf in leaves:
        if isinstance(leaf, Ragged):
            torch._dynamo.maybe_mark_dynamic(leaf.values, 0)
            torch._dynamo.maybe_mark_dynamic(leaf.offsets, 0)
            torch._dynamo.maybe_mark_dynamic(leaf.sizes, 0)
            for parts in leaf.row_offsets:  # nested levels: their element counts vary too
                torch._dynamo.maybe_mark_dynamic(parts, 0)


def dynamic_shapes(x: Ragged, name: str | None = None) -> list[dict[int, Any]]:
    """The ``dynamic_shapes`` entry of one ``Ragged`` argument of ``torch.export.export``.

    ``Ragged`` is a pytree node that flattens to ``[values, offsets, sizes,
    *row_offsets]``; this returns one dict per part, in that order: the packed axis
    ``T`` of ``values``, the batch axis of ``offsets`` (``B + 1``) and ``sizes``
    (``B``) and the element axis of each nested level's ``row_offsets`` are
    dynamic; dense axes, the number of ragged axes and the layout stay static.

    Args:
        x: the example ``Ragged`` argument (its number of nested levels sets the
            number of entries).
        name: ``None`` (default): every dynamic axis is ``Dim.AUTO`` (torch finds the
            relations between them itself). A string: named ``Dim`` objects
            ``{name}_batch`` (``offsets`` is ``{name}_batch + 1``), ``{name}_rows`` and
            ``{name}_level{k}`` (``row_offsets[k]`` is ``{name}_level{k} + 1``); export then
            raises where it would specialise one of them. Named dims are ``>= 2``:
            torch specialises sizes 0 and 1 (see docs/deploy.md).

    Returns:
        A list of ``{axis: Dim}`` dicts, one per pytree leaf of ``x``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value, or ``name`` is not a string
            identifier.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.zeros(5, 2), [2, 3])
        >>> spec = raggedfn.dynamic_shapes(x)   # one entry per leaf
        >>> len(spec), spec[0] == {0: torch.export.Dim.AUTO}
        (3, True)
        >>> class Pool(torch.nn.Module):
        ...     def forward(self, x):
        ...         return raggedfn.sum(x, 1)
        >>> ep = torch.export.export(Pool(), (x,), dynamic_shapes=(spec,))
        >>> y = raggedfn.from_lengths(torch.ones(9, 2), [4, 1, 4])
        >>> ep.module()(y).tolist()
        [[4.0, 4.0], [1.0, 1.0], [4.0, 4.0]]
    """
    if not isinstance(x, Ragged):
        raise fail("dynamic_shapes", f"expected a Ragged value, got {describe(x)}")
    levels = len(x.row_offsets)
    if name is None:
        auto = torch.export.Dim.AUTO
        return [{0: auto} for _ in range(3 + levels)]
    if not isinstance(name, str) or not name.isidentifier():
        raise fail("dynamic_shapes", f"name must be a string identifier, got {name!r}")
    Dim = torch.export.Dim
    batch = Dim(f"{name}_batch", min=2)
    parts: list[dict[int, Any]] = [{0: Dim(f"{name}_rows", min=2)}, {0: batch + 1}, {0: batch}]
    parts += [{0: Dim(f"{name}_level{k}", min=2) + 1} for k in range(levels)]
    return parts
