"""Helpers for ``torch.compile`` of functions of ``Ragged`` values (see docs/compile.md)."""

from __future__ import annotations

from typing import Any

import torch._dynamo
import torch.utils._pytree as pytree

from .._layout import Layout
from .._ragged import Ragged

__all__ = ["mark_dynamic"]

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
