"""Grouping rows by id and one weight per group: the expert half of mixture-of-experts.

``group_by(values, ids, num_groups)`` sorts rows by id (stably) into a
``Ragged`` of ``num_groups`` samples; ``segment_matmul(grouped, weight)`` applies
one weight per sample (``[G, K, F]``) with one GEMM per non-empty group (JAX's
``lax.ragged_dot``, PyG's ``segment_matmul``); ``order`` scatters the results
back to the original rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._axes import logical_shape_text
from .._errors import describe, fail, shape_text
from .._index import offsets_of
from .._layout import Layout
from .._prims import host_planned
from .._prims import segment_matmul as _segment_matmul
from .._ragged import Ragged, like
from .._validate import is_tracing

__all__ = ["group_by", "segment_matmul"]


def group_by(values: Tensor, ids: Tensor, num_groups: int) -> tuple[Ragged, Tensor]:
    """Group the rows of ``values`` by ``ids``: a ``Ragged`` of ``num_groups`` samples.

    Rows keep their order within a group (a stable sort); groups without rows
    are empty samples. Nothing is read on the host, so this compiles without
    data-dependent shapes.

    Args:
        values: ``[T, *dense]`` rows (tokens, or token-expert assignments).
        ids: int ``[T]`` group of every row, in ``[0, num_groups)`` (an expert id).
        num_groups: ``G``, a Python int.

    Returns:
        ``(grouped, order)``: ``grouped`` of logical shape ``(G, N*, *dense)`` with
        ``grouped.values == values[order]``, and ``order`` (int64 ``[T]``), the
        source row of every grouped row. Scatter results back with
        ``out.index_copy(0, order, y)`` (or ``index_add`` to combine several
        rows per token).

    Raises:
        RaggedError: ``ids`` not integers or not ``[T]``, ids outside
            ``[0, num_groups)``, ``num_groups`` not a non-negative int.

    Examples:
        >>> import torch, raggedfn
        >>> tokens = torch.arange(5.0).unsqueeze(1)
        >>> experts = torch.tensor([2, 0, 2, 1, 0])
        >>> grouped, order = raggedfn.group_by(tokens, experts, 3)
        >>> grouped.lengths.tolist(), order.tolist()
        ([2, 1, 2], [1, 4, 3, 0, 2])
        >>> back = torch.empty_like(tokens).index_copy(0, order, grouped.values)
        >>> torch.equal(back, tokens)
        True
    """
    fn = "group_by"
    if not isinstance(values, Tensor) or values.ndim < 1:
        raise fail(fn, f"values must be a [T, ...] tensor, got {describe(values)}")
    if not isinstance(num_groups, (int, torch.SymInt)) or isinstance(num_groups, bool):
        raise fail(fn, f"num_groups must be an int, got {describe(num_groups)}")
    if num_groups < 0:
        raise fail(fn, f"num_groups must be >= 0, got {num_groups}")
    if (
        not isinstance(ids, Tensor)
        or ids.is_floating_point()
        or ids.is_complex()
        or ids.dtype == torch.bool
        or ids.ndim != 1
        or ids.shape[0] != values.shape[0]
    ):
        raise fail(
            fn,
            f"ids must be an integer [T] tensor with T = {values.shape[0]} (one group per row of "
            f"values), got {describe(ids)}",
        )
    if ids.device != values.device:
        raise fail(fn, f"ids must be on {values.device} like values, got {describe(ids)}")
    outside = (ids < 0) | (ids >= num_groups)
    if is_tracing(ids):
        torch._assert_async(~outside.any(), f"{fn}: ids must lie in [0, num_groups)")
    elif bool(outside.any()):
        bad = int(outside.nonzero()[0, 0])
        raise fail(
            fn,
            f"ids must lie in [0, num_groups) = [0, {num_groups}), got ids[{bad}] = {int(ids[bad])}",
        )
    ids = ids.to(torch.int64)
    order = torch.sort(ids, stable=True).indices
    counts = torch.zeros(num_groups, dtype=torch.int64, device=ids.device)
    counts = counts.index_add(0, ids.clamp(0, max(num_groups - 1, 0)), torch.ones_like(ids))
    layout = Layout.standard(1, values.ndim - 1)
    grouped = Ragged(values.index_select(0, order), offsets_of(counts), counts.unsqueeze(1), layout)
    return grouped, order


def segment_matmul(x: Ragged, weight: Tensor, bias: Tensor | None = None) -> Ragged:
    """``x[g] @ weight[g] + bias[g]`` for every sample ``g``: one weight per group.

    The forward and the backward (for ``x``, ``weight`` and ``bias``; also double
    backward and forward mode) cost one GEMM per non-empty group; the ``[T, K, F]``
    per-row weights are never gathered. Eagerly the group boundaries are read on
    the host once per call; under ``torch.compile`` the product is one opaque
    graph node, so new group sizes reuse the graph.

    Args:
        x: ``Ragged`` of logical shape ``(G, N*, K)`` (e.g. from :func:`group_by`).
        weight: ``[G, K, F]``, same dtype and device.
        bias: optional ``[G, F]``.

    Returns:
        ``Ragged`` of logical shape ``(G, N*, F)`` with the partition of ``x``.

    Raises:
        RaggedError: ``x`` not of logical shape ``(G, N*, K)``; ``weight`` or
            ``bias`` of another shape, dtype or device.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.ones(3, 2), [2, 0, 1])
        >>> w = torch.stack([torch.eye(2), torch.zeros(2, 2), 2 * torch.eye(2)])
        >>> raggedfn.segment_matmul(x, w).values.tolist()
        [[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]
    """
    fn = "segment_matmul"
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    if x.row_offsets or x.layout.code != "r0 d0":
        raise fail(
            fn,
            f"x must have logical shape (G, N*, K) (one ragged axis, then one dense axis), got "
            f"(G, {logical_shape_text(x)[1:]}",
        )
    groups, features = x.batch_size, x.values.shape[1]
    if not isinstance(weight, Tensor) or weight.ndim != 3:
        raise fail(fn, f"weight must be a [G, K, F] tensor, got {describe(weight)}")
    if weight.shape[0] != groups or weight.shape[1] != features:
        raise fail(
            fn,
            f"weight must have shape [G, K, F] = [{groups}, {features}, F] for x of logical shape "
            f"(G={groups}, N*, {features}), got {shape_text(weight.shape)}",
        )
    expected: list[tuple[str, Any]] = [("weight", weight)]
    if bias is not None:
        if not isinstance(bias, Tensor) or tuple(bias.shape) != (groups, weight.shape[2]):
            raise fail(
                fn,
                f"bias must be a [G, F] = [{groups}, {weight.shape[2]}] tensor, got {describe(bias)}",
            )
        expected.append(("bias", bias))
    for name, t in expected:
        if t.dtype != x.dtype or t.device != x.device:
            raise fail(fn, f"{name} must be {x.dtype} on {x.device} like x, got {describe(t)}")
    if torch.compiler.is_compiling():
        tensors = [x.values, x.offsets, weight, *([bias] if bias is not None else [])]
        shape = [x.values.shape[0], weight.shape[2]]
        values = host_planned("segment_matmul", "", tensors, shape)
    else:
        values = _segment_matmul(x.values, x.offsets, weight, bias)
    return like(x, values)
